"""Prioritized Fictitious Self-Play (PFSP): which students each teacher plays this step.

Each teacher draws ``per_teacher`` distinct students. Student ``s`` is drawn with a weight
``f(p)``, where ``p = P(teacher beats s)`` from the ratings (the drawer's win
probability, as in AlphaStar):

- ``"even"``    ``f = p (1 - p)``: close matches, the most informative for both sides;
- ``"hard"``    ``f = (1 - p)^k``: AlphaStar's hard weighting, students the teacher tends
  to lose to (``k = exponent``, default 2);
- ``"uniform"`` ``f = 1``: the ablation.

Weights are floored at a tiny positive value so a draw never fails on an extreme rating.

Every member plays every step: every teacher draws at least one student, and after the
draws a *repair* gives each left-out student a teacher. For a left-out student ``u`` a
teacher is drawn (weight ``f`` of that teacher against ``u``) among those whose list holds
a student also played by someone else; that student (the least-weighted such) is swapped
for ``u``, so no one else is left out and every list keeps its size. Only when
``n_teachers * per_teacher < n_students`` is there nothing to swap; the teacher then
takes ``u`` on top of its list.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Literal

from lorapop.league.ratings import Ratings

PFSPMode = Literal["even", "hard", "uniform"]
PFSP_MODES: tuple[PFSPMode, ...] = ("even", "hard", "uniform")
_FLOOR = 1e-9


def pfsp_weight(p: float, mode: PFSPMode = "even", exponent: float = 2.0) -> float:
    """PFSP weight of an opponent that the drawer beats with probability ``p``."""
    if mode == "even":
        w = p * (1.0 - p)
    elif mode == "hard":
        w = (1.0 - p) ** exponent
    elif mode == "uniform":
        w = 1.0
    else:
        raise ValueError(f"unknown PFSP mode {mode!r}; choose one of {PFSP_MODES}")
    return max(w, _FLOOR)


def pfsp_probabilities(
    ratings: Ratings,
    teacher: str,
    students: Sequence[str] | None = None,
    mode: PFSPMode = "even",
    exponent: float = 2.0,
) -> dict[str, float]:
    """Probability that ``teacher``'s first draw is each student (sums to 1)."""
    pool = list(ratings.students if students is None else students)
    if not pool:
        raise ValueError("PFSP needs at least one student to draw from")
    weights = {s: pfsp_weight(ratings.win_probability(teacher, s), mode, exponent) for s in pool}
    total = sum(weights.values())
    return {s: w / total for s, w in weights.items()}


def match(
    ratings: Ratings,
    rng: random.Random,
    per_teacher: int = 1,
    mode: PFSPMode = "even",
    exponent: float = 2.0,
) -> list[tuple[str, str]]:
    """(teacher, student) pairs for one step: each teacher in pool order, its draws in order."""
    if per_teacher < 1:
        raise ValueError(f"per_teacher must be >= 1, got {per_teacher}")
    students = ratings.students
    k = min(per_teacher, len(students))

    def weight(t: str, s: str) -> float:
        return pfsp_weight(ratings.win_probability(t, s), mode, exponent)

    drawn: dict[str, list[str]] = {}
    for t in ratings.teachers:
        pool, picks = list(students), []
        for _ in range(k):
            s = rng.choices(pool, weights=[weight(t, c) for c in pool])[0]
            pool.remove(s)
            picks.append(s)
        drawn[t] = picks
    _repair(drawn, students, weight, rng)
    return [(t, s) for t, picks in drawn.items() for s in picks]


def _repair(
    drawn: dict[str, list[str]],
    students: list[str],
    weight: Callable[[str, str], float],
    rng: random.Random,
) -> None:
    """Give every left-out student a teacher (see the module docstring)."""
    count = Counter(s for picks in drawn.values() for s in picks)
    for u in [s for s in students if count[s] == 0]:
        swappable = {t: [s for s in picks if count[s] > 1] for t, picks in drawn.items()}
        hosts = [t for t, dup in swappable.items() if dup]
        if not hosts:
            hosts = list(drawn)
        t = rng.choices(hosts, weights=[weight(h, u) for h in hosts])[0]
        if swappable[t]:
            out = min(swappable[t], key=lambda s: weight(t, s))
            drawn[t][drawn[t].index(out)] = u
            count[out] -= 1
        else:
            drawn[t].append(u)
        count[u] += 1
