"""experiments/regime/world_experiment.py: the gate on whatever single-agent steps exist (--gate-probe),
per task type from the rollouts, a single-agent arm run to its end, and the levels the buffers
start with (--seed-levels)."""

import gzip
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path
from statistics import fmean

import pytest

from script_env import run_main, script_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "regime" / "world_experiment.py"


def _row(step: int, solve: float, cyclomatic: float, update_s: float) -> dict:
    prog = {"valid": 4, "proposed": 5, "cyclomatic": cyclomatic, "ast_depth": 6.0, "loc": 5.0,
            "variables": 2.0, "coverage": 3, "distinct_in_step": 4 if step <= 40 else 2}  # fmt: skip
    return {"step": step, "members": {"A0": {"valid_rate": 0.8, "entropy": 0.5, "kl": 1e-5,
                                             "teacher_reward": -0.1 if step <= 40 else 0.2}},
            "matchups": [{"teacher": "A0", "student": "A0", "answers": 64, "solve_rate": solve}],
            "programs": {"code_o": prog, "code_i": prog},
            "task_solve_rates": {"partial": 0.5, "unsolved": 0.1 if step <= 40 else 0.3},
            "teacher_reward_var": 0.1, "replacements": [],
            "phase_s": {"proposal": 1.0, "solving": 2.0, "update": update_s}}  # fmt: skip


def _module(name: str = "world_experiment"):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / "regime" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _script(capsys, *args: str, we=None) -> subprocess.CompletedProcess:
    """`world_experiment.py ARGS` run in this process (`we`: that module, e.g. patched)."""
    capsys.readouterr()
    code = run_main((we or _module()).main, SCRIPT, *args)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([str(SCRIPT), *args], code, out, err)


def _probe(out: Path, capsys) -> dict:
    proc = _script(capsys, "--out", str(out), "--gate-probe")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == json.loads((out / "gate_probe.json").read_text())
    return json.loads(proc.stdout)


def test_gate_probe_reports_the_collapse_its_slope_and_phase_costs(tmp_path, capsys) -> None:
    runs = {  # seed 0 collapses (solve 0.2 -> 0.99, complexity falling); seed 1 learns, no drift
        "single_s0": [_row(i + 1, 0.2 + 0.01 * i, 3.0 - 0.02 * i, 20.0 if i == 0 else 1.5)
                      for i in range(80)],
        "single_s1": [_row(i + 1, 0.3 + 0.001 * i, 1.5 + 0.001 * i, 1.5) for i in range(80)],
    }  # fmt: skip
    for name, rows in runs.items():
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"ste')
    (tmp_path / "runs" / "population_s0").mkdir()  # other arms are not the gate's
    rollouts = tmp_path / "runs" / "single_s0" / "rollouts"
    rollouts.mkdir()
    for step, verdicts in ((1, ["wrong", "correct"]), (80, ["correct", "correct"])):
        recs = [{"role": "student", "type": "code_o", "verdict": v} for v in verdicts]
        recs += [{"role": "student", "type": "code_f", "verdict": "format_error"},
                 {"role": "teacher", "type": "code_f", "verdict": "valid"}]  # fmt: skip
        with gzip.open(rollouts / f"step_{step}.jsonl.gz", "wt") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in recs))
    (rollouts / "step_81.jsonl.gz").write_bytes(gzip.compress(b'{"role": "student"}\n')[:-9])
    (rollouts / "step_0.jsonl.gz").write_bytes(gzip.compress(b'{"role": "student", "type": "code_o"}\n'))
    res = _probe(tmp_path, capsys)
    assert set(res) == {"single_s0", "single_s1"}
    assert (tmp_path / "gate_probe.png").stat().st_size > 10_000  # one panel per probe curve
    titles = _module().plot_gate(res, tmp_path / "again.png")
    assert titles[0] == "solve rate" and len(titles) == len(_module().PROBE_PANELS)
    assert titles[-2:] == ["solve rate code_o + code_i", "solve rate code_f"]
    s0, s1 = res["single_s0"], res["single_s1"]
    assert s0["steps"] == 80 and s0["collapsed"] and s0["complexity_slope"] < 0
    assert abs(s0["solve_rate_slope_per_100_steps"] - 1.0) < 1e-6
    assert s0["final_solve_rate"] >= 0.8 and s0["solve_rate_first_last"][0] < 0.3
    assert s0["phase_s_median"]["update"] == 1.5  # a median: the 20 s warm-up step does not skew it
    assert not s1["collapsed"] and abs(s1["solve_rate_slope_per_100_steps"] - 0.1) < 1e-6
    assert s1["entropy_first_last"] == [0.5, 0.5] and s1["loc_first_last"] == [5.0, 5.0]
    bins = s0["every_10_steps"]["solve_rate"]  # 10-step means: 0.245, 0.345, ...
    assert len(bins) == 8 and abs(bins[0] - 0.245) < 1e-6 and abs(bins[-1] - 0.945) < 1e-6
    assert s0["kl_max"] == 1e-5
    # what turns a rise back: the teacher's mean reward, unsolved tasks, distinct programs
    assert s1["teacher_reward_first_last"] == [-0.1, 0.2]
    assert s1["unsolved_share_first_last"] == [0.1, 0.3]
    assert s1["distinct_programs_first_last"] == [8, 4]  # code_o + code_i
    assert s1["every_10_steps"]["teacher_reward"][3:5] == [-0.1, 0.2]
    by_type = s0["solve_rate_by_type"]  # from the rollouts; step 0 and the cut step 81 skipped
    assert by_type["code_o"]["first_last"] == [0.5, 1.0] and by_type["code_f"]["first_last"] == [0, 0]
    assert by_type["code_o"]["every_10_steps"][0] == 0.5 and not s1["solve_rate_by_type"]
    # the gate on code_o/code_i answers alone, beside the pre-registered (mixed) one
    assert s0["gate_code_o_i"] == {"final_solve_rate": 1.0, "complexity_slope": s0["complexity_slope"],
                                   "collapsed": True}
    assert s1["gate_code_o_i"]["final_solve_rate"] is None and not s1["gate_code_o_i"]["collapsed"]


