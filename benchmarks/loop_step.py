"""One full self-play step of a config against the single-adapter baseline step, on the GPU.

The base model is built from the architecture's config.json with random weights (same cost as
the real weights). Random weights propose no valid task, so the solving phase is fed valid
tasks from a buffer warm-started by the tiny-world generator (`tasks.fill_from_buffer`), and
generation runs to a fixed length (`sampling.ignore_eos`): every phase runs at full size.
A BPE tokenizer trained on generated tasks stands in for the real one (similar characters
per token on code). Each run does `--warmup` steps first, then times `--steps` steps.

    PYTHONPATH=src python benchmarks/loop_step.py --out benchmarks/results/loop_step.json

`--paper` runs the population config alone at its own sizes (no baseline, no warm-up unless
asked): first at realistic answer lengths (log-normal, median 500 tokens, sigma 1.0, capped at
the config's 2,048), then with every row at 1,024 tokens (`--uniform`), in one process; each
phase's decode milliseconds per step stand beside their roofline bound (`decode`, see
`decode_roofline`). `--skip-update` times the generation phases only (no policy-gradient step),
`--max-new-tokens N` sets both generation lengths, `--lengths MEDIAN[:SIGMA[:CAP]]`
makes each row stop at a length drawn from a log-normal (through `generate`'s stop function,
keyed by the row's seed and key; EOS stays off), `--valid F` makes that share of proposals
valid (`valid_share`; --paper: 0.5) so that answers can start before the last proposal ends
(`sampling.overlap`), and `--static` decodes static batches (no
refills: each batch, of the size continuous batching gets from the free memory, runs until
its slowest row ends), for comparison with continuous batching; `--and-static` runs both in one
process, the same rows drawing the same lengths. `--update-ab grouped,auto,...` runs the last
timed step's update again under each listed LoRA kernel (the loop's own update, one process);
`--update-trace` runs it once more with four micro-batches profiled (is the GPU kept busy?).
A run writes one JSON (`--out`): phase
times, peak memory, generated tokens/s and the update's tokens/s and model FLOP utilisation.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median

import torch
from torch import profiler

from lorapop.engine.generate import GenerateSpec
from lorapop.lora.routing import KERNELS

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


def bench_overrides(seeds: Path, tasks_per_cell: int) -> list[str]:
    """BENCH plus the seed tasks and tokenizer in `seeds` (made there unless it holds them)."""
    if not (seeds / "seed.jsonl").exists():
        seeds.mkdir(parents=True, exist_ok=True)
        seed_tasks(seeds / "seed.jsonl", seeds / "tok", tasks_per_cell)
    return [*BENCH, f"tasks.seed_tasks={seeds / 'seed.jsonl'}", f"model.tokenizer={seeds / 'tok'}"]


PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16, SXM datasheet
DEV = "cuda" if torch.cuda.is_available() else "cpu"
#: the profiling scripts' `--smoke` model: tiny, random, in the dtype the GPU runs
SMOKE = ["model.name_or_path=tiny-random", f"model.device={DEV}", "model.dtype=bfloat16"]
#: The realistic length mix --paper reports first: log-normal, median 500, sigma 1.0, cap 2,048
REALISTIC = "500:1.0:2048"


def _patch(name: str, wrap) -> None:
    """Replace function `name` in every loaded lorapop module that imported it."""
    import lorapop.engine.generate as g
    import lorapop.engine.logprobs as lp

    original = {"generate": g.generate, "sequence_logprobs": lp.sequence_logprobs}[name]
    new = wrap(original)
    for mod in [m for k, m in list(sys.modules.items()) if k.startswith("lorapop")]:
        if getattr(mod, name, None) is original:
            setattr(mod, name, new)


class _WatchedFeed:
    """A `generate` feed that also tells `added(prompts)` what it adds."""

    def __init__(self, feed, added) -> None:
        self.feed, self.added, self.max_new_tokens = feed, added, feed.max_new_tokens

    def __call__(self, done, wait):
        new = self.feed(done, wait)
        if new:
            self.added(new)
        return new


def length_stop(median_len: float, sigma: float, cap: int | None):
    """A stop function ending each row after a log-normal number of tokens drawn from its
    (seed, key): a row stops at the same length whichever call or batch it runs in (a step's
    phases in turn or overlapped, the headline or an A/B rerun)."""
    active = [True]

    def wrap(generate):
        @functools.wraps(generate)
        def run(*a, **kw):
            if not active[0]:
                return generate(*a, **kw)
            spec = a[5] if len(a) > 5 else kw.get("spec") or GenerateSpec()
            prompts = a[3] if len(a) > 3 else kw["prompts"]
            keys = kw.get("row_keys") or range(len(prompts))
            rows = [(spec.seed, k, spec.params.max_new_tokens) for k in keys]
            if kw.get("feed") is not None:
                kw["feed"] = _WatchedFeed(kw["feed"], lambda new: rows.extend(
                    (p.seed, p.key, p.max_new_tokens) for p in new))

            def stop(i: int, toks: list[int]) -> int | None:
                seed, key, top = rows[i]
                r = random.Random(f"{seed}/{key}").lognormvariate(math.log(median_len), sigma)
                n = max(1, min(cap or top, top, round(r)))
                return n if len(toks) >= n else None

            return generate(*a, stop_fn=stop, **kw)

        return run

    wrap.active = active  # [False]: every row runs to max_new_tokens
    return wrap


def valid_share(fraction: float) -> None:
    """Random weights propose nothing valid, so every answer would be to a task filled from the
    buffer, known only once every proposal is verified. A trained model's proposals are often
    valid: make each proposal valid with probability `fraction`, drawn from its step and text
    (the same in every run and mode), its task a buffer task of its type drawn the same way,
    credited to its teacher. The work per step is unchanged (filling tops each teacher up to
    the same number of tasks); what changes is when the answers can start."""
    from lorapop.selfplay.loop import SelfPlay
    from lorapop.tasks.task import Validity

    original = SelfPlay._verdicts

    def verdicts(self, step, proposals):
        out = original(self, step, proposals)
        for i, p in proposals.items():
            rng = random.Random(f"{step}/{p.rollout.text}/{len(p.rollout.token_ids)}")
            if not out[i].valid and rng.random() < fraction:
                picked = self.parts.buffers[p.type].sample(1, rng)
                if picked:
                    task = dataclasses.replace(picked[0], teacher=p.teacher, step=step)
                    out[i] = Validity(True, task=task)
        return out

    SelfPlay._verdicts = verdicts


def static_batches(generate):
    """Static batching at the batch size continuous batching gets (the engine's
    `refill=False`): a batch's rows wait for its slowest before the next batch starts."""

    @functools.wraps(generate)
    def run(*a, **kw):
        if len(a) > 5:
            a, kw["spec"] = a[:5], a[5]
        kw["spec"] = dataclasses.replace(kw.get("spec") or GenerateSpec(), refill=False)
        return generate(*a, **kw)

    return run


