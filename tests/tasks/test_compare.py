"""compare: a value's text against a gold text, decided in the caller without running code."""

import pytest

from lorapop.tasks.compare import MATCH, MISMATCH, NOT_A_VALUE, judge, plain, tuple_items
from lorapop.tasks.parsing import value_names

NAMES = value_names("class Point:\n    pass\ndef f(a):\n    return a")


@pytest.mark.parametrize(
    ("value", "gold", "want"),
    [
        ("2", "2.0", MATCH),  # Python's ==, as in AZR
        ("[3, 2, 1.0]", "[3, 2, 1]", MATCH),
        ("True", "1", MATCH),
        ("{1, 2}", "frozenset({2, 1})", MATCH),
        ("set()", "frozenset()", MATCH),
        ("[1.0, inf, -inf]", "[1, inf, -inf]", MATCH),
        ("nan", "nan", MATCH),  # the same text is the same value, though nan != nan
        ("(inf+1j)", "(inf+1j)", MATCH),
        ("Point(1, 2)", "Point(1, 2)", MATCH),
        ("{'a': (1, [2])}", "{'a': (1, [2.0])}", MATCH),
        ("2", "3", MISMATCH),
        ("'2'", "2", MISMATCH),
        ("[1, 2]", "(1, 2)", MISMATCH),
        ("Point(1, 2)", "Point(1, 3)", MISMATCH),  # not plain: the text decides
        ("Point(1, 2)", "[1, 2]", MISMATCH),
        ("[1, nan]", "[1, 2]", MISMATCH),
        ("f(3)", "3", NOT_A_VALUE),  # calls f
        ("(lambda: 3)()", "3", NOT_A_VALUE),
        ("1 if True else 2", "1", NOT_A_VALUE),
        ("Other(1)", "Point(1)", NOT_A_VALUE),  # not a class of the program
        ("<__main__.A object at 0x7f>", "1", NOT_A_VALUE),
        ("[" * 3000 + "]" * 3000, "[]", NOT_A_VALUE),
        ("1" * 30_000, "1", NOT_A_VALUE),
    ],
)
def test_judge(value, gold, want):
    assert judge(value, gold, NAMES) == want


def test_plain_builds_only_builtin_values():
    assert plain("frozenset({1, (2, 3)})") == (True, frozenset({1, (2, 3)}))
    assert plain("{frozenset({1}): [set()]}") == (True, {frozenset({1}): [set()]})
    for text in ("Point(1)", "frozenset(x)", "set([[1]])", "frozenset({1}, 2)", "list((1,))", ""):
        assert plain(text) == (False, None)


def test_tuple_items_splits_a_tuple_repr():
    assert tuple_items("('a, b', [1, (2,)], Point(x=1))", 3) == [
        "'a, b'",
        "[1, (2,)]",
        "Point(x=1)",
    ]
    assert tuple_items("(5,)", 1) == ["5"]
    assert tuple_items("(P(\n 'é→x'), 'ü')", 2) == ["P(\n 'é→x')", "'ü'"]  # offsets are bytes
    assert tuple_items("(1, 2)", 3) is None
    assert tuple_items("[1, 2]", 2) is None
    assert tuple_items("True", 1) is None
    assert tuple_items("(1, *x)", 2) is None
    assert tuple_items("(1, 2", 2) is None