def test_gate_probe_reads_per_type_solve_rates_from_the_metrics_of_every_step(
        tmp_path, capsys) -> None:  # fmt: skip
    """Runs logged with per-type answers get their type curves from every step's metrics row
    (the rollouts only keep the last few steps)."""
    rows = []
    for i in range(40):
        row = _row(i + 1, 0.5, 2.0, 1.0)
        row["programs"] = {t: {**p, "answers": 16, "solve_rate": r}
                           for (t, p), r in zip(row["programs"].items(), (0.75, 0.25), strict=True)}
        row["programs"]["code_f"] = {"valid": 2, "proposed": 4, "answers": 8, "solve_rate": i / 40}
        rows.append(row)
    d = tmp_path / "runs" / "single_s0"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s0 = _probe(tmp_path, capsys)["single_s0"]
    assert s0["solve_rate_by_type"]["code_o"]["first_last"] == [0.75, 0.75]
    assert s0["solve_rate_code_o_i_first_last"] == [0.5, 0.5]  # 12 of 16 and 4 of 16, pooled
    assert s0["every_10_steps"]["solve_rate_code_f"][0] == pytest.approx(fmean(range(10)) / 40, abs=0.02)
    assert len(s0["every_10_steps"]["solve_rate_code_f"]) == 4


def test_type_solve_rate_pools_the_types_asked_for() -> None:
    counts = {1: {"code_o": [1, 2], "code_i": [0, 1], "code_f": [0, 4]}, 3: {"code_f": [1, 4]}}
    rate = _module().type_solve_rate
    assert rate(counts, ("code_o", "code_i")) == [1 / 3, None, None]  # answers pooled, not rates
    assert rate(counts, ("code_f",)) == [0.0, None, 0.25] and rate({}, ("code_o",)) == []


def _short_answers(monkeypatch) -> None:
    """Held-out answers of at most 32 new tokens (code_f's budget is 384): the tests count the
    grades, not how good the answers are."""
    from lorapop.tiny import evaluate

    for kind in evaluate.MAX_NEW:
        monkeypatch.setitem(evaluate.MAX_NEW, kind, min(evaluate.MAX_NEW[kind], 32))


