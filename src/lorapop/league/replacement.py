"""Replacement: the weakest members of a pool are overwritten by children of the best.

``plan_replacement`` only decides; the loop applies the plan with the LoRA operators
(``lorapop.lora.evolve.OPERATORS[op](parent_states, seed)``), resets the children's
optimizer state, and calls ``rate_children`` for their ratings.

In a pool of ``n`` ranked by conservative rating (mu - 3 sigma, best first):

- targets: the bottom ``floor(fraction * n)`` members (at most ``n - 1``);
- parents: drawn uniformly from the top ``max(1, floor(parent_fraction * n))`` members,
  never from the targets, so a member is never both parent and target in one plan and
  every child is made from weights that this plan does not overwrite (the order in which
  the loop applies the plan does not matter);
- the operator: drawn from ``operators`` (name -> weight); names in ``crossovers`` take
  two distinct parents (fitter first), the rest one. With a single possible parent only
  the one-parent operators are drawn;
- a seed per child for the operator, drawn from the same RNG, so a plan is reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from lorapop.league.ratings import Ratings, Role

ChildRating = Literal["reset", "inherit"]


@dataclass(frozen=True)
class Replacement:
    """Overwrite ``target`` with ``operator(parents, seed)``; parents fitter first."""

    target: str
    parents: tuple[str, ...]
    operator: str
    seed: int


def plan_replacement(
    ratings: Ratings,
    role: Role,
    rng: random.Random,
    operators: Mapping[str, float],
    crossovers: Collection[str] = (),
    fraction: float = 0.25,
    parent_fraction: float = 0.5,
) -> list[Replacement]:
    """The replacements for one pool, worst target first."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"replacement fraction must be in [0, 1), got {fraction}")
    if not 0.0 < parent_fraction <= 1.0:
        raise ValueError(f"parent fraction must be in (0, 1], got {parent_fraction}")
    if not operators or any(w < 0 for w in operators.values()) or sum(operators.values()) <= 0:
        raise ValueError(
            f"operators need non-negative weights with a positive sum, got {operators}"
        )
    ranked = ratings.ranked(role)
    n = len(ranked)
    n_targets = min(int(fraction * n), n - 1)
    if n_targets == 0:
        return []
    n_parents = min(max(1, int(parent_fraction * n)), n - n_targets)
    parents, targets = ranked[:n_parents], ranked[::-1][:n_targets]

    mix = {op: w for op, w in operators.items() if w > 0}
    if n_parents < 2:
        mix = {op: w for op, w in mix.items() if op not in crossovers}
        if not mix:
            raise ValueError(
                f"only one parent in the {role} pool, but every operator with weight > 0 "
                f"is a crossover: {sorted(operators)}"
            )
    names = list(mix)
    plan = []
    for target in targets:
        op = rng.choices(names, weights=[mix[o] for o in names])[0]
        chosen = rng.sample(parents, 2) if op in crossovers else [rng.choice(parents)]
        chosen.sort(key=parents.index)
        plan.append(Replacement(target, tuple(chosen), op, rng.randrange(2**31)))
    return plan


def rate_children(
    ratings: Ratings,
    plan: Sequence[Replacement],
    policy: ChildRating = "inherit",
    sigma_scale: float = 2.0,
    sigma_floor: float | None = None,
) -> None:
    """Give each child its rating.

    ``"reset"``: the prior. ``"inherit"``: the mean of the parents' mu, and the largest
    parent sigma times ``sigma_scale``, at least ``sigma_floor`` (default: half the prior
    sigma) and at most the prior sigma: the child plays like its parents at first, but its
    rating must stay free to move since the weights changed. Read all parents before
    writing any child, so the order of the plan does not matter.
    """
    if policy not in ("reset", "inherit"):
        raise ValueError(f"child rating policy must be 'reset' or 'inherit', got {policy!r}")
    prior = ratings.params.sigma
    floor = prior / 2.0 if sigma_floor is None else sigma_floor
    new = {}
    for r in plan:
        if policy == "reset":
            new[r.target] = (ratings.params.mu, prior)
            continue
        mus = [ratings.get(p).mu for p in r.parents]
        sigma = max(ratings.get(p).sigma for p in r.parents) * sigma_scale
        new[r.target] = (sum(mus) / len(mus), min(prior, max(floor, sigma)))
    for target, (mu, sigma) in new.items():
        ratings.set(target, mu, sigma)
