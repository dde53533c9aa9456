import pytest

from lorapop.rl.rewards import (
    RewardScheme,
    solve_rate,
    solve_rates,
    student_reward,
    teacher_reward,
)
from lorapop.tasks.task import Outcome


def test_student_rewards():
    assert student_reward(Outcome.CORRECT) == 1.0
    assert student_reward(Outcome.WRONG) == -0.5
    assert student_reward(Outcome.FORMAT_ERROR) == -1.0
    assert student_reward(Outcome.WRONG, RewardScheme(wrong=0.0)) == 0.0


@pytest.mark.parametrize(
    ("valid", "rate", "zero", "azr", "inverse"),
    [
        (False, None, -1.0, -1.0, -1.0),
        (False, 0.5, -1.0, -1.0, -1.0),  # an invalid task's solve rate is ignored
        (True, 0.0, 0.0, -0.5, 1.0),
        (True, 1.0, 0.0, -0.5, -0.5),
        (True, 0.25, 0.75, 0.75, 0.75),
        (True, 0.9, 0.1, 0.1, 0.1),
    ],
)
def test_teacher_reward_table(valid, rate, zero, azr, inverse):
    assert teacher_reward(valid, rate) == pytest.approx(zero)  # the default rule
    assert teacher_reward(valid, rate, RewardScheme(teacher_rule="azr")) == pytest.approx(azr)
    got = teacher_reward(valid, rate, RewardScheme(teacher_rule="inverse"))
    assert got == pytest.approx(inverse)


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
    with pytest.raises(ValueError, match="teacher_rule"):
        RewardScheme(teacher_rule="best")
