"""One full self-play step of a config against the single-adapter baseline step, on the GPU.

The base model is built from the architecture's config.json with random weights (same cost as
the real weights). Random weights propose no valid task, so the solving phase is fed valid
tasks from a buffer warm-started by the tiny-world generator (`tasks.fill_from_buffer`), and
generation runs to a fixed length (`sampling.ignore_eos`): every phase runs at full size.
A BPE tokenizer trained on generated tasks stands in for the real one (similar characters
per token on code). Each run does `--warmup` steps first, then times `--steps` steps.

    PYTHONPATH=src python benchmarks/loop_step.py --out benchmarks/results/loop_step.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = [
    f"model.name_or_path={ROOT / 'configs/models/qwen2.5-coder-7b'}",
    "model.random_init=true",
    "tasks.fill_from_buffer=true",
    "sampling.ignore_eos=true",
    "evolve.every=0",
    "run.progress=false",
]


def seed_tasks(path: Path, tok_dir: Path, n: int) -> None:
    """Valid tasks of every type for the buffers, and a tokenizer trained on their text."""
    from lorapop.tiny.generator import generate_tasks
    from lorapop.tiny.tokenizer import corpus_texts, save_tokenizer, train_tokenizer
    from lorapop.verify import Sandbox

    with Sandbox(workers=8) as sb:
        tasks = [t for kind in ("code_o", "code_i", "code_f") for level in (2, 3, 4)
                 for t in generate_tasks(kind, n, level, seed=level, sandbox=sb)]
    path.write_text("".join(t.dumps() + "\n" for t in tasks))
    save_tokenizer(train_tokenizer(corpus_texts(tasks), vocab_size=8192), tok_dir)


def measure(config: str, overrides: list[str], warmup: int, steps: int, run_dir: Path) -> dict:
    from lorapop.config import load_config
    from lorapop.loop import SelfPlay

    cfg = load_config(ROOT / config, overrides)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sp = SelfPlay(cfg, run_dir)
    rows = []
    try:
        for i in range(warmup + steps):
            sync()
            t0 = time.perf_counter()
            row = sp.step()
            sync()
            row["wall_s"] = time.perf_counter() - t0
            if i >= warmup:
                rows.append(row)
            print(f"{config} step {i}: {row['wall_s']:.1f}s {row['phase_s']}", flush=True)
    finally:
        sp.close()
        del sp
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    phases = {p: median(r["phase_s"].get(p, 0.0) for r in rows) for p in rows[0]["phase_s"]}
    return {
        "config": config,
        "overrides": overrides,
        "adapters": len(rows[0]["members"]),
        "wall_s": median(r["wall_s"] for r in rows),
        "phase_s": phases,
        "generated_tokens": rows[0]["generated_tokens"],
        "tokens_per_s": median(r["tokens_per_s"] for r in rows),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/qwen2.5-coder-7b-4v4.yaml")
    ap.add_argument("--baseline", default="configs/azr-7b-baseline.yaml")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--tasks-per-cell", type=int, default=12)
    ap.add_argument("--out", default="benchmarks/results/loop_step.json")
    ap.add_argument("--smoke", action="store_true", help="allow a CPU run (to test the script)")
    ap.add_argument("overrides", nargs="*", help="extra key.path=value for both runs")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        sys.exit("loop_step.py needs a CUDA GPU (or --smoke for a CPU check of the script)")
    tmp = Path(tempfile.mkdtemp())
    seed_tasks(tmp / "seed.jsonl", tmp / "tok", args.tasks_per_cell)
    common = [*BENCH, f"tasks.seed_tasks={tmp / 'seed.jsonl'}", f"model.tokenizer={tmp / 'tok'}",
              *args.overrides]
    pop = measure(args.config, common, args.warmup, args.steps, tmp / "pop")
    base = measure(args.baseline, common, args.warmup, args.steps, tmp / "base")
    result = {
        "benchmark": "loop_step",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "population": pop,
        "baseline": base,
        "wall_ratio": pop["wall_s"] / base["wall_s"],
        "phase_ratio": {p: pop["phase_s"][p] / base["phase_s"][p]
                        for p in pop["phase_s"] if base["phase_s"].get(p)},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\n{'phase':14s} {'population':>11s} {'baseline':>9s} {'ratio':>6s}")
    for p, v in pop["phase_s"].items():
        b = base["phase_s"].get(p, 0.0)
        print(f"{p:14s} {v:11.2f} {b:9.2f} {v / b if b else float('nan'):6.2f}")
    print(f"{'wall':14s} {pop['wall_s']:11.2f} {base['wall_s']:9.2f} {result['wall_ratio']:6.2f}")
    print(f"peak GiB: population {pop['peak_memory_gib']}, baseline {base['peak_memory_gib']}")


if __name__ == "__main__":
    main()
