"""Teacher-forced log-probabilities of completions: what the policy-gradient loss needs.

Each row is laid out as [prompt, completion, right padding] with position ids 0..n-1, exactly
as `generate` cached it, so a row scores the same as it would alone and as it did while it
was sampled. Padding only ever follows a row's real tokens, so plain causal attention needs no
padding mask: SDPA takes its fused causal kernel (FlashAttention on CUDA). Only the final
hidden states of the completion positions go through the LM head, a chunk of positions at a
time under activation checkpointing: the [tokens, vocabulary] logits never exist whole, in
the forward or the backward.

How rows are grouped into micro-batches and packs is the update's choice
(`lorapop.selfplay.update`).

Prompt sharing: a student answers each task several times under one adapter, so several rows
share their prompt and slot. With `share_prompts` such rows go through the model as one
sequence [prompt, c1, ..., ck] (position ids restart after the prompt for each completion) in
which each completion sees the prompt and its own earlier tokens only (`pack_attention`: fused
SDPA kernels piecewise, no mask): the same log-probs and gradients, with the prompt computed
once. Rows sharing nothing keep the plain causal path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lorapop.engine import pack_attention
from lorapop.engine.decoder import route
from lorapop.engine.fused import compile_failures, fast_pass
from lorapop.engine.patches import use_pack_attention
from lorapop.engine.transfer import host_to_device

HEAD_CHUNK = 2048  # positions whose logits are formed at once (memory.update_fixed_bytes)


def shared_prompt_packs(prompt_ids: Sequence[Sequence[int]],
                        slot_ids: Sequence[int]) -> list[list[int]]:
    """Row indices grouped by identical (prompt, slot), groups in order of first appearance."""
    packs: dict[tuple, list[int]] = {}
    for i, (p, s) in enumerate(zip(prompt_ids, slot_ids, strict=True)):
        packs.setdefault((int(s), tuple(p)), []).append(i)
    return list(packs.values())


def pack_widths(packs: Sequence[Sequence[int]], prompt_ids: Sequence[Sequence[int]],
                completion_ids: Sequence[Sequence[int]],
                overhead: tuple[float, float] | None = None) -> list[int]:
    """Tokens of each pack's sequence: its prompt once plus every completion. With
    `overhead` (`memory.pack_overhead`), a shared pack's width in memory instead: plus what its
    attention keeps beyond its tokens, in tokens' worth."""
    return [pack_width(len(prompt_ids[g[0]]), [len(completion_ids[i]) for i in g], overhead)
            for g in packs]


def pack_width(prompt: int, lengths: Sequence[int], overhead: tuple[float, float] | None) -> int:
    """A pack's tokens, plus (when shared) `overhead`'s (per completion token, per prompt
    token per completion) tokens' worth of the attention's padded queries and gathered keys."""
    width = prompt + sum(lengths)
    if overhead is None or len(lengths) < 2:
        return width
    per_completion, per_prompt_key = overhead
    return width + math.ceil(per_completion * sum(lengths) + per_prompt_key * len(lengths) * prompt)