def forward_tokens(prompt_ids, completion_ids, slot_ids, share_prompts: bool) -> int:
    """Tokens a `sequence_logprobs` forward runs: with shared prompts, a prompt once per pack
    of its rows (as the function lays them out), else once per row."""
    from lorapop.engine.logprobs import pack_widths, shared_prompt_packs

    slots = slot_ids.tolist() if isinstance(slot_ids, torch.Tensor) else list(slot_ids)
    packs = (shared_prompt_packs(prompt_ids, slots) if share_prompts
             else [[i] for i in range(len(prompt_ids))])
    return sum(pack_widths(packs, prompt_ids, completion_ids))


class UpdateCount:
    """Tokens the update's log-prob forwards see: real (prompt + completion of every row),
    forward (a shared prompt once: what the GPU computes) and padded.

    Each micro-batch's start is printed with the tokens so far, so a run cut off by a time
    limit still shows the update's rate in its log.
    """

    def __init__(self, tag: str = "") -> None:
        self.tag = tag  # e.g. the rank, at the start of each log line
        self.real = self.forward = self.padded = self.micro_batches = self.checkpointed = 0
        self.start: float | None = None

    def __call__(self, fn):
        @functools.wraps(fn)
        def run(model, bank, prompt_ids, completion_ids, slot_ids, *a, share_prompts=False,
                **kw):
            if torch.is_grad_enabled():
                lens = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
                now = time.perf_counter()
                self.start = self.start or now
                recompute = bool(getattr(model, "is_gradient_checkpointing", False))
                print(f"{self.tag}[update] micro-batch {self.micro_batches}: {len(lens)} rows"
                      f"{', checkpointed' if recompute else ''}; "
                      f"{self.real} tokens done in {now - self.start:.1f} s{_peak()}", flush=True)
                self.checkpointed += recompute
                self.real += sum(lens)
                self.forward += forward_tokens(prompt_ids, completion_ids, slot_ids,
                                               share_prompts)
                self.padded += len(lens) * max(lens, default=0)
                self.micro_batches += 1
            return fn(model, bank, prompt_ids, completion_ids, slot_ids, *a,
                      share_prompts=share_prompts, **kw)

        return run

    def reset(self) -> None:
        self.real = self.forward = self.padded = self.micro_batches = self.checkpointed = 0
        self.start = None


