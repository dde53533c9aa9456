"""One self-play step of a config on 1, 2, 4... GPUs of one node (data parallel, torchrun).

Same set-up as `loop_step.py` (random-weight 7B from the architecture's config.json, buffer
warm-started with valid tiny-world tasks and `tasks.fill_from_buffer`, fixed-length generation
with `sampling.ignore_eos`), so every phase runs at full size. For each GPU count the step
runs in fresh processes: one plain process for 1 GPU (the single-process path), torchrun
for more. `--gpus 1+2,4` runs 1 and 2 GPUs at the same time on disjoint GPUs (0 | 1-2), then
4. Each run does a small warm-up step (`--warmup-tokens`, one proposal per type: lazy
initialisation, allocator growth; 0 skips it), then `--steps` timed steps at full size. For the
steady state give it the step's own length (e.g. 1024): the first update micro-batch at real
widths costs 1-7 s once per process, which otherwise lands in the timed step. Every GPU count
runs the phases in turn (`sampling.overlap=false`): one batch across the phases needs one
process, and the scaling compares like with like.

Recorded per GPU count: the step's wall time and rank 0's per-phase times (they include
waiting for the slowest rank at each gather), every rank's generation time, the bank-gradient
all-reduce inside the step (including the wait for the slowest rank's backward) and alone
(after a barrier), every rank's peak GPU memory, and a per-phase scaling model fitted to 1
and 2 GPUs. The JSON is rewritten after each group, so a run cut short keeps what it measured.

    PYTHONPATH=src python benchmarks/loop_step_dist.py --gpus 1+2,4 --out benchmarks/results/loop_step_dist.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).parent))
from loop_step import (  # noqa: E402
    GENERATE_CALLS,
    ROOT,
    UpdateCount,
    _patch,
    allocator_counts,
    bench_overrides,
    trace_generate,
    warm_compiled,
)

# NVLink multicast stays off (shared hosts: see the device notes); children inherit these.
SMOKE = ["model.name_or_path=tiny-random", "model.device=cpu", "model.dtype=float32",
         "model.gradient_checkpointing=false", "sampling.teacher_max_new_tokens=16",
         "sampling.student_max_new_tokens=8", "tasks.proposals_per_type=2", "verify.workers=2",
         "tasks.template=compact", "tasks.references=1", "tasks.answers_per_task=1"]
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def worker(args: argparse.Namespace) -> None:
    """One rank: warm up, time `--steps` steps, gather every rank's figures on rank 0."""
    from lorapop import dist
    from lorapop.config import load_config
    from lorapop.selfplay.loop import SelfPlay

    cfg = load_config(ROOT / args.config, args.overrides)
    world = dist.init(cfg.model.device)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    sp = SelfPlay(cfg, Path(args.run_dir), world=world)
    load_s = time.perf_counter() - t0
    compile_s = warm_compiled(sp.parts.model, sp.parts.bank)
    counter = UpdateCount(f"rank {world.rank} ")  # its update tokens, a log line per micro-batch
    _patch("sequence_logprobs", counter)
    _patch("generate", trace_generate)
    full = (cfg.sampling.teacher_max_new_tokens, cfg.sampling.student_max_new_tokens,
            cfg.tasks.proposals_per_type)
    try:
        if args.warmup_tokens:
            cfg.sampling.teacher_max_new_tokens = cfg.sampling.student_max_new_tokens = \
                args.warmup_tokens
            cfg.tasks.proposals_per_type = 1
            sp.step()
            (cfg.sampling.teacher_max_new_tokens, cfg.sampling.student_max_new_tokens,
             cfg.tasks.proposals_per_type) = full
        rows = []
        counter.reset()
        GENERATE_CALLS.clear()
        alloc = allocator_counts()
        for _ in range(args.steps):
            dist.barrier(world)
            sync()
            t0 = time.perf_counter()
            row = sp.step()
            sync()
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            if world.main:
                print(f"{world.size} GPU(s): step {row['wall_s']:.1f}s {row['phase_s']}",
                      flush=True)
        dist.barrier(world)
        sync()
        t0 = time.perf_counter()
        grads = sp.parts.bank.grads
        dist.all_reduce_sum(grads, world)
        sync()
        pure = time.perf_counter() - t0
        mine = {
            "rank": world.rank,
            "wall_s": median(r["wall_s"] for r in rows),
            "phase_s": {p: median(r["phase_s"][p] for r in rows) for p in rows[0]["phase_s"]},
            "generation_s": median(r["generated_tokens"] / r["tokens_per_s"] for r in rows),
            "allreduce_in_step_s": median(r.get("allreduce_s", 0.0) for r in rows),
            "allreduce_alone_s": pure if world.distributed else 0.0,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "load_s": load_s,
            "compile_s": compile_s,
            "update_tokens": counter.real // len(rows),
            "update_forward_tokens": counter.forward // len(rows),  # a shared prompt once
            "update_micro_batches": counter.micro_batches // len(rows),
            "update_padded_tokens": counter.padded // len(rows),
            "checkpointed_micro_batches": counter.checkpointed // len(rows),
            "generate_calls": GENERATE_CALLS,  # the timed steps' (proposal, solving, ...)
            "allocator_events": {k: v - alloc.get(k, 0) for k, v in allocator_counts().items()},
        }
        ranks = dist.all_gather(mine, world)
        if world.main:
            Path(args.part).write_text(json.dumps({
                "gpus": world.size,
                "generated_tokens": rows[0]["generated_tokens"],
                "wall_s": ranks[0]["wall_s"],
                "phase_s": ranks[0]["phase_s"],
                "allreduce_alone_s": max(r["allreduce_alone_s"] for r in ranks),
                "bank_grad_gib": grads.numel() * grads.element_size() / 2**30,
                "ranks": ranks,
            }, indent=1))
    finally:
        sp.close()
        dist.close(world)


