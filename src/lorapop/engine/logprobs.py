"""Teacher-forced log-probabilities of completions: what the policy-gradient loss needs.

Each row is laid out as [left padding, prompt, completion, right padding], with position ids
that count real tokens only, so a row scores the same as it would alone and as it did while
`generate` sampled it. Logits are computed for the completion positions only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lorapop.engine.decoder import route


def sequence_logprobs(
    model: Any,
    bank: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    slot_ids: Sequence[int] | torch.Tensor,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(completion token | prefix) per token, each row under its adapter slot.

    Returns `(logprobs, mask)`, both [B, T] with T the longest completion; completions are
    right-aligned to the prompt (column j is completion token j) and `mask` marks real
    tokens (padding has logprob 0). Differentiable when called with grad enabled.
    `chunk_size` bounds how many positions' float32 log-softmax is formed at once.
    """
    b = len(prompt_ids)
    if len(completion_ids) != b or len(slot_ids) != b:
        raise ValueError("prompt_ids, completion_ids and slot_ids must have the same length")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    dev = next(model.parameters()).device
    width = max((len(p) for p in prompt_ids), default=0)
    t = max((len(c) for c in completion_ids), default=0)
    if b == 0 or t == 0:
        empty = torch.zeros(b, t, device=dev)
        return empty, empty.bool()
    ids = torch.zeros(b, width + t, dtype=torch.long)
    real = torch.zeros(b, width + t, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        ids[i, width - len(p) : width + len(c)] = torch.as_tensor([*p, *c], dtype=torch.long)
        real[i, width - len(p) : width + len(c)] = True
    ids, real = ids.to(dev), real.to(dev)
    slots = torch.as_tensor(slot_ids, dtype=torch.long, device=dev)
    positions = (real.long().cumsum(1) - 1).clamp_(min=0)
    with route(bank, slots):
        logits = model(
            input_ids=ids,
            attention_mask=real.long(),
            position_ids=positions,
            use_cache=False,
            logits_to_keep=t + 1,
        ).logits[:, :-1]
    target = ids[:, width:]
    parts = []
    for s in range(0, t, chunk_size):
        x = logits[:, s : s + chunk_size].float()
        picked = x.gather(-1, target[:, s : s + chunk_size, None]).squeeze(-1)
        parts.append(picked - torch.logsumexp(x, dim=-1))
    mask = real[:, width:]
    return torch.cat(parts, dim=1).masked_fill(~mask, 0.0), mask