def warm_compiled(model, bank=None) -> float:
    """Compile the update's compiled passes (the LM head's log-softmax and, where they are
    fused, the SwiGLU and the rotary embedding; forward and backward, at one position and at
    several) and, with the `bank`, the decode step's kernels (two short generations: the
    Triton attention split along long rows and whole, its sampler, the fused passes at the
    layouts of a prefill and of a decode step) before timing: a one-off cost per process,
    not a step's. Seconds taken (0 without CUDA)."""
    from lorapop.engine import fused, logprobs
    from lorapop.engine.generate import GenerateSpec, generate
    from lorapop.engine.sampling import SamplingParams

    if not torch.cuda.is_available():
        return 0.0
    t0 = time.perf_counter()
    head = model.get_output_embeddings()
    width = getattr(model.config, "intermediate_size", 0)
    for positions in (1, 32):  # one position is a shape of its own to the compiler
        h = torch.randn(positions, head.in_features, device="cuda", dtype=head.weight.dtype,
                        requires_grad=True)
        y = torch.zeros(positions, dtype=torch.long, device="cuda")
        logprobs.head_logprobs(head, h, y).sum().backward()
        if fused.mlps_fused(model) and width:
            gate, up = (torch.randn(positions, width, device="cuda", dtype=head.weight.dtype,
                                    requires_grad=True) for _ in range(2))
            fused._SwiGLU.apply(gate, up).sum().backward()
    if fused.rotary_fused(model):  # [batch x tokens, heads, dim]: one graph for all shapes
        cfg, dt = model.config, head.weight.dtype
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        q, k = (torch.randn(1, heads, 32, dim, device="cuda", dtype=dt, requires_grad=True)
                for heads in (cfg.num_attention_heads, cfg.num_key_value_heads))
        cos, sin = torch.randn(2, 1, 32, dim, device="cuda", dtype=dt)
        sum(t.sum() for t in fused._Rotary.apply(q, k, cos, sin)).backward()
    if bank is not None:
        params = SamplingParams(max_new_tokens=8, eos_token_ids=())
        for rows, prompt in ((2, 1100), (72, 16)):  # few long rows split; many run whole
            ids = [[(7 * r + i) % 1000 for i in range(prompt)] for r in range(rows)]
            generate(model, bank, None, ids, [r % bank.n_slots for r in range(rows)],
                     GenerateSpec(params=params, batch_size=rows))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


#: Bytes `hold_all_but` holds: peaks are reported net of them (what the step itself needs)
_BALLAST_BYTES = 0


def hold_all_but(gib: float) -> torch.Tensor | None:
    """A tensor holding the card's memory beyond `gib` GiB (None if the card is no larger):
    the free memory the engine reads (`engine/memory.free_memory`) is then a smaller card's."""
    global _BALLAST_BYTES
    _, total = torch.cuda.mem_get_info()
    extra = total - int(gib * 2**30)
    if extra <= 0:
        return None
    _BALLAST_BYTES = extra
    print(f"[card] holding {extra / 2**30:.1f} of {total / 2**30:.1f} GiB: sized as a "
          f"{gib:g} GiB card", flush=True)
    return torch.empty(extra, dtype=torch.uint8, device="cuda")


def _peak() -> str:
    """The process's peak GPU memory so far and the SM clock now, for a log line ('' on CPU;
    the clock needs NVML: a GPU that throttles under load shows there)."""
    if not torch.cuda.is_available():
        return ""
    try:
        clock = f"; SM {torch.cuda.clock_rate()} MHz"
    except Exception:  # noqa: BLE001 - no NVML bindings: memory only
        clock = ""
    return f"; peak {_peak_gib():.1f} GiB{clock}"


def _peak_gib() -> float:
    """The process's peak allocated GPU memory, less `hold_all_but`'s ballast."""
    return (torch.cuda.max_memory_allocated() - _BALLAST_BYTES) / 2**30


def _kernel_events(prof) -> list:
    """The profile's GPU kernels (operators, which sum their kernels, left out)."""
    return [e for e in prof.key_averages()
            if "CUDA" in str(getattr(e, "device_type", "")) and e.device_time_total > 0]


def kernel_table(prof, n: int | None = 25) -> list[dict]:
    """The `n` GPU kernels with the most time (None: all)."""
    return [{"name": e.key[:120], "calls": e.count, "cuda_ms": e.device_time_total / 1e3}
            for e in sorted(_kernel_events(prof), key=lambda e: -e.device_time_total)[:n]]


def stack_profile(*activities: profiler.ProfilerActivity) -> profiler.profile:
    """A profile that records each operator's Python stack, for `op_table`. `verbose` makes
    kineto fill each event's `stack`: on torch 2.11 under Python 3.12.3 (the GPU machine's)
    the profiler records no Python function events, so walking an operator's parents finds
    no lorapop frame there."""
    return profiler.profile(activities=list(activities), with_stack=True,
                            experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True))


def op_table(prof, n: int = 25) -> list[dict]:
    """The operators whose own kernels take the most GPU time (CPU time on a CPU), by where
    they ran: the autograd node whose backward ran them, or else the innermost lorapop or
    transformers frame above them (a `stack_profile`). Says which code an add or a copy of
    the kernel table comes from: a backward's sum of gradients shows as an add under the node
    that produced the second gradient. Parents come first: a backward operator's `stack` is
    its forward's."""
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    cuda = any(e.self_device_time_total > 0 for e in events)
    totals: dict[tuple[str, str], list] = {}
    ours = ("lorapop/", "transformers/")
    for e in events:
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us <= 0:
            continue
        where, up = "", e.cpu_parent
        while up is not None and not where:
            if up.name.startswith("autograd::engine::evaluate_function") or any(
                    lib in up.name for lib in ours):
                where = up.name.removeprefix("autograd::engine::evaluate_function: ")
            up = up.cpu_parent
        if not where:
            where = next((f for f in e.stack or () if any(lib in f for lib in ours)), "")
        row = totals.setdefault((e.name, where[:120]), [0, 0.0])
        row[0] += 1
        row[1] += us / 1e3
    top = sorted(totals.items(), key=lambda kv: -kv[1][1])[:n]
    unit = "cuda_ms" if cuda else "cpu_ms"
    return [{"op": op, "where": where, "calls": c, unit: ms} for (op, where), (c, ms) in top]


