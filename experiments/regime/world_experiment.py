"""The regime experiment: PopuLoRA vs its controls in the regime world, several seeds, one GPU.

Arms (all with the same generation compute per step: proposals and answers):
  population   (a) PopuLoRA, T teachers + S students (configs/world.yaml: 4 + 4)
  single       (b) the single agent (AZR), proposals_per_type x T and answers x students_per_teacher
  independent  (c) T independent single agents, each proposals_per_type and answers x k
  noevolve     (d) the population without evolution (evolve.every=0)

    PYTHONPATH=src python experiments/regime/world_experiment.py --model runs/world/world-short \\
        --out runs/world --seeds 0 1 2 --parallel 21 --deadline 540   # trains; re-run to continue
    python experiments/regime/world_experiment.py --plot runs/world/world_experiment.json

Every run trains in its own process (many share one GPU; the sandboxes share the CPUs), stops
at `--deadline` seconds after the call began with a checkpoint, and resumes from it when the
same command runs again, so a long experiment spans several calls. When every run is done,
each scores its students on the held-out set (levels 1-5 of the base model's level table: the
world recipes' `world`) and on a selection set (which picks
the best and weakest student), then on the other arms' recent tasks (cross-play), and the
summary is written: per-step curves, the gate, the pre-registered criterion (README), paired
bootstrap CIs. `--model` builds the base with `--size` when the directory holds no model.

A call's small results (curves, per-task grades, cross-play) go to `results.json`; `--merge`
joins those of calls that ran other seeds or arms (runs cannot move between machines, their
results can). `--gpus N` puts each run on one of N GPUs.
A chain that cannot reach train.steps ends with `--finish` (runs scored where they are); one cut
before that still gives `--partial` (gate, slopes and scored end points from what came back).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import fmean, median

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "world.yaml"
ARMS = ("population", "single", "independent", "noevolve")
TYPES = ("code_o", "code_i", "code_f")
SELECT_SEED = "world-select-v1"
COMPLEXITY = ("cyclomatic", "ast_depth", "loc", "variables")
CURVES = (*COMPLEXITY, "solve_rate", "valid_rate", "partial_share", "unsolved_share",
          "teacher_reward", "teacher_reward_var", "distinct_programs", "entropy", "kl",
          "coverage", "valid_programs", "replacements")


# -- the runs ---------------------------------------------------------------------------------


def arm_runs(arm: str, seed: int, overrides: list[str]) -> list[tuple[str, list[str]]]:
    """(run name, config overrides) of one arm and seed, compute-matched to the population."""
    from lorapop.config import load_config

    cfg = load_config(CONFIG, overrides)
    t, k = cfg.league.teachers, cfg.league.students_per_teacher
    p, n = cfg.tasks.proposals_per_type, cfg.tasks.answers_per_task
    single = ["league.mode=single", f"tasks.answers_per_task={n * k}"]
    if arm == "population":
        return [(f"population_s{seed}", [f"seed={seed}"])]
    if arm == "noevolve":
        return [(f"noevolve_s{seed}", [f"seed={seed}", "evolve.every=0"])]
    if arm == "single":
        return [(f"single_s{seed}", [f"seed={seed}", *single, f"tasks.proposals_per_type={p * t}"])]
    if arm == "independent":
        return [(f"independent_s{seed}_a{j}",
                 [f"seed={1000 * (j + 1) + seed}", *single, f"tasks.proposals_per_type={p}"])
                for j in range(t)]  # fmt: skip
    raise ValueError(f"unknown arm {arm!r}")


def train_one(job: dict) -> dict:
    """Train (or resume) one run until done or the deadline; when done, score its students."""
    import torch

    from lorapop.config import load_config
    from lorapop.run.checkpoint import latest_checkpoint
    from lorapop.selfplay.loop import SelfPlay
    from lorapop.tiny.evaluate import evaluate_tiny
    from lorapop.tiny.heldout import load_jsonl, save_jsonl

    torch.set_num_threads(1)
    cfg = load_config(CONFIG, job["overrides"])
    run_dir = Path(job["run_dir"])
    resume = latest_checkpoint(run_dir) is not None
    if not resume and run_dir.exists():
        shutil.rmtree(run_dir)  # killed before its first checkpoint: start again
    sp = SelfPlay(cfg, run_dir, resume=resume)
    try:
        saved = sp.step_done
        while sp.step_done < cfg.train.steps and time.time() < job["deadline_at"]:
            sp.step()
            if sp.step_done % cfg.run.save_every == 0:
                sp.save()
                saved = sp.step_done
        if sp.step_done != saved:
            sp.save()
        # --finish: the chain's device time ends here, so score the run at the step it reached
        done = sp.step_done >= cfg.train.steps or (job.get("finish", False) and sp.step_done > 0)
        rec: dict = {"name": job["name"], "arm": job["arm"], "seed": job["seed"],
                     "steps": sp.step_done, "done": done}  # fmt: skip
        if done:
            p = sp.parts
            slots = {m: p.slot[m] for m in p.students}
            for key in ("heldout", "select"):
                res = evaluate_tiny(p.model, p.tokenizer, load_jsonl(job[key]), p.sandbox,
                                    bank=p.bank, slots=slots, keep_grades=True)  # fmt: skip
                rec[key] = {"grades": res["grades"],
                            "pass@1": {m: r["pass@1"] for m, r in res["members"].items()}}
            recent = max(1, sp.step_done - job["recent_steps"])
            tasks = [t for b in p.buffers.values() for t in b if (t.step or 0) >= recent]
            random.Random(job["name"]).shuffle(tasks)
            save_jsonl(tasks[: job["recent_tasks"]], run_dir / "recent_tasks.jsonl")
    finally:
        sp.close()
    return rec


def cross_one(job: dict) -> dict:
    """A finished run's students on the pooled recent tasks of every arm of its seed."""
    import torch

    from lorapop.config import load_config
    from lorapop.selfplay.loop import SelfPlay
    from lorapop.tiny.evaluate import evaluate_tiny
    from lorapop.tiny.heldout import load_jsonl

    torch.set_num_threads(1)
    cfg = load_config(CONFIG, job["overrides"])
    sp = SelfPlay(cfg, Path(job["run_dir"]), resume=True)
    try:
        p = sp.parts
        tasks = load_jsonl(job["pool"])
        res = evaluate_tiny(p.model, p.tokenizer, tasks, p.sandbox, bank=p.bank,
                            slots={m: p.slot[m] for m in p.students}, keep_grades=True)
    finally:
        sp.close()
    by_arm: dict[str, list[float]] = {}
    for i, t in enumerate(tasks):
        by_arm.setdefault(t.meta["arm"], []).append(fmean(g[i] for g in res["grades"].values()))
    return {arm: fmean(v) for arm, v in by_arm.items()}


