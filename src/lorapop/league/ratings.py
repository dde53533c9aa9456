"""TrueSkill ratings of the league's teachers and students, and the match outcome rule.

A *match* is one teacher against one matched student on the tasks that teacher proposed
this step and the sandbox accepted (its valid tasks). Its outcome is read from the
student's solve rate ``s`` over all its graded answers to those tasks, against a *center*
``c`` and a draw margin ``m`` (default 0.1):

- ``s < c - m``            -> the teacher wins (its tasks beat the student);
- ``s > c + m``            -> the student wins;
- otherwise                -> draw;
- no valid task at all     -> the student wins (a teacher that poses nothing loses).

``match_results`` takes one step's matches together. Its default center is *relative*:
the mean solve rate of this step's matches, so an outcome says which side did better than
this step's typical pairing. The *absolute* center 0.5 (the rule before, "teacher wins
below 0.4, student above 0.6") lets a league-wide offset decide the outcomes: where most
answers fail whoever plays (small models, code_f that no student solves, so a third of the
answers are 0 by construction), nearly every match is a teacher win, the outcomes carry no
information about who is better, and the ratings end up ranking roles rather than skill.
In a simulation with fixed hidden skills (``tests/league/test_simulation.py``; 4 + 4, 300
steps, 6 seeds), at a league-wide solve rate of about 0.05 (the tiny world's early steps)
the absolute center recovers the within-pool order with a mean Kendall tau of 0.28, the
relative one with 0.97; at a league-wide rate of about 0.33 both give 1.0. What the relative
center changes: a cross-pool win probability means "does better than this step's typical
pairing", not "solves under / over half", so PFSP's weights stay informative instead of
saturating when one pool dominates. With one match a step (1 + 1) the center is that
match's rate and every outcome is a draw.

The margin is about one standard error of an even game for a typical match (3 task types x
8 answers: ``0.5/sqrt(24) ~ 0.1``), so a draw says "no evidence either way" and a win needs
a clear margin. The band is symmetric, so swapping the roles' luck swaps the winner.

The outcome is deliberately *not* measured against the ratings' prediction for the pair:
TrueSkill's update already weighs each result by how surprising it was (an expected win
barely moves the ratings, an upset moves them a lot). Judging the outcome relative to the
prediction as well would count the prediction twice and keep ratings from separating. The
relative center is the same for every match of the step, so it removes a common offset
without looking at who plays whom.

Rating maths is the ``trueskill`` library's (``rate_1vs1`` with ``drawn``). The only
formula written here is the win probability, which the library does not expose:
``P(a beats b) = Phi((mu_a - mu_b) / sqrt(2 beta^2 + sigma_a^2 + sigma_b^2))``.

``Ratings`` also counts the matches each member has played since its rating was last set
(``played``): replacement protects a child until it has played enough of them.

Teachers and students are two *pools*: each is ranked only against itself (replacement
works per pool), but both live on one TrueSkill scale (one environment), since every match
is teacher against student and a win probability across pools must mean something.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from statistics import fmean
from typing import Any, Literal

import trueskill

Role = Literal["teacher", "student"]
ROLES: tuple[Role, Role] = ("teacher", "student")
_VETERAN = 1 << 30  # matches played by a member of a checkpoint that did not count them


class MatchResult(str, Enum):
    """Who won a teacher-vs-student match."""

    TEACHER = "teacher"
    STUDENT = "student"
    DRAW = "draw"


def match_result(solve_rate: float | None, low: float = 0.4, high: float = 0.6) -> MatchResult:
    """The outcome of a match from the student's solve rate (None: the teacher had no valid task)."""
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(
            f"outcome thresholds need 0 <= low <= high <= 1, got low={low}, high={high}"
        )
    if solve_rate is None:
        return MatchResult.STUDENT
    if not 0.0 <= solve_rate <= 1.0 or math.isnan(solve_rate):
        raise ValueError(f"solve rate must be in [0, 1], got {solve_rate}")
    if solve_rate < low:
        return MatchResult.TEACHER
    if solve_rate > high:
        return MatchResult.STUDENT
    return MatchResult.DRAW


OutcomeCenter = Literal["relative", "absolute"]


def match_results(
    rates: Sequence[float | None], margin: float = 0.1, center: OutcomeCenter = "relative"
) -> list[MatchResult]:
    """Results of one step's matches from their solve rates (see the module docstring)."""
    if not 0.0 <= margin <= 0.5:
        raise ValueError(f"draw margin must be in [0, 0.5], got {margin}")
    if center not in ("relative", "absolute"):
        raise ValueError(f"outcome center must be 'relative' or 'absolute', got {center!r}")
    known = [r for r in rates if r is not None]
    c = fmean(known) if center == "relative" and known else 0.5
    low, high = max(0.0, c - margin), min(1.0, c + margin)
    return [match_result(r, low, high) for r in rates]


