"""The regime experiment as the paper runs it: the protocol registered in PROTOCOL.md.

Arms, each seed in its own run (compute matched to one adapter of the population):
  population   PopuLoRA, T teachers + S students (the regime config: 4 + 4)
  per_adapter  the paper's comparator: one single agent (AZR) with one teacher's proposals and
               the answers a teacher's task gets (answers x students_per_teacher)
  total        the single agent with the population's total compute (T x the proposals),
               reported beside the comparator, not scored

Stages, in one command that a later call continues (runs checkpoint at --deadline):
  1. horizon: the per-adapter agents train to --horizon; the horizon holds when they collapse
     (PROTOCOL.md: own solve rate over the last 10% >= 0.8 and the frozen solver's solve rate
     of their tasks rising, in >= 2/3 of the seeds); if not, they continue by --extend steps,
     up to --max-horizon, where the protocol stops with "not tested";
  2. verdict: the population and the total-compute agent train to the horizon found;
  3. summary (OUT/protocol.json): per seed, C1 (the frozen solver's difficulty slope, the
     paper's four complexity slopes beside it) and C2 (held-out, weakest student), each with a
     t-interval over seeds and a two-level bootstrap, against the per-adapter agent (and the
     total-compute agent beside), and the verdict.

Every run measures difficulty with the base model as a fixed solver (`difficulty.*`, set here
for all arms alike) and is scored at its last step on held-out and selection sets; a
population's students are scored after that step's update and before its replacement (the
member the league ranked lowest is scored, and kept, too).

    PYTHONPATH=src python experiments/regime/protocol.py --model DIR --out runs/protocol \\
        --parallel 15 --gpus 4 --deadline 540          # again to continue, until the summary
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import fmean, stdev
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _d in (HERE, ROOT / "benchmarks"):  # world_experiment.py: here, or where it was before
    if _d.is_dir() and str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

import world_experiment as wx  # noqa: E402  (the world's sets, curves and bootstrap)

ARMS = ("population", "per_adapter", "total")
COMPARATOR, BESIDE = "per_adapter", "total"
COMPLEXITY = ("cyclomatic", "ast_depth", "loc", "variables")
#: the registered protocol (PROTOCOL.md); the CLI's defaults
HORIZON, EXTEND, MAX_HORIZON = 600, 300, 1200
SEEDS = (0, 1, 2, 3, 4)
DIFFICULTY = {"every": 10, "samples": 8, "answers": 8}
COLLAPSE_SOLVE = 0.8
N_BOOT = 4000


def config_path() -> Path:
    """The regime config: beside this script once the recipes live here, else configs/."""
    for p in (HERE / "world.yaml", ROOT / "configs" / "world.yaml"):
        if p.is_file():
            return p
    raise SystemExit("no regime config (experiments/regime/world.yaml or configs/world.yaml)")


# -- the runs ---------------------------------------------------------------------------------


def arm_overrides(arm: str, seed: int, base: list[str]) -> list[str]:
    """An arm's config overrides for one seed, compute-matched as the module doc says."""
    from lorapop.config import load_config

    cfg = load_config(config_path(), base)
    t, k = cfg.league.teachers, cfg.league.students_per_teacher
    p, n = cfg.tasks.proposals_per_type, cfg.tasks.answers_per_task
    single = ["league.mode=single", f"tasks.answers_per_task={n * k}"]
    if arm == "population":
        return [f"seed={seed}"]
    if arm == "per_adapter":
        return [f"seed={seed}", *single, f"tasks.proposals_per_type={p}"]
    if arm == "total":
        return [f"seed={seed}", *single, f"tasks.proposals_per_type={p * t}"]
    raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")