@pytest.mark.slow
def test_a_finished_single_arm_reports_its_gate(tmp_path, capsys, monkeypatch) -> None:
    """`--arms single` to the end (the gate probe's runs): the gate, not the criterion's error;
    `--levels` plays the base in another table's world (its rules and sets). The runs'
    `--train-one` and `--cross-one` children run in this process, through the script's main."""
    we = _module()
    children = []
    _short_answers(monkeypatch)

    def child(cmd: list[str], **kw) -> subprocess.CompletedProcess:
        assert cmd[:2] == [sys.executable, we.__file__] and "env" in kw
        children.append(cmd[2])
        return subprocess.CompletedProcess(cmd, run_main(we.main, SCRIPT, *cmd[2:]), "", "")

    monkeypatch.setattr(we, "subprocess", types.SimpleNamespace(run=child))
    small = ["train.steps=2", "tasks.proposals_per_type=1", "tasks.answers_per_task=1",
             "league.teachers=1", "league.students=1", "league.students_per_teacher=1",
             "sampling.teacher_max_new_tokens=48", "sampling.student_max_new_tokens=32",
             "train.kl_rows=0", "verify.workers=1", "model.device=cpu"]  # fmt: skip
    proc = _script(capsys, "--model", "tiny", "--arms", "single", "--out", str(tmp_path),
                   "--seeds", "0", "--parallel", "1", "--per-level", "1", "--workers", "1",
                   "--levels", "natural", *small, we=we)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert children == ["--train-one", "--cross-one"]
    probe = json.loads(proc.stdout[proc.stdout.index("{"):])["gate_probe"]
    assert probe["single_s0"]["steps"] == 2 and probe["single_s0"]["collapsed"] is False
    res = json.loads((tmp_path / "results.json").read_text())  # what a call brings back
    assert res["level_table"] == "natural" and "tasks.live_code=true" in res["base_overrides"]
    assert (tmp_path / "level_table.txt").read_text() == "natural\n"
    (run,) = res["runs"]
    assert res["arms"] == {"single": ["single_s0"]}
    assert run["done"] and len(run["heldout"]["grades"]["A0"]) == len(run["heldout_levels"]) == 15
    assert len(run["curves"]["solve_rate"]) == 2 and res["runs"][0]["steps"] == 2


@pytest.mark.slow
def test_finish_scores_a_run_at_the_step_it_reached(tmp_path, monkeypatch) -> None:
    """The last call of a chain that ran out of device time: --finish scores what is there."""
    from lorapop.engine.load import TINY_DIR
    from lorapop.selfplay.loop import SelfPlay
    from lorapop.tiny.heldout import load_jsonl
    from lorapop.tiny.world import world_of

    we = _module()
    _short_answers(monkeypatch)
    paths = we.prepare(tmp_path, 1, 1, world_of(TINY_DIR)["levels"])
    small = ["model.name_or_path=tiny", f"tasks.seed_tasks={paths['seed_tasks']}",
             "train.steps=50", "tasks.proposals_per_type=1", "tasks.answers_per_task=1",
             "sampling.teacher_max_new_tokens=48", "sampling.student_max_new_tokens=32",
             "train.kl_rows=0", "verify.workers=1", "model.device=cpu"]  # fmt: skip
    run_dir = tmp_path / "runs" / "single_s0"
    job = {"name": "single_s0", "arm": "single", "seed": 0, "run_dir": str(run_dir),
           "overrides": [*small, *we.arm_runs("single", 0, small)[0][1]], "heldout": paths["heldout"],
           "select": paths["select"], "deadline_at": float("inf"), "recent_steps": 30,
           "recent_tasks": 60, "finish": True}  # fmt: skip
    step = SelfPlay.step

    def two_steps_then_the_deadline(sp):
        step(sp)
        if sp.step_done == 2:
            job["deadline_at"] = 0.0

    monkeypatch.setattr(SelfPlay, "step", two_steps_then_the_deadline)
    rec = we.train_one(job)
    assert rec["done"] and rec["steps"] == 2  # scored at step 2 of 50
    assert len(rec["heldout"]["grades"]["A0"]) == len(load_jsonl(paths["heldout"]))
    assert (run_dir / "recent_tasks.jsonl").read_text()  # the last steps' tasks, for cross-play
    job["finish"] = False  # without --finish the same run is left to a later call, unscored
    assert we.train_one(job) == {"name": "single_s0", "arm": "single", "seed": 0, "steps": 2,
                                 "done": False}


def test_seed_levels_choose_the_buffers_start_and_reuse_the_sets(tmp_path) -> None:
    from lorapop.tiny.heldout import load_jsonl

    prepare = _module().prepare
    high = prepare(tmp_path, 1, 2, "short", (4, 5))
    held = Path(high["heldout"]).stat().st_mtime_ns
    low = prepare(tmp_path, 1, 2, "short")  # the default start: levels 1-3, its own file
    assert Path(low["heldout"]).stat().st_mtime_ns == held and low["seed_tasks"] != high["seed_tasks"]
    for paths, levels in ((high, {4, 5}), (low, {1, 2, 3})):
        tasks = load_jsonl(paths["seed_tasks"])
        assert {t.meta["difficulty"] for t in tasks} == levels and len(tasks) == 3 * 8 * len(levels)
    # a world of 3 code_f inputs seeds its code_f buffer with tasks of 3 pairs, in its own file
    three = prepare(tmp_path, 1, 2, "short", (1,), code_f_inputs=3)
    fs = [t for t in load_jsonl(three["seed_tasks"]) if t.type == "code_f"]
    assert three["seed_tasks"] != low["seed_tasks"] and fs and all(len(t.inputs) == 3 for t in fs)
    assert all(len(t.inputs) == 4 for t in load_jsonl(low["seed_tasks"]) if t.type == "code_f")


