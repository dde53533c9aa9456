"""experiments/regime/regime_measure.py: the regime measurement on the shipped model."""

import pytest

from lorapop.tiny.generator import normalize
from regime_measure import measure_world, regime_checks, similarity, world_pools


def test_similarity_ignores_formatting() -> None:
    a = "def f(n):\n    return n + 1\n"
    assert similarity(a, "def f(n):\n    return (n + 1)  # same\n") == 1.0
    assert similarity(a, "def f(s):\n    return s[::-1].upper()\n") < 0.8
    assert normalize(a) == "def f(n):\n    return n + 1"


def test_measure_world_on_the_shipped_model(tiny_sandbox) -> None:
    from lorapop.engine.load import load_base_model, load_tokenizer

    tok = load_tokenizer("tiny")
    tok.padding_side = "left"
    model = load_base_model("tiny", tok, "cpu", "float32")
    pools = world_pools(4, tiny_sandbox, levels=(1,))
    m = measure_world(model, tok, tiny_sandbox, pools, proposals=4, answers=2,
                      teacher_max_new_tokens=96, seed=0)  # fmt: skip
    assert set(m["valid_rate"]) == {"code_o", "code_i", "code_f"}
    assert all(0 <= v <= 1 for v in m["valid_rate"].values())
    assert m["valid_tasks"] > 0 and set(m["solve_rate_by_level"]) == {"1"}
    shares = m["share_partial"] + m["share_unsolved"] + m["share_all_solved"]
    assert shares == pytest.approx(1.0)
    dep = m["reference_dependence"]
    if dep["n"]:
        assert 0 <= dep["unshown_similarity"] <= 1 and 0 <= dep["shown_similarity"] <= 1
    n, v = 3 * 4, m["valid_tasks"]  # invalid proposals count -1 in the reward landscape
    mean_valid = m["teacher_reward_valid"]["mean"] or 0.0
    assert m["teacher_reward_by_level"]["1"] == pytest.approx((v * mean_valid - (n - v)) / n)
    drift = m["complexity_drift_by_level"]  # level-1 references: straight-line, cyclomatic 1
    assert set(drift) <= {"1"} and all(d is None or d >= 0 for d in drift.values())
    checks = regime_checks(m)
    assert checks["solves_fewer_at_levels_4_5"] is None  # levels 4-5 not measured here
