"""Rewards of students (per answer) and teachers (per proposed task).

Student: correct 1, wrong -0.5, format error (unparsable answer) -1, as AZR's solver.
Answers are the tasks layer's grade outcomes (``lorapop.tasks.task.Outcome``).

Teacher, per task, from ``s``, the solve rate of the matched students' answers to it:
an invalid task (unparsable, or rejected by the sandbox) gets -1; a valid one gets a
*learnability* reward in two steps, named as in AZR's code (LeapLabTHU/Absolute-Zero-Reasoner
at a82124e, ``absolute_zero_reasoner/rewards/reward_managers.py``):

1. conversion (``teacher_conversion``; AZR's ``generation_accuracy_convertion``, in
   ``CodeIORewardManager._get_problem_generator_rewards_and_valid_programs``):
   - ``"one_minus"`` (default; AZR's default too): ``1 - s`` if ``s > 0`` else 0. So 0 at
     ``s`` of 0 and 1: a task nobody or everybody solves teaches nothing. This is
     PopuLoRA's rule;
   - ``"inverse"``: ``1 - s`` (an unsolved task earns 1).
2. format penalty (``teacher_format_penalty``, default None = off): AZR's composite reward
   (``CodeIORewardManager.__call__``, the ``gen`` branch) gives a response with
   ``format_score > 0`` its converted reward if that is positive and -0.5 otherwise, and
   -1 when ``format_score`` is 0. ``format_score`` is 0 for every proposal whose program
   fails to parse or run (``_get_data_dict``), so in AZR *invalid* proposals get -1, like
   here; the -0.5 goes to a *valid*, well-formatted proposal whose converted reward is not
   positive (under ``one_minus``: ``s`` of 0 or 1; under ``inverse``: ``s = 1``). Set the
   penalty to -0.5 for AZR's proposer reward.

AZR's selfplay scripts use ``one_minus`` with the intrinsic (complexity, diversity) rewards
off, which is ``teacher_conversion="one_minus", teacher_format_penalty=-0.5`` here. What
still differs: AZR estimates ``s`` from 8 of the proposer's own answers; lorapop from
``tasks.answers_per_task`` answers of each matched student.

In the single-agent baseline (AZR) the one adapter is its own student: the loop passes the
solve rate of its own answers as ``s``; nothing else changes.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Literal

from lorapop.tasks.task import Outcome

TeacherConversion = Literal["one_minus", "inverse"]
TEACHER_CONVERSIONS: tuple[TeacherConversion, ...] = ("one_minus", "inverse")

__all__ = [
    "RewardScheme",
    "TeacherConversion",
    "solve_rate",
    "solve_rates",
    "student_reward",
    "teacher_reward",
]


@dataclass(frozen=True)
class RewardScheme:
    """Reward values; the defaults are AZR's for students and PopuLoRA's for teachers."""

    correct: float = 1.0
    wrong: float = -0.5
    format_error: float = -1.0
    invalid: float = -1.0
    teacher_conversion: TeacherConversion = "one_minus"
    teacher_format_penalty: float | None = None  # AZR: -0.5

    def __post_init__(self) -> None:
        if self.teacher_conversion not in TEACHER_CONVERSIONS:
            raise ValueError(f"teacher_conversion must be one of {TEACHER_CONVERSIONS}, "
                             f"got {self.teacher_conversion!r}")


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
    converted = 1.0 - rate if rate > 0 or scheme.teacher_conversion == "inverse" else 0.0
    if scheme.teacher_format_penalty is not None and converted <= 0:
        return scheme.teacher_format_penalty
    return converted
