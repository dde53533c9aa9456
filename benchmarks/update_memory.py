"""The update's memory under every length mix: no OOM, and a peak within the plan's budget.

A real model's answers end at any length up to the cap, and an update's micro-batches then come
in every width, one after another, in the same process: the shape that fragments a caching
allocator. This sweep builds the paper's 4v4 run (random-weight 7B, `benchmarks/loop_step.py`'s
set-up), then, for each length mix, runs the loop's own policy step over rollouts of that mix
(teacher rows on ~1,900-token prompts, each task's 4 student answers on one ~800-token prompt, as
the paper config's AZR prompts with 6 references give), the mixes back to back without emptying
the allocator's cache between them. Per mix it records the budget the update's memory plan was
given (`engine/memory.update_budget` at the update's start), the peak allocated bytes above the
update's starting point, the micro-batch plan (tokens that keep their activations, the widest
such micro-batch and the plan's estimate of its bytes, against which the peak is set) and the
time.

What it cannot be: the generation phases' own allocations between two updates (KV caches, CUDA
graph pools) are not replayed; `loop_step.py --paper` runs whole steps at the realistic mix.

    PYTHONPATH=src python benchmarks/update_memory.py --card-gib 79.6 --out RESULT.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

TEACHER_PROMPT, STUDENT_PROMPT, ANSWERS = 1900, 800, 4


def _lognormal(median: float, sigma: float, cap: int):
    return lambda r: max(1, min(cap, round(r.lognormvariate(math.log(median), sigma))))


def mixes(cap: int) -> dict:
    """Completion-length draws (random.Random -> tokens) named by what they model."""
    return {
        "uniform_short_128": lambda r: 128,
        f"uniform_cap_{cap}": lambda r: cap,
        "lognormal_500_s1.0": _lognormal(500, 1.0, cap),
        "lognormal_200_s0.5": _lognormal(200, 0.5, cap),
        "lognormal_1000_s1.5": _lognormal(1000, 1.5, cap),
        "bimodal_100_or_cap": lambda r: cap - r.randrange(64) if r.random() < 0.3 else
        50 + r.randrange(100),
        "one_at_cap_among_64": lambda r: 64,  # the first student row of each task is set to cap
    }


def rollouts(sp, draw, name: str, scale: float, vocab: int, seed: int, cap: int) -> list:
    """Teacher and student rows as the paper's step makes them, `scale` of its counts."""
    from lorapop.selfplay.records import Rollout

    rng = random.Random(f"{seed}/{name}")
    members = list(sp.parts.slot)
    teachers = [m for m in members if m.startswith("T")]
    students = [m for m in members if m.startswith("S")]
    n_rows = max(1, round(48 * scale))  # per teacher: 16 proposals x 3 types
    tokens = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    out = []
    for t, s in zip(teachers, students, strict=False):
        for k in range(n_rows):
            type_ = ("code_o", "code_i", "code_f")[k % 3]
            out.append(Rollout(t, "teacher", type_, tokens(TEACHER_PROMPT), tokens(draw(rng)), []))
            prompt = tokens(STUDENT_PROMPT)
            for a in range(ANSWERS):
                n = cap if name.startswith("one_at_cap") and a == 0 else draw(rng)
                out.append(Rollout(s, "student", type_, prompt, tokens(n), []))
    return out


@contextmanager
def _planned(policy) -> Iterator[dict]:
    """What the update planned: `keep` (tokens that keep their activations) and the padded
    tokens of each micro-batch within it (`kept`)."""
    import lorapop.selfplay.update as update

    plan: dict = {"kept": []}
    memory_plan, micro_batches = policy.memory_plan, update.pack_micro_batches

    def planned(longest):
        plan["keep"], _ = out = memory_plan(longest)
        return out

    def grouped(*args, **kwargs):
        out = micro_batches(*args, **kwargs)
        plan["kept"] += [padded for _, padded in out if padded <= (plan.get("keep") or 0)]
        return out

    policy.memory_plan, update.pack_micro_batches = planned, grouped
    try:
        yield plan
    finally:
        del policy.memory_plan
        update.pack_micro_batches = micro_batches


