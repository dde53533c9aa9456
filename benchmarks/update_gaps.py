"""Is the GPU kept busy through the update? Where it waits, on what?

At the paper step's composition (`update_profile.py`'s rows and set-up: random-weight 7B,
8-slot bank, a card sized by `--card-gib`), after a warm-up pass of each: (1) a whole pass
of student rows under CUDA's sync debug mode, every synchronising call counted by the line
that made it (one inside the micro-batch loop would drain the GPU's queue once a micro-batch);
(2) a profiled pass of teacher rows and one of student rows: the GPU's busy time (the union
of kernel intervals), its idle time by gap length (short gaps are launch bubbles between
kernels; long ones are the host not keeping up or a wait), and the longest gaps with the host
operators running during each. The profiler slows the host, so the gaps are an upper bound.

    PYTHONPATH=src python benchmarks/update_gaps.py --card-gib 79.6 \
        --out benchmarks/results/update_gaps.json
    PYTHONPATH=src python benchmarks/update_gaps.py --smoke --out /tmp/update_gaps.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import profiler

sys.path.insert(0, str(Path(__file__).resolve().parent))
import update_profile  # noqa: E402
from loop_step import ROOT, bench_overrides, hold_all_but  # noqa: E402

#: idle time is tallied by the length of the gap it lies in (microseconds)
GAP_BINS = {"<20us": (0, 20), "20-100us": (20, 100), "0.1-1ms": (100, 1e3), ">1ms": (1e3, float("inf"))}


def idle_gaps(kernels: Sequence[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """Busy time (the union of the (start, end) kernel intervals, which overlap across streams)
    and the idle gaps between them as (length, start), longest first."""
    busy, gaps = 0.0, []
    intervals = sorted(kernels)
    end = intervals[0][0] if intervals else 0.0
    for start, stop in intervals:
        if start > end:
            gaps.append((start - end, end))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy, sorted(gaps, reverse=True)


def gap_table(gaps: Sequence[tuple[float, float]]) -> dict[str, float]:
    """Idle milliseconds in gaps of each `GAP_BINS` length."""
    return {name: round(sum(g for g, _ in gaps if lo <= g < hi) / 1e3, 3)
            for name, (lo, hi) in GAP_BINS.items()}


def timeline(prof: profiler.profile, top: int = 20) -> dict:
    """Busy and idle time of a profiled pass, and its `top` longest gaps with the innermost
    host operators running at each gap's middle."""
    events = prof.events()
    device = torch.autograd.DeviceType.CUDA
    kernels = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == device]
    host = [e for e in events if e.device_type != device]
    busy, gaps = idle_gaps(kernels)
    first = min((s for s, _ in kernels), default=0.0)
    span = max((e for _, e in kernels), default=first) - first
    longest = []
    for length, start in gaps[:top]:
        middle = start + length / 2
        running = sorted((e for e in host if e.time_range.start <= middle <= e.time_range.end),
                         key=lambda e: e.time_range.end - e.time_range.start)
        longest.append({"gap_us": round(length), "at_ms": round((start - first) / 1e3, 2),
                        "host": [e.name[:80] for e in running[:4]]})
    return {"kernel_span_ms": span / 1e3, "busy_ms": busy / 1e3,
            "busy_share": busy / span if span else None, "idle_ms_by_gap": gap_table(gaps),
            "longest_gaps": longest}


def sync_calls(fn) -> list[tuple[str, int]]:
    """The synchronising CUDA calls `fn()` makes, counted by the line that made each."""
    cuda = torch.cuda.is_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    return Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                   if "synchronizing CUDA operation" in str(w.message)).most_common()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/qwen2.5-coder-7b-4v4.yaml")
    ap.add_argument("--tasks", type=int, default=24, help="student tasks (x --answers rows)")
    ap.add_argument("--answers", type=int, default=4)
    ap.add_argument("--teachers", type=int, default=24, help="teacher rows")
    ap.add_argument("--student-prompt", type=int, default=500)
    ap.add_argument("--teacher-prompt", type=int, default=1960)
    ap.add_argument("--completion", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16384, help="train.micro_batch_tokens")
    ap.add_argument("--card-gib", type=float, default=None,
                    help="hold all but this many GiB of the GPU first (e.g. 79.6: an H100 80GB)")
    ap.add_argument("--out", default="benchmarks/results/update_gaps.json")
    ap.add_argument("--smoke", action="store_true",
                    help="a CPU check of the script on a tiny random model (no kernels to time)")
    args = ap.parse_args()
    dev = update_profile.DEV
    if dev != "cuda" and not args.smoke:
        sys.exit("update_gaps.py needs a CUDA GPU (or --smoke for a CPU check of the script)")
    from lorapop.config import load_config
    from lorapop.selfplay.parts import build

    overrides = [*bench_overrides(Path(tempfile.mkdtemp()), 4),
                 *(update_profile.SMOKE if args.smoke else [])]
    parts = build(load_config(ROOT / args.config, overrides))
    ballast = hold_all_but(args.card_gib) if args.card_gib and dev == "cuda" else None
    vocab = parts.model.config.vocab_size
    student = update_profile._rows(vocab, args.tasks * args.answers, args.student_prompt,
                                   args.completion, args.answers,
                                   [parts.slot[n] for n in parts.students], 2)
    teacher = update_profile._rows(vocab, args.teachers, args.teacher_prompt, args.completion, 1,
                                   [parts.slot[n] for n in parts.teachers], 3)
    passes = {"teacher": (teacher, False), "student": (student, True)}

    def run(name: str) -> dict:
        rows, share = passes[name]
        return update_profile.update_pass(parts, rows, share, "auto", args.max_tokens)

    result = {"benchmark": "update_gaps", "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "card_gib": args.card_gib if ballast is not None else None}
    for name in passes:  # warm-up: compiled passes, the allocator's blocks
        run(name)
    result["student_pass_syncs"] = sync_calls(lambda: run("student"))
    print(json.dumps({"student_pass_syncs": result["student_pass_syncs"]}), flush=True)
    for name in passes:
        with profiler.profile(activities=[profiler.ProfilerActivity.CUDA,
                                          profiler.ProfilerActivity.CPU]) as prof:
            r = run(name)
        result[name] = {"micro_batches": r["micro_batches"], "unprofiled_s": run(name)["s"],
                        **timeline(prof)}
        print(json.dumps({name: {k: v for k, v in result[name].items() if k != "longest_gaps"}}),
              flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
