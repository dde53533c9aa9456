"""A world's input domain: the values a proposal's inputs may take, checked without running them."""

import pytest

from lorapop.config import Config
from lorapop.tasks import get_family
from lorapop.tasks.domain import InputDomain, WorldRules

NARROW = InputDomain(int_min=-5, int_max=9, str_chars=4, items=4)


@pytest.mark.parametrize("args", [
    "3", "-5", "9", "+2", "'abcd'", "''", "b'ab'", "[1, 2, -3, 9]", "(1, 'ab')", "{'a': 1, 'b': 9}",
    "{1, 2}", "True, None", "[[1], [2, 3]]", "x=4", "2.5", "'ab', [1], {'c': -1}",
])  # fmt: skip
def test_stated_values_inside_the_bounds_are_inside(args):
    assert NARROW.problem(args) is None


@pytest.mark.parametrize("args, why", [
    ("14", "the number 14"), ("-6", "the number -6"), ("'abcde'", "5 characters"),
    ("[1, 2, 3, 4, 5]", "5 items"), ("{'a': 1, 'b': 2, 'c': 3, 'd': 4, 'e': 5}", "5 items"),
    ("[[1, 2], [3, 40]]", "the number 40"), ("{'abcdef': 1}", "6 characters"), ("{1: 99}", "99"),
    ("3, 'zzzzzzz'", "7 characters"), ("x=100", "the number 100"), ("1e9", "1000000000.0"),
    ("float('inf')", "computes"), ("'ab' * 9", "computes"), ("2 + 3", "computes"),
    ("-(30)", "number -30"), ("-x", "computes"), ("*[1, 2]", "computes"), ("**{'a': 1}", "computes"),
    ("{**{'a': 1}}", "computes"), ("[i for i in range(3)]", "computes"), ("1j", "complex"),
    ("'a'.upper()", "computes"), ("1), (2", "argument list"), ("(", "not an argument list"),
    ("[" * 300 + "]" * 300, "argument list|nests"),
])  # fmt: skip
def test_values_outside_or_computed_are_outside_with_a_reason(args, why):
    problem = NARROW.problem(args)
    assert problem is not None
    assert any(w in problem for w in why.split("|")), problem


def test_bounds_are_checked_when_made():
    with pytest.raises(ValueError, match="int_min <= int_max"):
        InputDomain(int_min=3, int_max=2, str_chars=4, items=4)
    cfg = Config.model_validate({"tasks": {"input_domain": {"int_min": -5, "int_max": 9,
                                                              "str_chars": 4, "items": 4}}})
    assert cfg.tasks.input_domain == NARROW
    with pytest.raises(ValueError, match="int_min <= int_max"):
        Config.model_validate({"tasks": {"input_domain": {"int_min": 9, "int_max": -5,
                                                            "str_chars": 4, "items": 4}}})


def test_a_proposal_outside_the_domain_is_invalid_not_a_format_error(sandbox):
    """Each family refuses it before it runs; the same proposals are valid without a domain."""
    prog = "def f(s):\n    return len(s)"
    texts = [f"{prog}</f><i>'abc'</i>", f"{prog}</f><i>'abcdefg'</i>", f"{prog}</f><i>'ab' * 9</i>"]
    for kind in ("code_o", "code_i"):
        bounded = get_family(kind, template="compact", rules=WorldRules(inputs=NARROW)).verify(texts, sandbox)
        assert [v.valid for v in bounded] == [True, False, False]
        assert not any(v.format_error for v in bounded)
        assert "outside the world's input domain: a string of 7 characters" in bounded[1].reason
        free = get_family(kind, template="compact").verify(texts, sandbox)
        assert [v.valid for v in free] == [True, True, True]
    base = bounded[0].task
    code_f = get_family("code_f", template="compact", n_inputs=4, rules=WorldRules(inputs=NARROW))
    inside = "<i>'a'</i><i>'ab'</i><i>'abc'</i><i>''</i><m>length</m>"
    outside = "<i>'a'</i><i>'ab'</i><i>'abcde'</i><i>''</i><m>length</m>"
    v = code_f.verify([inside, outside], sandbox, bases=[base, base])
    assert [x.valid for x in v] == [True, False] and "input 2 outside" in v[1].reason


