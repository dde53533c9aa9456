"""code_o: prompts, proposal parsing, verification and checking through the real sandbox."""

import pytest

from lorapop.tasks import Draft, Outcome, Task, get_family
from lorapop.tasks.task import FormatError

REV = "def f(xs):\n    return sorted(xs)[::-1]"
TASK = Task("code_o", REV, ("[3, 1, 2]",), ("[3, 2, 1]",))


def proposal(program: str, inp: str) -> str:
    return (
        f"<think>plan</think>\n<answer>\n```python\n{program}\n```\n```input\n{inp}\n```\n</answer>"
    )


@pytest.fixture(scope="module")
def fam():
    return get_family("code_o")


@pytest.fixture(scope="module")
def compact():
    return get_family("code_o", template="compact")


# -- prompts ----------------------------------------------------------------------------


def test_teacher_prompt_shows_references_in_both_templates(fam, compact):
    refs = [TASK, *fam.seed_tasks()]
    azr = fam.teacher_prompt(refs)
    assert azr.endswith("Assistant: <think>") and "<answer>" in azr
    assert REV in azr and "[3, 2, 1]" in azr and "'Hello World'" in azr
    assert "<reference 2>" in azr
    small = compact.teacher_prompt(refs)
    assert small.endswith("<f>") and "<o>[3, 2, 1]</o>" in small
    assert len(small) < len(azr) / 3


def test_long_reference_outputs_are_capped(fam, compact):
    long = Task("code_o", REV, ("1",), ("'" + "x" * 5000 + "'",))
    for f in (fam, compact):
        p = f.teacher_prompt([long])
        assert "x" * 401 not in p and "…(truncated)" in p


def test_student_prompt_hides_the_output(fam, compact):
    for f in (fam, compact):
        p = f.student_prompt(TASK)
        assert REV in p and "[3, 1, 2]" in p and "[3, 2, 1]" not in p
    assert compact.student_prompt(TASK).endswith("<o>")


def test_unknown_template_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown template"):
        get_family("code_o", template="chatml")


# -- parsing teacher text -----------------------------------------------------------------


def test_parse_good_and_azr_fallbacks(fam):
    assert fam.parse_proposal(proposal(REV, "[3, 1, 2]")) == Draft(REV, ("[3, 1, 2]",))
    # no <answer> tags: blocks anywhere in the text (AZR's fallback)
    bare = f"```python\n{REV}\n```\n```input\n[1]\n```"
    assert fam.parse_proposal(bare) == Draft(REV, ("[1]",))
    # `# Input:` line instead of an input block
    hashed = f"<answer>```python\n{REV}\n```\n# Input: [2, 1]</answer>"
    assert fam.parse_proposal(hashed).inputs == ("[2, 1]",)
    # the only function gets renamed to f, with its recursive calls
    rec = "def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)"
    p = fam.parse_proposal(proposal(rec, "5"))
    assert "def f(n)" in p.program and "f(n - 1)" in p.program and "fact" not in p.program


def test_parse_takes_first_blocks_of_the_last_answer(fam):
    text = (
        "<answer>```python\ndef f(a):\n    return 0\n```\n```input\n0\n```</answer> wait, better:"
        + proposal(REV, "[1, 2]")
        + proposal(REV, "[9]")[len("<think>plan</think>\n") :]
    )
    assert fam.parse_proposal(text) == Draft(REV, ("[9]",))
    two = f"<answer>```python\n{REV}\n```\n```python\nx = 1\n```\n```input\n[1]\n```\n```input\n[2]\n```</answer>"
    assert fam.parse_proposal(two) == Draft(REV, ("[1]",))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "I refuse.",
        "<answer>```python\ndef f(a):\n    return a\n```</answer>",  # no input
        "<answer>```input\n1\n```</answer>",  # no program
        "<answer>```python\ndef f(a):\n    return a\n```\n```input\n1), g(2\n```</answer>",
        "<answer>```python\ndef f(a):\n    return a\n```\n```input\n1\n",  # unclosed everything
        "```" * 40_000,  # huge and fence-ridden
    ],
)
def test_parse_malformed_gives_format_error(fam, text):
    assert isinstance(fam.parse_proposal(text), FormatError)


def test_compact_parse(compact):
    assert compact.parse_proposal(f"{REV}</f><i>[3, 1, 2]</i>") == Draft(REV, ("[3, 1, 2]",))
    assert compact.parse_proposal(f"<f>{REV}</f><i>[1]") == Draft(REV, ("[1]",))
    assert isinstance(compact.parse_proposal(f"{REV}"), FormatError)  # unclosed <f> eats all


# -- verification -------------------------------------------------------------------------


