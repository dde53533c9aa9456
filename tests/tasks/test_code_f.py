"""code_f: inputs + message from a base program; the student writes f, checked on hidden pairs."""

import pytest

from lorapop.tasks import Outcome, Task, get_family
from lorapop.tasks.code import split_pairs
from lorapop.tasks.task import FormatError

BASE = Task("code_o", "def f(s):\n    return s[::-1].upper()", ("'ab'",), ("'BA'",))
INPUTS = ["'a'", "'ab'", "''", "'xyz'", "'Hello'", "'q r'", "'11'", "'aBc'", "'zz top'", "'!'"]


def proposal(inputs=INPUTS, message="reverse, then shout") -> str:
    blocks = "".join(f"```input\n{x}\n```\n" for x in inputs)
    return f"<think>pick inputs</think><answer>\n{blocks}```message\n{message}\n```\n</answer>"


def ans(program: str) -> str:
    return f"<think>pattern</think><answer>\n```python\n{program}\n```\n</answer>"


@pytest.fixture(scope="module")
def fam():
    return get_family("code_f")


@pytest.fixture(scope="module")
def task(fam, sandbox):
    [v] = fam.verify([proposal()], sandbox, bases=[BASE], teachers=["t1"], step=2)
    assert v.valid, v.reason
    return v.task


def test_verify_runs_every_input(task):
    assert task.type == "code_f" and task.program == BASE.program
    assert task.inputs == tuple(INPUTS) and task.message == "reverse, then shout"
    assert task.outputs[3] == "'ZYX'" and (task.teacher, task.step) == ("t1", 2)


def test_verify_rejections(fam, sandbox):
    texts = [
        proposal(INPUTS[:9]),  # too few
        proposal(message=""),  # no message
        proposal(INPUTS[:9] + ["'a'"]),  # duplicate
        proposal(INPUTS[:9] + ["5"]),  # 5[::-1] fails
        proposal(INPUTS[:9] + ["1), print(2"]),  # escapes the call
        proposal(message="m" * 1000),  # message too long for a prompt
    ]
    v = fam.verify(texts, sandbox, bases=[BASE] * len(texts))
    assert not any(x.valid for x in v)
    assert [x.format_error for x in v] == [True, True, False, False, True, False]
    assert v[2].reason == "duplicate inputs"
    assert v[3].reason.startswith("input 9: runtime_error")
    with pytest.raises(ValueError, match="base"):
        fam.verify(texts, sandbox)


def test_extra_inputs_keep_the_last_n(fam):
    p = fam.parse_proposal(proposal(["'junk'", *INPUTS]), BASE)
    assert p.inputs == tuple(INPUTS)


def test_student_sees_half_the_pairs_and_the_message(fam, task):
    visible, hidden = split_pairs(task)
    assert len(visible) == len(hidden) == 5
    for tpl in ("azr", "compact"):
        p = get_family("code_f", template=tpl).student_prompt(task)
        assert "reverse, then shout" in p
        assert all(i in p and o in p for i, o in visible)
        assert not any(o in p for _, o in hidden)
        assert BASE.program not in p


def test_teacher_prompt_needs_and_shows_the_base(fam):
    with pytest.raises(ValueError):
        fam.teacher_prompt([])
    for tpl in ("azr", "compact"):
        p = get_family("code_f", template=tpl).teacher_prompt(fam.seed_tasks(), base=BASE)
        assert BASE.program in p and "Hello World" in p


def test_seed_has_n_distinct_pairs():
    for n in (4, 10, 13):
        [seed] = get_family("code_f", n_inputs=n).seed_tasks()
        assert len(set(seed.inputs)) == n and seed.inputs == seed.outputs