# first match wins: FlashAttention's kernels name cutlass types, so attention comes first, and
# torch.compile's kernels (`triton_poi_fused__to_copy_mul_silu_0`: the SwiGLU, rotary and head
# passes) name the casts they fuse, so they come before the copies; the driver's `Memcpy` and
# `Memset` are copies
KINDS = {"attention": ("fmha", "flash", "attention", "sdpa", "efficient"),
         "gemm": ("gemm", "xmma", "cutlass", "nvjet", "matmul"),
         "compiled": ("triton_",),
         "copy_cast": ("copy", "memcpy", "memset", "cast", "fill", "cat", "index", "gather",
                       "scatter")}


def kernel_kinds(prof) -> dict[str, float]:
    """GPU kernel time (ms) by kind: attention, GEMMs, compiled (fused) passes,
    copies/casts/indexing, the rest."""
    out = dict.fromkeys([*KINDS, "other"], 0.0)
    for e in _kernel_events(prof):
        name = e.key.lower()
        kind = next((k for k, words in KINDS.items() if any(w in name for w in words)), "other")
        out[kind] += e.device_time_total / 1e3
    return out


def sync_cuda() -> None:
    """Wait for the GPU (a no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
                    "num_sync_all_streams")


def allocator_counts() -> dict[str, int]:
    """The CUDA caching allocator's event counters: retries (cached blocks freed to satisfy a
    request) and device mallocs/frees each synchronise the device, so a step with many of them
    stalls its GPU ({} on CPU)."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats[k]) for k in ALLOCATOR_COUNTS if k in stats}


class MicroBatchTrace:
    """Profile micro-batches [first, first + count) of the next update (wraps
    `sequence_logprobs`, as `UpdateCount`; the backward of a micro-batch runs before the next
    call): their wall time, GPU kernel time by kind, and the share of the wall the GPU was
    busy (well below 1: the GPU waited for the host)."""

    def __init__(self, first: int = 10, count: int = 4) -> None:
        self.first, self.count, self.seen = first, count, 0
        self.prof = None
        self.t0 = 0.0
        self.result: dict | None = None

    def __call__(self, fn):
        @functools.wraps(fn)
        def run(*a, **kw):
            if torch.is_grad_enabled() and self.result is None:
                if self.seen == self.first:
                    sync_cuda()
                    self.prof = profiler.profile(activities=[profiler.ProfilerActivity.CPU,
                                                             profiler.ProfilerActivity.CUDA])
                    self.prof.__enter__()
                    self.t0 = time.perf_counter()
                elif self.seen == self.first + self.count:
                    self.stop()
                self.seen += 1
            return fn(*a, **kw)

        return run

    def stop(self) -> None:
        if self.prof is None or self.result is not None:
            return
        sync_cuda()
        wall_ms = (time.perf_counter() - self.t0) * 1e3
        self.prof.__exit__(None, None, None)
        kinds = kernel_kinds(self.prof)
        self.result = {"micro_batches": min(self.count, self.seen - self.first),
                       "wall_ms": wall_ms, "kernel_ms": kinds,
                       "gpu_busy": sum(kinds.values()) / wall_ms,
                       "kernels": kernel_table(self.prof, 30)}


GENERATE_CALLS: list[dict] = []  # every traced generation call's rows, tokens and timing
PEAK_HBM_TBS = {"H100": 3.35, "H200": 4.8}  # HBM bandwidth, SXM datasheet


