"""experiments/regime/protocol.py: the whole protocol on the shipped tiny world (CPU dry run),
and its statistics on made-up curves."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _protocol():
    spec = importlib.util.spec_from_file_location("protocol",
                                                  ROOT / "experiments" / "regime" / "protocol.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMALL = ["model.device=cpu", "league.teachers=2", "league.students=2",
         "league.students_per_teacher=1", "tasks.proposals_per_type=1", "tasks.answers_per_task=1",
         "sampling.teacher_max_new_tokens=96", "sampling.student_max_new_tokens=12",
         "sampling.keep_decoders=0", "train.kl_rows=0", "verify.workers=1", "evolve.every=2",
         "evolve.protect_matches=0", "evolve.fraction=0.5", "run.save_every=1", "difficulty.samples=2",
         "difficulty.answers=2"]


def test_the_protocol_end_to_end_on_the_tiny_world(tmp_path, monkeypatch):
    """Horizon 1 fails (the tiny base does not collapse in a step), so the per-adapter agents
    are extended to 2, where the check is made to pass; then the verdict arms run and the
    summary has per-seed values, t-intervals and bootstraps for C1 and C2."""
    pr = _protocol()
    real, seen = pr.horizon_check, []

    def check(rows, horizon):
        res = real(rows, horizon)
        seen.append(res)
        return res if horizon == 1 else {**res, "passed": True}

    monkeypatch.setattr(pr, "horizon_check", check)
    monkeypatch.setattr(pr, "N_BOOT", 200)
    argv = ["--model", "tiny", "--out", str(tmp_path), "--seeds", "0", "1", "--horizon", "1",
            "--extend", "1", "--max-horizon", "2", "--difficulty-every", "1", "--per-level", "1",
            "--seed-levels", "1", "--workers", "1", "--score-max-new", "12", *SMALL]
    res = pr.main(argv)
    assert [c["horizon"] for c in seen] == [1, 2] and not seen[0]["passed"]
    assert res == json.loads((tmp_path / "protocol.json").read_text())
    assert (tmp_path / "protocol.png").stat().st_size > 0
    assert res["horizon"]["horizon"] == 2 and len(res["horizon_checks"]) == 2
    for arm in ("population", "per_adapter", "total"):
        for s in ("0", "1"):
            sc = res["scored"][arm][s]
            assert sc["step"] == 2 and len(res["curves"][arm][s]["solve_rate"]) == 2
            metrics = (tmp_path / "runs" / f"{arm}_s{s}" / "metrics.jsonl").read_text()
            assert [json.loads(x)["difficulty"]["solver"] for x in metrics.splitlines()] == [
                "base", "base"]  # the fixed solver measured every step
    for s in ("0", "1"):  # scored before step 2's replacement: the replaced student is scored
        pop = res["scored"]["population"][s]
        assert set(pop["heldout_pass@1"]) == {"S0", "S1"}
        replaced = pop["replaced_after_scoring"]
        assert any(r.startswith("S") for r in replaced)
        assert {r for r in replaced if r.startswith("S")} <= set(pop["individuals"].values())
    for ctrl in ("vs_per_adapter", "vs_total"):
        for key in ("C1_difficulty", "C2_weakest_levels_3_5"):
            c = res[ctrl][key]
            assert set(c["per_seed"]) == {"0", "1"}
            assert c["decision"] in ("holds", "fails", "inconclusive")
        c2 = res[ctrl]["C2_weakest_levels_3_5"]
        assert len(c2["t_ci95"]) == len(c2["bootstrap_ci95"]) == 2
        assert c2["mean_diff"] == pytest.approx(sum(c2["per_seed"].values()) / 2)
        # a slope needs two measured steps (a step without a valid task has none)
        c1 = res[ctrl]["C1_difficulty"]
        assert any(v["diff"] is not None for v in c1["per_seed"].values())
        assert (c1["t_ci95"] is None) == any(v["diff"] is None for v in c1["per_seed"].values())
        assert set(res[ctrl]["complexity_reported"]) == {"cyclomatic", "ast_depth", "loc",
                                                         "variables"}
    assert res["criterion"]["verdict"] in ("supported", "not supported", "inconclusive")
    # the same command again reads every run's scores: the same summary, nothing retrained
    mtime = (tmp_path / "runs" / "population_s0" / "metrics.jsonl").stat().st_mtime_ns
    scored = tmp_path / "runs" / "population_s1" / "scores_step2.json"
    scored.replace(scored.with_suffix(".pending"))  # as if cut after its last checkpoint
    again = pr.main(argv)
    assert scored.is_file()
    assert {k: v for k, v in again.items() if k not in ("wall_s", "horizon_checks")} == {
        k: v for k, v in res.items() if k not in ("wall_s", "horizon_checks")}
    assert (tmp_path / "runs" / "population_s0" / "metrics.jsonl").stat().st_mtime_ns == mtime
    # the per-adapter agent is the paper's comparator: one teacher's proposals, a teacher's answers
    cfg = (tmp_path / "runs" / "per_adapter_s0" / "config.yaml").read_text()
    assert "proposals_per_type: 1" in cfg and "answers_per_task: 1" in cfg and "single" in cfg
    total = (tmp_path / "runs" / "total_s0" / "config.yaml").read_text()
    assert "proposals_per_type: 2" in total


def test_the_horizon_holds_when_the_agents_collapse():
    pr = _protocol()

    def rows(solve, diff_solve):
        return [{"step": i + 1, "members": {"A0": {"valid_rate": 0.9}},
                 "matchups": [{"teacher": "A0", "student": "A0", "answers": 8,
                               "solve_rate": solve(i)}],
                 "programs": {"code_o": {"valid": 2, "cyclomatic": 2.0 - 0.01 * i, "coverage": 1}},
                 "difficulty": {"solve_rate": diff_solve(i)}} for i in range(100)]

    collapsing = rows(lambda i: 0.4 + 0.006 * i, lambda i: 0.2 + 0.004 * i)
    learning = rows(lambda i: 0.4 + 0.006 * i, lambda i: 0.2)  # solves, tasks no easier
    check = pr.horizon_check({0: collapsing, 1: collapsing, 2: learning}, 100)
    assert check["need"] == 2 and check["passed"]
    assert [check["seeds"][s]["collapsed"] for s in "012"] == [True, True, False]
    assert check["seeds"]["0"]["difficulty_slope_per_100"] == pytest.approx(-0.4)
    assert not pr.horizon_check({0: collapsing, 1: learning, 2: learning}, 100)["passed"]
    assert not pr.horizon_check({0: collapsing, 1: collapsing, 2: learning}, 50)["passed"]


def test_intervals_and_decisions():
    pr = _protocol()
    lo, hi = pr.t_interval([1.0, 2.0, 3.0])
    assert (lo + hi) / 2 == pytest.approx(2.0) and hi - lo == pytest.approx(2 * 4.303 / math.sqrt(3))
    assert pr.t975(200) == pytest.approx(1.972, abs=2e-3)
    assert pr.decide([0.1, 0.3], [0.05, 0.2]) == "holds"
    assert pr.decide([0.1, 0.3], [-0.05, 0.2]) == "inconclusive"
    assert pr.decide([-0.3, -0.1], [-0.2, -0.01]) == "fails"
    up = [[(s, 0.01 * s + (0.02 if s % 3 else 0)) for s in range(1, 40)] for _ in range(3)]
    flat = [[(s, 0.5) for s in range(1, 40)] for _ in range(3)]
    ci = pr.slope_bootstrap(up, flat, n_boot=300)
    assert ci[0] > 0.5 and ci[1] < 1.5  # slope 1 per 100 steps, give or take the wiggle
    c = pr.slope_contrast(dict(enumerate(up)), dict(enumerate(flat)), [0, 1, 2])
    assert c["per_seed"]["0"]["diff"] == pytest.approx(c["mean_diff"])


def test_bad_arguments_are_one_line_errors(capsys):
    pr = _protocol()
    for argv in (["--seeds", "0"], ["--horizon", "1300"], ["--difficulty-every", "0"]):
        with pytest.raises(SystemExit):
            pr.main(argv)
        assert "error:" in capsys.readouterr().err
