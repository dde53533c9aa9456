"""The league's mechanics on synthetic matches between members of fixed hidden skill.

Each slot has a hidden skill that never changes (a child is as good as the slot it
overwrites: replacement is judged only on how it picks targets and rates children). A
match's solve rate is drawn from the skills as in the loop: 24 answers, of which the 8
code_f answers always fail, each other answer right with probability
``sigmoid(student skill - teacher skill - offset)``. Matchmaking, outcomes, replacement
and child ratings are the real ones with the config's defaults, 4 + 4, evolution every 10.
"""

import itertools
import math
import random
from collections import Counter
from statistics import fmean

from lorapop.config import Config
from lorapop.league import Ratings, match, match_results, plan_replacement, rate_children

CFG = Config()
SKILLS = [0.0, 0.6, 1.2, 1.8]  # logits: the weakest answers ~0.35 where the strongest ~0.5


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a: (concordant - discordant pairs) / pairs; a tie counts as neither."""
    pairs = list(itertools.combinations(range(len(a)), 2))
    signs = [(a[i] - a[j]) * (b[i] - b[j]) for i, j in pairs]
    return (sum(x > 0 for x in signs) - sum(x < 0 for x in signs)) / len(pairs)


def simulate(seed: int, steps: int = 300, every: int = 10, offset: float = 0.0,
             center: str = CFG.league.outcome_center, skills: list[float] = SKILLS,
             per_teacher: int = CFG.league.students_per_teacher):
    """Targets of every replacement, and the within-pool Kendall tau between the ratings
    and the hidden skills when the last replacement is decided (the order it acts on)."""
    rng = random.Random(seed)
    teachers, students = [f"T{i}" for i in range(4)], [f"S{i}" for i in range(4)]
    skill = {m: k for pool in (teachers, students)
             for m, k in zip(pool, rng.sample(skills, 4), strict=True)}
    ratings, ev = Ratings(teachers, students), CFG.evolve
    targets, taus = Counter(), []
    for step in range(1, steps + 1):
        pairs = match(ratings, rng, per_teacher, CFG.league.pfsp)
        rates = []
        for t, s in pairs:
            p = 1 / (1 + math.exp(-(skill[s] - skill[t] - offset)))
            rates.append(sum(rng.random() < p for _ in range(16)) / 24)
        outcomes = match_results(rates, CFG.league.draw_margin, center)
        for (t, s), outcome in zip(pairs, outcomes, strict=True):
            ratings.record(t, s, outcome)
        if every and step % every == 0 or step == steps:
            taus = [kendall_tau([ratings.conservative(m) for m in pool], [skill[m] for m in pool])
                    for pool in (teachers, students)]
        if every and step % every == 0:
            for role in ("teacher", "student"):
                plan = plan_replacement(ratings, role, rng, ev.operators, (), ev.fraction,
                                        ev.parent_fraction, ev.protect_matches)
                targets.update(r.target for r in plan)
                rate_children(ratings, plan, ev.child_rating, ev.sigma_scale)
    return targets, steps // every if every else 0, taus, skill


def test_kendall_tau():
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([3, 2, 1], [10, 20, 30]) == -1.0
    assert kendall_tau([1, 1, 1], [10, 20, 30]) == 0.0  # equal ratings order nothing


def test_replacement_spreads_over_the_weakest_and_ratings_recover_the_order():
    taus = []
    for seed in range(4):
        targets, events, tau, skill = simulate(seed)
        taus += tau
        for pool in "TS":
            by_skill = sorted((m for m in skill if m[0] == pool), key=skill.get)
            hits = [targets[m] for m in by_skill]  # weakest first
            assert sum(hits) >= events * 0.9  # one target per event, few skipped
            # not one slot re-rolled: the two weakest share the events...
            assert min(hits[:2]) >= events * 0.25, (seed, pool, hits)
            assert sum(hits[2:]) <= events * 0.15, (seed, pool, hits)
            # ...and no slot but the weakest is hit at more than about half of them
            assert max(hits[1:]) <= events * 0.55, (seed, pool, hits)
    assert fmean(taus) >= 0.7, taus


def test_members_of_equal_skill_are_not_one_slot_re_rolled():
    """Equal skills (members that barely differ, as in the world runs) and 2 matches a step
    per teacher, so protection lapses at the next event: a child, whose sigma is still wider
    than its peers', is not culled for that alone (ranked by mu - 3 sigma one slot was the
    target at 23-29 of 30 events in 3 of 8 pools)."""
    for seed in range(4):
        targets, events, _, _ = simulate(seed, skills=[0.6] * 4, per_teacher=2)
        for pool in "TS":
            hits = sorted((targets[f"{pool}{i}"] for i in range(4)), reverse=True)
            assert sum(hits) >= events * 0.9 and hits[0] <= events * 0.6, (seed, pool, hits)
            assert hits[1] >= events * 0.15, (seed, pool, hits)


def test_relative_outcomes_rank_skill_where_most_answers_fail():
    """At offset 2.5 the league solves ~5% of answers (the tiny world's early steps): with
    the absolute center nearly every match is a teacher win and the order is half lost."""
    def mean_tau(center: str) -> float:
        return fmean(t for seed in range(3)
                     for t in simulate(seed, 300, 0, offset=2.5, center=center)[2])

    assert mean_tau("relative") >= 0.85
    assert mean_tau("absolute") <= 0.6