def _phase() -> str | None:
    """The loop phase (`proposal`, `solving`, ...) that called generate, from the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in ("proposal", "solving", "rollouts", "difficulty"):
            return frame.f_code.co_name
        frame = frame.f_back
    return None


def trace_generate(generate):
    """Print each generation call as it ends (rows, new tokens, seconds, where they went) and
    keep its figures in `GENERATE_CALLS`, with what its decode steps must read
    (`kv_token_reads`: sum over rows and steps of the tokens a row attends to) and the
    adapter slots it used."""

    @functools.wraps(generate)
    def run(*a, **kw):
        timing = kw.setdefault("timing", {})
        phase = _phase()
        slots = list(a[4] if len(a) > 4 else kw.get("slot_ids") or [])
        if kw.get("feed") is not None:  # the slots of the rows it adds count too
            kw["feed"] = _WatchedFeed(kw["feed"], lambda new: slots.extend(p.slot for p in new))
        t0 = time.perf_counter()
        out = generate(*a, **kw)
        sync_cuda()
        dt = time.perf_counter() - t0
        new = sum(len(g.token_ids) for g in out)
        reads = sum(len(g.token_ids) * len(g.prompt_ids)
                    + len(g.token_ids) * (len(g.token_ids) - 1) // 2 for g in out)
        GENERATE_CALLS.append({"phase": phase, "rows": len(out), "new_tokens": new, "s": dt,
                               "kv_token_reads": reads,
                               "slots": len(set(slots)) or None, **timing})
        parts = ", ".join(f"{k} {v:.1f}" for k, v in timing.items() if k.endswith("_s"))
        print(f"[generate] {phase}: {len(out)} rows, {new} new tokens in {dt:.1f} s "
              f"({new / max(dt, 1e-9):.0f} tok/s; batch {timing.get('batch')}, "
              f"{timing.get('steps')} steps: {parts}){_peak()}", flush=True)
        return out

    return run


def decode_cost(model, bank, steps: int, adapters: int, row_steps: int,
                kv_token_reads: int) -> tuple[int, int]:
    """Bytes and FLOPs of `steps` decode steps at their least (docs/performance.md):

        bytes = steps * (W + a * A) + kv_token_reads * K
        flops = 2 * N * row_steps + 4 * L * H * d * kv_token_reads

    W: the frozen weights a step reads (N parameters that multiply, at their width), A: one
    adapter's LoRA weights, a: the adapters the rows use, K: one token's keys and values over
    all layers, L/H/d: layers, query heads, head size."""
    from lorapop.engine.kvcache import kv_bytes_per_token

    cfg = model.config.get_text_config()
    n, item = flop_params(model), next(model.parameters()).dtype.itemsize
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    nbytes = steps * (n * item + adapters * bank.slot_numel * item) \
        + kv_token_reads * kv_bytes_per_token(model)
    flops = 2 * n * row_steps + 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head \
        * kv_token_reads
    return nbytes, flops


def _datasheet(table: dict[str, float]) -> float | None:
    """This GPU's figure in `table` (PEAK_TFLOPS, PEAK_HBM_TBS; None off the GPUs listed)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((v for k, v in table.items() if k in name), None)


def roofline_s(nbytes: int, flops: int) -> float | None:
    """max(bytes / HBM bandwidth, FLOPs / peak dense bf16 FLOP/s) on this GPU (None off the
    GPUs whose datasheet figures are listed)."""
    bw, peak = _datasheet(PEAK_HBM_TBS), _datasheet(PEAK_TFLOPS)
    return max(nbytes / (bw * 1e12), flops / (peak * 1e12)) if bw and peak else None


def prefill_mfu(model, positions: int, seconds: float) -> float | None:
    """A prefill's MFU: 2N FLOPs a prompt position, N the weights without the embeddings (the
    LM head runs for each prompt's last position only), against this GPU's peak."""
    peak = _datasheet(PEAK_TFLOPS)
    if not peak or not seconds:
        return None
    n = flop_params(model) - model.get_output_embeddings().weight.numel()
    return 2 * n * positions / seconds / (peak * 1e12)


def decode_roofline(model, bank, calls: list[dict]) -> dict[str, dict]:
    """Per phase, the decode steps' time against their roofline bound (`decode_cost`,
    `roofline_s`), summed over the phase's steps before the maximum is taken (max of sums <=
    sum of per-step maxima: a lower bound), and the prefills' positions and MFU."""
    out: dict[str, dict] = {}
    for c in calls:
        ph = out.setdefault(c["phase"] or "other", {"prefill_s": 0.0, "prefill_tokens": 0,
                                                     "prefills": 0, "capture_s": 0.0,
                                                     "decode_s": 0.0, "steps": 0, "bytes": 0,
                                                     "flops": 0, "rows": 0})
        steps = c.get("steps", 0)
        for k in ("prefill_s", "prefill_tokens", "prefills", "capture_s", "decode_s"):
            ph[k] += c.get(k, 0)
        ph["steps"] += steps
        ph["rows"] += c["rows"]
        nbytes, flops = decode_cost(model, bank, steps, c["slots"] or 1, c.get("row_steps", 0),
                                    c["kv_token_reads"])
        ph["bytes"] += nbytes
        ph["flops"] += flops
    for ph in out.values():
        ph["ms_per_step"] = 1e3 * ph["decode_s"] / max(1, ph["steps"])
        if (mfu := prefill_mfu(model, ph["prefill_tokens"], ph["prefill_s"])) is not None:
            ph["prefill_mfu"] = mfu
        bound = roofline_s(ph["bytes"], ph["flops"])
        if bound is not None:
            ph["bound_ms_per_step"] = 1e3 * bound / max(1, ph["steps"])
            ph["fraction_of_bound"] = bound / ph["decode_s"] if ph["decode_s"] else None
    return out


def flop_params(model) -> int:
    """Parameters that do a multiply-add per token (all but the input embedding)."""
    emb = model.get_input_embeddings().weight
    tied = emb is model.get_output_embeddings().weight
    return sum(p.numel() for p in model.parameters()) - (0 if tied else emb.numel())


def _save_so_far(save: Callable[[dict], None] | None, rows: list[dict], ab: list[dict]) -> None:
    if save is not None:
        save({"steps": [{k: r[k] for k in ("wall_s", "phase_s", "generated_tokens")} for r in rows],
              "update_ab": ab})