def launch(group: list[int], args: argparse.Namespace, common: list[str], tmp: Path) -> list[dict]:
    """Run the GPU counts of `group` at the same time on disjoint GPUs; one result each."""
    procs, first = [], 0
    for n in group:
        run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"gpus{n}_"))
        part = run_dir / "part.json"
        me = [str(Path(__file__).resolve()), "--worker", "--config", args.config,
              "--steps", str(args.steps), "--warmup-tokens", str(args.warmup_tokens),
              "--run-dir", str(run_dir / "run"), "--part", str(part), *common]
        cmd = [sys.executable, *me] if n == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={n}", *me]
        # torchrun gives each rank OMP_NUM_THREADS=1 unless set; every run gets the same
        # share of the cores instead, so the 1-GPU baseline and the ranks compare like for like
        threads = max(1, (os.cpu_count() or 1) // max(1, torch.cuda.device_count()))
        env = {"OMP_NUM_THREADS": str(threads), **os.environ, **NO_MULTICAST,
               "PYTHONUNBUFFERED": "1"}
        if torch.cuda.is_available():
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(n))
        first += n
        procs.append((n, part, subprocess.Popen(cmd, env=env), time.perf_counter()))
    ended: dict[int, float] = {}
    while len(ended) < len(procs):
        for i, (_, _, proc, _) in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.perf_counter()
        time.sleep(0.5)
    out = []
    for i, (n, part, proc, t0) in enumerate(procs):
        code = proc.returncode
        run = json.loads(part.read_text()) if code == 0 and part.exists() else {
            "gpus": n, "error": f"exit code {code} (see the log)"}
        run["process_s"] = ended[i] - t0
        run["concurrent_with"] = group[:i] + group[i + 1:]
        out.append(run)
    return out