# -- curves and statistics --------------------------------------------------------------------


def curves(rows: list[dict]) -> dict[str, list[float | None]]:
    """Per step: complexity of the teachers' code_o/code_i programs, own-task solve rate, valid
    rate, shares of tasks with 0 < s < 1 and with s = 0, the teachers' mean reward and its
    variance, distinct code_o/code_i programs, entropy, the update's KL (`train.kl_rows`),
    cumulative coverage and valid programs (code_o + code_i), cumulative replacements. A value
    a step's record lacks (older runs) is None."""
    out: dict[str, list[float | None]] = {k: [] for k in CURVES}
    valid = repl = 0
    for r in rows:
        progs = [r["programs"][t] for t in ("code_o", "code_i") if t in r["programs"]]
        for k in COMPLEXITY:
            pairs = [(p[k], p["valid"]) for p in progs if p.get(k) is not None and p["valid"]]
            w = sum(v for _, v in pairs)
            out[k].append(sum(x * v for x, v in pairs) / w if w else None)
        m = r["matchups"]
        answers = sum(x["answers"] for x in m if x["solve_rate"] is not None)
        out["solve_rate"].append(sum(x["solve_rate"] * x["answers"] for x in m
                                     if x["solve_rate"] is not None) / answers if answers else None)
        vr = [x["valid_rate"] for x in r["members"].values() if x.get("valid_rate") is not None]
        out["valid_rate"].append(fmean(vr) if vr else None)
        for k, key in (("partial_share", "partial"), ("unsolved_share", "unsolved")):
            out[k].append((r.get("task_solve_rates") or {}).get(key))
        tr = [x["teacher_reward"] for x in r["members"].values()
              if x.get("teacher_reward") is not None]
        out["teacher_reward"].append(fmean(tr) if tr else None)
        out["teacher_reward_var"].append(r.get("teacher_reward_var"))
        distinct = [p["distinct_in_step"] for p in progs if p.get("distinct_in_step") is not None]
        out["distinct_programs"].append(sum(distinct) if distinct else None)
        for k in ("entropy", "kl"):
            xs = [x[k] for x in r["members"].values() if x.get(k) is not None]
            out[k].append(fmean(xs) if xs else None)
        valid += sum(p["valid"] for p in progs)
        out["coverage"].append(sum(p["coverage"] for p in progs))
        out["valid_programs"].append(valid)
        repl += len(r.get("replacements") or [])
        out["replacements"].append(repl)
    return out


def slope(ys: list[float | None]) -> float | None:
    """Least-squares slope per step of the non-missing values."""
    pts = [(i, y) for i, y in enumerate(ys) if y is not None]
    if len(pts) < 2:
        return None
    mx, my = fmean(i for i, _ in pts), fmean(y for _, y in pts)
    den = sum((i - mx) ** 2 for i, _ in pts)
    return sum((i - mx) * (y - my) for i, y in pts) / den if den else None


def window(ys: list[float | None], last: bool, frac: float = 0.1) -> float | None:
    """Mean over the first or last `frac` of the steps (steps without a value left out, so a
    curve known only at its last steps, like the per-type rates from saved rollouts, is
    averaged over those, not reduced to its last value)."""
    n = max(1, int(len(ys) * frac))
    vals = [y for y in (ys[-n:] if last else ys[:n]) if y is not None]
    return fmean(vals) if vals else None


def coverage_at(c: dict[str, list], grid: list[int]) -> list[float | None]:
    """Distinct program shapes once `g` valid code_o/code_i programs were proposed, per g."""
    out = []
    for g in grid:
        hit = next((cov for cov, v in zip(c["coverage"], c["valid_programs"], strict=True)
                    if v >= g), None)  # fmt: skip
        out.append(hit)
    return out


def solver_vectors(runs: list[dict], key: str) -> dict[str, list[float]]:
    """Per-task held-out scores of one arm-seed's mean, best and weakest student (best and
    weakest picked on the selection set, so the pick is not fitted to the test)."""
    grades = {f"{r['name']}/{m}": g for r in runs for m, g in r[key]["grades"].items()}
    select = {f"{r['name']}/{m}": v for r in runs for m, v in r["select"]["pass@1"].items()}
    best, worst = max(select, key=select.__getitem__), min(select, key=select.__getitem__)
    n = len(next(iter(grades.values())))
    return {"mean": [fmean(g[i] for g in grades.values()) for i in range(n)],
            "best": [float(x) for x in grades[best]], "weakest": [float(x) for x in grades[worst]]}


def paired_bootstrap(a: list[list[float]], b: list[list[float]], idx: list[int],
                     n_boot: int = 2000, seed: int = 0) -> dict:  # fmt: skip
    """Mean of a - b over seeds and the tasks in `idx`, with a 95% CI that resamples seeds and
    tasks (the same tasks for both sides: paired)."""
    import numpy as np

    d = (np.asarray(a, dtype=float) - np.asarray(b, dtype=float))[:, idx]  # seeds x tasks
    rng = np.random.default_rng(seed)
    tasks = rng.integers(0, d.shape[1], size=(n_boot, d.shape[1]))
    seeds = rng.integers(0, d.shape[0], size=(n_boot, d.shape[0]))
    per_seed = d[:, tasks].mean(axis=2)  # seeds x n_boot: each resample's task mean per seed
    stats = np.sort(per_seed[seeds, np.arange(n_boot)[:, None]].mean(axis=1))
    return {"diff": float(d.mean()),
            "ci95": [float(stats[int(0.025 * n_boot)]), float(stats[int(0.975 * n_boot) - 1])]}


def collapse(c: dict[str, list]) -> dict:
    """The gate on one single-agent run's curves: last-10% own solve rate >= 0.8 and a
    negative cyclomatic-complexity slope."""
    sl, solve = slope(c["cyclomatic"]), window(c["solve_rate"], last=True)
    return {"final_solve_rate": solve, "complexity_slope": sl,
            "collapsed": solve is not None and solve >= 0.8 and sl is not None and sl < 0}


