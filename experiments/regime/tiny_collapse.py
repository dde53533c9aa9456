"""The tiny-collapse experiment: population self-play vs the single-agent baseline, several seeds.

Each seed trains `configs/tiny-collapse.yaml` twice — PopuLoRA (2 teachers + 2 students) and
the single-agent baseline with the same per-adapter compute — then scores every member on the
tiny held-out benchmark. The summary holds, per mode and seed, the curves of teacher program
complexity (AST depth, cyclomatic complexity, lines, variables), coverage, solve and valid
rates, ratings, and held-out pass@1 before and after.

    PYTHONPATH=src python experiments/regime/tiny_collapse.py --seeds 0 1 2 --out DIR   # runs (parallel)
    python experiments/regime/tiny_collapse.py --plot DIR/tiny_collapse.json               # figure + table
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import fmean, pstdev

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny-collapse.yaml"
CURVES = ("ast_depth", "cyclomatic", "loc", "variables", "coverage", "coverage_per_valid",
          "solve_rate", "valid_rate")


def one_run(seed: int, mode: str, run_dir: Path, heldout: Path, overrides: list[str],
            deadline: float) -> dict:
    """Train one run (until its steps are done or `deadline` seconds have passed), then score
    its solvers on the held-out set; returns the run's record."""
    import torch

    from lorapop.config import load_config
    from lorapop.run.report import read_metrics
    from lorapop.selfplay.loop import SelfPlay
    from lorapop.tiny.evaluate import evaluate_tiny
    from lorapop.tiny.heldout import load_jsonl

    torch.set_num_threads(1)
    cfg = load_config(CONFIG, [f"seed={seed}", f"league.mode={mode}", "run.with_baseline=false",
                               *overrides])
    t0 = time.perf_counter()
    sp = SelfPlay(cfg, run_dir)
    try:
        while sp.step_done < cfg.train.steps and time.perf_counter() - t0 < deadline:
            sp.step()
        train_s = time.perf_counter() - t0
        p = sp.parts
        solvers = p.students  # A0 in the baseline
        result = evaluate_tiny(p.model, p.tokenizer, load_jsonl(heldout), p.sandbox,
                               bank=p.bank, slots={m: p.slot[m] for m in solvers})
    finally:
        sp.close()
    rows = read_metrics(run_dir)
    return {"seed": seed, "mode": mode, "steps": len(rows), "train_s": train_s,
            "curves": curves(rows),
            "ratings": ratings(rows), "heldout": result}


def curves(rows: list[dict]) -> dict[str, list[float | None]]:
    """Per step: teacher program metrics (mean over task types, coverage summed), mean student
    solve rate and teacher valid rate."""
    out: dict[str, list[float | None]] = {k: [] for k in CURVES}
    valid = 0
    for r in rows:
        progs = r["programs"].values()
        for k in CURVES[:4]:
            vals = [p[k] for p in progs if p.get(k) is not None]
            out[k].append(fmean(vals) if vals else None)
        written = [p for p in progs if p.get("coverage") is not None]  # not code_f's copies
        cov = sum(p["coverage"] for p in written)
        valid += sum(p["valid"] for p in written)
        out["coverage"].append(cov)
        # distinct structures per valid program so far: the population proposes more programs
        # per step (2 teachers), so raw coverage alone would favour it
        out["coverage_per_valid"].append(cov / valid if valid else None)
        members = r["members"].values()
        for k in ("solve_rate", "valid_rate"):
            vals = [m[k] for m in members if m.get(k) is not None]
            out[k].append(fmean(vals) if vals else None)
    return out


