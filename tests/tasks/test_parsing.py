from lorapop.tasks.parsing import (
    MAX_TEXT_CHARS,
    answer_span,
    call_args,
    cap,
    fenced_blocks,
    literal,
    opened,
    python_expr,
    strip_fence,
    tag_blocks,
)


def test_answer_span_takes_last_complete_block():
    text = "<think>maybe <answer>1</answer>?</think> <answer> 2 </answer> <answer>3"
    assert answer_span(text) == " 2 "
    assert answer_span("<answer>unclosed") is None
    assert answer_span("no tags") is None
    assert answer_span("</answer> only a close") is None


def test_fenced_blocks_tags_inline_and_unclosed():
    text = (
        "```python\ndef f(a):\n    return a\n```\n```input 5```\n"
        "```\nplain\n```\n```PY\nx = 1\n```\n```output\nunclosed"
    )
    assert fenced_blocks(text) == [
        ("python", "def f(a):\n    return a"),
        ("input", "5"),
        ("", "plain"),
        ("python", "x = 1"),
    ]


def test_tag_blocks_and_opened():
    assert tag_blocks("<i>1</i> x <i>2</i><i>3", "i") == ["1", "2", "3"]
    assert tag_blocks(opened("5</o>", "o"), "o") == ["5"]
    assert tag_blocks(opened("<o>5</o>", "o"), "o") == ["5"]  # the model repeated the tag


def test_call_args_rejects_escapes_from_the_call():
    assert call_args("[1, 2], 'a'") == "[1, 2], 'a'"
    assert call_args("*ys, x=1") == "*ys, x=1"
    assert call_args("1), g(2") is None  # would turn f(...) into a tuple of two calls
    assert call_args("1)(2") is None  # calls the result of f
    assert call_args("1) if 0 else (2") is None
    assert call_args("1 # )") == "1"  # comments are gone after normalisation
    assert call_args("") is None
    assert call_args("def") is None


def test_python_expr_normalises_and_rejects_statements():
    assert python_expr("[1,2]") == "[1, 2]"
    assert python_expr("1, 2") == "(1, 2)"
    assert python_expr("import os") is None
    assert python_expr("x = 1") is None
    assert python_expr("  ") is None
    assert python_expr("(" * 500 + ")" * 500) is None  # parser nesting limit, no crash


def test_literal_never_runs_code():
    assert literal("{'a': (1, 2.5)}") == (True, {"a": (1, 2.5)})
    assert literal("__import__('os').system('true')") == (False, None)
    assert literal("10**10**10")[0] is False  # no arithmetic evaluation


def test_strip_fence_and_cap():
    assert strip_fence("\n```output\n42\n```\n") == "42"
    assert strip_fence(" 42 ") == "42"
    assert cap("x" * 10, 4) == "xxxx …(truncated)"
    assert cap("abc", 4) == "abc"


def test_huge_adversarial_text():
    # linear scans: a backtracking regex would take minutes on this (no time assert here)
    n = MAX_TEXT_CHARS // 3
    text = "```" * n + "<answer>" * 10_000
    assert len(fenced_blocks(text)) == (n - 1) // 2
    assert answer_span(text) is None
    assert len(tag_blocks(text, "answer")) == 1  # the first, unclosed, runs to the end
