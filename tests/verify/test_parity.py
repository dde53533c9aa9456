"""Honest parity: a job's output equals that of `python -c` running the same program.

Each program below runs in the sandbox and as `python -c "<program>\n...print(repr(<expr>))"`
(the same interpreter, the sandbox's environment and hash seed, stdin from /dev/null, a fresh
working directory); the printed repr must equal the job's output exactly. They cover what
earlier sandboxes got wrong: the recursion depth and limit, signals a program sends itself,
the standard streams' buffers, plus ordinary paths (exceptions, __main__, pickling, files).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lorapop.verify import Job, Status

PARITY: list[tuple[str, str, str]] = [
    ("recursion: the deepest call", "import sys\ndef d(n=1):\n    try:\n        return d(n + 1)\n    except RecursionError:\n        return n\ndef f():\n    return d(), sys.getrecursionlimit()", "f()"),
    ("recursion: depth 995", "def f(n):\n    return 0 if n == 0 else 1 + f(n - 1)", "f(995)"),
    ("recursion: a raised limit", "import sys\nsys.setrecursionlimit(3000)\ndef d(n=1):\n    try:\n        return d(n + 1)\n    except RecursionError:\n        return n\ndef f():\n    return d(), sys.getrecursionlimit()", "f()"),
    ("recursion: a limit set too low", "import sys\ndef f():\n    try:\n        sys.setrecursionlimit(0)\n    except ValueError as e:\n        return str(e)", "f()"),
    ("raise_signal to a handler", "import signal\nhits = []\nsignal.signal(signal.SIGUSR1, lambda s, fr: hits.append(s))\ndef f():\n    signal.raise_signal(signal.SIGUSR1)\n    return hits", "f()"),
    ("os.kill of itself to a handler", "import os, signal\nhits = []\nsignal.signal(signal.SIGUSR2, lambda s, fr: hits.append(s))\ndef f():\n    os.kill(os.getpid(), signal.SIGUSR2)\n    return hits", "f()"),
    ("alarm to a handler", "import signal\nhits = []\nsignal.signal(signal.SIGALRM, lambda s, fr: hits.append(s))\ndef f():\n    signal.setitimer(signal.ITIMER_REAL, 0.01)\n    while not hits:\n        pass\n    return hits", "f()"),
    ("SIGINT is KeyboardInterrupt", "import os, signal\ndef f():\n    try:\n        signal.raise_signal(signal.SIGINT)\n    except KeyboardInterrupt:\n        return 'interrupted', signal.getsignal(signal.SIGINT) is signal.default_int_handler", "f()"),
    ("stdout's buffer", "import sys\ndef f():\n    n = sys.stdout.buffer.write(b'raw')\n    sys.stdout.flush()\n    return n, sys.stdout.encoding, sys.stdout.errors, sys.stderr.errors, sys.stdout.isatty()", "f()"),
    ("stdin reads nothing", "import sys\ndef f():\n    return sys.stdin.read(), sys.stdin.buffer.read(), sys.stdin.encoding", "f()"),
    ("print to both streams", "import sys\ndef f():\n    print('out')\n    print('err', file=sys.stderr)\n    return sys.stdout.write('x'), sys.stderr.write('yz')", "f()"),
    ("stream names and fds", "import sys\ndef f():\n    return [(s.name, s.fileno(), s.mode) for s in (sys.stdin, sys.stdout, sys.stderr)]", "f()"),
    ("argv and __main__", "import sys\ndef f():\n    return sys.argv, __name__, sorted(k for k in globals() if k.startswith('__') and k != '__annotations__')", "f()"),
    ("exceptions and tracebacks", "def f():\n    try:\n        1 / 0\n    except ZeroDivisionError as e:\n        tb = e.__traceback__\n        return repr(e), tb.tb_frame.f_code.co_name, tb.tb_lineno", "f()"),
    ("a class of __main__ pickles", "import pickle\nfrom dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\ndef f():\n    return pickle.loads(pickle.dumps(P(3))), P.__module__", "f()"),
    ("files in the working directory", "import os\ndef f():\n    with open('a.txt', 'w') as fh:\n        fh.write('1\\n2\\n')\n    with open('a.txt') as fh:\n        return fh.read().split(), os.stat('a.txt').st_size, sorted(os.listdir('.'))", "f()"),
    ("environment", "import os\ndef f():\n    return sorted(kv for kv in getattr(os, 'envi' + 'ron').items() if kv[0] != 'PYTHONHASHSEED')", "f()"),
    ("string hashes (the same seed)", "def f():\n    return hash('abc') % 1000003, sorted({'x', 'y', 'z', 'w'})", "f()"),
    ("big integers", "def f():\n    try:\n        int('9' * 5000)\n    except ValueError as e:\n        return str(e)[:40], 7 ** 77", "f()"),
    ("generators and closures", "def f():\n    def g(k):\n        yield from (i * k for i in range(3))\n    return [list(g(k)) for k in range(3)]", "f()"),
]  # fmt: skip


def plain(program: str, expr: str, cwd: str) -> str:
    """The same program under `python -c`, as the sandbox's server would start it."""
    env = {"PATH": os.defpath, "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "1"}
    r = subprocess.run(
        [sys.executable, "-c", f"{program}\n_v = {expr}\nprint()\nprint(repr(_v))"], stdin=subprocess.DEVNULL,
        capture_output=True, text=True, env=env, cwd=cwd, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.splitlines()[-1]


@pytest.mark.parametrize("name, program, expr", PARITY, ids=[p[0] for p in PARITY])
def test_output_equals_python_c(sandbox, tmp_path, name, program, expr):
    (v,) = sandbox.run([Job(program, expr)])
    assert v.status is Status.OK, (name, v.error)
    assert v.output == plain(program, expr, str(tmp_path)), name


def test_parity_holds_under_the_determinism_check(sandbox, tmp_path):
    """The same programs, each run twice (two servers): no false nondeterminism."""
    keep = [p for p in PARITY if "hash" not in p[0]]  # the second server has another seed
    verdicts = sandbox.run([Job(p, e, deterministic=True) for _, p, e in keep])
    want = []
    for i, (_, program, expr) in enumerate(keep):
        (tmp_path / str(i)).mkdir()
        want.append((Status.OK, plain(program, expr, str(tmp_path / str(i)))))
    assert [(v.status, v.output) for v in verdicts] == want


@pytest.mark.parametrize(
    "program, want",
    [
        ("import os\ndef f():\n    os.kill(os.getpid(), 9)", "killed by signal SIGKILL"),
        ("import signal\ndef f():\n    signal.raise_signal(signal.SIGTERM)", "killed by signal SIGTERM"),
        ("import os\ndef f():\n    os.abort()", "killed by signal SIGABRT"),
        ("import os, signal\ndef f():\n    os.kill(0, signal.SIGKILL)", "killed by signal SIGKILL"),
    ],
)  # fmt: skip
def test_fatal_signals_to_itself_kill_the_job(sandbox, program, want):
    """As CPython would die of them (a job is pid 2: its signals reach it)."""
    (v,) = sandbox.run([Job(program, "f()")])
    assert (v.status, v.error) == (Status.CRASHED, want)


def test_sigstop_to_itself_stops_it_until_its_limit(sandbox):
    (v,) = sandbox.run([Job("import os, signal\ndef f():\n    os.kill(os.getpid(), signal.SIGSTOP)\n    return 1", "f()", timeout_s=0.5)])  # fmt: skip
    assert v.status is Status.TIMEOUT