def measure(config: str, overrides: list[str], warmup: int, steps: int, run_dir: Path,
            skip_update: bool = False, update_ab: list[str] | None = None,
            update_trace: bool = False, save: Callable[[dict], None] | None = None) -> dict:
    """One run's timed steps (and the update replays); `save` gets what is measured so far
    after every step and replay, so a call cut by its time limit still returns it."""
    from lorapop.config import load_config
    from lorapop.selfplay.loop import SelfPlay

    cfg = load_config(ROOT / config, overrides)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    counter = UpdateCount()
    _patch("sequence_logprobs", counter)
    sp = SelfPlay(cfg, run_dir)
    if skip_update:  # generation phases only: rewards and ratings, no policy-gradient step
        sp.policy.step = lambda rollouts, rewards: ({}, {}, [None] * len(rollouts))
    n_params = flop_params(sp.parts.model)
    compile_s = warm_compiled(sp.parts.model, sp.parts.bank)
    rows, warm_rows, ab, trace = [], [], [], None
    alloc = allocator_counts()
    last: list = []  # the last policy step's (rollouts, rewards), for the update A/B
    if update_ab or update_trace:
        policy_step = sp.policy.step

        def keep_args(rollouts, rewards):
            last[:] = [rollouts, rewards]
            return policy_step(rollouts, rewards)

        sp.policy.step = keep_args
    GENERATE_CALLS.clear()
    try:
        for i in range(warmup + steps):
            sync_cuda()
            t0 = time.perf_counter()
            row = sp.step()
            sync_cuda()
            row["wall_s"] = time.perf_counter() - t0
            if i >= warmup:
                rows.append(row)
            else:
                warm_rows.append({k: row[k] for k in ("wall_s", "phase_s")})
                counter.reset()
                GENERATE_CALLS.clear()
                alloc = allocator_counts()  # counted from the first timed step on
            print(f"{config} step {i}: {row['wall_s']:.1f}s {row['phase_s']}", flush=True)
            _save_so_far(save, rows, ab)
        timed = (counter.real, counter.forward, counter.padded, counter.micro_batches,
                 counter.checkpointed)
        decode = decode_roofline(sp.parts.model, sp.parts.bank, GENERATE_CALLS)
        alloc = {k: v - alloc.get(k, 0) for k, v in allocator_counts().items()}
        for kernel in update_ab or []:  # the last step's update again, one LoRA kernel each
            sp.parts.bank.kernel = kernel
            counter.reset()
            sync_cuda()
            t0 = time.perf_counter()
            policy_step(*last)
            sync_cuda()
            ab.append({"lora_kernel": kernel, "update_s": time.perf_counter() - t0,
                       "micro_batches": counter.micro_batches, "tokens": counter.real})
            print(f"update again, LoRA kernel {kernel}: {ab[-1]['update_s']:.1f}s", flush=True)
            _save_so_far(save, rows, ab)
        if update_trace:  # the last step's update again, 4 micro-batches (from the 11th) profiled
            per_update = timed[2] // max(1, len(rows))  # micro-batches of one update
            tracer = MicroBatchTrace(min(10, per_update // 3), min(4, max(1, per_update // 3)))
            _patch("sequence_logprobs", tracer)
            policy_step(*last)
            tracer.stop()
            trace = tracer.result
            if trace:
                print(f"update trace: GPU busy {trace['gpu_busy']:.2f} of "
                      f"{trace['wall_ms']:.0f} ms, {trace['kernel_ms']}", flush=True)
    finally:
        sp.close()
        del sp
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    # the replays above counted their micro-batches too: report the timed steps'
    counter.real, counter.forward, counter.padded, counter.micro_batches, counter.checkpointed = timed
    phases = {p: median(r["phase_s"].get(p, 0.0) for r in rows) for p in rows[0]["phase_s"]}
    update_s = sum(r["phase_s"].get("update", 0.0) for r in rows)
    peak = _datasheet(PEAK_TFLOPS)
    ckpt = cfg.model.gradient_checkpointing
    model_flops = 4 * n_params * counter.real  # forward 2N + backward 2N (input grads only)
    return {
        "config": config,
        "overrides": overrides,
        "adapters": len(rows[0]["members"]),
        "wall_s": median(r["wall_s"] for r in rows),
        "phase_s": phases,
        "generated_tokens": rows[0]["generated_tokens"],
        "tokens_per_s": median(r["tokens_per_s"] for r in rows),
        "decode": decode,  # per phase: ms per decode step, its roofline bound and fraction
        "peak_memory_gib": _peak_gib() if cuda else None,  # (net of a --card-gib ballast)
        "compile_s": compile_s,
        "warmup_steps": warm_rows,  # the untimed first steps: one-off costs show against the timed
        "allocator_events": alloc,  # over the timed steps
        "update_ab": ab or None,
        "update_trace": trace,
        "update": None if skip_update else {
            "tokens": counter.real // len(rows),
            "padded_tokens": counter.padded // len(rows),
            "micro_batches": counter.micro_batches // len(rows),
            "checkpointed_micro_batches": counter.checkpointed // len(rows),
            "tokens_per_s": counter.real / update_s if update_s else None,
            "flop_params": n_params,
            "gradient_checkpointing": ckpt,
            "mfu": model_flops / update_s / (peak * 1e12) if update_s and peak else None,
            # the same on the tokens the GPU runs (a shared prompt once, not once per answer)
            "forward_tokens": counter.forward // len(rows),
            "mfu_forward_tokens": 4 * n_params * counter.forward / update_s / (peak * 1e12)
            if update_s and peak else None,
            # a checkpointed micro-batch runs its forward twice: 2N more of its 4N a token
            "hfu_with_recompute": model_flops * (1 + 0.5 * counter.checkpointed
                                                 / max(counter.micro_batches, 1)) / update_s
            / (peak * 1e12) if update_s and peak else None,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/qwen2.5-coder-7b-4v4.yaml")
    ap.add_argument("--baseline", default="configs/azr-7b-baseline.yaml")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 1, --paper 0)")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--tasks-per-cell", type=int, default=12)
    ap.add_argument("--out", default="benchmarks/results/loop_step.json")
    ap.add_argument("--smoke", action="store_true", help="allow a CPU run (to test the script)")
    ap.add_argument("--paper", action="store_true",
                    help="the population config alone at its own sizes (no baseline)")
    ap.add_argument("--max-new-tokens", type=int, help="both generation lengths")
    ap.add_argument("--lengths", help="MEDIAN[:SIGMA[:CAP]]: log-normal row lengths via the "
                    "stop function instead of ignore_eos (sigma 1.0, cap max_new_tokens); "
                    f"--paper's default: {REALISTIC} (--lengths none: every row at the cap)")
    ap.add_argument("--uniform", type=int, default=None,
                    help="--paper: then the same run with every row this many tokens, in the "
                         "same process (default 1024 with --paper's realistic lengths, 0: none)")
    ap.add_argument("--valid", type=float, default=None,
                    help="share of proposals made valid, with a task from the buffer (random "
                         "weights propose none; --paper's default 0.5, else 0)")
    ap.add_argument("--static", action="store_true", help="static batches (no refills)")
    ap.add_argument("--and-static", action="store_true",
                    help="--paper: run again with static batches in the same process and "
                         "report continuous vs static generated tokens/s")
    ap.add_argument("--and-reference", action="store_true",
                    help="--paper: run again with the reference decode attention "
                         "(sampling.attention=sdpa) in the same process, the same rows "
                         "stopping at the same lengths")
    ap.add_argument("--and", dest="and_overrides", action="append", default=[],
                    metavar="'KEY=VALUE ...'",
                    help="--paper: run again with these config overrides in the same process, "
                         "the same rows stopping at the same lengths, and report each phase "
                         "against the headline's (repeatable; e.g. --and sampling.admit_min=16)")
    ap.add_argument("--skip-update", action="store_true",
                    help="generation phases only (no policy-gradient step)")
    ap.add_argument("--seed-dir", help="reuse (or create) the seed tasks and tokenizer here")
    ap.add_argument("--update-ab", help="KERNEL,... after the timed steps, run the last step's "
                    "update again once per listed LoRA kernel (e.g. grouped,auto,grouped,auto): "
                    "the loop's own update compared in one process")
    ap.add_argument("--update-trace", action="store_true",
                    help="after the timed steps, run the last step's update again with "
                         "micro-batches 10-13 profiled (kernel time by kind, GPU busy share)")
    ap.add_argument("--card-gib", type=float,
                    help="hold all but this many GiB of the GPU first, so the engine sizes its "
                         "batches and micro-batches as on a smaller card (e.g. 79.6: an H100 "
                         "80GB's 81,559 MiB, on an H200; same GEMM rate, faster memory)")
    ap.add_argument("overrides", nargs="*", help="extra key.path=value for both runs")
    args = ap.parse_args()
    ballast = hold_all_but(args.card_gib) if args.card_gib and torch.cuda.is_available() else None
    if (args.and_reference or args.and_overrides) and not args.paper:
        ap.error("--and-reference and --and need --paper")
    if args.and_static and (args.static or not args.paper):
        ap.error("--and-static needs --paper and runs the static batches itself (no --static)")
    if not torch.cuda.is_available() and not args.smoke:
        sys.exit("loop_step.py needs a CUDA GPU (or --smoke for a CPU check of the script)")
    tmp = Path(tempfile.mkdtemp())
    common = bench_overrides(Path(args.seed_dir) if args.seed_dir else tmp, args.tasks_per_cell)
    if args.max_new_tokens:
        common += [f"sampling.teacher_max_new_tokens={args.max_new_tokens}",
                   f"sampling.student_max_new_tokens={args.max_new_tokens}"]
    _patch("generate", trace_generate)  # one line per generation call
    if args.static:
        _patch("generate", static_batches)
    if args.paper and args.lengths is None and not args.max_new_tokens:
        args.lengths = REALISTIC  # what a real model's answers look like, at the config's cap
    if args.lengths == "none":
        args.lengths = None
    if args.uniform is None:
        args.uniform = 1024 if args.paper and args.lengths == REALISTIC else 0
    if args.uniform and not args.paper:
        ap.error("--uniform needs --paper")
    if args.lengths:  # lengths follow the prompt (its key), not its batch;
        # EOS stays off (random weights): the drawn length is the only stop
        parts = [*map(float, args.lengths.split(":"))]
        median_len, sigma, cap = [*parts, *[300.0, 1.0, 0.0][len(parts):]][:3]
        lengths = length_stop(median_len, sigma, int(cap) or None)
        _patch("generate", lengths)
    if args.valid is None:
        args.valid = 0.5 if args.paper else 0.0
    if not 0 <= args.valid <= 1:
        ap.error("--valid is a share in [0, 1]")
    if args.valid:
        valid_share(args.valid)
    common += args.overrides
    if args.warmup is None:
        args.warmup = 0 if args.paper else 1
    result = {
        "benchmark": "loop_step --paper" if args.paper else "loop_step",
        "lengths": f"log-normal {args.lengths} (median:sigma:cap)" if args.lengths
        else f"uniform {args.max_new_tokens or 'cap'} (ignore_eos)",
        "valid_proposals": args.valid,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "skip_update": args.skip_update,
        "card_gib": args.card_gib if ballast is not None else None,
        "ballast_gib": _BALLAST_BYTES / 2**30 if ballast is not None else None,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if (args.update_ab or args.update_trace) and args.skip_update:
        ap.error("--update-ab and --update-trace need the update (no --skip-update)")
    kernels = args.update_ab.split(",") if args.update_ab else None
    if kernels and not set(kernels) <= {"auto", *KERNELS}:
        ap.error(f"--update-ab: LoRA kernels are auto, {', '.join(KERNELS)}")

    def so_far(rec: dict) -> None:  # replaced by the whole record when the run ends
        tmp_out = out.with_name(out.name + ".tmp")  # a kill mid-write leaves the last whole one
        tmp_out.write_text(json.dumps({**result, "population_so_far": rec}, indent=1))
        tmp_out.replace(out)

    result["population"] = pop = measure(args.config, common, args.warmup, args.steps,
                                         tmp / "pop", args.skip_update, kernels,
                                         args.update_trace, so_far)
    if args.paper:
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps(pop, indent=1))

        def again(name: str, overrides: list[str], drawn: bool = True) -> dict:
            """The population run once more in this process, recorded under `name`; `drawn`:
            the same rows stop at the same lengths as in the headline run."""
            if args.lengths:
                lengths.active[0] = drawn
            result[name] = measure(args.config, [*common, *overrides], args.warmup, args.steps,
                                   tmp / name, args.skip_update)
            out.write_text(json.dumps(result, indent=1))
            print(json.dumps(result[name], indent=1))
            return result[name]

        if args.uniform:  # the headline's realistic mix, then uniform rows beside it
            again("uniform", [f"sampling.teacher_max_new_tokens={args.uniform}",
                              f"sampling.student_max_new_tokens={args.uniform}"], drawn=False)
            result["uniform"]["lengths"] = f"uniform {args.uniform} (ignore_eos)"
            out.write_text(json.dumps(result, indent=1))
        if args.and_reference:
            ref = again("reference", ["sampling.attention=sdpa"])
            result["kernel_vs_reference"] = {
                p: ref["phase_s"][p] / pop["phase_s"][p] for p in ("proposal", "solving")}
            out.write_text(json.dumps(result, indent=1))
        for spec in args.and_overrides:
            run = again(f"with {spec}", spec.split())
            result.setdefault("with_vs_headline", {})[spec] = {
                "step": run["wall_s"] / pop["wall_s"],
                **{p: run["phase_s"][p] / pop["phase_s"][p]
                   for p in ("proposal", "verification", "solving", "update")
                   if pop["phase_s"].get(p)}}
            out.write_text(json.dumps(result, indent=1))
        if args.and_static:
            _patch("generate", static_batches)
            static = again("static", [])
            result["continuous_vs_static"] = pop["tokens_per_s"] / static["tokens_per_s"]
            out.write_text(json.dumps(result, indent=1))
            print(f"continuous vs static generated tokens/s: {result['continuous_vs_static']:.2f}x")
        return
    out.write_text(json.dumps(result, indent=1))  # the population's part if the baseline dies
    result["baseline"] = base = measure(args.baseline, common, args.warmup, args.steps,
                                        tmp / "base", args.skip_update)
    result["wall_ratio"] = pop["wall_s"] / base["wall_s"]
    result["phase_ratio"] = {p: pop["phase_s"][p] / base["phase_s"][p]
                             for p in pop["phase_s"] if base["phase_s"].get(p)}
    out.write_text(json.dumps(result, indent=1))
    print(f"\n{'phase':14s} {'population':>11s} {'baseline':>9s} {'ratio':>6s}")
    for p, v in pop["phase_s"].items():
        b = base["phase_s"].get(p, 0.0)
        print(f"{p:14s} {v:11.2f} {b:9.2f} {v / b if b else float('nan'):6.2f}")
    print(f"{'wall':14s} {pop['wall_s']:11.2f} {base['wall_s']:9.2f} {result['wall_ratio']:6.2f}")
    print(f"peak GiB: population {pop['peak_memory_gib']}, baseline {base['peak_memory_gib']}")


if __name__ == "__main__":
    main()
