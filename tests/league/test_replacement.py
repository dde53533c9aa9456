import random
from collections import Counter

import pytest

from lorapop.league.ratings import MatchResult, Ratings
from lorapop.league.replacement import Replacement, plan_replacement, rate_children

OPS = {"gaussian": 1.0, "svd_crossover": 1.0}
CROSS = {"svd_crossover"}


def pool() -> Ratings:
    """Students ranked s3 > s1 > s0 > s2 > s4 by conservative rating."""
    r = Ratings(["t0"], ["s0", "s1", "s2", "s3", "s4"])
    for name, mu in {"s0": 25, "s1": 28, "s2": 22, "s3": 31, "s4": 19}.items():
        r.set(name, float(mu), 2.0)
    return r


def test_bottom_members_are_replaced_by_children_of_the_top():
    r = pool()
    plan = plan_replacement(r, "student", random.Random(0), OPS, CROSS, 0.4, 0.4)
    assert [p.target for p in plan] == ["s4", "s2"]
    for p in plan:
        assert set(p.parents) <= {"s3", "s1"}
        assert len(p.parents) == (2 if p.operator in CROSS else 1)
        if len(p.parents) == 2:
            assert p.parents == ("s3", "s1")  # fitter first
    assert r.ranked("teacher") == ["t0"]  # the other pool is not touched


def test_never_parent_and_target_and_reproducible():
    r = pool()
    ops_seen = Counter()
    for seed in range(50):
        plan = plan_replacement(r, "student", random.Random(seed), OPS, CROSS, 0.4, 1.0)
        targets = {p.target for p in plan}
        parents = {q for p in plan for q in p.parents}
        assert not targets & parents
        assert plan == plan_replacement(r, "student", random.Random(seed), OPS, CROSS, 0.4, 1.0)
        ops_seen.update(p.operator for p in plan)
    assert set(ops_seen) == set(OPS)  # the mix is used


def test_operator_weights_and_single_parent_pools():
    r = pool()
    plan = plan_replacement(r, "student", random.Random(0), {"a": 0.0, "b": 1.0}, (), 0.4)
    assert {p.operator for p in plan} == {"b"}
    # one possible parent: crossovers are left out of the mix
    plan = plan_replacement(r, "student", random.Random(0), OPS, CROSS, 0.4, 0.2)
    assert all(p.operator == "gaussian" and p.parents == ("s3",) for p in plan)
    with pytest.raises(ValueError, match="crossover"):
        plan_replacement(r, "student", random.Random(0), {"svd_crossover": 1}, CROSS, 0.4, 0.2)
    with pytest.raises(ValueError, match="operators"):
        plan_replacement(r, "student", random.Random(0), {}, CROSS)


def test_small_pools_and_fractions():
    r = Ratings(["t0"], ["s0", "s1"])
    assert plan_replacement(r, "student", random.Random(0), OPS, CROSS, 0.25) == []
    assert plan_replacement(r, "teacher", random.Random(0), OPS, CROSS, 0.9) == []
    with pytest.raises(ValueError, match="fraction"):
        plan_replacement(r, "student", random.Random(0), OPS, CROSS, 1.0)


def test_child_ratings_reset_and_inherit():
    r = pool()
    plan = [
        Replacement("s4", ("s3", "s1"), "svd_crossover", 1),
        Replacement("s2", ("s3",), "gaussian", 2),
    ]
    rate_children(r, plan, "inherit", sigma_scale=1.5)
    assert r.get("s4").mu == pytest.approx((31 + 28) / 2)
    assert r.get("s4").sigma == pytest.approx(3.0)  # no floor at half the prior
    assert r.get("s2").mu == pytest.approx(31.0)
    assert r.played("s4") == r.played("s2") == 0
    rate_children(r, plan[1:], "inherit", sigma_scale=10.0)
    assert r.get("s2").sigma == pytest.approx(r.params.sigma)  # capped at the prior
    rate_children(r, plan, "reset")
    assert (r.get("s4").mu, r.get("s4").sigma) == (r.params.mu, r.params.sigma)
    with pytest.raises(ValueError, match="policy"):
        rate_children(r, plan, "copy")
    with pytest.raises(ValueError, match="sigma_scale"):
        rate_children(r, plan, "inherit", sigma_scale=0.5)


def test_a_child_does_not_start_last_and_is_protected_until_it_has_played():
    """A child born with sigma >= 4.17 would rank last at the next event, so one slot would
    be re-rolled at every event. It starts next to its parent and is not a target until
    it has played `protect_matches` matches."""
    r = pool()
    for name in r.students:
        r.set(name, r.get(name).mu, 1.5, played=100)
    plan = plan_replacement(r, "student", random.Random(0), {"copy": 1.0}, (), 0.2, 0.2)
    assert [(p.target, p.parents) for p in plan] == [("s4", ("s3",))]
    rate_children(r, plan, "inherit", sigma_scale=2.0)
    assert r.ranked("student")[-1] != "s4"  # mu 31, sigma 3: above s2 (22 - 4.5)
    r.record("t0", "s4", MatchResult.TEACHER)
    r.set("s4", 15.0, 3.0, played=r.played("s4"))  # it has done badly and ranks last
    assert r.ranked("student")[-1] == "s4"
    protected = plan_replacement(r, "student", random.Random(0), {"copy": 1.0}, (), 0.2, 0.2, 2)
    assert [p.target for p in protected] == ["s2"]  # the weakest member it may replace
    r.record("t0", "s4", MatchResult.TEACHER)
    assert r.played("s4") == 2
    served = plan_replacement(r, "student", random.Random(0), {"copy": 1.0}, (), 0.2, 0.2, 2)
    assert [p.target for p in served] == ["s4"]


def test_protection_can_leave_nothing_to_replace():
    r = Ratings(["t0"], ["s0", "s1"])
    r.set("s0", 30.0, 1.0, played=50)
    r.set("s1", 20.0, 1.0, played=5)  # the only possible target is still protected
    assert plan_replacement(r, "student", random.Random(0), OPS, CROSS, 0.5, 0.5, 10) == []
    assert plan_replacement(r, "student", random.Random(0), OPS, CROSS, 0.5, 0.5, 5) != []
    with pytest.raises(ValueError, match="protect_matches"):
        plan_replacement(r, "student", random.Random(0), OPS, CROSS, 0.5, 0.5, -1)