def test_check_outcomes(fam, task, sandbox):
    texts = [
        ans("def f(s):\n    return ''.join(reversed(s)).upper()"),
        ans("def helper(s):\n    return s.upper()\n\ndef f(s):\n    return helper(s)[::-1]"),
        ans("def f(s):\n    return s.upper()"),  # fits some visible pairs, not all hidden ones
        ans("def f(s):\n    return s[::-1]"),
        ans("def f(s):\n    while True:\n        pass"),
        ans("import subprocess\ndef f(s):\n    return s"),  # static checks apply
        ans("def g(s):\n    return s"),  # no f
        ans("def f(s) return s"),  # does not parse
        "```python\ndef f(s):\n    return s[::-1].upper()\n```",  # no answer tags
        ans("class A:\n    def __eq__(self, o):\n        return True\ndef f(s):\n    return A()"),
        ans(
            "class S(str):\n    def __eq__(self, o):\n        return True\n"
            "def f(s):\n    return S('x')"
        ),
        ans("def f(s):\n    return [s[::-1].upper()][0]\n" + "x = " + "[" * 50 + "]" * 50),
    ]
    got = [g.outcome for g in fam.check([task] * len(texts), texts, sandbox)]
    C, W, F = Outcome.CORRECT, Outcome.WRONG, Outcome.FORMAT_ERROR
    assert got == [C, C, W, W, W, W, W, F, F, W, W, C]


def test_parse_answer_takes_the_last_code_block(fam):
    text = ans("def f(s):\n    return 1") + "\n"
    two = "<answer>```python\ndef f(s):\n    return 1\n```\n```python\ndef f(s):\n    return 2\n```</answer>"
    assert fam.parse_answer(two).endswith("return 2")
    assert fam.parse_answer(text).endswith("return 1")
    assert isinstance(fam.parse_answer("<answer></answer>"), FormatError)


def test_compact_round(sandbox):
    fam = get_family("code_f", template="compact", n_inputs=4)
    text = "'a'</i><i>'bc'</i><i>''</i><i>'xy'</i><m>reverse, shout</m>"
    [v] = fam.verify([text], sandbox, bases=[BASE])
    assert v.valid and v.task.outputs == ("'A'", "'CB'", "''", "'YX'")
    got = fam.check(
        [v.task] * 2,
        ["def f(s):\n    return s[::-1].upper()</f>", "def f(s): return s</f>"],
        sandbox,
    )
    assert [g.outcome for g in got] == [Outcome.CORRECT, Outcome.WRONG]


def test_hostile_student_programs_do_not_touch_the_host(fam, task, sandbox, tmp_path):
    target = tmp_path / "pwned"
    texts = [
        ans(f"import os\ndef f(s):\n    os.system('touch {target}')\n    return s[::-1].upper()"),
        ans(f"def f(s):\n    open('{target}', 'w').write('x')\n    return s[::-1].upper()"),
        ans(f"def f(s):\n    __import__('os').remove('{target}.keep')\n    return s[::-1].upper()"),
        ans("import os\ndef f(s):\n    os.kill(os.getppid(), 9)\n    return s"),
    ]
    (tmp_path / "pwned.keep").write_text("keep")
    grades = fam.check([task] * len(texts), texts, sandbox)
    assert not target.exists()
    assert (tmp_path / "pwned.keep").read_text() == "keep"
    assert grades[3].outcome is Outcome.WRONG
    # the pool keeps serving after hostile programs
    [ok] = fam.check([task], [ans("def f(s):\n    return s[::-1].upper()")], sandbox)
    assert ok.outcome is Outcome.CORRECT


def test_check_compares_each_hidden_value_by_value_or_by_repr(sandbox):
    fam = get_family("code_f", n_inputs=4)
    dc = "from dataclasses import dataclass\n@dataclass\nclass Pt:\n    x: int\n"
    base = Task("code_o", dc + "def f(n):\n    return Pt(n) if n > 2 else n * 2", ("1",), ("2",))
    text = "<answer>```input\n1\n```\n```input\n2\n```\n```input\n3\n```\n```input\n4\n```"
    [v] = fam.verify([text + "\n```message\ndouble\n```</answer>"], sandbox, bases=[base])
    assert v.valid and v.task.outputs == ("2", "4", "Pt(x=3)", "Pt(x=4)")
    texts = [
        ans(dc + "def f(n):\n    return Pt(n) if n > 2 else n * 2.0"),  # 4.0 == 4, same repr
        ans(dc + "def f(n):\n    return Pt(n * 1.0) if n > 2 else n * 2"),  # Pt(x=4.0)
        ans(dc + "def f(n):\n    return Pt(n) if n > 2 else str(n * 2)"),  # '4' is not 4
    ]
    got = fam.check([v.task] * len(texts), texts, sandbox)
    assert [g.outcome for g in got] == [Outcome.CORRECT, Outcome.WRONG, Outcome.WRONG]
    assert got[1].detail == "hidden pair 1: mismatch"
    assert got[2].detail == "hidden pair 0: mismatch"
