"""Do two GPU runs of one seed repeat bit for bit with `train.deterministic`, and what does it cost?

Three `lorapop train` runs of one config and seed, one after another on the same device: two
with `train.deterministic=true`, one without. It compares their metrics rows (timings left
out) and the adapters of their last checkpoints (SHA-256 of the PEFT files), and reports each
run's mean update and step time, so the deterministic kernels' cost is the ratio of two runs of
one process kind on one card. Without the switch, GPU runs of one seed part from their second
step (README, "Training").

    PYTHONPATH=src python benchmarks/deterministic_runs.py --out $OUT/deterministic_runs.json \\
        --steps 6 [config overrides, e.g. model.name_or_path=DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lorapop.run import runinfo  # noqa: E402
from lorapop.run.checkpoint import latest_checkpoint  # noqa: E402
from lorapop.run.report import read_metrics  # noqa: E402
from lorapop.selfplay.records import without_timings  # noqa: E402

RUNS = (("deterministic_a", True), ("deterministic_b", True), ("default", False))


def adapter_digests(run_dir: Path) -> dict[str, str]:
    """SHA-256 (first 16 hex digits) of each file under the last checkpoint's adapters/."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return {}
    files = sorted(p for p in (ckpt / "adapters").rglob("*") if p.is_file())
    return {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()[:16]
            for p in files}  # fmt: skip


def first_difference(a: list[dict], b: list[dict]) -> int | None:
    """The first step whose rows differ (or where one run stopped), None when all agree."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return x.get("step", i + 1)
    return None if len(a) == len(b) else min(len(a), len(b)) + 1


def summarise(runs: dict[str, Path]) -> dict:
    """What the three runs show: the deterministic pair agrees (rows and adapters), where the
    default run parts from them, and each run's mean update and step seconds (first step left
    out: it compiles and captures)."""
    rows = {n: read_metrics(d) for n, d in runs.items()}
    same = {n: [without_timings(x) for x in r] for n, r in rows.items()}
    digests = {n: adapter_digests(d) for n, d in runs.items()}
    a, b, off = "deterministic_a", "deterministic_b", "default"

    def mean(n: str, phase: str | None) -> float | None:
        xs = [r["phase_s"].get(phase, 0.0) if phase else sum(r["phase_s"].values())
              for r in rows[n][1:]]  # fmt: skip
        return statistics.fmean(xs) if xs else None

    times = {n: {"update_s": mean(n, "update"), "step_s": mean(n, None)} for n in runs}
    # the second deterministic run against the default one: the first process also compiles
    # what later ones read from the compiler's disk cache (H200: update 1.12 s a
    # step in the first run, 0.62 s in the second, 1.03 s without the switch)
    ratio = (times[b]["update_s"] / times[off]["update_s"]
             if times[b]["update_s"] and times[off]["update_s"] else None)  # fmt: skip
    kernels = {n: {k: (runinfo.read(d) or [{}])[-1].get(k)
                   for k in ("deterministic_kernels", "no_deterministic_kernel")}
               for n, d in runs.items()}  # fmt: skip
    return {
        "steps": {n: len(r) for n, r in rows.items()},
        "kernels": kernels,
        "deterministic_repeat": same[a] == same[b] and bool(digests[a]) and digests[a] == digests[b],
        "deterministic_first_difference": first_difference(same[a], same[b]),
        "adapters_equal": digests[a] == digests[b],
        "default_parts_at_step": first_difference(same[a], same[off]),
        "times": times,
        "update_time_ratio_deterministic_over_default": ratio,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "world.yaml"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--runs", default="/tmp/deterministic_runs", help="where the runs go")
    ap.add_argument("--out", required=True, help="the results JSON")
    ap.add_argument("overrides", nargs="*", help="config overrides (KEY=VALUE)")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be >= 2 (runs part from their second step)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    runs, walls = {}, {}
    for name, on in RUNS:
        run_dir = Path(args.runs) / name
        if run_dir.exists():
            raise SystemExit(f"{run_dir} exists: pass another --runs")
        # no report.html: the runs are compared by their rows and adapters, and the figures
        # would add seconds of CPU to every run's wall time
        cmd = [sys.executable, "-m", "lorapop", "train", args.config, "--out", str(run_dir),
               "--no-report", f"train.steps={args.steps}", f"run.save_every={args.steps}",
               "run.progress=false",
               f"train.deterministic={str(on).lower()}", *args.overrides]  # fmt: skip
        print(f"[{name}] {' '.join(cmd)}", flush=True)
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=env)
        walls[name] = time.perf_counter() - t
        if proc.returncode:
            raise SystemExit(f"[{name}] lorapop train exited {proc.returncode}")
        runs[name] = run_dir
    res = {"benchmark": "deterministic_runs", "command": " ".join(sys.argv), "machine": runinfo.machine(),
           "config": args.config, "overrides": args.overrides, "wall_s": walls, **summarise(runs)}
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("deterministic_repeat", "default_parts_at_step",
                                          "update_time_ratio_deterministic_over_default")}))


if __name__ == "__main__":
    main()
