"""Task-Relative REINFORCE++ (TRR++) advantages, AZR's baseline without a critic.

Every sampled sequence carries a group key, (adapter, role, task type) in lorapop, and a
scalar reward. Advantages are whitened within each group:
``a = (r - mean_group) / (std_group + eps)``, with the population standard deviation
(ddof 0, so two different rewards in a group get -1 and +1).

Normalising per group, not per batch, keeps one adapter's or task type's reward scale
from shifting another's baseline: a teacher's learnability reward and a student's
correctness reward are never compared.

A group of one sequence gets advantage 0: with no peer there is no baseline, and its
reward alone says nothing about whether the sample was better than the policy's average.
A group whose rewards are all equal also gets 0 (nothing to prefer).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence


def trr_advantages(records: Sequence[tuple[Hashable, float]], eps: float = 1e-6) -> list[float]:
    """Advantages, in the order of ``records`` (each a ``(group key, reward)``)."""
    groups: dict[Hashable, list[float]] = defaultdict(list)
    for key, reward in records:
        if not math.isfinite(reward):
            raise ValueError(f"reward of group {key!r} is not finite: {reward}")
        groups[key].append(float(reward))
    stats: dict[Hashable, tuple[float, float] | None] = {}  # None: advantage 0
    for key, rewards in groups.items():
        if len(rewards) < 2 or max(rewards) == min(rewards):
            stats[key] = None
            continue
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        stats[key] = (mean, std)
    out = []
    for key, reward in records:
        st = stats[key]
        out.append(0.0 if st is None else (reward - st[0]) / (st[1] + eps))
    return out