def _score(sp: Any, job: dict, step: int, replaced: list[str] | None = None) -> dict:
    """Held-out and selection pass@1 (per-task grades) of the run's students as they are now."""
    from lorapop.tiny.evaluate import evaluate_tiny
    from lorapop.tiny.heldout import load_jsonl

    p = sp.parts
    slots = {m: p.slot[m] for m in p.students}
    budget = job.get("score_max_new")
    rec: dict = {"step": step, "individuals": {m: p.lineage.individual(m) for m in slots}}
    for key in ("heldout", "select") if len(slots) > 1 else ("heldout",):
        res = evaluate_tiny(p.model, p.tokenizer, load_jsonl(job[key]), p.sandbox, bank=p.bank,
                            slots=slots, keep_grades=True,
                            max_new_tokens=None if budget is None else dict.fromkeys(
                                ("code_o", "code_i", "code_f"), budget))
        rec[key] = {"grades": res["grades"],
                    "pass@1": {m: r["pass@1"] for m, r in res["members"].items()}}
    if len(slots) == 1:  # one student: nothing to pick
        rec["select"] = {"pass@1": rec["heldout"]["pass@1"]}
    if p.ratings is not None:  # the league's ranking then: whom a replacement would take
        rec["conservative_rating"] = {m: p.ratings.get(m).mu - 3 * p.ratings.get(m).sigma
                                      for m in slots}
    return rec


def train_to(job: dict) -> dict:
    """Train (or resume) one run to `job['steps']` or the deadline; score it at that step,
    before the step's replacement where it has one, into RUN/scores_stepN.json. The scores
    become that file once the step's checkpoint is written: a run cut before replays the step
    (its row included), one cut after finds them complete."""
    import torch

    from lorapop.config import load_config
    from lorapop.run.checkpoint import latest_checkpoint
    from lorapop.selfplay.loop import SelfPlay

    run_dir, target = Path(job["run_dir"]), int(job["steps"])
    scores = run_dir / f"scores_step{target}.json"
    rec = {"name": job["name"], "arm": job["arm"], "seed": job["seed"]}
    pending = scores.with_suffix(".pending")
    last_ckpt = latest_checkpoint(run_dir)
    if not scores.is_file() and pending.is_file() and last_ckpt is not None \
            and last_ckpt.name == f"step_{target:06d}":
        pending.replace(scores)  # cut between the checkpoint and the rename
    if scores.is_file():  # scored by an earlier call (the run may have gone on since)
        return {**rec, "steps": target, "done": True, "scores": json.loads(scores.read_text())}
    torch.set_num_threads(job.get("threads", 1))
    cfg = load_config(config_path(), job["overrides"])
    resume = last_ckpt is not None
    if not resume and run_dir.exists():
        shutil.rmtree(run_dir)  # stopped before its first checkpoint: start again
    sp = SelfPlay(cfg, run_dir, resume=resume)
    try:
        if sp.step_done >= target:  # members of that step are gone (or replaced)
            raise SystemExit(f"{run_dir} is at step {sp.step_done}, unscored at {target}: "
                             "train it again from a checkpoint before that step")
        saved = sp.step_done
        while sp.step_done < target and time.time() < job["deadline_at"]:
            last = sp.step_done + 1 == target
            held: dict = {}

            def score_now(step: int, held: dict = held) -> None:
                held.update(_score(sp, job, step))

            row = sp.step(before_replacement=score_now if last else None)
            if last:
                if held:  # scored before this step's replacement: name whom it replaced
                    held["replaced_after_scoring"] = [r["replaced"] for r in row["replacements"]]
                else:
                    held.update(_score(sp, job, sp.step_done), replaced_after_scoring=[])
                pending.write_text(json.dumps(held))
            if sp.step_done % cfg.run.save_every == 0 or sp.step_done == target:
                sp.save()
                saved = sp.step_done
            if last:
                pending.replace(scores)
        if sp.step_done != saved:
            sp.save()
        rec.update(steps=sp.step_done, done=sp.step_done == target)
    finally:
        sp.close()
    if rec["done"]:
        rec["scores"] = json.loads(scores.read_text())
    return rec