#: the suffix of a run's cross-play job in jobs/ (beside its training job, `NAME.json`)
CROSS_JOB = ".cross"
#: a run directory's name, as `arm_runs` makes it
RUN_NAME = re.compile(rf"(?P<arm>{'|'.join(ARMS)})_s(?P<seed>\d+)(_a\d+)?")
PROBE_CURVES = ("solve_rate", "valid_rate", "cyclomatic", "loc", "partial_share",
                "unsolved_share", "teacher_reward", "distinct_programs", "entropy", "kl")
#: the probe's figure adds the solve rate split by task type (code_f's is what holds it down)
PROBE_PANELS = (*PROBE_CURVES, "solve_rate_code_o_i", "solve_rate_code_f")
_TYPE_TITLES = {"solve_rate_code_o_i": "solve rate code_o + code_i",
                "solve_rate_code_f": "solve rate code_f"}


def _bins(ys: list[float | None], n: int) -> list[float | None]:
    """Means of consecutive n-step bins (None where a bin has no value)."""
    out = []
    for i in range(0, len(ys), n):
        vals = [y for y in ys[i : i + n] if y is not None]
        out.append(round(fmean(vals), 6) if vals else None)
    return out


def rollout_counts(run_dir: Path) -> dict[int, dict[str, list[int]]]:
    """Per step and task type, [right, answers] of the student's answers, from the run's saved
    rollouts (steps without a readable student record are left out)."""
    from lorapop.run import rollouts

    out: dict[int, dict[str, list[int]]] = {}
    for f in (run_dir / "rollouts").glob("step_*.jsonl.gz"):
        stem = f.name.removeprefix("step_").split(".")[0]
        if not stem.isdigit() or int(stem) < 1:  # steps count from 1
            continue
        counts: dict[str, list[int]] = {}
        for r in rollouts.read(f):  # a file still being written gives what parses
            if r.get("role") == "student" and isinstance(r.get("type"), str):
                c = counts.setdefault(r["type"], [0, 0])
                c[0] += r.get("verdict") == "correct"
                c[1] += 1
        if counts:
            out[int(stem)] = counts
    return out


def metric_counts(rows: list[dict]) -> dict[int, dict[str, list[int]]]:
    """`rollout_counts` from the metrics rows, every step, where they have per-type answers
    (`programs[type]["answers"]` and `["solve_rate"]`; {} where the rows lack them)."""
    out: dict[int, dict[str, list[int]]] = {}
    for r in rows:
        by = {t: [round(p["solve_rate"] * p["answers"]), p["answers"]]
              for t, p in r.get("programs", {}).items()
              if p.get("answers") and p.get("solve_rate") is not None}  # fmt: skip
        if by:
            out[int(r["step"])] = by
    return out


def type_solve_rate(counts: dict[int, dict[str, list[int]]], types: tuple[str, ...]
                    ) -> list[float | None]:  # fmt: skip
    """Per step, the share of answers to tasks of `types` (pooled) graded correct (None at
    steps without such answers). The gate's solve rate mixes all types; this shows whether one
    of them (code_f) holds it down."""
    rates: list[float | None] = [None] * max(counts, default=0)
    for step, by_type in counts.items():
        right, n = (sum(by_type.get(t, (0, 0))[i] for t in types) for i in (0, 1))
        rates[step - 1] = right / n if n else None
    return rates


def gate_probe(out: Path) -> dict:
    """The gate on what the single-agent runs under OUT/runs have logged so far (finished or
    not), with first/last-10% means of the main curves and their 10-step means, the solve
    rate's least-squares slope per 100 steps (how fast it heads for the gate's 0.8), the
    largest per-step KL, the solve rate per task type (from the metrics rows, or the saved
    rollouts for runs logged before they had it) and the gate on the
    code_o/code_i answers alone (`gate_code_o_i`: beside the pre-registered gate, not instead of
    it), the seconds per step and the median seconds of each phase after the first step (which
    includes warm-up)."""
    from lorapop.run.report import read_metrics

    res = {}
    for d in sorted((out / "runs").glob("single_s*")):
        rows = read_metrics(d) if (d / "metrics.jsonl").is_file() else []
        if not rows:
            continue
        c = curves(rows)
        sl = slope(c["solve_rate"])
        counts = metric_counts(rows) or rollout_counts(d)
        by_type = {t: type_solve_rate(counts, (t,))
                   for t in sorted({t for step in counts.values() for t in step})}
        oi = type_solve_rate(counts, ("code_o", "code_i"))  # the tasks whose complexity is measured
        c |= {"solve_rate_code_o_i": oi, "solve_rate_code_f": by_type.get("code_f", [])}
        res[d.name] = {
            "steps": len(rows), **collapse(c),
            "solve_rate_slope_per_100_steps": None if sl is None else 100 * sl,
            **{f"{k}_first_last": [window(c[k], last=False), window(c[k], last=True)]
               for k in PROBE_PANELS},
            "kl_max": max((x for x in c["kl"] if x is not None), default=None),
            "every_10_steps": {k: _bins(c[k], 10) for k in PROBE_PANELS},
            "solve_rate_by_type": {t: {"first_last": [window(v, last=False), window(v, last=True)],
                                       "every_10_steps": _bins(v, 10)}
                                   for t, v in by_type.items()},
            "gate_code_o_i": collapse({"solve_rate": oi, "cyclomatic": c["cyclomatic"]}),
            "step_s": fmean(sum(r["phase_s"].values()) for r in rows),
            "phase_s_median": {k: median(r["phase_s"][k] for r in rows[1:] or rows)
                               for k in rows[0]["phase_s"]},
        }  # fmt: skip
    (out / "gate_probe.json").write_text(json.dumps(res, indent=1) + "\n")
    if res:
        try:
            plot_gate(res, out / "gate_probe.png")
        except ImportError as e:  # the JSON above is the result; the figure is a view of it
            print(f"no gate_probe.png: {e}", file=sys.stderr)
    return res


