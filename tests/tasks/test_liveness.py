"""Dead statements of a teacher's program, found without running it, and dropped from
generated programs without changing what they return."""

import random

import pytest

from lorapop.tasks.liveness import dead_statement, drop_dead
from lorapop.tiny.corpus import TrustedRunner
from lorapop.tiny.grammar import generate_input, generate_program, table_level
from lorapop.verify import Job


@pytest.mark.parametrize("program, why", [
    ("def f(s):\n    s = s\n    return s", "line 2: `s = s` assigns a name to itself"),
    ("def f(k):\n    res = str(k)[1:]\n    return k - 3", "line 2: `res = str(k)[1:]` stores a value never read"),
    ("def f(n):\n    a = n\n    b = a\n    return n", "line 2: `a = n` stores"),  # b dead makes a dead
    ("def f(n):\n    m = n\n    m += 1\n    return n", "`m = n` stores"),
    ("def f(s):\n    s.upper()\n    return s", "`s.upper()` computes a value and drops it"),
    ("def f(s):\n    pass\n    return s", "`pass` does nothing"),
    ("def f(s):\n    return s\n    s = 'a'", "line 3: `s = 'a'` stores"),  # after the return
    ("def f(s):\n    t = 0\n    for c in s:\n        t += 1\n    return s", "line 2: `t = 0` stores"),
    ("def f(s):\n    for c in s:\n        best = c\n    return s", "line 2: the block `for c in s:`"),
    ("def f(s):\n    for c in s:\n        pass\n    return s", "the block `for c in s:` changes nothing"),
    ("def f(n):\n    t = n\n    if n > 1:\n        t = 2\n    else:\n        n = 1\n    return n",
     "line 2: `t = n` stores"),
    ("def g(x):\n    y = x\n    return x\n\ndef f(n):\n    return g(n)", "line 2: `y = x`"),
])  # fmt: skip
def test_dead_statements_are_named_with_their_line(program, why) -> None:
    assert why in (dead_statement(program) or ""), dead_statement(program)


@pytest.mark.parametrize("program", [
    "def f(s):\n    t = 0\n    for c in s:\n        t += len(c)\n    return t",
    "def f(n):\n    total = 0\n    while n > 0:\n        n -= 1\n        total += n\n    return total",
    "def f(xs):\n    ys = xs\n    ys.append(1)\n    return xs",  # a mutating method on an alias
    "def f(xs):\n    x = xs.pop()\n    return xs",
    "def f(d):\n    d['a'] = 1\n    return d",
    "def g(xs):\n    xs.append(0)\n    return 1\n\ndef f(xs):\n    k = g(xs)\n    return xs",
    "def f(s):\n    '''docs'''\n    return s",
    "def f(n):\n    k = 0\n    for i in range(n):\n        if i > 2:\n            break\n        k = i\n    return k",
    "def f(n):\n    if n > 0:\n        n = -n\n    return n",
    "def f(n):\n    global G\n    G = n\n    return n",
    "def f(:\n",  # does not parse: running it says so
])  # fmt: skip
def test_live_or_unjudged_programs_have_no_dead_statement(program) -> None:
    assert dead_statement(program) is None


def test_dropping_dead_statements_keeps_every_result() -> None:
    """Generated programs of every level lose only what cannot change their result, and a
    block that loses all its statements keeps a `pass`."""
    rng, run, changed = random.Random(3), TrustedRunner(), 0
    for level in (2, 3, 4, 5):
        for _ in range(25):
            program = generate_program(rng, table_level(level, "standard"))
            live = drop_dead(program.source)
            assert dead_statement(live) is None, live
            changed += live != program.source
            for _ in range(2):
                x = generate_input(rng, program)
                a, b = run.run([Job(program.source, f"f({x})", entry="f"), Job(live, f"f({x})", entry="f")])
                if a.ok:
                    assert b.ok and b.output == a.output, (program.source, live, x)
    assert changed > 50  # the grammar writes plenty of dead code
    src = "def f(n):\n    if n > 1:\n        m = n\n    else:\n        return 0\n    return n\n"
    assert drop_dead(src) == "def f(n):\n    if n > 1:\n        pass\n    else:\n        return 0\n    return n\n"


def test_deeply_nested_loops_are_not_judged_rather_than_judged_slowly() -> None:
    """Each nested loop's fixed point multiplies the work: a hostile program of 19 nested loops
    (CPython allows 20 blocks) would take hours; past the visit budget it is not judged."""

    def nested(depth: int) -> str:
        lines = ["def f(n):", "    a0 = 0", "    z = 1"]
        for i in range(depth):
            lines += ["    " * (i + 1) + f"for i{i} in range(n):", "    " * (i + 2) + f"a{i + 1} = a{i} + i{i}"]
        return "\n".join([*lines, "    " * (depth + 1) + f"a0 = a{depth}", "    return a0"])

    assert dead_statement(nested(4)) == "line 3: `z = 1` stores a value never read"
    assert dead_statement(nested(19)) is None
