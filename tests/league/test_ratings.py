import json
from statistics import NormalDist

import pytest
import trueskill

from lorapop.league.ratings import (
    MatchResult,
    Ratings,
    TrueSkillParams,
    match_result,
    match_results,
)


def league() -> Ratings:
    return Ratings(["t0", "t1"], ["s0", "s1"])


@pytest.mark.parametrize(
    ("rate", "expected"),
    [
        (0.0, MatchResult.TEACHER),
        (0.3999, MatchResult.TEACHER),
        (0.4, MatchResult.DRAW),
        (0.5, MatchResult.DRAW),
        (0.6, MatchResult.DRAW),
        (0.6001, MatchResult.STUDENT),
        (1.0, MatchResult.STUDENT),
        (None, MatchResult.STUDENT),  # no valid task: the student wins
    ],
)
def test_outcome_rule_at_thresholds(rate, expected):
    assert match_result(rate) is expected


def test_outcome_thresholds_are_configurable_and_checked():
    assert match_result(0.25, low=0.2, high=0.3) is MatchResult.DRAW
    assert match_result(0.35, low=0.2, high=0.3) is MatchResult.STUDENT
    with pytest.raises(ValueError, match="low <= high"):
        match_result(0.5, low=0.7, high=0.3)
    with pytest.raises(ValueError, match="solve rate"):
        match_result(1.5)
    with pytest.raises(ValueError, match="solve rate"):
        match_result(float("nan"))


def test_step_results_absolute_center_is_the_fixed_band():
    rates = [0.0, 0.39, 0.4, 0.6, 0.61, None]
    want = [match_result(r) for r in rates]  # 0.4 / 0.6
    assert match_results(rates, 0.1, "absolute") == want


def test_step_results_relative_center_is_the_steps_mean():
    # mean of the known rates 0.05: teacher wins below 0 (never), student above 0.15
    rates = [0.0, 0.0, 0.2, 0.0, None]
    assert match_results(rates, 0.1) == [
        MatchResult.DRAW, MatchResult.DRAW, MatchResult.STUDENT, MatchResult.DRAW, MatchResult.STUDENT]
    # shifting every rate shifts the center: the same matches, the same outcomes
    low, high = [0.1, 0.3, 0.5], [0.4, 0.6, 0.8]
    assert match_results(low) == match_results(high) == [
        MatchResult.TEACHER, MatchResult.DRAW, MatchResult.STUDENT]
    # one match: it is the center, a draw
    assert match_results([0.9]) == [MatchResult.DRAW]
    assert match_results([None, None]) == [MatchResult.STUDENT, MatchResult.STUDENT]
    with pytest.raises(ValueError, match="margin"):
        match_results([0.5], margin=0.7)
    with pytest.raises(ValueError, match="center"):
        match_results([0.5], center="median")


def test_matches_played_are_counted_until_a_rating_is_set():
    r = league()
    r.record("t0", "s0", MatchResult.TEACHER)
    r.record("t0", "s1", MatchResult.DRAW)
    assert [r.played(n) for n in ("t0", "t1", "s0", "s1")] == [2, 0, 1, 1]
    r.set("t0", 25.0, 2.0)
    assert r.played("t0") == 0
    r.set("t0", 25.0, 2.0, played=7)
    r.reset("s0")
    assert (r.played("t0"), r.played("s0")) == (7, 0)
    with pytest.raises(ValueError, match="played"):
        r.set("t0", 25.0, 2.0, played=-1)


def test_teacher_win_moves_teacher_up_and_student_down():
    r = league()
    r.record("t0", "s0", MatchResult.TEACHER)
    prior = r.params
    assert r.get("t0").mu > prior.mu > r.get("s0").mu
    assert r.get("t0").sigma < prior.sigma and r.get("s0").sigma < prior.sigma
    assert r.get("t1").mu == prior.mu and r.get("s1").mu == prior.mu  # bystanders untouched


def test_student_win_moves_student_up_and_teacher_down():
    r = league()
    r.record("t0", "s0", MatchResult.STUDENT)
    assert r.get("s0").mu > r.params.mu > r.get("t0").mu
    # the update is the library's, with the student as the winner
    env = TrueSkillParams().env()
    s, t = trueskill.rate_1vs1(env.create_rating(), env.create_rating(), env=env)
    assert r.get("s0").mu == pytest.approx(s.mu) and r.get("t0").mu == pytest.approx(t.mu)


