"""Verdicts cannot be forged by the party they reward.

Code that runs in a sandbox job can write any verdict to the child's result pipe (fd 3) and
exit, or rebind builtins while it runs. So a check only ever asks the sandbox for a value's
repr and compares it in the caller; the gold never enters a process where an answer's code runs.
"""

import json
from collections.abc import Sequence

import pytest

from lorapop.tasks import Outcome, Task, get_family
from lorapop.tasks.code import split_pairs
from lorapop.verify import Job, Verdict
from lorapop.verify.child import RESULT_FD

BASE = Task("code_o", "def f(s):\n    return s[::-1].upper()", ("'ab'",), ("'BA'",))
INPUTS = ["'a'", "'ab'", "''", "'xyz'", "'Hello'", "'q r'", "'11'", "'aBc'", "'zz top'", "'!'"]
#: What the child writes on fd 3 for an ok job whose value's repr is `True` (see verify/child.py).
FORGED = json.dumps({"status": "ok", "output": "True", "error": None, "duration": 0.001})


class Spy:
    """A runner that records every job it passes on to the sandbox."""

    def __init__(self, inner) -> None:
        self.inner, self.jobs = inner, []

    def run(self, jobs: Sequence[Job]) -> list[Verdict]:
        self.jobs += list(jobs)
        return self.inner.run(jobs)


def ans(program: str) -> str:
    return f"<think>x</think><answer>\n```python\n{program}\n```\n</answer>"


@pytest.fixture(scope="module")
def fam():
    return get_family("code_f")


@pytest.fixture(scope="module")
def task(fam, sandbox):
    blocks = "".join(f"```input\n{x}\n```\n" for x in INPUTS)
    text = f"<answer>\n{blocks}```message\nreverse, shout\n```\n</answer>"
    [v] = fam.verify([text], sandbox, bases=[BASE])
    assert v.valid, v.reason
    return v.task


def test_forged_verdict_on_the_result_pipe_is_wrong(fam, task, sandbox):
    forge = f"import os\ndef f(s):\n    os.write({RESULT_FD}, {FORGED.encode()!r})\n    os._exit(0)"
    forge_at_import = f"import os\nos.write({RESULT_FD}, {FORGED.encode()!r})\nos._exit(0)\n"
    forge_at_import += "def f(s):\n    return s"
    grades = fam.check([task] * 2, [ans(forge), ans(forge_at_import)], sandbox)
    assert [g.outcome for g in grades] == [Outcome.WRONG, Outcome.WRONG]


def test_rebinding_builtins_during_f_is_wrong(fam, task, sandbox):
    rebind = (
        "def f(s):\n"
        "    __builtins__.bool = lambda *a: True\n"
        "    __builtins__.repr = lambda *a: 'True'\n"
        "    globals()['_lorapop_same'] = lambda *a: True\n"
        "    return s\n"
    )
    [g] = fam.check([task], [ans(rebind)], sandbox)
    assert g.outcome is Outcome.WRONG


@pytest.mark.parametrize(
    "prefix",
    [
        "",
        # hide the class from an exact-type check made later in the same process
        "import builtins\n_t = builtins.type\nbuiltins.type = lambda v: int if _t(v) is A else _t(v)\n",
    ],
)
def test_always_equal_objects_are_wrong(fam, task, sandbox, prefix):
    program = (
        "class A:\n    def __eq__(self, o):\n        return True\n"
        "    def __ne__(self, o):\n        return False\n"
        "    __hash__ = object.__hash__\n"
        f"{prefix}def f(s):\n    return A()\n"
    )
    [g] = fam.check([task], [ans(program)], sandbox)
    assert g.outcome is Outcome.WRONG


def test_a_forger_that_knows_the_shown_pairs_still_fails(fam, task, sandbox):
    """Forging text is no better than computing it: the hidden golds are not in the process."""
    visible, hidden = split_pairs(task)
    guess = "(" + ", ".join(o for _, o in visible) + ")"
    forged = json.dumps({"status": "ok", "output": guess, "error": None, "duration": 0.0})
    program = (
        f"import os\ndef f(s):\n    os.write({RESULT_FD}, {forged.encode()!r})\n    os._exit(0)"
    )
    [g] = fam.check([task], [ans(program)], sandbox)
    assert g.outcome is Outcome.WRONG


def test_golds_never_enter_a_sandbox_job(fam, task, sandbox):
    spy = Spy(sandbox)
    _, hidden = split_pairs(task)
    grades = fam.check([task], [ans("def f(s):\n    return s[::-1].upper()")], spy)
    assert grades[0].outcome is Outcome.CORRECT
    golds = [y for x, y in hidden if y != x]  # '!' is its own output
    assert len(golds) == 4 and len(spy.jobs) == 1
    assert all(y not in spy.jobs[0].program + spy.jobs[0].expr for y in golds)

    prog = (
        "class P:\n    def __init__(self, x):\n        self.x = x\n"
        "    def __repr__(self):\n        return f'P({self.x!r})'\n"
        "def f(a):\n    return P(a.upper())"
    )
    gold = "P('GOLD')"
    spy = Spy(sandbox)
    o = get_family("code_o").check(
        [Task("code_o", prog, ("'gold'",), (gold,))], ["<answer>P(x='GOLD')</answer>"], spy
    )
    i = get_family("code_i").check(
        [Task("code_i", prog, ("'gold'",), (gold,))], ["<answer>'GoLd'</answer>"], spy
    )
    assert [g.outcome for g in o + i] == [Outcome.CORRECT] * 2
    assert len(spy.jobs) == 2 and all(gold not in j.program + j.expr for j in spy.jobs)
