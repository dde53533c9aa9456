import pytest

from lorapop.verify import Job, Status
from lorapop.verify.static import check, compile_job

OK = "def f(x):\n    return x\n"


@pytest.mark.parametrize(
    "program, expr, reason",
    [
        ("import os.path\n" + OK, "f(1)", "os.path"),
        ("from os import path\n" + OK, "f(1)", "os.path"),
        ("from os import *\n" + OK, "f(1)", "os."),
        ("import os as o\ndef f():\n    return o.environ['X']", "f()", "os.environ"),
        ("import os\ndef f():\n    return getattr(os, 'environ')", "f()", "os.environ"),
        ("from sys import exit as quit_\n" + OK, "f(1)", "sys.exit"),
        ("import time as t\n" + OK, "f(1)", "time"),
        ("import random\n" + OK, "f(1)", "random"),
        ("def f():\n    import datetime\n    return 1", "f()", "datetime"),
        ("def f():\n    return __import__('hashlib')", "f()", "hashlib"),
        (
            "import importlib\ndef f():\n    return importlib.import_module('logging.handlers')",
            "f()",
            "logging",
        ),
        (OK, "__import__('subprocess')", "subprocess"),
        ("import os\n" + OK, "f(os.environ)", "os.environ"),
        ("def f():\n    return input()", "f()", "input()"),
    ],
)
def test_banned(program, expr, reason):
    status, error = check(program, expr)
    assert status is Status.BANNED and reason in error


@pytest.mark.parametrize(
    "program",
    [
        "import randomize\n" + OK,  # not `random`: whole dotted components only
        "import os\ndef f(x):\n    return os.getcwd()",  # os itself is allowed (AZR)
        "def f(x):\n    time = 3\n    return time + x",  # a variable named like a module
        "import numpy.random\n" + OK,
        "def helper(y):\n    return y\nclass K:\n    pass\n" + OK,  # helpers are allowed
        "f = lambda x: x",
    ],
)
def test_allowed(program):
    assert check(program, "f(1)") is None


def test_syntax_no_entry_and_sizes():
    assert check("def f(:", "f()")[0] is Status.SYNTAX_ERROR
    assert check(OK, "f(1")[0] is Status.SYNTAX_ERROR
    assert check(OK, "f(1)\x00")[0] is Status.SYNTAX_ERROR
    assert check("x" * 200_000, "1", entry=None)[0] is Status.SYNTAX_ERROR
    assert check("def g(x):\n    return x", "g(1)")[0] is Status.NO_ENTRY
    assert check("def g():\n    def f():\n        pass", "g()")[0] is Status.NO_ENTRY
    assert check("", "1 + 1", entry=None) is None


def test_static_verdicts_do_not_reach_the_servers(sandbox):
    (v,) = sandbox.run([Job("import subprocess\n" + OK, "f(1)")])
    assert v.status is Status.BANNED and v.duration == 0.0 and v.output is None


def test_compile_job_compiles_as_a_script_would():
    """No future flags leak from lorapop's own modules, asserts stay, compile-time errors
    the parser lets through are syntax errors, and the rules still apply."""
    program, expr = compile_job("def f(x: undefined_name):\n    assert x\n    return x", "f(0)")
    with pytest.raises(NameError):  # annotations evaluated eagerly: no `annotations` future
        exec(program, {})
    ns: dict = {}
    exec(compile_job("def f(x):\n    assert x, 'no'\n    return x", "f(0)")[0], ns)
    with pytest.raises(AssertionError):
        ns["f"](0)
    assert compile_job("def f():\n    pass\nreturn 1", "f()")[0] is Status.SYNTAX_ERROR
    assert compile_job("import random\n" + OK, "f(1)")[0] is Status.BANNED
    assert compile_job("def g(x):\n    return x", "g(1)")[0] is Status.NO_ENTRY


def test_threads_build_asts_one_at_a_time(monkeypatch):
    """Two sandboxes of one process check their jobs from two threads; CPython's AST
    constructor keeps its recursion depth interpreter-wide, so overlapping parses could raise
    `SystemError` for an honest job (it happened once in a full test run). Parses and compiles
    never overlap, and a mismatch error from a parse outside the lock is retried."""
    import ast
    import threading
    import time

    from lorapop.verify import static

    inside, overlaps = [0], []
    real_parse = ast.parse

    def slow_parse(*args, **kwargs):
        inside[0] += 1
        overlaps.append(inside[0] > 1)
        time.sleep(0.002)
        inside[0] -= 1
        return real_parse(*args, **kwargs)

    monkeypatch.setattr(static.ast, "parse", slow_parse)
    threads = [
        threading.Thread(
            target=lambda: [check("def f(x):\n    return x", f"f({i})") for i in range(20)]
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(overlaps) == 3 * 20 * 2 and not any(overlaps)

    calls = []

    def colliding_parse(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise SystemError("AST constructor recursion depth mismatch (before=24, after=115)")
        return real_parse(*args, **kwargs)

    monkeypatch.setattr(static.ast, "parse", colliding_parse)
    assert check("def f(x):\n    return x", "f(1)") is None