def plot_gate(res: dict, png: Path) -> list[str]:
    """The probe's curves, 10-step means, one line per single-agent run (the gate's threshold
    on the solve rate panel); returns the panels' titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 4, figsize=(19, 11), sharex=True)  # a type curve may be short
    for ax, key in zip(axes.flat, PROBE_PANELS, strict=False):
        for name, r in res.items():
            ys = [float("nan") if y is None else y for y in r["every_10_steps"].get(key, [])]
            ax.plot([10 * i + 5 for i in range(len(ys))], ys, lw=1.5, marker=".", label=name)
        if key.startswith("solve_rate"):
            ax.axhline(0.8, color="k", ls=":", lw=1)
        ax.set(title=_TYPE_TITLES.get(key, key.replace("_", " ")), xlabel="step")
    for ax in axes.flat[len(PROBE_PANELS):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"The gate: {sum(r['collapsed'] for r in res.values())} of {len(res)} "
                 "single-agent runs collapsed (last-10% solve rate >= 0.8, complexity falling)")
    return _save(fig, axes, png)


def _gate(single: dict[int, dict], seeds: list[int]) -> dict:
    """The pre-registered gate on the single arm's curves per seed."""
    per_seed = [{"seed": s, **collapse(single[s])} for s in seeds]
    need = math.ceil(2 * len(seeds) / 3)
    return {"seeds": per_seed, "passed": sum(g["collapsed"] for g in per_seed) >= need,
            "rule": f"single agent: last-10% own solve rate >= 0.8 and cyclomatic slope < 0 "
                    f"in >= {need} of {len(seeds)} seeds"}  # fmt: skip


#: complexity measures whose slopes are reported beside C1's cyclomatic one, not scored: in a
#: table of branch-free programs cyclomatic complexity sits at its floor, 1.0
REPORTED_COMPLEXITY = ("ast_depth", "loc")


def _reported_slopes(arm_curves: dict[str, dict[int, dict]], seeds: list[int]) -> dict:
    """Per 100 steps, each arm's and seed's slope of the `REPORTED_COMPLEXITY` measures."""
    return {m: _per_100({a: {s: slope(c[s][m]) for s in seeds} for a, c in arm_curves.items()})
            for m in REPORTED_COMPLEXITY}


def _per_100(slopes: dict[str, dict[int, float | None]]) -> dict[str, dict[int, float | None]]:
    """Slopes per step as slopes per 100 steps."""
    return {a: {s: None if v is None else 100 * v for s, v in sl.items()}
            for a, sl in slopes.items()}


def _c1(slopes: dict[str, dict[int, float | None]], seeds: list[int]) -> dict:
    """C1: the population's complexity slope above the single agent's, and >= 0, in a
    majority of seeds."""
    majority = len(seeds) // 2 + 1
    above = sum((slopes["population"][s] or 0) > (slopes["single"][s] or 0) for s in seeds)
    rising = sum((slopes["population"][s] or 0) >= 0 for s in seeds)
    return {"holds": above >= majority and rising >= majority,
            "population_above_single": above, "population_rising": rising}


def summarize(runs: list[dict], cross: dict, levels: list[int], seeds: list[int]) -> dict:
    """Curves per arm and seed, the gate, the criterion and the end points."""
    by: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        by.setdefault((r["arm"], r["seed"]), []).append(r)
    arm_curves = {arm: {s: _merge([r["curves"] for r in by[(arm, s)]]) for s in seeds}
                  for arm in ARMS if all((arm, s) in by for s in seeds)}  # fmt: skip
    if not {"population", "single"} <= set(arm_curves):
        raise ValueError("the gate and the criterion need the population and single arms")
    gate = _gate(arm_curves["single"], seeds)
    slopes = {arm: {s: slope(c[s]["cyclomatic"]) for s in seeds} for arm, c in arm_curves.items()}
    c1 = _c1(slopes, seeds)["holds"]
    vecs = {(arm, s): solver_vectors(by[(arm, s)], "heldout") for arm in arm_curves for s in seeds}
    task_levels = runs[0]["heldout_levels"]
    subsets = {"levels_1_5": [i for i, lv in enumerate(task_levels) if lv in levels],
               "levels_3_5": [i for i, lv in enumerate(task_levels) if lv >= 3],
               **{f"level_{lv}": [i for i, x in enumerate(task_levels) if x == lv]
                  for lv in levels}}  # fmt: skip
    endpoints: dict = {}
    for stat in ("mean", "best", "weakest"):
        for ctrl in ("single", "independent", "noevolve"):
            if ctrl not in arm_curves:
                continue
            endpoints[f"population_{stat}_vs_{ctrl}"] = {
                name: paired_bootstrap([vecs[("population", s)][stat] for s in seeds],
                                       [vecs[(ctrl, s)][stat] for s in seeds], idx)
                for name, idx in subsets.items() if idx
            }  # fmt: skip
    passk = {arm: {stat: {name: fmean(fmean(vecs[(arm, s)][stat][i] for i in idx) for s in seeds)
                          for name, idx in subsets.items() if idx}
                   for stat in ("mean", "best", "weakest")} for arm in arm_curves}  # fmt: skip
    c2 = endpoints["population_weakest_vs_single"]["levels_3_5"]
    c2_verdict = ("supported" if c2["ci95"][0] > 0 else
                  "refuted" if c2["ci95"][1] < 0 else "inconclusive")  # fmt: skip
    if not gate["passed"]:
        verdict = "not tested: the gate failed (the single agent did not collapse)"
    elif c1 and c2_verdict == "supported":
        verdict = "supported"
    elif not c1 or c2_verdict == "refuted":
        verdict = "not supported"
    else:
        verdict = "inconclusive"
    return {
        "steps": {r["name"]: r["steps"] for r in runs},  # below train.steps after --finish
        "gate": gate,
        "criterion": {"C1_complexity": {"holds": c1, "slopes": slopes},
                      "C2_weakest_vs_single_levels_3_5": {**c2, "verdict": c2_verdict},
                      "verdict": verdict},
        "complexity_reported_per_100_steps": _reported_slopes(arm_curves, seeds),
        "heldout_pass@1": passk,
        "endpoints": endpoints,
        "crossplay": cross,
        "coverage_at_valid": _coverage_table(arm_curves, seeds),
        "curves": {arm: {str(s): c for s, c in cs.items()} for arm, cs in arm_curves.items()},
    }


