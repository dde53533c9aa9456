"""Rewards, TRR++ advantages (plain Python) and the policy-gradient loss (``rl.loss``, torch)."""

from lorapop.rl.advantages import trr_advantages
from lorapop.rl.rewards import (
    RewardScheme,
    TeacherConversion,
    solve_rate,
    solve_rates,
    student_reward,
    teacher_reward,
)

__all__ = [
    "RewardScheme",
    "TeacherConversion",
    "solve_rate",
    "solve_rates",
    "student_reward",
    "teacher_reward",
    "trr_advantages",
]