@dataclass(frozen=True)
class TrueSkillParams:
    """The TrueSkill environment (library defaults: mu 25, sigma mu/3, beta sigma/2, tau sigma/100)."""

    mu: float = trueskill.MU
    sigma: float = trueskill.SIGMA
    beta: float = trueskill.BETA
    tau: float = trueskill.TAU
    draw_probability: float = trueskill.DRAW_PROBABILITY

    def env(self) -> trueskill.TrueSkill:
        return trueskill.TrueSkill(
            mu=self.mu,
            sigma=self.sigma,
            beta=self.beta,
            tau=self.tau,
            draw_probability=self.draw_probability,
        )


class Ratings:
    """Ratings of named members in a teacher pool and a student pool."""

    def __init__(
        self,
        teachers: Sequence[str],
        students: Sequence[str],
        params: TrueSkillParams | None = None,
    ) -> None:
        names = list(teachers) + list(students)
        if not teachers or not students:
            raise ValueError("a league needs at least one teacher and one student")
        if len(set(names)) != len(names):
            raise ValueError(f"member names must be unique, got {names}")
        self.params = params or TrueSkillParams()
        self.env = self.params.env()
        self._role: dict[str, Role] = {n: "teacher" for n in teachers}
        self._role.update({n: "student" for n in students})
        self._rating: dict[str, trueskill.Rating] = {n: self.env.create_rating() for n in names}
        self._played: dict[str, int] = dict.fromkeys(names, 0)

    # --- reading -----------------------------------------------------------------------
    def members(self, role: Role) -> list[str]:
        """Members of one pool, in the order they were given."""
        return [n for n, r in self._role.items() if r == role]

    @property
    def teachers(self) -> list[str]:
        return self.members("teacher")

    @property
    def students(self) -> list[str]:
        return self.members("student")

    def role(self, name: str) -> Role:
        return self._role[self._known(name)]

    def get(self, name: str) -> trueskill.Rating:
        return self._rating[self._known(name)]

    def conservative(self, name: str) -> float:
        """mu - 3 sigma: a skill the member has with ~99.9% confidence."""
        r = self.get(name)
        return r.mu - 3.0 * r.sigma

    def ranked(self, role: Role) -> list[str]:
        """One pool, best first by conservative rating (ties keep the pool's order)."""
        return sorted(self.members(role), key=lambda n: -self.conservative(n))

    def played(self, name: str) -> int:
        """Matches played since the member's rating was last set (its age, for protection)."""
        return self._played[self._known(name)]

    def win_probability(self, a: str, b: str) -> float:
        """P(a beats b), draws ignored; 0.5 for equal ratings."""
        ra, rb = self.get(a), self.get(b)
        denom = math.sqrt(2.0 * self.env.beta**2 + ra.sigma**2 + rb.sigma**2)
        return float(self.env.cdf((ra.mu - rb.mu) / denom))

    # --- writing -----------------------------------------------------------------------
    def record(self, teacher: str, student: str, result: MatchResult) -> None:
        """Update both ratings after one match (order of calls matters, as in any TrueSkill)."""
        if self.role(teacher) != "teacher" or self.role(student) != "student":
            raise ValueError(f"a match is teacher vs student, got {teacher!r} vs {student!r}")
        t, s = self._rating[teacher], self._rating[student]
        if result is MatchResult.STUDENT:
            s, t = trueskill.rate_1vs1(s, t, env=self.env)
        else:
            t, s = trueskill.rate_1vs1(t, s, drawn=result is MatchResult.DRAW, env=self.env)
        self._rating[teacher], self._rating[student] = t, s
        self._played[teacher] += 1
        self._played[student] += 1

    def set(self, name: str, mu: float, sigma: float, played: int = 0) -> None:
        """A new rating for ``name``, backed by ``played`` matches (0: a new individual)."""
        if not (math.isfinite(mu) and math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"rating needs finite mu and sigma > 0, got mu={mu}, sigma={sigma}")
        if played < 0:
            raise ValueError(f"matches played must be >= 0, got {played}")
        self._rating[self._known(name)] = self.env.create_rating(mu=mu, sigma=sigma)
        self._played[name] = played

    def reset(self, name: str) -> None:
        """A fresh rating (the environment's prior), no matches played."""
        self.set(name, self.params.mu, self.params.sigma)

    # --- checkpoints -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "params": asdict(self.params),
            "members": [
                {"name": n, "role": self._role[n], "mu": r.mu, "sigma": r.sigma,
                 "played": self._played[n]}
                for n, r in self._rating.items()
            ],
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> Ratings:
        members = state["members"]
        ratings = cls(
            [m["name"] for m in members if m["role"] == "teacher"],
            [m["name"] for m in members if m["role"] == "student"],
            TrueSkillParams(**state["params"]),
        )
        for m in members:  # checkpoints before match counts: nobody is protected
            played = int(m.get("played", _VETERAN))
            ratings.set(m["name"], float(m["mu"]), float(m["sigma"]), played)
        return ratings

    def _known(self, name: str) -> str:
        if name not in self._role:
            raise KeyError(f"unknown league member {name!r}; members: {list(self._role)}")
        return name