def partial_summary(out: Path) -> dict:
    """What a cut chain still shows: the gate and C1 from every run's `metrics.jsonl`, and the
    held-out pass@1 of the arms whose runs were all scored (their `jobs/*.out.json`), from an
    --out directory or an unpacked `progress.tgz`. Arms are compared over the steps every run
    reached; the gate reads each single-agent run to its end, as the full summary does."""
    from lorapop.run.report import read_metrics

    recs = [json.loads(f.read_text()) for f in sorted((out / "jobs").glob("*.out.json"))
            if not f.name.endswith(f"{CROSS_JOB}.out.json")]  # cross-play records: not runs
    known = {r["name"] for r in recs}
    for d in sorted((out / "runs").glob("*")) if (out / "runs").is_dir() else []:
        m = RUN_NAME.fullmatch(d.name)  # a run no call has ended yet has no record: its name
        if m and d.name not in known:
            recs.append({"name": d.name, "arm": m["arm"], "seed": int(m["seed"])})
    rows = {r["name"]: read_metrics(out / "runs" / r["name"])
            if (out / "runs" / r["name"] / "metrics.jsonl").is_file() else [] for r in recs}
    recs = [r for r in recs if rows[r["name"]]]
    if not recs:
        raise SystemExit(f"{out}: no run with recorded steps (jobs/*.out.json, runs/*/metrics.jsonl)")
    common = min(len(rows[r["name"]]) for r in recs)
    seeds = sorted({r["seed"] for r in recs})
    by: dict[tuple[str, int], list[dict]] = {}
    for r in recs:
        by.setdefault((r["arm"], r["seed"]), []).append(r)
    arms = [a for a in ARMS if all((a, s) in by for s in seeds)]
    run_curves = {name: curves(r) for name, r in rows.items() if r}  # entry i: rows 1..i only
    full = {a: {s: _merge([run_curves[r["name"]] for r in by[(a, s)]]) for s in seeds} for a in arms}
    cut = {a: {s: {k: v[:common] for k, v in c.items()} for s, c in cs.items()}
           for a, cs in full.items()}  # fmt: skip
    res: dict = {"steps": {r["name"]: len(rows[r["name"]]) for r in recs}, "common_steps": common,
                 "seeds": seeds}  # fmt: skip
    if "single" in arms:
        res["gate"] = {**_gate(full["single"], seeds),
                       "at_common_steps": [{"seed": s, **collapse(cut["single"][s])} for s in seeds]}
    slopes = {a: {s: slope(cut[a][s]["cyclomatic"]) for s in seeds} for a in arms}
    res["complexity_slope_per_100_steps"] = _per_100(slopes)
    res["complexity_reported_per_100_steps"] = _reported_slopes(cut, seeds)
    if {"population", "single"} <= set(arms):
        res["C1_complexity"] = _c1(slopes, seeds)
    firstlast = ("solve_rate", "cyclomatic", "ast_depth", "loc", "entropy", "partial_share",
                 "valid_rate")
    res["first_last_10pct"] = {
        a: {s: {k: [window(cut[a][s][k], False), window(cut[a][s][k], True)] for k in firstlast}
            for s in seeds} for a in arms}  # fmt: skip
    held = out / "heldout.jsonl"
    levels = ([json.loads(x)["meta"].get("difficulty") for x in held.read_text().splitlines()]
              if held.is_file() else None)  # fmt: skip
    scored = [a for a in arms if all(r.get("heldout") for s in seeds for r in by[(a, s)])]
    res["heldout_pass@1"] = {}
    for a in scored:
        vecs = [solver_vectors(by[(a, s)], "heldout") for s in seeds]
        if levels and any(len(v["mean"]) != len(levels) for v in vecs):
            raise SystemExit(f"{held} does not match the runs' held-out grades")
        res["heldout_pass@1"][a] = {}
        for stat in ("mean", "best", "weakest"):
            by_level = {"all": [v[stat] for v in vecs]}
            for lv in sorted(set(levels or [])):
                by_level[f"level_{lv}"] = [[x for x, y in zip(v[stat], levels, strict=True) if y == lv]
                                           for v in vecs]  # fmt: skip
            res["heldout_pass@1"][a][stat] = {k: fmean(map(fmean, g)) for k, g in by_level.items()}
    res["not_scored"] = [a for a in arms if a not in scored]
    res["curves"] = {a: {str(s): c for s, c in cs.items()} for a, cs in full.items()}
    res["coverage_at_valid"] = _coverage_table(cut, seeds)
    if "gate" in res and not res["gate"]["passed"]:  # final only once the single agent's runs end
        ended = all(r.get("done") for r in recs if r["arm"] == "single")
        steps = sorted(res["steps"].values())
        verdict = ("not tested: the gate failed (the single agent did not collapse)" if ended else
                   f"incomplete: the gate does not hold yet (runs at steps {steps[0]}-{steps[-1]})")
    else:
        verdict = "incomplete: " + ", ".join(res["not_scored"]) + " not scored"
    res["criterion"] = {"verdict": verdict}
    return res


def _merge(cs: list[dict]) -> dict:
    """One arm-seed's curves from its runs (arm c has several): means, sums for counts (the
    distinct programs of a step too: four agents with a quarter of the proposals each make as
    many programs a step as one agent with all of them; a sum bounds their union)."""
    if len(cs) == 1:
        return cs[0]
    out = {}
    for k in CURVES:
        n = min(len(c.get(k, [])) for c in cs)  # a curve older results lack merges as empty
        cols = [[c[k][i] for c in cs if c[k][i] is not None] for i in range(n)]
        add = k in ("coverage", "valid_programs", "replacements", "distinct_programs")
        out[k] = [(sum(v) if add else fmean(v)) if v else None for v in cols]
    return out


def _coverage_table(arm_curves: dict, seeds: list[int]) -> dict:
    ends = [c[s]["valid_programs"][-1] for c in arm_curves.values() for s in seeds
            if c[s]["valid_programs"]]  # fmt: skip
    top = min(ends) if ends else 0
    grid = [g for g in (25, 50, 100, 200, 400, 800, 1600, 3200, 6400) if g <= top]
    return {"valid_programs": grid,
            **{arm: {str(s): coverage_at(c[s], grid) for s in seeds}
               for arm, c in arm_curves.items()}}  # fmt: skip


# -- orchestration ----------------------------------------------------------------------------