def test_draw_moves_ratings_toward_each_other():
    r = league()
    r.set("t0", 30.0, 4.0)
    r.set("s0", 20.0, 4.0)
    r.record("t0", "s0", MatchResult.DRAW)
    assert 20.0 < r.get("s0").mu < r.get("t0").mu < 30.0
    # an even draw leaves the means but shrinks the uncertainty
    r.record("t1", "s1", MatchResult.DRAW)
    assert r.get("t1").mu == pytest.approx(r.params.mu)
    assert r.get("t1").sigma < r.params.sigma


def test_win_probability_matches_the_formula():
    r = league()
    assert r.win_probability("t0", "s0") == pytest.approx(0.5)
    r.set("t0", 30.0, 5.0)
    r.set("s0", 25.0, 3.0)
    beta = 25.0 / 6.0
    expected = NormalDist().cdf(5.0 / (2 * beta**2 + 25.0 + 9.0) ** 0.5)
    assert r.win_probability("t0", "s0") == pytest.approx(expected, abs=1e-6)
    assert r.win_probability("s0", "t0") == pytest.approx(1 - expected, abs=1e-6)


def test_conservative_rating_and_ranking_per_pool():
    r = Ratings(["t0"], ["a", "b", "c"])
    r.set("a", 30.0, 5.0)  # 15
    r.set("b", 25.0, 2.0)  # 19
    r.set("c", 40.0, 10.0)  # 10
    assert r.conservative("a") == pytest.approx(15.0)
    assert r.ranked("student") == ["b", "a", "c"]
    assert r.ranked("teacher") == ["t0"]
    assert r.role("a") == "student" and r.teachers == ["t0"]


def test_round_trip_through_json_keeps_ratings_and_params():
    r = Ratings(["t0"], ["s0", "s1"], TrueSkillParams(mu=10.0, sigma=3.0, beta=1.5))
    r.record("t0", "s0", MatchResult.TEACHER)
    r.record("t0", "s1", MatchResult.DRAW)
    back = Ratings.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.params == r.params
    for name in ("t0", "s0", "s1"):
        assert back.get(name).mu == r.get(name).mu
        assert back.get(name).sigma == r.get(name).sigma
        assert back.role(name) == r.role(name)
        assert back.played(name) == r.played(name)
    # the restored league keeps evolving exactly like the original
    r.record("t0", "s1", MatchResult.STUDENT)
    back.record("t0", "s1", MatchResult.STUDENT)
    assert back.get("s1").mu == r.get("s1").mu
    # a checkpoint from before match counts: every member counts as a veteran (unprotected)
    old = r.to_dict()
    for m in old["members"]:
        del m["played"]
    assert Ratings.from_dict(old).played("s1") >= 10**6


def test_bad_input_gets_clear_errors():
    with pytest.raises(ValueError, match="unique"):
        Ratings(["x"], ["x"])
    with pytest.raises(ValueError, match="at least one"):
        Ratings([], ["s"])
    r = league()
    with pytest.raises(KeyError, match="unknown league member"):
        r.get("nobody")
    with pytest.raises(ValueError, match="teacher vs student"):
        r.record("s0", "t0", MatchResult.DRAW)
    with pytest.raises(ValueError, match="sigma > 0"):
        r.set("s0", 25.0, 0.0)


@pytest.mark.parametrize("params", [None, TrueSkillParams(beta=1.0, draw_probability=0.3)])
def test_matches_update_as_the_library_does(params):
    """Teacher wins, student wins and draws move both ratings as trueskill.rate_1vs1 does in
    the same environment (the library's defaults when no params are given)."""
    r = Ratings(["t0"], ["s0"], params)
    env = params.env() if params else trueskill.TrueSkill()
    t, s = env.create_rating(), env.create_rating()
    for result in (MatchResult.TEACHER, MatchResult.STUDENT, MatchResult.DRAW):
        r.record("t0", "s0", result)
        if result is MatchResult.STUDENT:
            s, t = trueskill.rate_1vs1(s, t, env=env)
        else:
            t, s = trueskill.rate_1vs1(t, s, drawn=result is MatchResult.DRAW, env=env)
        for name, want in (("t0", t), ("s0", s)):
            got = r.get(name)
            assert (got.mu, got.sigma) == pytest.approx((want.mu, want.sigma), rel=1e-12)
