"""Rewards against AZR's code (LeapLabTHU/Absolute-Zero-Reasoner at a82124e,
absolute_zero_reasoner/rewards/reward_managers.py), transcribed below case by case."""

import pytest

from lorapop.rl.rewards import (
    RewardScheme,
    solve_rate,
    solve_rates,
    student_reward,
    teacher_reward,
)
from lorapop.tasks.task import Outcome

AZR = {"one_minus": RewardScheme(teacher_format_penalty=-0.5),
       "inverse": RewardScheme(teacher_conversion="inverse", teacher_format_penalty=-0.5)}
RATES = [i / 8 for i in range(9)]  # AZR samples 8 answers per proposal


def azr_proposer_reward(code_validity: bool, accuracy: float, conversion: str) -> float:
    """CodeIORewardManager: _get_data_dict sets format_score 0 for code that fails to parse or
    run, and 1 for a valid, well-formatted response; invalid uids get accuracy 1.0 in
    _get_problem_generator_rewards_and_valid_programs, which converts it; __call__ combines."""
    format_score = 1.0 if code_validity else 0.0
    acc = accuracy if code_validity else 1.0
    if conversion == "one_minus":  # noqa: SIM108 (transcribed as AZR writes it)
        reward = (1 - acc) if acc > 0 else 0.0
    elif conversion == "inverse":
        reward = 1 - acc
    if format_score > 0:
        return reward if reward > 0 else -0.5  # intrinsic rewards are off in AZR's scripts
    return -1.0


def azr_solver_reward(format_ok: bool, accuracy: float) -> float:
    """__call__'s `pred` branch, split == 'train' (code_f accuracy is binary)."""
    if format_ok:
        return accuracy if accuracy > 0 else -0.5
    return -1.0


@pytest.mark.parametrize("conversion", ["one_minus", "inverse"])
@pytest.mark.parametrize("rate", RATES)
def test_teacher_reward_with_format_penalty_is_azrs(conversion, rate):
    for valid in (True, False):
        want = azr_proposer_reward(valid, rate, conversion)
        assert teacher_reward(valid, rate, AZR[conversion]) == pytest.approx(want)


@pytest.mark.parametrize("rate", RATES)
def test_default_teacher_reward_is_populoras_and_azrs_one_minus_conversion(rate):
    # PopuLoRA: -1 invalid, 0 at s in {0, 1}, else 1 - s; that is AZR's conversion alone
    want = 0.0 if rate in (0.0, 1.0) else 1.0 - rate
    assert teacher_reward(True, rate) == pytest.approx(want)
    assert teacher_reward(False, rate) == -1.0  # an invalid task's solve rate is ignored
    assert teacher_reward(False, None) == -1.0


def test_named_cases():
    azr = AZR["one_minus"]
    assert teacher_reward(True, 0.0, azr) == -0.5  # valid, nobody solves it
    assert teacher_reward(True, 1.0, azr) == -0.5  # valid, everybody solves it
    assert teacher_reward(True, 0.25, azr) == pytest.approx(0.75)
    assert teacher_reward(False, None, azr) == -1.0  # invalid: -1 in AZR too, never -0.5
    inv = RewardScheme(teacher_conversion="inverse")
    assert teacher_reward(True, 0.0, inv) == 1.0
    assert teacher_reward(True, 1.0, inv) == 0.0
    assert teacher_reward(True, 1.0, RewardScheme(teacher_format_penalty=-0.2)) == -0.2


@pytest.mark.parametrize(
    ("answer", "format_ok", "accuracy"),
    [(Outcome.CORRECT, True, 1.0), (Outcome.WRONG, True, 0.0), (Outcome.FORMAT_ERROR, False, 0.0)],
)
def test_student_reward_is_azrs_solver_reward(answer, format_ok, accuracy):
    assert student_reward(answer) == azr_solver_reward(format_ok, accuracy)


def test_student_reward_values_are_configurable():
    assert student_reward(Outcome.WRONG, RewardScheme(wrong=0.0)) == 0.0


def test_solve_rate_counts_format_errors_as_unsolved():
    answers = [Outcome.CORRECT, Outcome.WRONG, Outcome.FORMAT_ERROR, Outcome.CORRECT]
    assert solve_rate(answers) == 0.5
    assert solve_rate([]) is None


def test_solve_rates_per_key():
    c, w = Outcome.CORRECT, Outcome.WRONG
    answers = [(("T0", "k1"), c), (("T1", "k1"), w), (("T0", "k1"), w), (("T0", "k2"), c)]
    assert solve_rates(answers) == {("T0", "k1"): 0.5, ("T1", "k1"): 0.0, ("T0", "k2"): 1.0}


def test_single_agent_teacher_is_rewarded_from_its_own_answers():
    own = [Outcome.CORRECT, Outcome.WRONG, Outcome.WRONG, Outcome.WRONG]
    assert teacher_reward(True, solve_rate(own)) == pytest.approx(0.75)


def test_bad_input():
    with pytest.raises(ValueError, match="solve rate"):
        teacher_reward(True, None)
    with pytest.raises(ValueError, match="solve rate"):
        teacher_reward(True, 1.2)
    with pytest.raises(ValueError, match="teacher_conversion"):
        RewardScheme(teacher_conversion="azr")  # type: ignore[arg-type]