def sandbox_workers(cpus: int, runs: int) -> int:
    """Each of `runs` concurrent runs' sandbox workers: its share of the cores left after one
    per run's trainer, at least 2 (a gate of 3 runs of 2 workers on 16 cores spent
    ~0.7 s of its 2.4 s steps grading answers at a load of ~4.5)."""
    return max(2, (cpus - runs) // max(1, runs))


def place(jobs: list[dict], gpus: int) -> None:
    """Spread the runs over `gpus` GPUs (0: leave CUDA's default), each to the least loaded
    (lowest index on ties), the full runs first: an independent agent (arm c) generates a
    quarter of what the others do per step, and is counted as half a run."""
    if gpus > 0:
        load = [0.0] * gpus
        for job in sorted(jobs, key=lambda j: j["arm"] == "independent"):
            job["gpu"] = min(range(gpus), key=lambda g: (load[g], g))
            load[job["gpu"]] += 0.5 if job["arm"] == "independent" else 1.0


def _subprocess(mode: str, job: dict, path: Path) -> dict:
    path.write_text(json.dumps(job))
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": str(job["gpu"])} if "gpu" in job else {})}
    proc = subprocess.run([sys.executable, __file__, mode, str(path)], capture_output=True,
                          text=True, env=env)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"{job['name']} ({mode}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(path.with_suffix(".out.json").read_text())


def ensure_model(args: argparse.Namespace) -> str:
    if args.model in ("tiny", "tiny-random") or (Path(args.model) / "config.json").is_file():
        return args.model
    from lorapop.tiny.pretrain import pretrain_size
    from regime_recipes import RECIPES

    print(f"building the {args.size} base model in {args.model}", flush=True)
    pretrain_size(args.model, args.size, seed=0, workers=args.workers, sizes=RECIPES,
                  command=" ".join(sys.argv))  # fmt: skip
    return args.model


def prepare(out: Path, per_level: int, workers: int, table: str,
            seed_levels: tuple[int, ...] = (1, 2, 3), types: tuple[str, ...] = TYPES,
            code_f_inputs: int | None = None) -> dict[str, str]:  # fmt: skip
    """Held-out and selection sets at the levels of level table `table`, and the buffers' seed
    tasks at `seed_levels` (each built once, then reused), all of task `types`. Seed code_f
    tasks have the world's `code_f_inputs` pairs, as its proposals (held-out ones keep 6)."""
    from lorapop.tiny import generate_tasks
    from lorapop.tiny.grammar import table_level
    from lorapop.tiny.heldout import build_heldout, save_jsonl
    from lorapop.tiny.world import CODE_F_INPUTS
    from lorapop.verify import Sandbox

    seeds_name = "seed_tasks" + ("" if seed_levels == (1, 2, 3) else
                                 "_levels" + "".join(map(str, seed_levels)))  # fmt: skip
    code_f_inputs = code_f_inputs or CODE_F_INPUTS
    seeds_name += "" if code_f_inputs == CODE_F_INPUTS else f"_f{code_f_inputs}"
    paths = {k: str(out / f"{k}.jsonl") for k in ("heldout", "select")}
    paths["seed_tasks"] = str(out / f"{seeds_name}.jsonl")
    made = out / "level_table.txt"
    sets_of = table if types == TYPES else f"{table} {','.join(types)}"  # (all types: as before)
    have_sets = Path(paths["heldout"]).is_file() and Path(paths["select"]).is_file()
    if have_sets:
        have = made.read_text().strip() if made.is_file() else "standard"  # (older sets)
        if have != sets_of:
            raise SystemExit(f"{out} holds sets of level table {have!r}, this run's is "
                             f"{sets_of!r}: use another --out")  # fmt: skip
        if Path(paths["seed_tasks"]).is_file():
            return paths
    with Sandbox(workers=workers) as sb:
        if not have_sets:
            held = build_heldout(per_level, sandbox=sb, table=table, kinds=types)
            save_jsonl(held, paths["heldout"])
            save_jsonl(build_heldout(per_level, seed=SELECT_SEED, sandbox=sb, table=table,
                                     kinds=types, exclude=[t.program for t in held]),
                       paths["select"])  # fmt: skip
        seeds = [t for k in types for lv in seed_levels
                 for t in generate_tasks(k, 8, table_level(lv, table), "world-seed-tasks",
                                         sandbox=sb, n_inputs=code_f_inputs)]  # fmt: skip
        save_jsonl(seeds, paths["seed_tasks"])
    made.write_text(sets_of + "\n")
    return paths


def run_all(args: argparse.Namespace) -> None:
    t0 = time.time()
    out = Path(args.out)
    (out / "jobs").mkdir(parents=True, exist_ok=True)
    model = ensure_model(args)
    from lorapop.engine.load import TINY_DIR
    from lorapop.tiny.world import rule_overrides, training_record, world_of

    try:
        world = world_of(TINY_DIR if model == "tiny" else model)  # what the base was made for
    except ValueError as e:
        raise SystemExit(str(e)) from None
    table = args.levels or world["levels"]
    if table != world["levels"]:
        print(f"playing a base of level table {world['levels']!r} in the world of {table!r}",
              flush=True)
    types = tuple(t for t in TYPES if t in args.types)
    paths = prepare(out, args.per_level, args.workers, table, tuple(sorted(set(args.seed_levels))),
                    types, world["code_f_inputs"])  # fmt: skip
    base = [f"model.name_or_path={Path(model).resolve() if Path(model).exists() else model}",
            f"tasks.seed_tasks={Path(paths['seed_tasks']).resolve()}",
            f"tasks.references={world['references']}", *rule_overrides(table),
            *([f"tasks.code_f_inputs={world['code_f_inputs']}"] if world["code_f_inputs"] else []),
            *([] if types == TYPES else [f"tasks.types=[{','.join(types)}]"]), *args.overrides]
    jobs = []
    for arm in args.arms:
        for seed in args.seeds:
            for name, ov in arm_runs(arm, seed, base):
                jobs.append({"name": name, "arm": arm, "seed": seed, "overrides": [*base, *ov],
                             "run_dir": str(out / "runs" / name), "heldout": paths["heldout"],
                             "select": paths["select"], "deadline_at": t0 + args.deadline,
                             "recent_steps": args.recent_steps, "recent_tasks": args.recent_tasks,
                             "finish": args.finish})
    share = f"verify.workers={sandbox_workers(os.cpu_count() or 2, min(args.parallel, len(jobs)))}"
    for job in jobs:  # first, so a verify.workers override still wins
        job["overrides"].insert(0, share)
    place(jobs, args.gpus)

    def train(job: dict) -> dict:
        path = out / "jobs" / f"{job['name']}.json"
        done = path.with_suffix(".out.json")
        if done.is_file() and json.loads(done.read_text())["done"]:
            return json.loads(done.read_text())  # trained and scored by an earlier call
        rec = _subprocess("--train-one", job, path)
        print(f"{job['name']}: {rec['steps']} steps{' (done)' if rec['done'] else ''}", flush=True)
        return rec

    with ThreadPoolExecutor(args.parallel) as pool:
        recs = list(pool.map(train, jobs))
    if not all(r["done"] for r in recs):
        left = sum(not r["done"] for r in recs)
        print(f"{left} of {len(recs)} runs not finished: run the same command again to continue")
        return
    from lorapop.run.report import read_metrics
    from lorapop.tiny.heldout import load_jsonl, save_jsonl

    task_levels = [t.meta.get("difficulty") for t in load_jsonl(paths["heldout"])]
    for rec, job in zip(recs, jobs, strict=True):
        rec["curves"] = curves(read_metrics(Path(job["run_dir"])))
        rec["heldout_levels"] = task_levels
    cross_jobs = []
    for seed in args.seeds:  # cross-play: every arm's students on the pooled recent tasks
        pool_tasks = []
        for job in jobs:
            if job["seed"] == seed:
                for t in load_jsonl(Path(job["run_dir"]) / "recent_tasks.jsonl"):
                    pool_tasks.append(dataclasses.replace(t, meta={**t.meta, "arm": job["arm"]}))
        pool_path = out / f"crossplay_pool_s{seed}.jsonl"
        save_jsonl(pool_tasks, pool_path)
        cross_jobs += [{**j, "pool": str(pool_path)} for j in jobs if j["seed"] == seed]
    with ThreadPoolExecutor(args.parallel) as pool:
        cross_recs = list(pool.map(
            lambda j: _subprocess("--cross-one", j, out / "jobs" / f"{j['name']}{CROSS_JOB}.json"),
            cross_jobs))  # fmt: skip
    cross: dict[str, dict[str, list[float]]] = {}
    for j, res in zip(cross_jobs, cross_recs, strict=True):
        for task_arm, v in res.items():
            cross.setdefault(j["arm"], {}).setdefault(task_arm, []).append(v)
    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "level_table": table,
        "base_overrides": base,
        "base_weights_sha256": training_record(model).get("weights_sha256"),
        "seeds": args.seeds,
        "arms": {arm: [j["name"] for j in jobs if j["arm"] == arm] for arm in args.arms},
        "device": _device(),
        "cpus": os.cpu_count(),
        "gpus": args.gpus,
        "wall_s": round(time.time() - t0, 1),
        "runs": recs,
        "crossplay": cross,
    }
    (out / "results.json").write_text(json.dumps(results) + "\n")
    print(f"wrote {out / 'results.json'} ({len(recs)} runs, their end points and cross-play)")
    if not {"population", "single"} <= set(args.arms):  # the criterion compares the two
        print(json.dumps({"gate_probe": gate_probe(out)}, indent=1))
        return
    write_summary([results], out / "world_experiment.json")