def test_a_world_without_code_f_has_no_code_f_in_its_sets_and_keeps_them_apart(tmp_path) -> None:
    from lorapop.config import load_config
    from lorapop.tiny.heldout import load_jsonl

    we = _module()
    types = ("code_o", "code_i")
    paths = we.prepare(tmp_path, 1, 2, "short", (1,), types)
    for key in ("heldout", "select", "seed_tasks"):
        assert {t.type for t in load_jsonl(paths[key])} == set(types)
    assert len(load_jsonl(paths["heldout"])) == 2 * 5  # one task per type and level
    with pytest.raises(SystemExit, match="code_o,code_i"):  # sets of all types: another --out
        we.prepare(tmp_path, 1, 2, "short", (1,))
    assert load_config(None, ["tasks.types=[code_o,code_i]"]).tasks.types == list(types)


def test_runs_are_spread_over_the_gpus_each_in_its_own_process(tmp_path, monkeypatch) -> None:
    we = _module()
    arms = ["population", "single", *["independent"] * 4, "noevolve"]
    jobs = [{"name": f"r{i}", "arm": a} for i, a in enumerate(arms)]
    we.place(jobs, 3)  # the three full runs on three GPUs, then the light ones
    assert [j["gpu"] for j in jobs] == [0, 1, 0, 1, 2, 0, 2]
    big = [{"name": f"{a}{s}{i}", "arm": a} for s in range(3) for a in _module().ARMS
           for i in range(4 if a == "independent" else 1)]  # the experiment: 21 runs
    we.place(big, 4)  # 15 full-run equivalents: at most 4 on a GPU (round robin: 4.5)
    per_gpu = [[j["arm"] for j in big if j["gpu"] == g] for g in range(4)]
    assert [sum(0.5 if a == "independent" else 1 for a in arms) for arms in per_gpu] == [4, 4, 3.5, 3.5]
    seen = {}

    def fake_run(cmd, **kw):
        path = Path(cmd[-1])
        seen[path.stem] = kw["env"].get("CUDA_VISIBLE_DEVICES")
        path.with_suffix(".out.json").write_text("{}")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(we.subprocess, "run", fake_run)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for j in jobs[:2]:
        we._subprocess("--train-one", j, tmp_path / f"{j['name']}.json")
    untouched = [{"name": "r9", "arm": "single"}]
    we.place(untouched, 0)
    we._subprocess("--train-one", untouched[0], tmp_path / "r9.json")
    assert seen == {"r0": "0", "r1": "1", "r9": None}


def _results(seeds: list[int], shift: float) -> dict:
    """One call's results.json: population and single arms for `seeds`, 4 held-out tasks."""
    we = _module()
    runs = []
    for s in seeds:
        for arm, cyc, solve in (("population", 1.0, 0.3), ("single", 2.0, 0.85)):
            rows = [_row(i, solve + shift, cyc - (0.01 if arm == "single" else -0.01) * i, 1.0)
                    for i in range(1, 11)]  # fmt: skip
            g = [1.0] * 4 if arm == "population" else [0.0] * 4
            runs.append({"name": f"{arm}_s{s}", "arm": arm, "seed": s, "steps": 10, "done": True,
                         "heldout": {"grades": {"A0": g}, "pass@1": {"A0": fmean(g)}},
                         "select": {"grades": {"A0": g}, "pass@1": {"A0": fmean(g)}},
                         "curves": we.curves(rows), "heldout_levels": [1, 3, 4, 5]})  # fmt: skip
    return {"command": "x", "level_table": "short", "base_overrides": [], "seeds": seeds,
            "arms": {a: [f"{a}_s{s}" for s in seeds] for a in ("population", "single")},
            "device": "cpu",
            "cpus": 2, "gpus": 0, "wall_s": 1.0, "runs": runs,
            "crossplay": {"population": {"single": [0.5] * len(seeds)},
                          "single": {"population": [0.25] * len(seeds)}}}  # fmt: skip


def _partial(out: Path, capsys) -> subprocess.CompletedProcess:
    """`world_experiment.py --out OUT --partial`, as on an unpacked progress.tgz."""
    return _script(capsys, "--out", str(out), "--partial")


