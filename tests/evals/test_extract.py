import math

import pytest

from lorapop.evals.extract import answer_span, code_block, last_boxed
from lorapop.evals.literal import NotLiteral, parse, source
from lorapop.evals.oracle import Oracle, allclose


def test_answer_and_boxed():
    text = "<think>maybe \\boxed{1}</think> <answer>so \\boxed{\\frac{1}{2}} </answer>"
    assert answer_span(text) == "so \\boxed{\\frac{1}{2}}"
    assert last_boxed(text) == "\\frac{1}{2}"
    assert last_boxed("\\boxed{a{b}c} and \\boxed{unclosed") == "a{b}c"
    assert answer_span("<answer> 42") == "42"  # unclosed last tag runs to the end
    assert answer_span("no tags") is None


def test_code_block_prefers_the_entry_point():
    text = "```python\ndef helper():\n    pass\n```\nthen\n```python\ndef add(a, b):\n    return a+b\n```\n```python\nprint(add(1, 2))\n```"
    assert "def add" in code_block(text, "add")
    assert code_block("</think>def f(x):\n    return x") == "def f(x):\n    return x"
    assert code_block("```python\ndef g():\n    return 1") == "def g():\n    return 1"  # unclosed


def test_literal_roundtrip_and_refusal():
    for v in [1, -2.5, (1,), [1, (2, 3)], {1, 2}, set(), {"a": [1]}, 1 + 2j, None, b"x", "q'"]:
        assert parse(repr(v)) == v
        assert eval(source(v)) == v  # noqa: S307 - our own literal source
    assert math.isnan(parse("nan")) and parse("[inf, -inf]") == [math.inf, -math.inf]
    for hostile in ["__import__('os')", "(lambda: 1)()", "[x for x in ()]", "a.b"]:
        with pytest.raises(NotLiteral):
            parse(hostile)


def test_oracle_matches_evalplus():
    o = Oracle("humaneval", "f", 0.0)
    assert o(3, 3, [1]) and not o(3, 4, [1])
    mixed = ([1.0, 2.0000001], [1.0, 2])  # exp not all floats: exact match only ...
    assert not Oracle("humaneval", "f", 0.0)(*mixed, [1])
    assert o(1.0000001, 1.0, [1])  # ... a float exp forces atol 1e-6
    assert o(*mixed, [1])  # and evalplus keeps that atol for the rest of the run
    assert not Oracle("humaneval", "f", 0.0)(1, 1.0000001, [1])  # int vs float: type differs
    assert not Oracle("humaneval", "f", 0.0)([1.0, 2.0], [1.0], [1])
    assert Oracle("mbpp", "similar_elements", 0.0)((4, 5), (5, 4), [])
    assert Oracle("humaneval", "find_zero", 1e-6)(1.0, 0.0, [[-1.0, 1.0]])  # root of x - 1
    assert not Oracle("humaneval", "find_zero", 1e-6)(0.0, 1.0, [[-1.0, 1.0]])
    assert allclose([1.0, [2.0]], [1.0, [2.0 + 1e-9]], 1e-7, 1e-6)
    assert not allclose(math.nan, math.nan, 1e-7, 1e-6)
