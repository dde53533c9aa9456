"""How long would a larger regime-world base take to build? Training speed per model shape.

    PYTHONPATH=src python experiments/regime/base_speed.py --size world-nocount --steps 150 --workers 15 \\
        --shape "" --shape hidden=768,layers=12,heads=12,kv_heads=4,intermediate=2048 \\
        --out $OUT/base_speed.json

The gate kept failing on one reading: the 26M students of the world bases execute the
grammar's arithmetic too poorly, and a larger base is the lever left. What counts then is how a
recipe's build time grows with the shape. This makes the recipe's
corpus once, then trains each shape (`--shape`, fields of `ModelSize`; "" is the recipe's own)
for `--steps` steps on the recipe's own batches (`pretrain_tiny` with the recipe's settings,
that shape and the corpus given; the pool is drawn per shape, sized to the steps). It records
each shape's parameters, ms per step (steady state: between the last two logged steps, since
the first steps warm up; and over all steps), peak GPU memory, and the recipe's training time
at the steady speed (its steps x ms per step). A shape that does not fit is out of memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import tempfile
import time
from pathlib import Path

import torch

from lorapop.engine.load import resolve_device
from lorapop.tiny.corpus import generate_corpus
from lorapop.tiny.grammar import table_levels
from lorapop.tiny.pretrain import pretrain_tiny, reshape
from regime_recipes import RECIPES as SIZES

STEP_LINE = re.compile(r"step\s+(\d+)\s+loss\s+\S+\s+([\d.]+)s")


def measure(size: str, shape_spec: str, corpus: list, steps: int, device: str,
            workers: int) -> dict:  # fmt: skip
    """One shape of recipe `size`, trained `steps` steps on its own batches."""
    recipe = SIZES[size]
    shape = reshape(recipe.size, shape_spec)
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    row = {"shape": shape_spec or "(recipe)", "model": dataclasses.asdict(shape)}
    logged: list[tuple[int, float]] = []  # (step, seconds since training began), every 50 steps

    def log(line: str) -> None:
        if m := STEP_LINE.match(line):
            logged.append((int(m[1]), float(m[2])))

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        try:
            rec = pretrain_tiny(tmp, 0, device=device, corpus=corpus, workers=workers, log=log,
                                **dataclasses.asdict(recipe) | {"size": shape, "steps": steps})
        except torch.OutOfMemoryError:
            return {**row, "status": "out of memory"}
    # steady state: between the last two logged steps (the first steps pay for warm-up), where
    # they are 10 or more steps apart; else over all steps
    (s0, t_0), (s1, t_1) = logged[-2:] if len(logged) > 1 else ((0, 0.0), (0, 0.0))
    step_ms = round(1000 * (t_1 - t_0) / (s1 - s0), 1) if s1 - s0 >= 10 else rec["step_ms"]
    return {**row, "status": "ok", "parameters": rec["parameters"], "steps": steps,
            "step_ms": step_ms, "step_ms_all": rec["step_ms"], "final_loss": rec["final_loss"],
            "pool_tokens": rec["pool"]["tokens"] if rec.get("pool") else None,
            "seconds": round(time.perf_counter() - t0, 1),
            "peak_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
            if dev.type == "cuda" else None,
            "recipe_train_s": round(recipe.steps * step_ms / 1000, 1)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="world-nocount", help="a pretrain-tiny recipe with fast_corpus")
    ap.add_argument("--shape", action="append", default=None, metavar="KEY=N,...",
                    help="a shape to train (repeat; \"\" is the recipe's own; default: that one)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--n-per-level", type=int, help="corpus programs per level (default: the recipe's)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="experiments/regime/results/base_speed.json")
    a = ap.parse_args()
    recipe = SIZES.get(a.size)
    if recipe is None or not recipe.fast_corpus:
        ap.error(f"--size {a.size!r}: give a recipe with a worker-made corpus, e.g. world-nocount")
    shapes = a.shape if a.shape is not None else [""]
    for spec in shapes:
        try:
            reshape(recipe.size, spec)
        except ValueError as e:
            ap.error(f"--shape {spec!r}: {e}")
    t0 = time.perf_counter()
    corpus = generate_corpus(a.n_per_level or recipe.n_per_level, "pretrain/0", workers=a.workers,
                             log=None, levels=table_levels(recipe.levels))  # fmt: skip
    out = {"benchmark": "base_speed", "size": a.size, "recipe_steps": recipe.steps,
           "batch_tokens": recipe.batch_tokens, "corpus_programs": len(corpus),
           "corpus_s": round(time.perf_counter() - t0, 1),
           "machine": {"device": torch.cuda.get_device_name() if torch.cuda.is_available()
                       else platform.processor() or "cpu", "torch": torch.__version__},
           "shapes": []}  # fmt: skip
    for spec in shapes:
        out["shapes"].append(measure(a.size, spec, corpus, a.steps, a.device, a.workers))
        print(json.dumps(out["shapes"][-1]), flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")  # after every shape: a cut call keeps them


if __name__ == "__main__":
    main()
