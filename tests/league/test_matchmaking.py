import random
from collections import Counter
from statistics import NormalDist

import pytest

from lorapop.league.matchmaking import match, pfsp_probabilities, pfsp_weight
from lorapop.league.ratings import Ratings

BETA = 25.0 / 6.0


def p_win(mu_a, sa, mu_b, sb):
    return NormalDist().cdf((mu_a - mu_b) / (2 * BETA**2 + sa**2 + sb**2) ** 0.5)


def three_students() -> Ratings:
    r = Ratings(["t"], ["even", "weak", "strong"])
    r.set("t", 25.0, 3.0)
    r.set("even", 25.0, 3.0)
    r.set("weak", 15.0, 3.0)
    r.set("strong", 33.0, 3.0)
    return r


def test_pfsp_weights():
    assert pfsp_weight(0.5, "even") == pytest.approx(0.25)
    assert pfsp_weight(0.8, "even") == pytest.approx(0.16)
    assert pfsp_weight(0.8, "hard", exponent=2) == pytest.approx(0.04)
    assert pfsp_weight(0.8, "hard", exponent=1) == pytest.approx(0.2)
    assert pfsp_weight(0.8, "uniform") == 1.0
    assert pfsp_weight(1.0, "hard") > 0  # floored, never a dead weight
    with pytest.raises(ValueError, match="unknown PFSP mode"):
        pfsp_weight(0.5, "greedy")


@pytest.mark.parametrize("mode", ["even", "hard", "uniform"])
def test_pfsp_probabilities_for_known_ratings(mode):
    r = three_students()
    p = {
        "even": 0.5,
        "weak": p_win(25, 3, 15, 3),  # the teacher beats the weak student often
        "strong": p_win(25, 3, 33, 3),
    }
    f = {
        "even": lambda x: x * (1 - x),
        "hard": lambda x: (1 - x) ** 2,
        "uniform": lambda x: 1.0,
    }[mode]
    total = sum(f(x) for x in p.values())
    got = pfsp_probabilities(r, "t", mode=mode)
    assert got == pytest.approx({s: f(x) / total for s, x in p.items()}, abs=1e-6)
    assert sum(got.values()) == pytest.approx(1.0)
    if mode == "even":
        assert max(got, key=got.get) == "even"
    if mode == "hard":
        assert max(got, key=got.get) == "strong"


def test_draws_follow_pfsp_probabilities():
    r = three_students()
    rng = random.Random(0)
    n = 4000
    # one teacher draws all three students in turn; the first draw is the PFSP draw
    first = Counter(match(r, rng, per_teacher=3)[0][1] for _ in range(n))
    for s, prob in pfsp_probabilities(r, "t").items():
        assert first[s] / n == pytest.approx(prob, abs=0.03)


def test_every_member_plays_and_lists_keep_their_size():
    r = Ratings([f"t{i}" for i in range(4)], [f"s{i}" for i in range(4)])
    r.set("s0", 45.0, 1.0)  # every teacher is drawn to s0 in "hard" mode
    for seed in range(30):
        pairs = match(r, random.Random(seed), per_teacher=1, mode="hard")
        assert {t for t, _ in pairs} == set(r.teachers)
        assert {s for _, s in pairs} == set(r.students)
        assert Counter(t for t, _ in pairs) == {t: 1 for t in r.teachers}


def test_per_teacher_draws_are_distinct_and_reproducible():
    r = Ratings(["t0", "t1"], [f"s{i}" for i in range(5)])
    a = match(r, random.Random(7), per_teacher=3)
    assert a == match(r, random.Random(7), per_teacher=3)
    for t in r.teachers:
        mine = [s for tt, s in a if tt == t]
        assert len(mine) == 3 and len(set(mine)) == 3
    assert {s for _, s in a} == set(r.students)


def test_too_few_draws_still_cover_every_student():
    r = Ratings(["t0"], ["s0", "s1", "s2"])
    pairs = match(r, random.Random(1), per_teacher=1)
    assert sorted(s for _, s in pairs) == ["s0", "s1", "s2"]
    with pytest.raises(ValueError, match="per_teacher"):
        match(r, random.Random(1), per_teacher=0)


def test_single_pair_league():
    r = Ratings(["azr"], ["azr_solver"])
    assert match(r, random.Random(0), per_teacher=4) == [("azr", "azr_solver")]


def test_empty_student_list_is_an_error():
    with pytest.raises(ValueError, match="at least one student"):
        pfsp_probabilities(three_students(), "t", students=[])
