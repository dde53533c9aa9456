"""Replacement: the weakest members of a pool are overwritten by children of the best.

``plan_replacement`` only decides; the loop applies the plan with the LoRA operators
(``lorapop.lora.evolve.OPERATORS[op](parent_states, seed)``), resets the children's
optimizer state, and calls ``rate_children`` for their ratings.

The rule is population-based training's exploit step: a member that has shown itself
weak is overwritten by a copy (mutated or crossed) of a strong one, and the copy then has
to show its own worth before it can be culled. In a pool of ``n`` ranked by conservative
rating (mu - 3 sigma, best first):

- parents: drawn uniformly from the top ``max(1, floor(parent_fraction * n))`` members
  (at most ``n - targets``);
- targets: the ``floor(fraction * n)`` members (at most ``n - 1``) of lowest mu among those
  not *protected* and not parents: a member is culled for being weak, not for being unsure.
  Ranked by mu - 3 sigma, a child whose protection has just lapsed still has a wider sigma
  than its established peers and ranks last whatever its results; in a 4 + 4 world
  run (a teacher plays 2 matches a step, so 20 matches lapse at the next event of every 10
  steps) one teacher slot was re-rolled at 12 consecutive events with its mu above another
  target's (25.7 vs 25.2, sigma 1.18 vs 0.78). A member is protected until it has played
  ``protect_matches`` matches since it was made (``Ratings.played``), so a child cannot
  be culled on the prior it was born with, only on its own results. When protected
  members fill the bottom, fewer (or no) targets are replaced this time. A member is
  never both parent and target in one plan, so every child is made from weights that this
  plan does not overwrite (the order in which the loop applies the plan does not matter);
- the operator: drawn from ``operators`` (name -> weight); names in ``crossovers`` take
  two distinct parents (fitter first), the rest one. With a single possible parent only
  the one-parent operators are drawn;
- a seed per child for the operator, drawn from the same RNG, so a plan is reproducible.

Child ratings (``rate_children``, ``"inherit"``): the parents' mean mu and their largest
sigma times ``sigma_scale``, capped at the prior. An earlier rule also floored sigma at
half the prior (4.17): with established members at sigma 1.5-2, a child's mu - 3 sigma
started at least 12.5 below its parent's, so it ranked last at the next event and the
same slot was re-rolled at nearly every event. Without the floor a child starts
near its parent's rank, with a wider sigma so its first results move it quickly.

In the league simulation (``tests/league/test_simulation.py``: 4 + 4 with fixed hidden
skills, 300 steps, evolution every 10, the config's defaults, 4 seeds) the weakest slot of
a pool was the target at 15 of 30 events, the second weakest at 11-14, the third at 0-3,
the strongest never; under the earlier rule one slot was the target at all 30.

With two members per pool there is one parent and one possible target, so every event
overwrites the weaker of the two with a child of the other (protection only skips events).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from lorapop.config import pool_split
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
    protect_matches: int = 0,
) -> list[Replacement]:
    """The replacements for one pool, worst target first."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"replacement fraction must be in [0, 1), got {fraction}")
    if not 0.0 < parent_fraction <= 1.0:
        raise ValueError(f"parent fraction must be in (0, 1], got {parent_fraction}")
    if protect_matches < 0:
        raise ValueError(f"protect_matches must be >= 0, got {protect_matches}")
    if not operators or any(w < 0 for w in operators.values()) or sum(operators.values()) <= 0:
        raise ValueError(
            f"operators need non-negative weights with a positive sum, got {operators}"
        )
    ranked = ratings.ranked(role)
    n = len(ranked)
    n_targets, n_parents = pool_split(n, fraction, parent_fraction)
    if n_targets == 0:
        return []
    parents = ranked[:n_parents]
    eligible = [m for m in ranked[n_parents:] if ratings.played(m) >= protect_matches]
    # culled for being weak (mu), not for being unsure (sigma): see the module docstring
    targets = sorted(eligible, key=lambda m: (ratings.get(m).mu, ratings.conservative(m)))[:n_targets]

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
) -> None:
    """Give each child its rating, with no matches played (see the module docstring).

    ``"reset"``: the prior. ``"inherit"``: the mean of the parents' mu, and the largest
    parent sigma times ``sigma_scale`` (at most the prior sigma): the child plays like its
    parents at first, but its rating must stay free to move since the weights changed.
    Read all parents before writing any child, so the order of the plan does not matter.
    """
    if policy not in ("reset", "inherit"):
        raise ValueError(f"child rating policy must be 'reset' or 'inherit', got {policy!r}")
    if sigma_scale < 1.0:
        raise ValueError(f"sigma_scale must be >= 1 (a child is no surer than its parents), "
                         f"got {sigma_scale}")
    prior = ratings.params.sigma
    new = {}
    for r in plan:
        if policy == "reset":
            new[r.target] = (ratings.params.mu, prior)
            continue
        mus = [ratings.get(p).mu for p in r.parents]
        sigma = max(ratings.get(p).sigma for p in r.parents) * sigma_scale
        new[r.target] = (sum(mus) / len(mus), min(prior, sigma))
    for target, (mu, sigma) in new.items():
        ratings.set(target, mu, sigma)
