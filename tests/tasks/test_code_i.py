"""code_i: the student finds any input giving the output; checked in the real sandbox."""

import pytest

from lorapop.tasks import Outcome, Task, get_family
from lorapop.tasks.task import FormatError

PROG = "def f(a, b):\n    return sorted(a)[b]"
TASK = Task("code_i", PROG, ("[5, 2, 9], 1",), ("5",))


def ans(x: str) -> str:
    return f"<think>work backwards</think><answer>{x}</answer>"


@pytest.fixture(scope="module")
def fam():
    return get_family("code_i")


def test_prompts_show_output_not_input():
    for tpl in ("azr", "compact"):
        p = get_family("code_i", template=tpl).student_prompt(TASK)
        assert PROG in p and "5" in p and "[5, 2, 9]" not in p
    assert get_family("code_i", template="compact").student_prompt(TASK).endswith("<i>")
    t = get_family("code_i").teacher_prompt([TASK])
    assert "find an input" in t and "[5, 2, 9], 1" in t


def test_parse_answer(fam):
    assert fam.parse_answer(ans("[1, 5], 1")) == "[1, 5], 1"
    assert fam.parse_answer(ans("```input\n[5], 0\n```")) == "[5], 0"
    assert isinstance(fam.parse_answer(ans("[1], 0), print(1")), FormatError)
    assert isinstance(fam.parse_answer("[1], 0"), FormatError)
    assert isinstance(fam.parse_answer(ans("   ")), FormatError)


def test_check_any_input_that_gives_the_output_counts(fam, sandbox):
    texts = [
        ans("[5, 2, 9], 1"),  # the teacher's own input
        ans("[5], 0"),  # another input with the same output
        ans("a=[5, 7], b=0"),  # keywords are fine
        ans("[5, 2, 9], 0"),  # wrong
        ans("[], 0"),  # IndexError in the sandbox: wrong, not a crash
        ans("[5.0], 0"),  # 5.0 == 5, as in AZR
        "no tags at all",
        ans("[5], f([5], 0) - 5"),  # computing the input is not stating it
        ans("[type('X', (), {'__eq__': lambda s, o: True, '__lt__': lambda s, o: True})()], 0"),
        ans("__import__('os').system('echo pwned'), 0"),
    ]
    got = [g.outcome for g in fam.check([TASK] * len(texts), texts, sandbox)]
    C, W, F = Outcome.CORRECT, Outcome.WRONG, Outcome.FORMAT_ERROR
    assert got == [C, C, C, W, W, C, F, F, F, F]


def test_hostile_teacher_class_cannot_make_every_answer_right(fam, sandbox):
    prog = (
        "class Any:\n    def __eq__(self, o):\n        return True\n"
        "    def __repr__(self):\n        return 'Any()'\n"
        "def f(a):\n    return Any() if a else 0"
    )
    [v] = fam.verify([f"<answer>```python\n{prog}\n```\n```input\n1\n```</answer>"], sandbox)
    assert v.valid and v.task.output == "Any()"
    got = fam.check([v.task] * 2, [ans("1"), ans("0")], sandbox)
    # the gold is not a plain value, so only the same repr matches: 0 is not Any()
    assert [g.outcome for g in got] == [Outcome.CORRECT, Outcome.WRONG]


def test_check_compact(sandbox):
    fam = get_family("code_i", template="compact")
    got = fam.check([TASK] * 2, ["[5], 0</i>", "[9], 0</i>"], sandbox)
    assert [g.outcome for g in got] == [Outcome.CORRECT, Outcome.WRONG]
