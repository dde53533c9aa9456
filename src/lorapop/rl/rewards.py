"""Rewards of students (per answer) and teachers (per proposed task).

Student: correct 1, wrong -0.5, format error (unparsable answer) -1, as AZR's solver.
Answers are the tasks layer's grade outcomes (``lorapop.tasks.task.Outcome``).

Teacher, per task, from ``s``, the solve rate of the matched students' answers to it:
an invalid task (unparsable, or rejected by the sandbox) gets -1; a valid one gets a
*learnability* reward by one of three rules:

- ``"zero"`` (default, PopuLoRA): ``1 - s`` for ``0 < s < 1``, and 0 when ``s`` is 0 or 1
  (a task nobody or everybody solves teaches nothing);
- ``"azr"``: AZR's code (``generation_accuracy_convertion='one_minus'``): as ``"zero"``
  but ``s`` of 0 or 1 gets -0.5, AZR's penalty for a zero proposer reward;
- ``"inverse"``: AZR's other conversion: ``1 - s`` (so an unsolved task earns 1), and
  ``s = 1`` gets -0.5.

In the single-agent baseline (AZR) the one adapter is its own student: the loop passes the
solve rate of its own answers as ``s``; nothing else changes.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Literal

from lorapop.tasks.task import Outcome

TeacherRule = Literal["zero", "azr", "inverse"]
TEACHER_RULES: tuple[TeacherRule, ...] = ("zero", "azr", "inverse")

__all__ = [
    "RewardScheme",
    "TeacherRule",
    "solve_rate",
    "solve_rates",
    "student_reward",
    "teacher_reward",
]


@dataclass(frozen=True)
class RewardScheme:
    """Reward values; the defaults are AZR's and the paper's."""

    correct: float = 1.0
    wrong: float = -0.5
    format_error: float = -1.0
    invalid: float = -1.0
    teacher_rule: TeacherRule = "zero"
    extreme_penalty: float = -0.5  # the "azr" and "inverse" rules' reward for s of 0 / 1

    def __post_init__(self) -> None:
        if self.teacher_rule not in TEACHER_RULES:
            raise ValueError(
                f"teacher_rule must be one of {TEACHER_RULES}, got {self.teacher_rule!r}"
            )


DEFAULT = RewardScheme()


def student_reward(answer: Outcome, scheme: RewardScheme = DEFAULT) -> float:
    if answer is Outcome.CORRECT:
        return scheme.correct
    if answer is Outcome.WRONG:
        return scheme.wrong
    return scheme.format_error


def solve_rate(answers: Iterable[Outcome]) -> float | None:
    """Fraction of correct answers (format errors count as unsolved); None if there are none."""
    graded = list(answers)
    if not graded:
        return None
    return sum(a is Outcome.CORRECT for a in graded) / len(graded)


def solve_rates(answers: Iterable[tuple[Hashable, Outcome]]) -> dict[Hashable, float]:
    """The solve rate of each key's answers (the loop keys them by (teacher, task key))."""
    by: dict[Hashable, list[Outcome]] = {}
    for key, answer in answers:
        by.setdefault(key, []).append(answer)
    return {k: rate for k, v in by.items() if (rate := solve_rate(v)) is not None}


def teacher_reward(valid: bool, rate: float | None, scheme: RewardScheme = DEFAULT) -> float:
    """Reward of one proposed task; ``rate`` is its solve rate (ignored when invalid)."""
    if not valid:
        return scheme.invalid
    if rate is None or math.isnan(rate) or not 0.0 <= rate <= 1.0:
        raise ValueError(f"a valid task needs a solve rate in [0, 1], got {rate}")
    extreme = rate in (0.0, 1.0)
    if scheme.teacher_rule == "zero":
        return 0.0 if extreme else 1.0 - rate
    if scheme.teacher_rule == "azr":
        return scheme.extreme_penalty if extreme else 1.0 - rate
    return scheme.extreme_penalty if rate == 1.0 else 1.0 - rate