def sweep(config: str, overrides: list[str], scale: float, seed_dir: Path, run_dir: Path,
          only: list[str] | None = None) -> list[dict]:
    """Each mix's update in one process; an OOM is recorded (and the sweep goes on)."""
    from loop_step import bench_overrides
    from lorapop.config import load_config
    from lorapop.engine.logprobs import HEAD_CHUNK, head_compiled
    from lorapop.engine.memory import GIB, update_budget, update_bytes_per_token, update_fixed_bytes
    from lorapop.selfplay.loop import SelfPlay

    cfg = load_config(ROOT / config, [*bench_overrides(seed_dir, 12), *overrides])
    sp = SelfPlay(cfg, run_dir)
    cap = cfg.sampling.student_max_new_tokens
    model = sp.parts.model
    vocab = model.config.get_text_config().vocab_size
    rows = []
    try:
        for name, draw in mixes(cap).items():
            if only and name not in only:
                continue
            batch = rollouts(sp, draw, name, scale, vocab, cfg.seed, cap)
            rewards = [random.Random(i).choice([1.0, -0.5]) for i in range(len(batch))]
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            budget = update_budget(model, cfg.train.memory_share)
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            rec = {"mix": name, "rows": len(batch),
                   "tokens": sum(len(r.prompt_ids) + len(r.token_ids) for r in batch),
                   "completion_tokens": sorted(len(r.token_ids) for r in batch)[::max(1, len(batch) // 8)],
                   "budget_gib": budget / GIB}
            try:
                with _planned(sp.policy) as plan:
                    sp.policy.step(batch, rewards)
                torch.cuda.synchronize()
                rec["oom"] = False
            except torch.OutOfMemoryError as e:
                rec["oom"] = True
                rec["error"] = str(e).splitlines()[0][:300]
                sp.parts.opt.zero_grad()
            rec["update_s"] = time.perf_counter() - t0
            rec["peak_above_start_gib"] = (torch.cuda.max_memory_allocated() - start) / GIB
            rec["reserved_gib"] = torch.cuda.memory_reserved() / GIB
            stats = torch.cuda.memory_stats()
            rec["alloc_retries"] = stats.get("num_alloc_retries", 0)
            rec["within_budget"] = rec["peak_above_start_gib"] <= rec["budget_gib"]
            if plan.get("kept"):  # the estimate of the widest micro-batch that kept activations
                est = update_fixed_bytes(model, HEAD_CHUNK, head_compiled(model)) + \
                    max(plan["kept"]) * update_bytes_per_token(model)
                rec |= {"keep_tokens": plan["keep"], "widest_kept_tokens": max(plan["kept"]),
                        "estimated_peak_gib": est / GIB,
                        "peak_over_estimate": rec["peak_above_start_gib"] * GIB / est}
            print(json.dumps(rec), flush=True)
            rows.append(rec)
    finally:
        sp.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/qwen2.5-coder-7b-4v4.yaml")
    ap.add_argument("--scale", type=float, default=0.25,
                    help="share of the paper step's rows per mix (1.0: 192 teacher rows, 768 answers)")
    ap.add_argument("--card-gib", type=float, help="size the GPU as a card of this many GiB")
    ap.add_argument("--mix", action="append", help="only these mixes (repeatable)")
    ap.add_argument("--seed-dir", help="reuse (or create) the seed tasks and tokenizer here")
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*", help="extra key.path=value")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("update_memory.py needs a CUDA GPU")
    from loop_step import hold_all_but

    ballast = hold_all_but(args.card_gib) if args.card_gib else None  # noqa: F841 (held)
    tmp = Path(tempfile.mkdtemp())
    rows = sweep(args.config, args.overrides, args.scale,
                 Path(args.seed_dir) if args.seed_dir else tmp / "seeds", tmp / "run", args.mix)
    from lorapop.engine.memory import ALLOC_CONF

    record = {
        "benchmark": "update_memory",
        "command": " ".join(["python", *sys.argv]),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, cwd=ROOT).stdout.strip() or None,
        "device": torch.cuda.get_device_name(),
        "card_gib": args.card_gib,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "allocator": os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get(
            "PYTORCH_CUDA_ALLOC_CONF") or ALLOC_CONF,
        "scale": args.scale,
        "mixes": rows,
        "all_within_budget": all(r["within_budget"] and not r["oom"] for r in rows),
    }
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