def ratings(rows: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in rows:
        for name, m in r["members"].items():
            if m.get("mu") is not None:
                out.setdefault(name, []).append(m["mu"])
    return out


def run_all(args: argparse.Namespace) -> None:
    out = Path(args.out)
    runs = Path(args.runs_dir) if args.runs_dir else out / "runs"
    out.mkdir(parents=True, exist_ok=True)
    heldout = runs / "heldout.jsonl"
    runs.mkdir(parents=True, exist_ok=True)
    before = base_heldout(heldout, args.per_level, args.workers)
    jobs = [(s, m) for s in args.seeds for m in ("population", "single")]

    def launch(job: tuple[int, str]) -> dict:
        seed, mode = job
        rec = out / f"{mode}_seed{seed}.json"
        cmd = [sys.executable, __file__, "--one", str(seed), mode, str(runs / f"{mode}_{seed}"),
               str(heldout), str(rec), "--deadline", str(args.deadline), *args.overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{mode} seed {seed} failed:\n{proc.stderr[-3000:]}")
        print(f"done: {mode} seed {seed}", flush=True)
        return json.loads(rec.read_text())

    with ThreadPoolExecutor(args.parallel) as pool:
        runs = list(pool.map(launch, jobs))
    summary = {
        "benchmark": "tiny_collapse",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "config": str(CONFIG.relative_to(ROOT)),
        "overrides": args.overrides,
        "seeds": args.seeds,
        "device": _device(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "heldout_before": before,
        "runs": runs,
    }
    (out / "tiny_collapse.json").write_text(json.dumps(summary))
    print(table(summary))


def base_heldout(path: Path, per_level: int, workers: int) -> dict:
    """Build the held-out set once and score the base model on it (the "before" figures)."""
    from lorapop.engine.load import load_base_model, load_tokenizer
    from lorapop.tiny.evaluate import evaluate_tiny
    from lorapop.tiny.heldout import build_heldout, save_jsonl
    from lorapop.verify import Sandbox

    tok = load_tokenizer("tiny")
    model = load_base_model("tiny", tok)
    with Sandbox(workers=workers) as sb:
        tasks = build_heldout(per_level, sandbox=sb)
        save_jsonl(tasks, path)
        return evaluate_tiny(model, tok, tasks, sb)


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()


def _spread(vals: list[float]) -> str:
    return f"{fmean(vals):.3f} ± {pstdev(vals):.3f}" if vals else "-"


def table(summary: dict) -> str:
    """Markdown: first vs last 10 steps of each curve, and held-out pass@1, mean ± sd over seeds."""
    lines = ["| measure | population | baseline |", "|---|---:|---:|"]

    def window(run: dict, key: str, last: bool) -> float | None:
        vals = [v for v in run["curves"][key] if v is not None]
        vals = vals[-10:] if last else vals[:10]
        return fmean(vals) if vals else None

    for key in CURVES:
        for last in (False, True):
            cells = []
            for mode in ("population", "single"):
                vals = [w for r in summary["runs"] if r["mode"] == mode
                        if (w := window(r, key, last)) is not None]
                cells.append(_spread(vals))
            lines.append(f"| {key} ({'last' if last else 'first'} 10 steps) | "
                         + " | ".join(cells) + " |")
    before = summary["heldout_before"]["members"]
    base = next(iter(before.values()))["pass@1"]
    lines.append(f"| held-out pass@1 before (base model) | {base:.3f} | {base:.3f} |")
    for label, pick in (("mean", fmean), ("best", max), ("worst", min)):
        cells = []
        for mode in ("population", "single"):
            vals = [pick([m["pass@1"] for m in r["heldout"]["members"].values()])
                    for r in summary["runs"] if r["mode"] == mode]
            cells.append(_spread(vals))
        lines.append(f"| held-out pass@1 after, {label} solver | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = json.loads(path.read_text())
    keys = ("ast_depth", "cyclomatic", "loc", "variables", "coverage_per_valid", "solve_rate")
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, key in zip(axes.flat, keys, strict=True):
        for mode, color in (("population", "C0"), ("single", "C3")):
            runs = [r["curves"][key] for r in summary["runs"] if r["mode"] == mode]
            n = min(len(c) for c in runs)
            steps = range(1, n + 1)
            for c in runs:
                ax.plot(steps, [float("nan") if v is None else v for v in c[:n]],
                        color=color, alpha=0.25, lw=0.8)
            mean = [fmean([c[i] for c in runs if c[i] is not None] or [float("nan")])
                    for i in range(n)]
            label = "PopuLoRA (2T+2S)" if mode == "population" else "single agent (AZR)"
            ax.plot(steps, mean, color=color, lw=2, label=label)
        ax.set(title=key.replace("_", " "), xlabel="step")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"Tiny world, seeds {summary['seeds']}: teacher programs and student solve rate")
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=90)
    print(f"wrote {png}")
    print(table(summary))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default="runs/tiny-collapse")
    ap.add_argument("--runs-dir", help="where the run directories go (default OUT/runs)")
    ap.add_argument("--parallel", type=int, default=6, help="runs trained at once")
    ap.add_argument("--per-level", type=int, default=20, help="held-out tasks per type and level")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--deadline", type=float, default=float("inf"),
                    help="stop training a run after this many seconds (steps done are kept)")
    ap.add_argument("--plot", type=Path, help="plot a finished summary JSON and print its table")
    ap.add_argument("--one", nargs=5, metavar=("SEED", "MODE", "RUN_DIR", "HELDOUT", "RECORD"),
                    help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="key.path=value for every run")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot)
    elif args.one:
        seed, mode, run_dir, heldout, record = args.one
        rec = one_run(int(seed), mode, Path(run_dir), Path(heldout), args.overrides,
                      args.deadline)
        Path(record).write_text(json.dumps(rec))
    else:
        run_all(args)


if __name__ == "__main__":
    main()