def test_a_cut_chain_still_gives_the_gate_slopes_and_scored_end_points(tmp_path, capsys) -> None:
    """--partial on what progress.tgz brings back: metrics of every run, out.json of each."""
    for s in (0, 1, 2):
        for arm, n, cyc in (("population", 20, lambda i: 1.0 + 0.01 * i),
                            ("single", 30, lambda i: 2.0 - 0.02 * i)):  # fmt: skip
            name = f"{arm}_s{s}"
            d = tmp_path / "runs" / name
            d.mkdir(parents=True)
            solve = (lambda i: 0.5 + 0.02 * i) if s < 2 else (lambda i: 0.5)  # seed 2: no collapse
            d.joinpath("metrics.jsonl").write_text(
                "".join(json.dumps(_row(i, solve(i), cyc(i), 1.0)) + "\n" for i in range(1, n + 1)))
            rec = {"name": name, "arm": arm, "seed": s, "steps": n, "done": arm == "single"}
            if arm == "single":  # scored: 4 held-out tasks at levels 1, 3, 4, 5
                g = {"A0": [1.0, 0.0, 1.0, 1.0]}
                rec |= {"heldout": {"grades": g, "pass@1": {"A0": 0.75}},
                        "select": {"grades": g, "pass@1": {"A0": 0.75}}}  # fmt: skip
            (tmp_path / "jobs").mkdir(exist_ok=True)
            (tmp_path / "jobs" / f"{name}.out.json").write_text(json.dumps(rec))
            if arm == "single":  # a finished call's cross-play record sits beside it
                (tmp_path / "jobs" / f"{name}.cross.out.json").write_text(
                    json.dumps({"single": {"tasks": 10}}))
    (tmp_path / "heldout.jsonl").write_text("".join(
        json.dumps({"meta": {"difficulty": lv}}) + "\n" for lv in (1, 3, 4, 5)))
    proc = _partial(tmp_path, capsys)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((tmp_path / "world_experiment_partial.json").read_text())
    assert (tmp_path / "world_experiment_partial.png").is_file()
    assert res["common_steps"] == 20 and res["steps"]["single_s0"] == 30
    # the gate reads the single agent to its end (last 3 steps of 30: 1.06-1.1 >= 0.8)
    assert [g["collapsed"] for g in res["gate"]["seeds"]] == [True, True, False]
    assert res["gate"]["passed"]  # 2 of 3 seeds
    slopes = res["complexity_slope_per_100_steps"]  # over the 20 steps both arms reached
    assert abs(slopes["population"]["0"] - 1.0) < 1e-6 and abs(slopes["single"]["0"] + 2.0) < 1e-6
    assert res["C1_complexity"] == {"holds": True, "population_above_single": 3,
                                    "population_rising": 3}  # fmt: skip
    assert res["complexity_reported_per_100_steps"]["loc"]["single"]["0"] == 0.0
    assert res["heldout_pass@1"]["single"]["mean"] == {"all": 0.75, "level_1": 1.0, "level_3": 0.0,
                                                       "level_4": 1.0, "level_5": 1.0}  # fmt: skip
    assert res["not_scored"] == ["population"]
    assert res["criterion"]["verdict"] == "incomplete: population not scored"
    empty = tmp_path / "empty"
    (empty / "jobs").mkdir(parents=True)
    proc = _partial(empty, capsys)
    assert proc.returncode == 1 and "no run with recorded steps" in proc.stderr


def test_a_pipeline_cut_before_any_run_ended_is_read_from_its_run_directories(
        tmp_path, capsys) -> None:  # fmt: skip
    """progress.tgz of a pipeline whose runs are all still training holds no job records: the runs'
    names say their arm and seed, and the verdict says the run is incomplete, not failed."""
    for arm, n in (("population", 12), ("single", 15)):
        for s in (0, 1, 2):
            d = tmp_path / "runs" / f"{arm}_s{s}"
            d.mkdir(parents=True)
            d.joinpath("metrics.jsonl").write_text(
                "".join(json.dumps(_row(i, 0.4, 1.1, 1.0)) + "\n" for i in range(1, n + 1)))
    (tmp_path / "runs" / "not_a_run").mkdir()
    proc = _partial(tmp_path, capsys)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((tmp_path / "world_experiment_partial.json").read_text())
    assert res["steps"] == {**{f"population_s{s}": 12 for s in (0, 1, 2)},
                            **{f"single_s{s}": 15 for s in (0, 1, 2)}}  # fmt: skip
    assert res["common_steps"] == 12 and not res["gate"]["passed"]
    assert res["criterion"]["verdict"] == "incomplete: the gate does not hold yet (runs at steps 12-15)"


