"""Side-by-side cost of `make demo` for two configs: both `lorapop train CONFIG run.with_baseline=true`
runs start at once (same machine load), each for `--steps` steps, and the demo's full length is
extrapolated from the measured fixed cost and per-step cost.

    python benchmarks/demo_cost.py OLD.yaml NEW.yaml --steps 4 --out benchmarks/results/demo_cost.json

Per run: wall time of the whole command (model load, population run, baseline run, report) and
the summed phase times of every step (metrics.jsonl of the run and its baseline); fixed cost =
wall − steps. Extrapolated demo = fixed + per-step × the config's own `train.steps`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def _step_seconds(run_dir: Path) -> float:
    total = 0.0
    for path in (run_dir / "metrics.jsonl", run_dir / "baseline" / "metrics.jsonl"):
        for line in path.read_text().splitlines():
            total += sum(json.loads(line)["phase_s"].values())
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs=2, type=Path, help="OLD and NEW config files")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/demo_cost.json"))
    a = ap.parse_args()
    lorapop = str(Path(sys.executable).with_name("lorapop"))
    tmp = Path(tempfile.mkdtemp(prefix="demo_cost_"))
    load_before = os.getloadavg()
    procs, t0 = [], time.perf_counter()
    for i, cfg in enumerate(a.configs):
        cmd = [lorapop, "train", str(cfg), "--steps", str(a.steps), "--out", str(tmp / str(i)),
               "run.with_baseline=true", "run.progress=false"]
        procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                            text=True)))
    runs = []
    for i, (cmd, proc) in enumerate(procs):
        _, err = proc.communicate()
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise SystemExit(f"{a.configs[i]} failed:\n{err[-2000:]}")
        steps_s = _step_seconds(tmp / str(i))
        demo_steps = yaml.safe_load(a.configs[i].read_text())["train"]["steps"]
        per_step = steps_s / a.steps
        runs.append({"config": str(a.configs[i]), "command": " ".join(cmd), "wall_s": round(wall, 1),
                     "steps_s": round(steps_s, 1), "per_step_s (pop + baseline)": round(per_step, 2),
                     "fixed_s": round(wall - steps_s, 1), "demo_steps": demo_steps,
                     "demo_extrapolated_s": round(wall - steps_s + per_step * demo_steps, 1)})
    shutil.rmtree(tmp, ignore_errors=True)
    old, new = runs
    result = {
        "benchmark": "demo_cost",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        "note": "both runs at once, so they share the load; wall_s is each command's own time",
        "runs": runs,
        "ratio_new_over_old": {
            "per_step": round(new["per_step_s (pop + baseline)"] / old["per_step_s (pop + baseline)"], 3),
            "demo_extrapolated": round(new["demo_extrapolated_s"] / old["demo_extrapolated_s"], 3),
        },
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["ratio_new_over_old"]), json.dumps(result["machine"]))


if __name__ == "__main__":
    main()
