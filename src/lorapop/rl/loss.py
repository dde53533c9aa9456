"""The policy-gradient loss: PPO-clip on per-token log-probabilities, aggregated per adapter.

``ratio = exp(logp - logp_old)``; per token the loss is
``max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps_high))``. On the first update after
sampling ``logp == logp_old`` and ratio is 1, so the gradient is REINFORCE's
``-A grad logp``; clipping only matters for later updates on the same samples.

Aggregation (``agg``), as AZR/veRL:

- ``"token-mean"``: the sum of token losses over the number of response tokens (each
  token weighs the same; AZR's default);
- ``"seq-mean-token-mean"``: each sequence's token mean, averaged over sequences.

Joint training of many adapters: with ``groups`` (one id per row, e.g. its adapter slot)
the aggregation is done *within each group* and the group losses are summed. Since a row
only depends on its own adapter's weights, every adapter then receives exactly the
gradient it would get if its rows were trained alone; with a single batch-wide mean
instead, an adapter's step would shrink as other adapters add rows.

For micro-batching, compute ``group_normalizers`` on the whole batch's mask and pass them
to each micro-batch; the sum of the micro-batch losses then equals the whole-batch loss.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Agg = Literal["token-mean", "seq-mean-token-mean"]
AGGS: tuple[Agg, ...] = ("token-mean", "seq-mean-token-mean")


def ppo_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token loss [B, T], the ratio, and a bool mask of tokens where the clip was active.

    ``advantages`` is per sequence [B] (broadcast over tokens) or per token [B, T].
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(logprobs.dtype)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + high)
    return torch.maximum(unclipped, clipped), ratio, clipped > unclipped


def _groups(mask: Tensor, groups: Tensor | None) -> Tensor:
    if groups is None:
        return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    if groups.dim() != 1 or groups.shape[0] != mask.shape[0]:
        raise ValueError(f"groups must be [batch]={mask.shape[0]}, got {tuple(groups.shape)}")
    if groups.numel() and int(groups.min()) < 0:
        raise ValueError("group ids must be >= 0")
    return groups.long()


def group_normalizers(
    mask: Tensor, groups: Tensor | None = None, agg: Agg = "token-mean", n_groups: int | None = None
) -> Tensor:
    """Per group id: its number of response tokens (token-mean) or non-empty rows (seq-mean)."""
    if agg not in AGGS:
        raise ValueError(f"unknown aggregation {agg!r}; choose one of {AGGS}")
    g = _groups(mask, groups)
    size = max(int(g.max()) + 1 if g.numel() else 0, n_groups or 0)
    tokens = mask.to(torch.float32).sum(dim=1)
    per_row = tokens if agg == "token-mean" else (tokens > 0).to(torch.float32)
    return torch.zeros(size, device=mask.device).index_add_(0, g, per_row)


def row_losses(
    token_loss: Tensor,
    mask: Tensor,
    groups: Tensor | None = None,
    agg: Agg = "token-mean",
    normalizers: Tensor | None = None,
) -> Tensor:
    """Each row's share of the loss [B]; their sum is the sum over groups of group losses."""
    m = mask.to(token_loss.dtype)
    g = _groups(mask, groups)
    norms = group_normalizers(mask, groups, agg) if normalizers is None else normalizers
    denom = norms.to(token_loss.dtype)[g].clamp(min=1.0)
    summed = (token_loss * m).sum(dim=1)
    if agg == "token-mean":
        return summed / denom
    return summed / m.sum(dim=1).clamp(min=1.0) / denom


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    groups: Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    agg: Agg = "token-mean",
    normalizers: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The loss to minimise (scalar) and stats: clip fraction, mean ratio, approx. KL, entropy.

    All token tensors are [B, T] and aligned with ``mask`` (1 on response tokens).
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must have the same shape"
        )
    token_loss, ratio, clipped = ppo_token_loss(
        logprobs, old_logprobs, advantages, clip_eps, clip_eps_high
    )
    loss = row_losses(token_loss, mask, groups, agg, normalizers).sum()
    with torch.no_grad():
        m = mask.to(torch.float32)
        n = m.sum().clamp(min=1.0)

        def mean(x: Tensor) -> float:
            return float((x.to(torch.float32) * m).sum() / n)

        log_ratio = torch.log(ratio)
        stats = {
            "clip_frac": mean(clipped),
            "ratio_mean": mean(ratio),
            "approx_kl": mean(ratio - 1.0 - log_ratio),  # k3 estimator of KL(old || new)
        }
        if entropy is not None:
            stats["entropy"] = mean(entropy)
    return loss, stats
