import pytest

from lorapop.rl.advantages import trr_advantages

T_O = ("t0", "teacher", "code_o")
S_O = ("s0", "student", "code_o")
S_I = ("s0", "student", "code_i")
S1_O = ("s1", "student", "code_o")


def test_hand_computed_example():
    records = [
        (T_O, 1.0),
        (S_O, 1.0),
        (S_O, -0.5),
        (S_I, 1.0),  # alone in its group
        (S_O, -1.0),
        (T_O, 0.5),
        (S1_O, -0.5),
        (S1_O, -0.5),  # equal rewards
    ]
    # T_O: mean 0.75, std 0.25 -> +1, -1
    # S_O: mean -1/6, var ((7/6)^2 + (1/3)^2 + (5/6)^2) / 3 = 13/18, std 0.849837
    expected = [1.0, 1.372813, -0.392232, 0.0, -0.980581, -1.0, 0.0, 0.0]
    assert trr_advantages(records) == pytest.approx(expected, abs=1e-5)


def test_groups_are_independent_of_each_other():
    a = [(S_O, 1.0), (S_O, -0.5), (S_O, -1.0)]
    b = [(S1_O, 100.0), (S1_O, -30.0)]
    alone = trr_advantages(a)
    mixed = trr_advantages(b[:1] + a + b[1:])
    assert mixed[1:4] == pytest.approx(alone)


def test_empty_and_bad_input():
    assert trr_advantages([]) == []
    with pytest.raises(ValueError, match="not finite"):
        trr_advantages([(S_O, float("nan"))])
