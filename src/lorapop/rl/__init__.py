"""Rewards, TRR++ advantages (plain Python) and the policy-gradient loss (``rl.loss``, torch)."""

from lorapop.rl.advantages import trr_advantages
from lorapop.rl.rewards import (
    Answer,
    RewardScheme,
    TeacherRule,
    solve_rate,
    student_reward,
    teacher_reward,
)

__all__ = [
    "Answer",
    "RewardScheme",
    "TeacherRule",
    "solve_rate",
    "student_reward",
    "teacher_reward",
    "trr_advantages",
]