def scaling_model(runs: list[dict], predict: tuple[int, ...] = (4, 8)) -> dict | None:
    """Per phase t(n) = fixed + parallel / n through the 1- and 2-GPU times (fixed clamped to
    [0, t(1)]); the predicted step time and speed-up for `predict` GPUs (the all-reduce is
    inside "update")."""
    by = {r["gpus"]: r for r in runs}
    if 1 not in by or 2 not in by:
        return None
    one, two = by[1]["phase_s"], by[2]["phase_s"]
    fixed = {p: min(max(0.0, 2 * two.get(p, 0.0) - t), t) for p, t in one.items()}
    fit = {p: {"fixed_s": fixed[p], "parallel_s": t - fixed[p]} for p, t in one.items()}
    step = {n: sum(f["fixed_s"] + f["parallel_s"] / n for f in fit.values()) for n in predict}
    return {"phases": fit, "predicted_step_s": step,
            "predicted_speedup": {n: sum(one.values()) / t for n, t in step.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/qwen2.5-coder-7b-4v4.yaml")
    ap.add_argument("--gpus", default="1,2",
                    help="GPU counts run one after the other (comma) or at once on disjoint "
                         "GPUs (plus): 1+2,4 runs 1 and 2 together, then 4")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--warmup-tokens", type=int, default=32,
                    help="generation length of the small warm-up step (0: no warm-up)")
    ap.add_argument("--tasks-per-cell", type=int, default=12)
    ap.add_argument("--out", default="benchmarks/results/loop_step_dist.json")
    ap.add_argument("--seed-dir", help="reuse (or create) the seed tasks and tokenizer here")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip a GPU count once the previous one's run would not fit in it")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the script (tiny model)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="extra key.path=value")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    groups = [[int(g) for g in spec.split("+")] for spec in args.gpus.split(",")]
    if args.smoke:  # a CPU check of the script: tiny random model, gloo
        args.overrides = [*args.overrides, *SMOKE]
    elif not torch.cuda.is_available():
        sys.exit("loop_step_dist.py needs CUDA GPUs (or --smoke for a CPU check of the script)")
    elif max(map(sum, groups)) > torch.cuda.device_count():
        sys.exit(f"--gpus {args.gpus}: only {torch.cuda.device_count()} GPUs visible")
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp())
    common = [*bench_overrides(Path(args.seed_dir) if args.seed_dir else tmp,
                               args.tasks_per_cell), "sampling.overlap=false", *args.overrides]
    result = {
        "benchmark": "loop_step_dist",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
        if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "config": args.config,
        "overrides": common,
        "runs": [],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    last = 0.0  # seconds the previous group's fastest run took (more GPUs: faster)
    for group in groups:
        if args.budget_s and time.perf_counter() - start + last > args.budget_s:
            result["skipped"] = f"{group} GPUs: the time budget ({args.budget_s:.0f} s) ran out"
            Path(args.out).write_text(json.dumps(result, indent=1))
            print(result["skipped"], flush=True)
            break
        runs = launch(group, args, common, tmp)
        last = min(r["process_s"] for r in runs)
        for run in runs:
            if "error" in run:
                result.setdefault("failed", []).append(run)
                print(f"{run['gpus']} GPU(s) failed: {run['error']}", flush=True)
            else:
                result["runs"].append(run)
        result["runs"].sort(key=lambda r: r["gpus"])
        for run in result["runs"]:
            run["speedup"] = result["runs"][0]["wall_s"] / run["wall_s"]  # over the fewest GPUs
        result["scaling_model"] = scaling_model(result["runs"])
        Path(args.out).write_text(json.dumps(result, indent=1))
        for run in runs:
            if "error" in run:
                continue
            print(f"{run['gpus']} GPU(s): step {run['wall_s']:.1f}s, speed-up "
                  f"{run['speedup']:.2f}x, phases {run['phase_s']}, all-reduce alone "
                  f"{run['allreduce_alone_s']:.3f}s, peak GiB "
                  f"{[r['peak_memory_gib'] for r in run['ranks']]}", flush=True)


if __name__ == "__main__":
    main()