def test_outputs_outside_the_output_domain_and_dead_code_are_invalid(sandbox):
    """The other world rules: code_o/code_i refuse a program with a dead statement or an output
    outside the bounds, code_f an example output outside them; code_f's base program is the
    buffer's, not the teacher's, so its dead code is not held against the teacher."""
    rules = WorldRules(inputs=NARROW, outputs=NARROW, live_code=True)
    texts = ["def f(n):\n    return n * 2</f><i>3</i>", "def f(n):\n    return n * 3</f><i>4</i>",
             "def f(n):\n    m = n + 1\n    return n * 2</f><i>3</i>"]
    for kind in ("code_o", "code_i"):
        v = get_family(kind, template="compact", rules=rules).verify(texts, sandbox)
        assert [x.valid for x in v] == [True, False, False] and not any(x.format_error for x in v)
        assert "output outside the world's output domain: the number 12" in v[1].reason
        assert "dead code: line 2: `m = n + 1` stores a value never read" in v[2].reason
        free = get_family(kind, template="compact").verify(texts, sandbox)
        assert all(x.valid for x in free)
    base = get_family("code_o", template="compact").verify(texts[2:], sandbox)[0].task
    code_f = get_family("code_f", template="compact", n_inputs=4, rules=rules)
    small, large = "<i>1</i><i>2</i><i>3</i><i>4</i><m>double</m>", "<i>1</i><i>2</i><i>3</i><i>5</i><m>d</m>"
    v = code_f.verify([small, large], sandbox, bases=[base, base])
    assert [x.valid for x in v] == [True, False] and "input 3: output outside" in v[1].reason


def test_a_banned_call_makes_a_proposal_invalid_for_every_type(sandbox):
    """A world that leaves `count` out refuses `s.count(c)` and a bare `count(x)` in code_o,
    code_i and code_f proposals, with the reason; a name that only looks alike (`counts`, a
    variable `count`) is fine, and so is every proposal in a world without the rule."""
    rules = WorldRules(banned_calls=("count",))
    texts = ["def f(s):\n    return s.count('a')</f><i>'aba'</i>",
             "def f(count):\n    return count + 1</f><i>3</i>",
             "def f(s):\n    counts = len(s)\n    return counts</f><i>'ab'</i>",
             "def f(s):\n    return count(s)</f><i>'ab'</i>"]
    for kind in ("code_o", "code_i"):
        v = get_family(kind, template="compact", rules=rules).verify(texts[:3], sandbox)
        assert [x.valid for x in v] == [False, True, True] and not v[0].format_error
        assert v[0].reason == "calls count(), which the world leaves out"
        assert all(x.valid for x in get_family(kind, template="compact").verify(texts[:3], sandbox))
    assert rules.call_problem(texts[3].split("</f>")[0]) == "calls count(), which the world leaves out"
    assert rules.call_problem("def f(:") is None  # running it reports the syntax error
    base = get_family("code_o", template="compact").verify(texts[:1], sandbox)[0].task
    code_f = get_family("code_f", template="compact", n_inputs=4, rules=rules)
    v = code_f.verify(["<i>'a'</i><i>'ab'</i><i>'b'</i><i>''</i><m>a count</m>"], sandbox, bases=[base])
    assert not v[0].valid and "calls count()" in v[0].reason


def test_config_bundles_the_world_rules():
    cfg = Config.model_validate({"tasks": {
        "output_domain": {"int_min": -5, "int_max": 9, "str_chars": 4, "items": 4}, "live_code": True}})
    assert cfg.tasks.world_rules() == WorldRules(inputs=None, outputs=NARROW, live_code=True)
    assert Config().tasks.world_rules() == WorldRules()
    banned = Config.model_validate({"tasks": {"banned_calls": ["count"]}}).tasks.world_rules()
    assert banned == WorldRules(banned_calls=("count",))