def _settings(overrides: list[str]) -> list[str]:
    """A call's config overrides less the folders of its machine: the base model and the seed
    tasks keep their file names (`world-nojoin-77m`, `seed_tasks_levels12345.jsonl`), which
    say which recipe and which seed levels the runs played."""
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        out.append(f"{key}={Path(value).name}" if key in ("model.name_or_path", "tasks.seed_tasks")
                   else o)  # fmt: skip
    return out


def merge_results(parts: list[dict]) -> dict:
    """One call's results from several calls' `results.json` (runs of other arms or seeds, the
    same level table and settings): runs concatenated, cross-play lists joined (cross-play only
    pairs arms of one call)."""
    if not parts:
        raise SystemExit("--merge needs at least one results.json")
    names = [r["name"] for p in parts for r in p["runs"]]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise SystemExit(f"--merge: runs in more than one results.json: {', '.join(dup)}")
    if len({p["level_table"] for p in parts}) > 1:
        raise SystemExit("--merge: results of different level tables")
    digests = {p.get("base_weights_sha256") for p in parts}
    if len(digests - {None}) > 1:
        raise SystemExit("--merge: results of different builds of the base (weights "
                         f"{', '.join(sorted(digests - {None}))}): rebuild it on the GPU kind "
                         "and number of ranks of the first")  # fmt: skip
    if None in digests and len(digests) > 1:
        print("--merge: a results.json records no base digest; check its build log's "
              "`weights` against the others'", file=sys.stderr)  # fmt: skip
    settings = [sorted(_settings(p.get("base_overrides", []))) for p in parts]
    if any(x != settings[0] for x in settings):
        diff = sorted(set().union(*map(set, settings)) - set.intersection(*map(set, settings)))
        raise SystemExit(f"--merge: results of different settings: {', '.join(diff)}")
    cross: dict[str, dict[str, list[float]]] = {}
    arms: dict[str, list[str]] = {}
    for p in parts:
        for arm, row in p["crossplay"].items():
            for task_arm, v in row.items():
                cross.setdefault(arm, {}).setdefault(task_arm, []).extend(v)
        for arm, runs in p["arms"].items():
            arms.setdefault(arm, []).extend(runs)
    return {**parts[0], "base_weights_sha256": next(iter(digests - {None}), None),
            "command": [p["command"] for p in parts],
            "seeds": sorted({s for p in parts for s in p["seeds"]}), "arms": arms,
            "device": sorted({p["device"] for p in parts}), "wall_s": [p["wall_s"] for p in parts],
            "runs": [r for p in parts for r in p["runs"]], "crossplay": cross}  # fmt: skip