def test_calls_of_other_seeds_merge_into_one_verdict(tmp_path, capsys) -> None:
    """Each seed's runs in its own call (its own machine); --merge gives what one call would."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_results([0], 0.0)))
    b.write_text(json.dumps(_results([1, 2], 0.0)))
    proc = _script(capsys, "--merge", str(a), str(b), "--out", str(tmp_path / "m"))
    assert proc.returncode == 0, proc.stderr
    merged = json.loads((tmp_path / "m" / "world_experiment.json").read_text())
    assert (tmp_path / "m" / "world_experiment.png").is_file()
    assert merged["seeds"] == [0, 1, 2] and merged["gate"]["passed"] is True
    assert merged["criterion"]["C1_complexity"]["holds"] is True
    # the other complexity measures' slopes beside C1's, per arm and seed (constant here)
    reported = merged["complexity_reported_per_100_steps"]
    assert set(reported) == {"ast_depth", "loc"}
    assert reported["ast_depth"]["population"] == {"0": 0.0, "1": 0.0, "2": 0.0}
    c2 = merged["criterion"]["C2_weakest_vs_single_levels_3_5"]
    assert c2["diff"] == pytest.approx(1.0) and c2["verdict"] == "supported"
    assert merged["crossplay"] == {"population": {"single": 0.5}, "single": {"population": 0.25}}
    titles = _module().plot(tmp_path / "m" / "world_experiment.json")  # one panel per metric
    assert len(titles) == len(set(titles)) == 13 and "kl" in titles and "teacher reward" in titles
    assert titles[-1] == "coverage at equal valid programs"
    whole = _module().merge_results([_results([0, 1, 2], 0.0)])
    parts = _module().merge_results([_results([0], 0.0), _results([1, 2], 0.0)])
    assert parts["runs"] == whole["runs"] and parts["arms"] == whole["arms"]
    assert whole["arms"]["single"] == ["single_s0", "single_s1", "single_s2"]


def test_merge_refuses_a_run_given_twice_or_other_settings(tmp_path) -> None:
    we = _module()
    with pytest.raises(SystemExit, match="population_s0, single_s0"):
        we.merge_results([_results([0], 0.0), _results([0, 1], 0.1)])
    a, b = _results([0], 0.0), _results([1], 0.0)
    a["base_overrides"] = ["model.name_or_path=/tmp/m/b", "train.lr=0.001", "tasks.references=1"]
    b["base_overrides"] = ["model.name_or_path=/x/b", "train.lr=0.003", "tasks.references=1"]
    with pytest.raises(SystemExit, match="different settings: train.lr=0.001, train.lr=0.003"):
        we.merge_results([a, b])
    b["base_overrides"][1] = "train.lr=0.001"  # another machine's paths are the same settings
    assert len(we.merge_results([a, b])["runs"]) == 4
    # ... but the seed tasks' file name says the levels the buffers started from
    a["base_overrides"].append("tasks.seed_tasks=/tmp/wx/seed_tasks_levels12345.jsonl")
    b["base_overrides"].append("tasks.seed_tasks=/y/seed_tasks.jsonl")
    with pytest.raises(SystemExit, match="seed_tasks.jsonl, tasks.seed_tasks=seed_tasks_levels"):
        we.merge_results([a, b])
    b["base_overrides"][-1] = "tasks.seed_tasks=/y/seed_tasks_levels12345.jsonl"
    # and two builds of one recipe (another GPU kind or rank count) are not one experiment
    a["base_weights_sha256"], b["base_weights_sha256"] = "aec6d279f43748ed", "4f1dba07c05c7463"
    with pytest.raises(SystemExit, match="different builds of the base"):
        we.merge_results([a, b])
    b["base_weights_sha256"] = None  # (an older results.json: merged, with a note)
    assert we.merge_results([b, a])["base_weights_sha256"] == "aec6d279f43748ed"


def test_results_record_the_digest_of_a_pretrained_base(tmp_path) -> None:
    from lorapop.tiny.world import training_record

    def digest(model: str) -> str | None:  # what run_all records in results.json
        return training_record(model).get("weights_sha256")

    assert digest("tiny") is None and digest(str(tmp_path)) is None
    (tmp_path / "training.json").write_text(json.dumps({"weights_sha256": "aec6d279f43748ed"}))
    assert digest(str(tmp_path)) == "aec6d279f43748ed"
    (tmp_path / "training.json").write_text("[1, 2")  # a broken record is no digest, not a crash
    assert digest(str(tmp_path)) is None


def test_merge_of_a_single_arm_or_a_broken_file_is_a_one_line_error(tmp_path, capsys) -> None:
    only_single = _results([0], 0.0)
    only_single["runs"] = [r for r in only_single["runs"] if r["arm"] == "single"]
    (tmp_path / "single.json").write_text(json.dumps(only_single))
    (tmp_path / "cut.json").write_text(json.dumps(_results([1], 0.0))[:100])
    for name in ("single.json", "cut.json"):  # in this process: any other exception fails here
        proc = _script(capsys, "--merge", str(tmp_path / name), "--out", str(tmp_path / "m"))
        assert proc.returncode == 1 and "merge" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, str(SCRIPT), "--merge", str(tmp_path / "absent.json"),
                           "--out", str(tmp_path / "m")], capture_output=True, text=True,
                          env=script_env(), timeout=300)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "no such results file" in proc.stderr


def test_a_bounded_world_sets_its_rules_and_seeds_inside_them(tmp_path) -> None:
    """On the narrow, live and natural tables the runs get the table's rules, and the seed
    tasks lie inside them."""
    from lorapop.config import load_config
    from lorapop.tiny.grammar import TABLE_RULES
    from lorapop.tiny.heldout import load_jsonl
    from lorapop.tiny.world import rule_overrides

    we = _module()
    assert rule_overrides("short") == []
    assert load_config(None, rule_overrides("live")).tasks.world_rules() == TABLE_RULES["live"]
    cfg = load_config(None, rule_overrides("narrow"))
    assert cfg.tasks.world_rules() == TABLE_RULES["narrow"]
    paths = we.prepare(tmp_path, 1, 1, "narrow", (1, 3))
    seeds = load_jsonl(paths["seed_tasks"])
    assert seeds and all(cfg.tasks.input_domain.problem(x) is None for t in seeds for x in t.inputs)
    rules = load_config(None, rule_overrides("natural")).tasks.world_rules()
    assert rules == TABLE_RULES["natural"] and rules.inputs.int_min == rules.outputs.int_min == 0
    seeds = load_jsonl(we.prepare(tmp_path / "natural", 1, 1, "natural", (1, 3))["seed_tasks"])
    assert seeds and not any(rules.input_problem(k, x) for t in seeds for k, x in enumerate(t.inputs))
    assert not any(rules.output_problem(y) for t in seeds for y in t.outputs)
    rules = load_config(None, rule_overrides("nocount")).tasks.world_rules()
    assert rules == TABLE_RULES["nocount"] and rules.banned_calls == ("count",)


def test_world_rollouts_tells_unsolved_tasks_and_domain_apart(tmp_path) -> None:
    """benchmarks/world_rollouts.py on rollouts of two code_o tasks: one solved by every answer
    inside the narrow domain, one never solved (one answer repeated) outside it."""
    wr = _module("world_rollouts")
    run = tmp_path / "runs" / "single_s0" / "rollouts"
    run.mkdir(parents=True)
    easy = "solve code_o\n<f>def f(n: int):\n    return n * 2</f><i>3</i>\n<o>"
    hard = "solve code_o\n<f>def f(n: int):\n    return n * 3</f><i>14</i>\n<o>"
    rows = [{"role": "teacher", "type": "code_o", "prompt": "p"}]
    rows += [{"role": "student", "type": "code_o", "prompt": easy, "verdict": "correct",
              "parsed": "6"} for _ in range(4)]  # fmt: skip
    rows += [{"role": "student", "type": "code_o", "prompt": hard, "verdict": "wrong",
              "parsed": "48"} for _ in range(4)]  # fmt: skip
    with gzip.open(run / "step_7.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    s = wr.summarize(run.parent, "narrow")["code_o"]
    assert (s["tasks"], s["solve"], s["all_solved"], s["unsolved"], s["unanimous_wrong"]) == (2, 0.5, 0.5, 0.5, 0.5)
    assert s["inside_domain"] == {"tasks": 1, "solve": 1.0}
    assert s["outside_domain"] == {"tasks": 1, "solve": 0.0}
    assert s["examples_unsolved"][0]["answers"] == ["48"] * 4
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / "regime" / "world_rollouts.py"),
                           str(tmp_path / "nothing")], capture_output=True, text=True,
                          env=script_env())  # fmt: skip
    assert done.returncode == 2 and "does not exist" in done.stderr


def test_world_rollouts_names_the_operation_that_costs_the_most_solve_rate() -> None:
    """Operations come from the syntax tree (a variable named `count` is not a `count` call),
    and the blind spot is the operation whose tasks are solved least against the rest,
    weighted by how many tasks use it; one every task uses cannot be told apart."""
    wr = _module("world_rollouts")
    assert wr.operations("def f(count: int):\n    count += count * 3\n    return count // 3") == \
        ["*", "+=", "//"]  # fmt: skip
    assert wr.operations("def f(s):\n    return s.count('y') if s else len(s[1:])") == \
        ["[", "count", "if", "len"]  # fmt: skip
    assert wr.operations("def f(:") == []
    programs = {"return s.count('y') * 2": 0.0, "return s.count('z') * 3": 0.25,
                "return len(s) * 2": 1.0, "return len(s[1:]) * 2": 0.75, "return s[:1] * 2": 1.0}
    tasks = [{"solve": v, "ops": wr.operations(f"def f(s):\n    {k}")} for k, v in programs.items()]
    spots = wr.blind_spots(tasks)
    assert [r["op"] for r in spots] == ["count"]  # `[` and `len` tasks are solved above the rest
    assert spots[0] == {"op": "count", "share": 0.4, "solve_with": 0.12, "solve_without": 0.92,
                        "lost": 0.317}  # fmt: skip
    tasks.append({"solve": 0.0, "ops": ["*", "//"]})
    assert "*" not in [r["op"] for r in wr.blind_spots(tasks, top=9)]  # in every task


def test_each_runs_sandbox_gets_its_share_of_the_cores_and_never_fewer_than_two() -> None:
    we = _module()
    assert we.sandbox_workers(16, 3) == 4  # 13 cores left after 3 trainers, over 3 runs
    assert we.sandbox_workers(64, 21) == 2 and we.sandbox_workers(2, 1) == 2


def test_arms_c_and_d_from_a_later_call_join_the_verdict_call(tmp_path) -> None:
    """Arms (a) and (b) in one call, (c) and (d) in another on the same base;
    --merge reports the population against all three controls, the verdict unchanged."""
    we = _module()
    ab = _results([0, 1, 2], 0.0)
    cd = _results([0, 1, 2], 0.0)
    runs = []
    for r in cd["runs"]:
        if r["arm"] == "population":  # (d): the population's curves, its students a bit weaker
            g = [1.0, 1.0, 0.0, 0.0]
            runs.append({**r, "name": f"noevolve_s{r['seed']}", "arm": "noevolve",
                         "heldout": {"grades": {"A0": g}, "pass@1": {"A0": fmean(g)}}})  # fmt: skip
        else:  # (c): four single agents a seed, their curves averaged into one
            runs += [{**r, "name": f"independent_s{r['seed']}_a{j}", "arm": "independent"}
                     for j in range(4)]  # fmt: skip
    cd["runs"] = runs
    cd["arms"] = {a: sorted({r["name"] for r in runs if r["arm"] == a}) for a in ("independent", "noevolve")}
    cd["crossplay"] = {"noevolve": {"independent": [0.4] * 3}, "independent": {"noevolve": [0.3] * 3}}
    for p in (ab, cd):
        p["base_weights_sha256"] = "aec6d279f43748ed"
    merged = we.merge_results([ab, cd])
    assert set(merged["arms"]) == {"population", "single", "independent", "noevolve"}
    we.write_summary([ab, cd], tmp_path / "m" / "world_experiment.json")
    res = json.loads((tmp_path / "m" / "world_experiment.json").read_text())
    assert set(res["curves"]) == {"population", "single", "independent", "noevolve"}
    # four agents a seed (here copies of the single agent): rates are their mean, counts their
    # sum, so their distinct programs a step compare with one agent making all the proposals
    one, four = res["curves"]["single"]["0"], res["curves"]["independent"]["0"]
    assert four["solve_rate"] == pytest.approx(one["solve_rate"])
    assert four["distinct_programs"] == pytest.approx([4 * x for x in one["distinct_programs"]])
    alone = json.loads(json.dumps(we.summarize(ab["runs"], {}, [1, 2, 3, 4, 5], [0, 1, 2])))
    assert res["gate"] == alone["gate"] and res["criterion"]["verdict"] == "supported"
    assert res["criterion"]["C2_weakest_vs_single_levels_3_5"] == alone["criterion"][
        "C2_weakest_vs_single_levels_3_5"]
    vs_d = res["endpoints"]["population_weakest_vs_noevolve"]["levels_3_5"]
    vs_c = res["endpoints"]["population_mean_vs_independent"]["levels_3_5"]
    assert vs_d["diff"] == pytest.approx(2 / 3) and vs_c["diff"] == pytest.approx(1.0)
    assert res["crossplay"]["noevolve"] == {"independent": pytest.approx(0.4)}
