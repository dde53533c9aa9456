"""The policy-gradient loss: REINFORCE with TRR++ advantages, aggregated per adapter.

Per response token the loss is ``-A * logp`` (``A``: the sequence's advantage), whose
gradient is REINFORCE's ``-A grad logp``. Every batch is sampled, trained on by one
optimiser step and dropped, so the update is on-policy: there is no importance ratio, hence
nothing for a PPO clip to clip.

Aggregation is token-mean (AZR's default): the sum of token losses over the number of
response tokens. With ``groups`` (one id per row, e.g. its adapter slot) the mean is taken
*within each group* and the group losses are summed. Since a row only depends on its own
adapter's weights, every adapter then receives exactly the gradient it would get if its rows
were trained alone; with a single batch-wide mean instead, an adapter's step would shrink as
other adapters add rows.

For micro-batching, compute ``group_token_counts`` on the whole batch's mask and pass them to
each micro-batch; the sum of the micro-batch losses then equals the whole-batch loss.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _groups(mask: Tensor, groups: Tensor | None) -> Tensor:
    """The rows' group ids. Ids on the host are checked here; ids on an accelerator only where
    they are read back anyway (`group_token_counts`, once per batch): reading them in every
    micro-batch's loss would make the host wait for every kernel queued before it."""
    if groups is None:
        return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    if groups.dim() != 1 or groups.shape[0] != mask.shape[0]:
        raise ValueError(f"groups must be [batch]={mask.shape[0]}, got {tuple(groups.shape)}")
    if groups.device.type == "cpu" and groups.numel() and int(groups.min()) < 0:
        raise ValueError("group ids must be >= 0")
    return groups.long()


def group_token_counts(
    mask: Tensor, groups: Tensor | None = None, n_groups: int | None = None
) -> Tensor:
    """Number of response tokens of each group id (at least `n_groups` entries)."""
    g = _groups(mask, groups)
    lo, hi = torch.stack(torch.aminmax(g)).tolist() if g.numel() else (0, -1)
    if lo < 0:
        raise ValueError("group ids must be >= 0")
    size = max(hi + 1, n_groups or 0)
    tokens = mask.to(torch.float32).sum(dim=1)
    return torch.zeros(size, device=mask.device).index_add_(0, g, tokens)


def row_losses(
    token_loss: Tensor,
    mask: Tensor,
    groups: Tensor | None = None,
    token_counts: Tensor | None = None,
) -> Tensor:
    """Each row's share of the loss [B]; their sum is the sum over groups of group losses.

    Given `token_counts` (from `group_token_counts` on the whole batch), ids on an accelerator
    are not read back: a micro-batch's loss queues behind its forward instead of waiting for
    it, and the host goes on to lay out the next micro-batch."""
    m = mask.to(token_loss.dtype)
    g = _groups(mask, groups)
    counts = group_token_counts(mask, groups) if token_counts is None else token_counts
    return (token_loss * m).sum(dim=1) / counts.to(token_loss.dtype)[g].clamp(min=1.0)


def policy_loss(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    groups: Tensor | None = None,
    token_counts: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The loss to minimise (scalar) and each row's detached share of it [B].

    ``logprobs`` and ``mask`` are [B, T] (mask: 1 on response tokens); ``advantages`` is per
    sequence [B] or per token [B, T].
    """
    if logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and mask {tuple(mask.shape)} differ in shape"
        )
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    token_loss = -advantages.to(logprobs.dtype) * logprobs
    rows = row_losses(token_loss, mask, groups, token_counts)
    return rows.sum(), rows.detach()