def test_verify_valid_and_invalid_in_one_batch(fam, sandbox):
    texts = [
        proposal(REV, "[3, 1, 2]"),
        "garbage",
        proposal("def f(a):\n    return 1 // a", "0"),
        proposal("def f(a):\n    return list({'x', 'y', 'z', 'w'})", "0"),
        proposal("def f(a):\n    while True:\n        a += 1", "0"),
        proposal("def f(a):\n    return __import__('subprocess').run(['ls'])", "0"),
        proposal("def f(a):\n    return 'x' * a", "1000"),
        proposal(
            "class A:\n    def __repr__(self):\n        return '<A>'\ndef f(a):\n    return A()",
            "0",
        ),
        proposal("import os\ndef f(a):\n    return os.environ", "0"),
    ]
    v = fam.verify(texts, sandbox, teachers=["t3"] * len(texts), step=7)
    assert [x.valid for x in v] == [True] + [False] * 8
    assert v[0].task == Task("code_o", REV, ("[3, 1, 2]",), ("[3, 2, 1]",), teacher="t3", step=7)
    assert v[1].format_error and v[1].reason.startswith("format:")
    assert v[2].reason.startswith("runtime_error") and "ZeroDivisionError" in v[2].reason
    assert v[3].reason.startswith("nondeterministic")
    assert v[4].reason.startswith("timeout")
    assert v[5].reason.startswith("banned")
    assert "output longer than" in v[6].reason
    assert v[7].reason == "output is not a Python expression"
    assert v[8].reason.startswith("banned")
    assert not any(x.format_error for x in v[2:])


# -- checking -----------------------------------------------------------------------------


def ans(x: str) -> str:
    return f"<think>let me see</think> <answer>{x}</answer>"


def test_check_outcomes(fam, sandbox):
    texts = [
        ans("[3, 2, 1]"),
        ans("```output\n[3, 2, 1]\n```"),
        ans("[3, 2, 1.0]"),  # equal in value, as in AZR
        ans("[1, 2, 3]"),
        "[3, 2, 1]",  # no answer tags
        "<answer>[3, 2, 1]",  # unclosed
        ans(""),
        ans("x = [3, 2, 1]"),
        ans("f([3, 1, 2])"),  # would be correct if it could run f: computing is not answering
        ans("(lambda: [3, 2, 1])()"),
        ans("type('X', (), {'__eq__': lambda s, o: True})()"),
        ans("__import__('os').system('echo pwned')"),
        ans("list((3, 2, 1))"),  # a constructor call states a value: goes to the sandbox
        ans("list(range(1000000000000))"),  # so does this one, which runs out of memory or time
    ]
    got = [g.outcome for g in fam.check([TASK] * len(texts), texts, sandbox)]
    C, W, F = Outcome.CORRECT, Outcome.WRONG, Outcome.FORMAT_ERROR
    assert got == [C, C, C, W, F, F, F, F, F, F, F, F, C, W]


def test_check_non_literal_gold_in_the_sandbox(fam, sandbox):
    prog = "def f(a):\n    return frozenset(a)"
    [v] = fam.verify([proposal(prog, "[1, 2]")], sandbox)
    assert v.valid and v.task.output == "frozenset({1, 2})"
    texts = [ans("frozenset({2, 1})"), ans("{1, 2}"), ans("{1, 3}"), ans("frozenset()")]
    got = [g.outcome for g in fam.check([v.task] * 4, texts, sandbox)]
    # equal in value as Python's == says: a set equals a frozenset with the same items
    assert got == [Outcome.CORRECT, Outcome.CORRECT, Outcome.WRONG, Outcome.WRONG]


def test_check_compact(compact, sandbox):
    got = compact.check([TASK] * 3, ["[3, 2, 1]</o>", "[3, 2, 1]", "<o>[1]</o>"], sandbox)
    assert [g.outcome for g in got] == [Outcome.CORRECT, Outcome.CORRECT, Outcome.WRONG]


def test_check_length_mismatch_is_an_error(fam, sandbox):
    with pytest.raises(ValueError):
        fam.check([TASK], [], sandbox)


def test_adversarial_answer_texts_are_format_errors(fam, sandbox):
    texts = [
        "<answer>" + "[" * 150_000 + "</answer>",  # longer than any generation
        ans("[" * 3000 + "]" * 3000),  # past the parser's nesting limit
        ans("1" * 30_000),  # longer than an answer may be
        "<think>" * 5000 + "<answer>" * 5000,  # tags, no answer
        ans("[3, 2, 1]\n```\n```python\nimport os\n```"),  # a fenced block after the answer
    ]
    got = fam.check([TASK] * len(texts), texts, sandbox)
    assert [g.outcome for g in got[:4]] == [Outcome.FORMAT_ERROR] * 4
    assert got[4].outcome is not Outcome.CORRECT  # "import os" is the answer, not [3, 2, 1]


def test_check_class_and_special_float_golds(fam, sandbox):
    prog = (
        "class P:\n    def __init__(self, x, y=0):\n        self.x, self.y = x, y\n"
        "    def __repr__(self):\n        return f'P({self.x!r}, {self.y!r})'\n"
        "def f(a):\n    return [P(a, a + 1), float('nan'), -float('inf')]"
    )
    [v] = fam.verify([proposal(prog, "1")], sandbox)
    assert v.valid and v.task.output == "[P(1, 2), nan, -inf]"
    texts = [
        ans("[P(1, 2), nan, -inf]"),
        ans("[P(y=2, x=1), float('nan'), float('-inf')]"),  # evaluated in the sandbox
        ans("[P(1, 3), nan, -inf]"),
        ans("[P(1, 2), nan, inf]"),
    ]
    got = [g.outcome for g in fam.check([v.task] * len(texts), texts, sandbox)]
    assert got == [Outcome.CORRECT, Outcome.CORRECT, Outcome.WRONG, Outcome.WRONG]