def run_jobs(jobs: list[dict], out: Path, parallel: int, gpus: int) -> list[dict]:
    """Each job to its steps: in this process one after another (`--parallel 1` without GPUs:
    the CPU dry run), else each in its own process, `parallel` at once, spread over `gpus`."""
    (out / "jobs").mkdir(parents=True, exist_ok=True)
    if parallel <= 1 and gpus <= 0:
        return [train_to(j) for j in jobs]
    wx.place(jobs, gpus)

    def one(job: dict) -> dict:
        path = out / "jobs" / f"{job['name']}_to{job['steps']}.json"
        path.write_text(json.dumps(job))
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": str(job["gpu"])} if "gpu" in job else {})}
        proc = subprocess.run([sys.executable, __file__, "--job", str(path)], capture_output=True,
                              text=True, env=env)
        if proc.returncode:
            raise RuntimeError(f"{job['name']} failed:\n{proc.stderr[-3000:]}")
        return json.loads(path.with_suffix(".out.json").read_text())

    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(one, jobs))


# -- measures of a run --------------------------------------------------------------------------


def difficulty_points(rows: list[dict]) -> list[tuple[int, float]]:
    """(step, difficulty) of a run: 1 - the fixed solver's solve rate of the step's tasks."""
    return [(r["step"], 1.0 - r["difficulty"]["solve_rate"]) for r in rows
            if isinstance((r.get("difficulty") or {}).get("solve_rate"), (int, float))]


