"""Teacher-forced log-probabilities of completions: what the policy-gradient loss needs.

Each row is laid out as [prompt, completion, right padding] with position ids 0..n-1, exactly
as `generate` cached it, so a row scores the same as it would alone and as it did while it
was sampled. Padding only ever follows a row's real tokens, so plain causal attention needs no
padding mask: SDPA takes its fused causal kernel (FlashAttention on CUDA). Only the final
hidden states of the completion positions go through the LM head, a chunk of positions at a
time under activation checkpointing: the [tokens, vocabulary] logits never exist whole, in
the forward or the backward.

`micro_batches` cuts rows into length-grouped micro-batches of a bounded padded-token count,
so the update wastes little compute on padding and runs as few forwards as memory allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from lorapop.engine.decoder import route


def micro_batches(lengths: Sequence[int], max_tokens: int, max_rows: int) -> list[list[int]]:
    """Row indices grouped by length: each group's rows x longest row <= `max_tokens` (a
    longer row goes alone) and at most `max_rows` rows; rows keep their order in a group."""
    if max_tokens < 1 or max_rows < 1:
        raise ValueError(f"max_tokens and max_rows must be >= 1, got {max_tokens}, {max_rows}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and len(groups[-1]) < max_rows:
            widest = lengths[groups[-1][0]]
            if (len(groups[-1]) + 1) * widest <= max_tokens:
                groups[-1].append(i)
                continue
        groups.append([i])
    return [sorted(g) for g in groups]


def _token_logprobs(head: torch.nn.Module, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    picked = logits.gather(-1, target[..., None]).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def sequence_logprobs(
    model: Any,
    bank: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    slot_ids: Sequence[int] | torch.Tensor,
    chunk_size: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(completion token | prefix) per token, each row under its adapter slot.

    Returns `(logprobs, mask)`, both [B, T] with T the longest completion; column j is
    completion token j and `mask` marks real tokens (padding has logprob 0). Differentiable
    when called with grad enabled. `chunk_size` bounds how many positions' logits (over all
    rows) are formed at once.
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
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True))
    ids = torch.zeros(b, width, dtype=torch.long)
    target = torch.zeros(b, t, dtype=torch.long)
    at = torch.zeros(b, t, dtype=torch.long)  # position whose output predicts column j
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        ids[i, : len(p) + len(c)] = torch.as_tensor([*p, *c], dtype=torch.long)
        target[i, : len(c)] = torch.as_tensor(list(c), dtype=torch.long)
        at[i] = torch.arange(len(p) - 1, len(p) - 1 + t).clamp_(max=width - 1)
        mask[i, : len(c)] = True
    ids, target, at, mask = ids.to(dev), target.to(dev), at.to(dev), mask.to(dev)
    slots = torch.as_tensor(slot_ids, dtype=torch.long, device=dev)
    with route(bank, slots):
        hidden = model.get_decoder()(
            input_ids=ids,
            position_ids=torch.arange(width, device=dev).expand(b, -1),
            use_cache=False,
        ).last_hidden_state
    hidden = hidden.gather(1, at[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, T, h]
    head = model.get_output_embeddings()
    rows = max(1, chunk_size // b)  # positions per chunk, so a chunk holds ~chunk_size rows
    parts = []
    for s in range(0, t, rows):
        h, y = hidden[:, s : s + rows], target[:, s : s + rows]
        if torch.is_grad_enabled():
            parts.append(checkpoint(_token_logprobs, head, h, y, use_reentrant=False))
        else:
            parts.append(_token_logprobs(head, h, y))
    return torch.cat(parts, dim=1).masked_fill(~mask, 0.0), mask