def write_summary(parts: list[dict], path: Path) -> None:
    """The criterion, end points and curves of one or more calls' results, and the figure."""
    res = merge_results(parts)
    summary = {
        "benchmark": "world_experiment",
        "config": str(CONFIG.relative_to(ROOT)),
        **{k: v for k, v in res.items() if k not in ("runs", "crossplay")},
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        **summarize(res["runs"],
                    {a: {t: fmean(v) for t, v in row.items()} for a, row in res["crossplay"].items()},
                    [1, 2, 3, 4, 5], res["seeds"]),  # fmt: skip
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary) + "\n")
    print(json.dumps({"gate": summary["gate"]["passed"],
                      "verdict": summary["criterion"]["verdict"]}))  # fmt: skip
    plot(path)


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def plot(path: Path) -> list[str]:
    """One panel per metric, arms overlaid, seeds as a min-max band around the mean; returns
    the panels' titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = json.loads(Path(path).read_text())
    keys = ("cyclomatic", "ast_depth", "solve_rate", "valid_rate", "partial_share",
            "unsolved_share", "teacher_reward", "teacher_reward_var", "distinct_programs",
            "entropy", "kl", "replacements")
    fig, axes = plt.subplots(4, 4, figsize=(19, 14))
    for ax, key in zip(axes.flat, keys, strict=False):
        for color, (arm, cs) in zip(("C0", "C3", "C2", "C1"), s["curves"].items(), strict=False):
            series = [c.get(key) or [] for c in cs.values()]
            n = min(len(x) for x in series)
            cols = [[x[i] for x in series if x[i] is not None] for i in range(n)]
            mean = [fmean(c) if c else float("nan") for c in cols]
            lo = [min(c) if c else float("nan") for c in cols]
            hi = [max(c) if c else float("nan") for c in cols]
            ax.plot(range(1, n + 1), mean, color=color, lw=1.5, label=arm)
            ax.fill_between(range(1, n + 1), lo, hi, color=color, alpha=0.2)
        ax.set(title=key.replace("_", " "), xlabel="step")
    for ax in axes.flat[len(keys) + 1:]:
        ax.axis("off")
    ax = axes.flat[len(keys)]
    grid = s["coverage_at_valid"]["valid_programs"]
    for color, arm in zip(("C0", "C3", "C2", "C1"), s["curves"], strict=False):
        rows = list(s["coverage_at_valid"][arm].values())
        ax.plot(grid, [fmean([r[i] for r in rows if r[i] is not None] or [float("nan")])
                       for i in range(len(grid))], color=color, marker="o", label=arm)
    ax.set(title="coverage at equal valid programs", xlabel="valid code_o/code_i programs")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"Regime world, seeds {s['seeds']}: verdict {s['criterion']['verdict']}")
    png = Path(path).with_suffix(".png")
    titles = _save(fig, axes, png)
    print(f"wrote {png}")
    return titles


def _save(fig, axes, png: Path) -> list[str]:
    """Lay out, write and close a figure; the titles of its drawn panels."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return [ax.get_title() for ax in axes.flat if ax.axison]


def main() -> None:
    from lorapop.tiny.grammar import LEVEL_TABLES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])  # fmt: skip
    ap.add_argument("--model", default="runs/world/world-short",
                    help="base model directory (built with --size when empty), or `tiny`")
    ap.add_argument("--size", default="world-short",
                    help="pretrain-tiny size used to build --model (the best base so far)")
    ap.add_argument("--out", default="runs/world")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--parallel", type=int, default=21, help="runs trained at once")
    ap.add_argument("--gpus", type=int, default=0,
                    help="spread the runs over this many GPUs (CUDA_VISIBLE_DEVICES per run)")
    ap.add_argument("--deadline", type=float, default=540.0,
                    help="seconds after start at which runs checkpoint and stop; runs that finish "
                    "then score their students, so leave room for that in the last call")
    ap.add_argument("--finish", action="store_true",
                    help="score every run at the step it reached by --deadline, finished or not "
                    "(the last call of a chain that cannot reach train.steps; results record "
                    "each run's steps)")
    ap.add_argument("--per-level", type=int, default=20, help="held-out tasks per type and level")
    ap.add_argument("--recent-steps", type=int, default=30, help="cross-play: tasks of the last N steps")
    ap.add_argument("--recent-tasks", type=int, default=60, help="cross-play: tasks per run")
    ap.add_argument("--workers", type=int, default=4, help="sandbox workers for set-up")
    ap.add_argument("--seed-levels", type=int, nargs="+", default=[1, 2, 3],
                    choices=[1, 2, 3, 4, 5], metavar="LEVEL",
                    help="levels of the grammar tasks the buffers start with (8 per type and "
                    "level): where the teachers' references, so their proposals, begin")
    ap.add_argument("--levels", choices=list(LEVEL_TABLES), metavar="TABLE",
                    help="play the base in another level table's world: its rules, held-out, "
                    "selection and seed tasks (default: the table the base was pretrained on); "
                    "a cheap test of a world's rules before a base is built for it")
    ap.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES, metavar="TYPE",
                    help="the world's task types (default all: code_o code_i code_f); the runs, "
                    "held-out, selection and seed tasks have only these")
    ap.add_argument("--plot", type=Path, help="plot a finished world_experiment.json")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="RESULTS",
                    help="merge calls' results.json (other arms or seeds) into --out's "
                    "world_experiment.json and figure, then stop")
    ap.add_argument("--partial", action="store_true",
                    help="summarize what the runs under --out recorded so far (a cut chain's "
                    "progress.tgz unpacked will do): gate, complexity slopes over the steps all "
                    "runs reached, held-out pass@1 of scored arms; writes world_experiment_partial.json")
    ap.add_argument("--gate-probe", action="store_true",
                    help="print the gate on the single-agent runs under --out so far (any steps)")
    ap.add_argument("--train-one", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--cross-one", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="key.path=value for every run (before matching)")
    args = ap.parse_intermixed_args()  # overrides may come before the options
    if args.gpus < 0:
        ap.error("--gpus must be >= 0")
    if args.plot:
        plot(args.plot)
    elif args.merge:
        missing = [str(m) for m in args.merge if not m.is_file()]
        if missing:
            ap.error(f"no such results file: {', '.join(missing)}")
        try:
            write_summary([json.loads(m.read_text()) for m in args.merge],
                          Path(args.out) / "world_experiment.json")  # fmt: skip
        except (ValueError, KeyError, TypeError) as e:  # (JSONDecodeError is a ValueError)
            raise SystemExit(f"--merge: not mergeable results ({type(e).__name__}: {e})") from None
    elif args.partial:
        path = Path(args.out) / "world_experiment_partial.json"
        path.write_text(json.dumps(partial_summary(Path(args.out))) + "\n")
        plot(path)
    elif args.gate_probe:
        print(json.dumps(gate_probe(Path(args.out)), indent=1))
    elif args.train_one or args.cross_one:
        path = args.train_one or args.cross_one
        job = json.loads(path.read_text())
        rec = train_one(job) if args.train_one else cross_one(job)
        path.with_suffix(".out.json").write_text(json.dumps(rec))
    else:
        run_all(args)


if __name__ == "__main__":
    main()