def complexity_points(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of a complexity measure of the teachers' code_o/code_i programs."""
    return [(i + 1, v) for i, v in enumerate(wx.curves(rows)[key]) if v is not None]


def slope_per_100(pts: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of (step, value) points, per 100 steps."""
    if len({s for s, _ in pts}) < 2:
        return None
    mx, my = fmean(s for s, _ in pts), fmean(v for _, v in pts)
    return 100 * sum((s - mx) * (v - my) for s, v in pts) / sum((s - mx) ** 2 for s, _ in pts)


def collapse(rows: list[dict]) -> dict:
    """The registered collapse of a single agent: own solve rate over the last 10% of its steps
    >= COLLAPSE_SOLVE and its tasks getting easier for the fixed solver (difficulty slope < 0);
    the cyclomatic slope beside it."""
    c = wx.curves(rows)
    solve = wx.window(c["solve_rate"], last=True)
    d = slope_per_100(difficulty_points(rows))
    return {"steps": len(rows), "final_solve_rate": solve, "difficulty_slope_per_100": d,
            "cyclomatic_slope_per_100": slope_per_100(complexity_points(rows, "cyclomatic")),
            "collapsed": solve is not None and solve >= COLLAPSE_SOLVE and d is not None and d < 0}


def horizon_check(rows: dict[int, list[dict]], horizon: int) -> dict:
    """The collapse of the per-adapter agents over their first `horizon` steps, per seed."""
    seeds = sorted(rows)
    per = {str(s): collapse(rows[s][:horizon]) for s in seeds}
    need = math.ceil(2 * len(seeds) / 3)
    return {"horizon": horizon, "seeds": per, "need": need,
            "passed": sum(p["collapsed"] for p in per.values()) >= need}


# -- statistics ---------------------------------------------------------------------------------

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (a table to 30, then the
    normal quantile with its first Cornish-Fisher term)."""
    if df < 1:
        raise ValueError("a t-interval needs >= 2 seeds")
    z = 1.959964
    return _T975[df - 1] if df <= len(_T975) else z + (z**3 + z) / (4 * df)


def t_interval(xs: list[float]) -> list[float] | None:
    """The 95% t-interval of the mean of per-seed values (None with fewer than 2)."""
    if len(xs) < 2:
        return None
    h = t975(len(xs) - 1) * stdev(xs) / math.sqrt(len(xs))
    return [fmean(xs) - h, fmean(xs) + h]


def slope_bootstrap(a: list[list[tuple[int, float]]], b: list[list[tuple[int, float]]],
                    n_boot: int, seed: int = 0) -> list[float] | None:
    """95% CI of the mean over seeds of slope(a) - slope(b), two levels: seeds resampled, then
    each run's measured steps (its points) resampled within it."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def slopes(pts: list[tuple[int, float]]) -> np.ndarray:  # one per resample of the points
        draw = rng.integers(0, len(pts), size=(n_boot, len(pts)))
        x, y = np.asarray(pts, dtype=float).T
        xm, ym = x[draw] - x[draw].mean(1, keepdims=True), y[draw] - y[draw].mean(1, keepdims=True)
        den = (xm**2).sum(1)
        out = np.full(n_boot, np.nan)
        np.divide(100 * (xm * ym).sum(1), den, out=out, where=den > 0)
        return out

    if not a:
        return None
    per = np.stack([slopes(pa) - slopes(pb) for pa, pb in zip(a, b, strict=True)])  # seeds x boot
    picks = rng.integers(0, len(a), size=(n_boot, len(a)))
    drawn = per[picks, np.arange(n_boot)[:, None]]
    ok = ~np.isnan(drawn).all(1)
    if not ok.any():
        return None
    stats = np.sort(np.nanmean(drawn[ok], axis=1))
    return [float(stats[int(0.025 * len(stats))]), float(stats[int(0.975 * len(stats)) - 1])]


def decide(ci_t: list[float] | None, ci_boot: list[float] | None) -> str:
    """`holds` when both 95% intervals lie above 0, `fails` when both lie below, else
    `inconclusive` (PROTOCOL.md)."""
    if ci_t is None or ci_boot is None:
        return "inconclusive"
    if ci_t[0] > 0 and ci_boot[0] > 0:
        return "holds"
    if ci_t[1] < 0 and ci_boot[1] < 0:
        return "fails"
    return "inconclusive"


def slope_contrast(pop: dict[int, list], ctrl: dict[int, list], seeds: list[int]) -> dict:
    """Population minus control slope (per 100 steps) per seed, t-interval, bootstrap."""
    per = {s: (slope_per_100(pop[s]), slope_per_100(ctrl[s])) for s in seeds}
    diffs = {s: a - b for s, (a, b) in per.items() if a is not None and b is not None}
    ok = [s for s in seeds if s in diffs]
    ci_t = t_interval([diffs[s] for s in ok])
    ci_b = slope_bootstrap([pop[s] for s in ok], [ctrl[s] for s in ok], N_BOOT) if ok else None
    return {"per_seed": {str(s): {"population": per[s][0], "control": per[s][1],
                                  "diff": diffs.get(s)} for s in seeds},
            "mean_diff": fmean(diffs.values()) if diffs else None,
            "t_ci95": ci_t, "bootstrap_ci95": ci_b, "decision": decide(ci_t, ci_b)}


def weakest_vectors(scores: dict) -> dict[str, list[float]]:
    """Per-task held-out grades of a run's mean, best and weakest student (best and weakest
    picked on the selection set)."""
    grades = scores["heldout"]["grades"]
    select = scores["select"]["pass@1"]
    best, worst = max(select, key=select.__getitem__), min(select, key=select.__getitem__)
    n = len(next(iter(grades.values())))
    return {"mean": [fmean(float(g[i]) for g in grades.values()) for i in range(n)],
            "best": [float(x) for x in grades[best]], "weakest": [float(x) for x in grades[worst]],
            "picked": {"best": best, "weakest": worst}}


def heldout_contrast(pop: dict[int, dict], ctrl: dict[int, dict], seeds: list[int],
                     idx: list[int], stat: str = "weakest") -> dict:
    """Population (`stat` student) minus the control's agent on held-out tasks `idx`: per seed,
    t-interval over seeds, two-level bootstrap (seeds, then tasks; paired)."""
    a = [weakest_vectors(pop[s])[stat] for s in seeds]
    b = [weakest_vectors(ctrl[s])["mean"] for s in seeds]  # a single agent: its one student
    per = [fmean(x[i] - y[i] for i in idx) for x, y in zip(a, b, strict=True)]
    ci_t = t_interval(per)
    boot = wx.paired_bootstrap(a, b, idx, n_boot=N_BOOT) if len(seeds) > 1 else None
    ci_b = boot["ci95"] if boot else None
    return {"per_seed": dict(zip(map(str, seeds), per, strict=True)), "mean_diff": fmean(per),
            "t_ci95": ci_t, "bootstrap_ci95": ci_b, "decision": decide(ci_t, ci_b)}


def summarize(rows: dict[str, dict[int, list[dict]]], scores: dict[str, dict[int, dict]],
              levels: list[int], horizon: dict) -> dict:
    """C1 and C2 against the per-adapter agent (and the total-compute agent beside), and the
    verdict (PROTOCOL.md)."""
    seeds = sorted(rows["population"])
    hard = [i for i, lv in enumerate(levels) if lv is not None and lv >= 3]
    out: dict = {"seeds": seeds, "horizon": horizon}
    for ctrl in (COMPARATOR, BESIDE):
        if ctrl not in rows:
            continue
        diff = {a: {s: difficulty_points(rows[a][s]) for s in seeds} for a in ("population", ctrl)}
        c1 = slope_contrast(diff["population"], diff[ctrl], seeds)
        c1["population_difficulty_slope_t_ci95"] = t_interval(
            [v["population"] for v in c1["per_seed"].values() if v["population"] is not None])
        comp = {m: slope_contrast({s: complexity_points(rows["population"][s], m) for s in seeds},
                                  {s: complexity_points(rows[ctrl][s], m) for s in seeds}, seeds)
                for m in COMPLEXITY}
        c2 = heldout_contrast(scores["population"], scores[ctrl], seeds, hard)
        out[f"vs_{ctrl}"] = {
            "C1_difficulty": c1, "complexity_reported": comp,
            "C2_weakest_levels_3_5": c2,
            "mean_student_levels_3_5": heldout_contrast(scores["population"], scores[ctrl],
                                                        seeds, hard, "mean"),
            "best_student_levels_3_5": heldout_contrast(scores["population"], scores[ctrl],
                                                        seeds, hard, "best"),
        }
    main = out[f"vs_{COMPARATOR}"]
    c1, c2 = main["C1_difficulty"]["decision"], main["C2_weakest_levels_3_5"]["decision"]
    if c1 == "holds" and c2 == "holds":
        verdict = "supported"
    elif "fails" in (c1, c2):
        verdict = "not supported"
    else:
        verdict = "inconclusive"
    out["criterion"] = {"C1": c1, "C2": c2, "verdict": verdict}
    out["scored"] = {a: {str(s): {"step": sc["step"], "individuals": sc["individuals"],
                                  "replaced_after_scoring": sc.get("replaced_after_scoring", []),
                                  "heldout_pass@1": sc["heldout"]["pass@1"],
                                  "picked": weakest_vectors(sc)["picked"]}
                         for s, sc in by.items()} for a, by in scores.items()}
    out["curves"] = {a: {str(s): {"difficulty": difficulty_points(r),
                                  **{k: v for k, v in wx.curves(r).items()
                                     if k in (*COMPLEXITY, "solve_rate", "valid_rate", "entropy")}}
                         for s, r in by.items()} for a, by in rows.items()}
    return out


# -- the figure ---------------------------------------------------------------------------------

PANELS = {"difficulty": "difficulty (1 - fixed solver's solve rate)",
          "solve_rate": "own solve rate", "valid_rate": "valid rate", "entropy": "entropy",
          "cyclomatic": "cyclomatic complexity", "ast_depth": "AST depth", "loc": "lines",
          "variables": "variables"}


def plot(path: Path) -> Path:
    """PATH's curves (a protocol.json) as PATH.png: a panel a measure, arms overlaid, the mean
    over seeds with their min-max band (the difficulty at its measured steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(path).read_text())
    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    for ax, (key, title) in zip(axes.flat, PANELS.items(), strict=True):
        for color, (arm, by_seed) in zip(("C0", "C2", "C3"), res.get("curves", {}).items(),
                                         strict=False):
            cols: dict[int, list[float]] = {}
            for c in by_seed.values():
                pts = c[key] if key == "difficulty" else [
                    (i + 1, v) for i, v in enumerate(c.get(key, [])) if v is not None]
                for step, v in pts:
                    cols.setdefault(int(step), []).append(v)
            steps = sorted(cols)
            if steps:
                ax.plot(steps, [fmean(cols[s]) for s in steps], color=color, lw=1.5, label=arm)
                ax.fill_between(steps, [min(cols[s]) for s in steps],
                                [max(cols[s]) for s in steps], color=color, alpha=0.2)
        ax.set(title=title, xlabel="step")
    axes.flat[0].legend(fontsize=8)
    crit = res.get("criterion", {})
    fig.suptitle(f"Regime protocol, seeds {res.get('seeds')}, horizon "
                 f"{res.get('horizon', {}).get('horizon')}: C1 {crit.get('C1')}, "
                 f"C2 {crit.get('C2')}, verdict {crit.get('verdict')}")
    fig.tight_layout()
    png = Path(path).with_suffix(".png")
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return png


# -- the protocol -------------------------------------------------------------------------------


def run_protocol(args: argparse.Namespace) -> dict | None:
    """Stages 1-3 (module doc); None while runs are left for a later call."""
    from lorapop.engine.load import TINY_DIR
    from lorapop.run.report import read_metrics
    from lorapop.tiny.heldout import load_jsonl
    from lorapop.tiny.world import rule_overrides, training_record, world_of

    t0, out = time.time(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = wx.ensure_model(args)
    world = world_of(TINY_DIR if model == "tiny" else model)
    table = world["levels"]
    paths = wx.prepare(out, args.per_level, args.workers, table,
                       tuple(sorted(set(args.seed_levels))), wx.TYPES, world["code_f_inputs"])
    dc = {"every": args.difficulty_every, "samples": args.difficulty_samples,
          "answers": args.difficulty_answers}
    base = [f"model.name_or_path={Path(model).resolve() if Path(model).exists() else model}",
            f"tasks.seed_tasks={Path(paths['seed_tasks']).resolve()}",
            f"tasks.references={world['references']}", *rule_overrides(table),
            *([f"tasks.code_f_inputs={world['code_f_inputs']}"] if world["code_f_inputs"] else []),
            *(f"difficulty.{k}={v}" for k, v in dc.items()), *args.overrides]
    n_runs = len(args.seeds) * len(ARMS)
    share = f"verify.workers={wx.sandbox_workers(os.cpu_count() or 2, min(args.parallel, n_runs))}"

    def jobs(arm: str, steps: int) -> list[dict]:
        return [{"name": f"{arm}_s{s}", "arm": arm, "seed": s, "steps": steps,
                 "overrides": [share, *base, *arm_overrides(arm, s, base)],
                 "run_dir": str(out / "runs" / f"{arm}_s{s}"), "heldout": paths["heldout"],
                 "select": paths["select"], "deadline_at": t0 + args.deadline,
                 "score_max_new": args.score_max_new} for s in args.seeds]

    def rows_of(arm: str) -> dict[int, list[dict]]:
        return {s: read_metrics(out / "runs" / f"{arm}_s{s}") for s in args.seeds}

    # 1. the horizon: per-adapter agents until they collapse, or the longest horizon
    horizon, checks = args.horizon, []
    while True:
        recs = run_jobs(jobs(COMPARATOR, horizon), out, args.parallel, args.gpus)
        if not all(r["done"] for r in recs):
            return _left(recs)
        check = horizon_check(rows_of(COMPARATOR), horizon)
        checks.append(check)
        if check["passed"] or horizon + args.extend > args.max_horizon:
            break
        horizon += args.extend
    result: dict = {"protocol": "experiments/regime/PROTOCOL.md", "config": str(config_path()),
                    "command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "base_overrides": base, "seeds": args.seeds, "horizon_checks": checks,
                    "base_weights_sha256": training_record(model).get("weights_sha256")}
    if not checks[-1]["passed"]:
        result["criterion"] = {"verdict": "not tested: the per-adapter agent did not collapse "
                                          f"within {horizon} steps"}
    else:
        # 2. the verdict arms to the horizon found
        recs += run_jobs([j for a in ARMS if a != COMPARATOR for j in jobs(a, horizon)], out,
                         args.parallel, args.gpus)
        if not all(r["done"] for r in recs):
            return _left(recs)
        # 3. the summary
        rows = {a: {s: rows_of(a)[s][:horizon] for s in args.seeds} for a in ARMS}
        scores = {a: {r["seed"]: r["scores"] for r in recs if r["arm"] == a} for a in ARMS}
        levels = [t.meta.get("difficulty") for t in load_jsonl(paths["heldout"])]
        result |= summarize(rows, scores, levels, checks[-1])
    result["wall_s"] = round(time.time() - t0, 1)
    text = json.dumps(result)
    (out / "protocol.json").write_text(text + "\n")
    if "curves" in result:
        try:
            plot(out / "protocol.json")
        except ImportError as e:  # the JSON is the result; the figure a view of it
            print(f"no protocol.png: {e}", file=sys.stderr)
    print(json.dumps({"horizon": checks[-1]["horizon"], **result["criterion"]}))
    return json.loads(text)


def _left(recs: list[dict]) -> None:
    left = [f"{r['name']} ({r['steps']})" for r in recs if not r["done"]]
    print(f"not finished: {', '.join(left)}; run the same command again to continue")
    return None


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--model", default="runs/world/world-nojoin-77m",
                    help="base model directory (built with --size when empty), or `tiny`")
    ap.add_argument("--size", default="world-nojoin-77m", help="pretrain-tiny size for --model")
    ap.add_argument("--out", default="runs/protocol")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--horizon", type=int, default=HORIZON, help="first horizon checked")
    ap.add_argument("--extend", type=int, default=EXTEND, help="steps added when it fails")
    ap.add_argument("--max-horizon", type=int, default=MAX_HORIZON)
    ap.add_argument("--difficulty-every", type=int, default=DIFFICULTY["every"])
    ap.add_argument("--difficulty-samples", type=int, default=DIFFICULTY["samples"])
    ap.add_argument("--difficulty-answers", type=int, default=DIFFICULTY["answers"])
    ap.add_argument("--parallel", type=int, default=1, help="runs trained at once")
    ap.add_argument("--gpus", type=int, default=0, help="spread the runs over this many GPUs")
    ap.add_argument("--deadline", type=float, default=float("inf"),
                    help="seconds after start at which runs checkpoint and stop")
    ap.add_argument("--per-level", type=int, default=20, help="held-out tasks per type and level")
    ap.add_argument("--seed-levels", type=int, nargs="+", default=[1, 2, 3, 4, 5],
                    choices=[1, 2, 3, 4, 5], metavar="LEVEL")
    ap.add_argument("--workers", type=int, default=4, help="sandbox workers for set-up")
    ap.add_argument("--score-max-new", type=int, help="new-token budget of held-out answers "
                    "(default: each type's, lorapop.tiny.evaluate.MAX_NEW)")
    ap.add_argument("--plot", type=Path, help="draw a protocol.json's curves, then stop")
    ap.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="key.path=value for every run (before matching)")
    args = ap.parse_intermixed_args(argv)
    if args.plot:
        print(f"wrote {plot(args.plot)}")
        return None
    if args.job:
        rec = train_to(json.loads(args.job.read_text()))
        args.job.with_suffix(".out.json").write_text(json.dumps(rec))
        return None
    if len(args.seeds) < 2:
        ap.error("the t-interval and the bootstrap need >= 2 seeds")
    if not 0 < args.horizon <= args.max_horizon or args.extend < 1:
        ap.error("need 0 < --horizon <= --max-horizon and --extend >= 1")
    if args.difficulty_every < 1:
        ap.error("--difficulty-every must be >= 1: C1 reads the fixed solver's curve")
    return run_protocol(args)


if __name__ == "__main__":
    main()