def _pick_and_lse(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's target logit and log-sum-exp, in float32."""
    x = logits.float()
    return x.gather(-1, target[..., None]).squeeze(-1), torch.logsumexp(x, dim=-1)


def _logits_grad(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                 g: torch.Tensor) -> torch.Tensor:
    """d(sum g * log_softmax(logits)[target]) / d logits = g * (onehot(target) - softmax)."""
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (vocab == target[..., None]).float()
    return ((onehot - torch.exp(logits.float() - lse[..., None])) * g[..., None]).to(logits.dtype)


def head_compiled(model: Any) -> bool:
    """Whether `model`'s LM-head passes run compiled (on CUDA, `fused.fast_pass`, unless the
    compiler failed on them): `memory.update_fixed_bytes` then reserves a quarter of the eager
    passes' memory. Eager, the float32 cast, the log-sum-exp and its gradient each make
    full-size copies (~15% of an update micro-batch at 7B with a 152k vocabulary); compiled,
    the forward is one reduction and the gradient one elementwise kernel."""
    on_cuda = next(model.parameters()).is_cuda
    failed = {_pick_and_lse.__qualname__, _logits_grad.__qualname__} & compile_failures
    return on_cuda and not failed


class _HeadLogprobs(torch.autograd.Function):
    """log pi(target) through the LM head without keeping the [positions, vocabulary] logits:
    the backward recomputes them from the hidden states (activation checkpointing by hand,
    so the compiled passes run in the backward too; torch's checkpoint recomputes with the
    compiler off)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                target: torch.Tensor) -> torch.Tensor:
        # [positions, h]: one dynamic dimension, so the compiled passes rarely recompile
        h, y = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
        picked, lse = fast_pass(_pick_and_lse, F.linear(h, weight, bias), y)
        ctx.save_for_backward(h, weight, bias, y, lse)
        ctx.shape = hidden.shape
        return (picked - lse).view(target.shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, weight, bias, y, lse = ctx.saved_tensors
        grad = fast_pass(_logits_grad, F.linear(h, weight, bias), y, lse, g.reshape(-1))
        need = ctx.needs_input_grad
        return ((grad @ weight).view(ctx.shape) if need[0] else None,
                grad.T @ h if need[1] else None,
                grad.sum(0) if need[2] else None, None)


def head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """log pi(target) [..] from final hidden states [.., h] through the LM head (a Linear);
    compiled on CUDA (`fused.fast_pass`)."""
    return _HeadLogprobs.apply(hidden, head.weight, getattr(head, "bias", None), target)


def sequence_logprobs(
    model: Any,
    bank: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    slot_ids: Sequence[int] | torch.Tensor,
    chunk_size: int = HEAD_CHUNK,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(completion token | prefix) per token, each row under its adapter slot.

    Returns `(logprobs, mask)`, both [B, T] with T the longest completion; column j is
    completion token j and `mask` marks real tokens (padding has logprob 0). Differentiable
    when called with grad enabled. `chunk_size` bounds how many positions' logits (over all
    rows) are formed at once. `share_prompts` packs rows of one prompt and slot together.
    Given `slot_ids` on the host (a list), the call never waits for the GPU, so a loop of
    micro-batches keeps it busy; a device tensor of ids is read back first.
    """
    b = len(prompt_ids)
    if len(completion_ids) != b or len(slot_ids) != b:
        raise ValueError("prompt_ids, completion_ids and slot_ids must have the same length")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    dev = next(model.parameters()).device
    t = max((len(c) for c in completion_ids), default=0)
    if b == 0 or t == 0:
        empty = torch.zeros(b, t, device=dev)
        return empty, empty.bool()
    slot_list = slot_ids.tolist() if isinstance(slot_ids, torch.Tensor) else list(slot_ids)
    packs = shared_prompt_packs(prompt_ids, slot_list) if share_prompts else [[i] for i in range(b)]
    shared = any(len(g) > 1 for g in packs)
    width = max(pack_widths(packs, prompt_ids, completion_ids))
    n = len(packs)
    ids = torch.zeros(n, width, dtype=torch.long)
    pos = torch.zeros(n, width, dtype=torch.long)
    target = torch.zeros(b, t, dtype=torch.long)
    at = torch.zeros(b, t, dtype=torch.long)  # flat position whose output predicts column j
    mask = torch.zeros(b, t, dtype=torch.bool)
    for s, g in enumerate(packs):
        p = prompt_ids[g[0]]
        ids[s, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        pos[s, : len(p)] = torch.arange(len(p))
        start = len(p)
        for i in g:
            c = completion_ids[i]
            end = start + len(c)
            ids[s, start:end] = torch.as_tensor(list(c), dtype=torch.long)
            pos[s, start:end] = torch.arange(len(p), len(p) + len(c))
            target[i, : len(c)] = torch.as_tensor(list(c), dtype=torch.long)
            at[i, : len(c)] = s * width + torch.arange(start - 1, end - 1)
            at[i, 0] = s * width + len(p) - 1  # the first token follows the prompt
            mask[i, : len(c)] = True
            start = end
    # queued copies: the host lays out the next micro-batch while the GPU runs this one
    ids, target, at, mask = (host_to_device(x, dev) for x in (ids, target, at, mask))
    # no mask step (`maskless`): the all-ones padding mask only stops transformers searching
    # the position ids for packed sequences; packs attend through their layout, lone rows
    # causally (padding only follows real tokens)
    use_pack_attention(model)
    extra: dict[str, Any] = {"attention_mask": torch.ones(n, width, dtype=torch.long, device=dev)}
    if shared:
        extra["pack_layout"] = pack_attention.PackLayout.build(
            [len(prompt_ids[g[0]]) for g in packs],
            [[len(completion_ids[i]) for i in g] for g in packs], width, dev)
        pos = host_to_device(pos, dev)
    else:  # one row per sequence: positions run on into the padding, as generated
        pos = torch.arange(width, device=dev).expand(n, -1)
    # slot ids on the host: route checks them there and queues their copy
    slots = torch.as_tensor([slot_list[g[0]] for g in packs], dtype=torch.long)
    with route(bank, slots), pack_attention.maskless():
        hidden = model.get_decoder()(
            input_ids=ids, position_ids=pos, use_cache=False, **extra,
        ).last_hidden_state
    hidden = hidden.flatten(0, 1)[at]  # [B, T, h]
    head = model.get_output_embeddings()
    rows = max(1, chunk_size // b)  # positions per chunk, so a chunk holds ~chunk_size rows
    parts = [head_logprobs(head, hidden[:, s : s + rows], target[:, s : s + rows])
             for s in range(0, t, rows)]
    return torch.cat(parts, dim=1).masked_fill(~mask, 0.0), mask
