"""How many decode rows fit, and whether the update may keep every activation: upper
estimates of the generation and update phases' device memory (and the host's free memory, for
training on a CPU).

Generation holds, per row, the KV cache of `length` tokens, the sampler's float copies of a
vocabulary-wide logit row (twice: the captured decode step's pool and the prefill's), the
output buffers and one token's activations; and once, the activations of one prefill forward
(`prefill_tokens` tokens). The update phase needs none of this at the same time: `generate`
frees its cache and graph pool before returning, so only memory free *now* is budgeted.

The update (teacher-forced forward + backward) without activation checkpointing keeps each
layer's activations of every token until the backward: about layers x (10 hidden + 4
intermediate + 2 kv_heads x head_dim) values per token through eager passes (norms, q/k/v/o,
attention output, gate/up/act/product, LoRA inputs; keys and values once per head group, as
SDPA's grouped-query kernels and the pack attention keep them). The fused passes
(`engine/fused`) keep less: the SwiGLU no act (3 intermediate), the rotary no rotated halves
and the one-kernel norms on CUDA their input alone, so with both fused the estimate counts 8
hidden widths (Qwen2.5-7B on an H200: 6.6 measured, 4.57 MB a token for unshared rows against
the estimate's 4.85; 5.25 with 10). LoRA dropout adds each target's dropped input and mask.
With checkpointing only each layer's input stays;
recomputing costs one more forward (1.4-1.6x the time on an H100), so it pays only when
memory is short.

Every estimate here is of *allocated* bytes. PyTorch's default caching allocator keeps freed
blocks in fixed segments: after a generation phase and micro-batches of every width, a request
can fail with many GiB free but cut into pieces (a log-normal length mix ran the 7B paper config
out of memory on an 80 GB card, in its first update, with ~20 GiB reserved but unallocated).
`configure_allocator` therefore turns on expandable segments (segments that grow and shrink in
place, so freed memory stays usable at any size) before CUDA starts, unless the user configured
the allocator (`PYTORCH_ALLOC_CONF` / `PYTORCH_CUDA_ALLOC_CONF`: theirs is kept). With them,
the update plans for `UPDATE_MARGIN` of the free memory rather than generation's 0.9: what the
margin guarded against was mostly fragmentation, and the estimates above are upper bounds (a
7B update's micro-batches of every length mix peaked at 94-99% of the estimate for the widest
of them, <= 95.8% of the plan's budget on an 80 GB card:
`benchmarks/results/update_memory_sweep_h200_80gb.json`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from lorapop.engine.fused import mlps_fused, rotary_fused
from lorapop.engine.kvcache import kv_bytes_per_token, kv_shape
from lorapop.engine.pack_attention import PAD_SLACK

log = logging.getLogger(__name__)
GIB = 2**30
_SAMPLER_FLOATS = 12  # float32 [V] temporaries per sampled row, top-p sort included
_logged: set[tuple] = set()
#: The allocator setting lorapop applies when the user set none (see the module's docstring).
ALLOC_CONF = "expandable_segments:True"
_ALLOC_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
#: The share of free memory the update's plan uses under expandable segments (else 0.9)
UPDATE_MARGIN = 0.95


def configure_allocator() -> str:
    """Expandable segments for the CUDA caching allocator unless the user chose a setting;
    returns the setting in effect ('' when the user's environment decides). Before CUDA starts
    the environment variable does it; once started (a caller allocated first), the allocator's
    runtime setter, which applies to the segments made from then on (the variable is set
    too: the environment names the setting in effect either way)."""
    user = _alloc_conf()
    if user is not None:
        return user
    if torch.cuda.is_initialized():
        # private in torch 2.11-2.14 under two names; both parse the variable's syntax
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        (setter or torch.cuda.memory._set_allocator_settings)(ALLOC_CONF)
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    return ALLOC_CONF


def _alloc_conf() -> str | None:
    return next((os.environ[k] for k in _ALLOC_ENV if os.environ.get(k)), None)


def expandable_segments() -> bool:
    """Whether the CUDA allocator's setting in effect has expandable segments."""
    return "expandable_segments:true" in (_alloc_conf() or "").replace(" ", "").lower()


class GenerationMemoryError(ValueError):
    """Not even one row of the requested generation fits in memory (one-line message)."""


def _dims(model: Any) -> tuple[int, int, int, int, int]:
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    inter = getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size
    return cfg.hidden_size, inter, heads, head_dim, cfg.vocab_size


def row_bytes(model: Any, length: int, steps: int) -> int:
    """Device bytes one decode row adds (cache, sampler, buffers, activations)."""
    hidden, inter, heads, head_dim, vocab = _dims(model)
    item = next(model.parameters()).dtype.itemsize
    cache = kv_bytes_per_token(model) * length
    sampler = 2 * vocab * (item + 4 * _SAMPLER_FLOATS)
    buffers = steps * 4 + (steps + 1) * 12 + length + 64
    activations = (12 * hidden + 3 * inter) * item + 2 * heads * length * 4
    return cache + sampler + buffers + activations


def prefill_bytes(model: Any, length: int, prefill_tokens: int) -> int:
    """Device bytes of one prefill forward of `prefill_tokens` tokens (chunk keys included)."""
    hidden, inter, heads, head_dim, _ = _dims(model)
    item = next(model.parameters()).dtype.itemsize
    per_token = (6 * hidden + 4 * inter + kv_bytes_per_token(model) // item) * item
    gathered = 4 * heads * head_dim * length * item  # a later chunk's keys and values
    return 2 * prefill_tokens * per_token + gathered


def free_memory(model: Any, margin: float = 0.9) -> int | None:
    """Bytes generation may use on the model's device (None on CPU: no limit).

    The driver's free memory plus what PyTorch's allocator holds unused, times `margin`
    (fragmentation and kernels' workspaces).
    """
    dev = next(model.parameters()).device
    if dev.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(dev)
    unused = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    return int((free + unused) * margin)


def update_budget(model: Any, share: float | None = None) -> int | None:
    """Bytes the update may plan for (`plan_update`; None on CPU): `free_memory` at `share`,
    by default `UPDATE_MARGIN` under expandable segments and 0.9 under an allocator whose
    fragmentation is unknown."""
    if share is None:
        share = UPDATE_MARGIN if expandable_segments() else 0.9
    return free_memory(model, share)


def fit_batch(
    model: Any, want: int, length: int, steps: int, prefill_tokens: int, budget: int | None
) -> int:
    """The largest batch <= `want` whose generation memory stays within `budget` bytes.

    Raises `GenerationMemoryError` when not even one row fits; logs once per (want, length,
    fit) when the batch is lowered.
    """
    if budget is None:
        return want
    fixed = prefill_bytes(model, length, prefill_tokens)
    per_row = row_bytes(model, length, steps)
    fit = (budget - fixed) // per_row
    if fit < 1:
        raise GenerationMemoryError(
            f"one sampling row needs {(fixed + per_row) / GIB:.2f} GiB (a {length}-token KV "
            f"cache, {prefill_tokens}-token prefill) but {budget / GIB:.2f} GiB are free: "
            "shorten the prompts or *_max_new_tokens, or lower the prefill chunk"
        )
    if fit < want and (want, length, fit) not in _logged:
        _logged.add((want, length, fit))
        log.warning(
            "sampling batch lowered from %d to %d rows: %d-token KV cache, %.1f GiB free",
            want, fit, length, budget / GIB,
        )  # fmt: skip
    return int(min(want, fit))


def activation_bytes_per_token(layers: int, hidden: int, inter: int, kv_heads: int,
                               head_dim: int, item: int, kept_inter: int = 4,
                               kept_hidden: int = 10) -> int:
    """Activation bytes one token keeps through a training forward without checkpointing, for
    a model of these dimensions (the module's note: `kept_hidden` hidden-wide and `kept_inter`
    intermediate-wide values a layer, keys and values once per head group)."""
    return layers * (kept_hidden * hidden + kept_inter * inter + 2 * kv_heads * head_dim) * item


def update_bytes_per_token(model: Any) -> int:
    """Activation bytes one token keeps through an update forward without checkpointing."""
    hidden, inter, *_ = _dims(model)
    layers, kv_heads, head_dim = kv_shape(model)
    item = next(model.parameters()).dtype.itemsize
    swiglu = mlps_fused(model)
    kept_inter = 3 if swiglu else 4  # the fused SwiGLU keeps no silu(gate)
    # 8 as measured with CUDA's one-kernel norms (a CPU update plans no budget)
    kept_hidden = 8 if swiglu and rotary_fused(model) else 10
    return activation_bytes_per_token(layers, hidden, inter, kv_heads, head_dim, item,
                                      kept_inter, kept_hidden) + _dropout_bytes_per_token(model)


def _dropout_bytes_per_token(model: Any) -> int:
    """What LoRA dropout keeps a token for the backward: each target projection's dropped copy
    of its input and the mask (counted as two values of the model's dtype; a bool mask on CUDA
    is half a bf16 value). At 7B, 28 x (6 hidden + 1 intermediate) inputs: ~4.5 MB a token,
    nearly as much again as the rest of the estimate; an H200 kept ~2 MB more a token with
    dropout 0.05 (peaks at 71-72% of the plan's estimate), so this errs on the safe side."""
    bank = getattr(model, "_lorapop_bank", None)  # the attached `lora.bank.AdapterBank`
    if bank is None or not bank.dropout:
        return 0
    item = next(model.parameters()).dtype.itemsize
    return 2 * item * sum(t.module.in_features for t in bank.targets.values())


def pack_overhead(model: Any) -> tuple[float, float]:
    """What a shared pack's attention keeps beyond its tokens (`engine/pack_attention`), in
    tokens' worth of `update_bytes_per_token`: per completion token, its padded query and
    output and its gathered key and value (up to `PAD_SLACK` x the real ones), plus a third
    query width (a 7B's packs kept ~1.3x those four without padding: 10.7k values a completion
    token and layer against 8.2k); per prompt token and completion, the prompt's key and value
    gathered for that completion's call."""
    _, _, heads, _, _ = _dims(model)
    layers, kv_heads, head_dim = kv_shape(model)
    item = next(model.parameters()).dtype.itemsize
    per_token = update_bytes_per_token(model)
    q_width = heads * head_dim
    kv = 2 * kv_heads * head_dim
    return (layers * item * PAD_SLACK * (3 * q_width + kv) / per_token,
            layers * item * kv / per_token)


def host_free_memory() -> int | None:
    """Bytes of host memory available now (Linux), else the machine's total; None: unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def update_fixed_bytes(model: Any, head_chunk: int, compiled_head: bool = False) -> int:
    """Bytes an update micro-batch needs besides its activations: the chunked LM head's logits
    of `head_chunk` positions. Eager: the logits (model dtype), their float32 copy, the
    log-softmax and their gradients. Compiled (`logprobs.head_compiled`): the logits and their
    gradient in the model's dtype alone, the float32 work staying inside the fused kernels: a
    quarter of eager's at 7B in bf16 (1.2 against 4.7 GiB for 2,048 positions of a 152k
    vocabulary, so an 80 GB card's micro-batch fits two of the paper's 4,596-token packs)."""
    *_, vocab = _dims(model)
    item = next(model.parameters()).dtype.itemsize
    return head_chunk * vocab * (2 * item + (0 if compiled_head else 3 * 4))


#: Below this many tokens a micro-batch without checkpointing is too small to be worth it.
MIN_KEEP_TOKENS = 2048


def plan_update(model: Any, longest: int, max_tokens: int, head_chunk: int,
                budget: int | None, compiled_head: bool = False) -> tuple[int, int]:
    """`(keep_tokens, micro_batch_tokens)` for an update whose longest sequence has `longest`
    tokens: a micro-batch of at most `keep_tokens` padded tokens runs with every activation
    kept (no checkpointing), a larger one (a sequence longer than that, alone) checkpoints.
    `keep_tokens` is what fits `budget` bytes, and micro-batches are sized to it (at most
    `max_tokens`); 0 when fewer than `MIN_KEEP_TOKENS` (and the longest) fit or there is no
    budget (CPU): then every micro-batch checkpoints, `max_tokens` each. Logs each choice once
    (micro-batch tokens follow the free memory from update to update)."""
    fixed = update_fixed_bytes(model, head_chunk, compiled_head)
    fit = 0 if budget is None else int((budget - fixed) // max(1, update_bytes_per_token(model)))
    keep = fit if fit >= min(longest, MIN_KEEP_TOKENS) else 0
    plan = (keep, min(max_tokens, keep) if keep else max_tokens)
    how = "without" if keep >= longest else "partly with" if keep else "with"
    if ("update", how, budget is None) not in _logged:
        _logged.add(("update", how, budget is None))
        free = "no memory limit" if budget is None else f"{budget / GIB:.1f} GiB free"
        log.info("update: %s activation checkpointing, micro-batches of <= %d tokens (%s, "
                 "longest sequence %d)", how, plan[1], free, longest)
    return plan
