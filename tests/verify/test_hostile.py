"""Hostile programs: each gets a clear verdict, none reaches the host, the pool keeps serving."""

import json
import os
import uuid
from pathlib import Path

import pytest

from lorapop.verify import Job, Sandbox, Status

S = Status
ROOT = os.geteuid() == 0


def hostile_cases(canaries: list[Path]) -> list[tuple[str, Job, set[Status]]]:
    c0, cl = str(canaries[0]), str(canaries[-1])
    me = os.getpid()
    escape = f"/tmp/lorapop-escape-{uuid.uuid4().hex[:8]}"

    def j(body: str, expr: str = "f()", det: bool = False) -> Job:
        return Job(body, expr, deterministic=det)

    return [
        ("infinite loop", j("def f():\n    while True:\n        pass"), {S.TIMEOUT}),
        ("memory hog, one block", j("def f():\n    return bytearray(1 << 34)"), {S.MEMORY}),
        ("memory hog, growing", j("def f():\n    xs = []\n    while True:\n        xs.append(bytes(1 << 24))"), {S.MEMORY}),
        ("deep recursion", j("def f(n=0):\n    return f(n + 1)"), {S.RUNTIME_ERROR}),
        ("recursion past the C stack", j("import sys\nsys.setrecursionlimit(10**8)\ndef g(n):\n    return g(n + 1) + 1\ndef f():\n    return g(0)"), {S.CRASHED, S.MEMORY, S.TIMEOUT}),
        ("fork", j("import os\ndef f():\n    return os.fork()"), {S.RUNTIME_ERROR}),
        ("fork bomb", j("import os\ndef f():\n    while True:\n        os.fork()"), {S.RUNTIME_ERROR}),
        ("thread", j("import _thread\ndef f():\n    return _thread.start_new_thread(print, ())"), {S.RUNTIME_ERROR}),
        ("os.system writes a file", j(f"import os\ndef f():\n    return os.system('echo x > {escape}; rm -f {cl}')"), {S.OK, S.RUNTIME_ERROR}),
        ("os.execv a shell", j(f"import os\ndef f():\n    os.execv('/bin/sh', ['sh', '-c', 'rm -f {cl}'])"), {S.RUNTIME_ERROR, S.CRASHED}),
        ("posix_spawn", j(f"import os\ndef f():\n    return os.posix_spawn('/bin/rm', ['rm', '{cl}'], {{}})"), {S.RUNTIME_ERROR}),
        ("subprocess via __import__", j("def f():\n    return __import__('subprocess').run(['id'])"), {S.BANNED}),
        ("subprocess via computed name", j("def f():\n    return __import__('sub' + 'process').run(['id'])"), {S.RUNTIME_ERROR}),
        ("importlib with computed name", j("import importlib\ndef f():\n    return importlib.import_module(''.join(['sub', 'process']))"), {S.RUNTIME_ERROR}),
        ("exec of an import", j("def f():\n    exec('imp' + 'ort socket')"), {S.RUNTIME_ERROR}),
        ("delete a file outside", j(f"import os\ndef f():\n    os.remove({c0!r})\n    os.remove({cl!r})"), {S.RUNTIME_ERROR}),
        ("overwrite a file outside", j(f"def f():\n    open({cl!r}, 'w').write('pwned')"), {S.RUNTIME_ERROR}),
        ("write in the working dir", j("def f():\n    with open('x.txt', 'w') as fh:\n        fh.write('x' * 100)"), {S.RUNTIME_ERROR}),
        ("leave a dir in /tmp", j(f"import os\ndef f():\n    os.mkdir({escape!r})\n    return 1"), {S.OK, S.RUNTIME_ERROR}),
        ("read /etc/shadow", j("def f():\n    return open('/etc/shadow').read()"), {S.RUNTIME_ERROR}),
        ("read the parent's memory", j("import os\ndef f():\n    return open(f'/proc/{os.getppid()}/mem', 'rb').read(8)"), {S.RUNTIME_ERROR}),
        ("regain root", j("import os\ndef f():\n    os.setuid(0)"), {S.RUNTIME_ERROR} if ROOT else {S.RUNTIME_ERROR, S.OK}),
        ("socket via computed import", j("def f():\n    s = __import__('_so' + 'cket')"), {S.RUNTIME_ERROR}),
        ("kill the server", j("import os\ndef f():\n    os.kill(os.getppid(), 9)"), {S.RUNTIME_ERROR}),
        ("kill the test process", j(f"import os\ndef f():\n    os.kill({me}, 9)"), {S.RUNTIME_ERROR}),
        ("kill own process group", j("import os\ndef f():\n    os.killpg(0, 9)"), {S.CRASHED}),
        ("kill everything it can", j("import os\ndef f():\n    os.kill(-1, 9)\n    return 1"), {S.OK}),
        ("sys.exit", j("import sys\ndef f():\n    sys.exit(0)"), {S.BANNED}),
        ("raise SystemExit", j("def f():\n    raise SystemExit(3)"), {S.RUNTIME_ERROR}),
        ("os._exit", j("import os\ndef f():\n    os._exit(0)"), {S.CRASHED}),
        ("os.abort", j("import os\ndef f():\n    os.abort()"), {S.CRASHED}),
        ("segfault by signal", j("import os\ndef f():\n    os.kill(os.getpid(), 11)"), {S.CRASHED}),
        ("segfault via ctypes", j("import ctypes\ndef f():\n    return ctypes.string_at(0)"), {S.RUNTIME_ERROR, S.CRASHED}),
        ("huge return value", j("def f():\n    return 'x' * 10**6"), {S.OUTPUT_TOO_LARGE}),
        ("huge int", j("def f():\n    return 7 ** 100000"), {S.RUNTIME_ERROR}),
        ("print flood", j("def f():\n    for _ in range(10**5):\n        print('x' * 100)\n    return 1"), {S.OK}),
        ("stdout fd flood", j("import os\ndef f():\n    for _ in range(10**4):\n        os.write(1, b'x' * 1000)\n    return 2"), {S.OK}),
        ("result pipe flood", j("import os\ndef f():\n    while True:\n        os.write(3, b'x' * 65536)"), {S.OUTPUT_TOO_LARGE}),
        ("set order", j("def f(n):\n    return list({str(i) for i in range(n)})", "f(40)", det=True), {S.NONDETERMINISTIC}),
        ("string hash", j("def f(s):\n    return hash(s)", "f('abc')", det=True), {S.NONDETERMINISTIC}),
        ("hash-dependent branch", j("def f(s):\n    if hash(s) % 2:\n        raise ValueError\n    return 1", "f('abcdef')", det=True), {S.NONDETERMINISTIC}),
        ("hostile __repr__ raises", j("class A:\n    def __repr__(self):\n        raise RuntimeError('no')\ndef f():\n    return A()"), {S.RUNTIME_ERROR}),
        ("hostile __repr__ loops", j("class A:\n    def __repr__(self):\n        while True:\n            pass\ndef f():\n    return A()"), {S.TIMEOUT}),
        ("hostile __eq__", j("class A:\n    def __eq__(self, o):\n        return True\n    def __repr__(self):\n        return '42'\ndef f():\n    return [A(), lambda: 0]"), {S.UNPICKLABLE}),
        ("rebound builtins.repr", j("import builtins\ndef f():\n    builtins.repr = lambda x: '42'\n    return 1"), {S.OK}),
        ("unpicklable lambda", j("def f():\n    return lambda x: x"), {S.UNPICKLABLE}),
        ("unpicklable generator", j("def f():\n    return (i for i in range(3))"), {S.UNPICKLABLE}),
        ("ignored signals", j("import signal\ndef f():\n    for s in (signal.SIGTERM, signal.SIGXCPU, signal.SIGINT):\n        signal.signal(s, signal.SIG_IGN)\n    while True:\n        pass"), {S.TIMEOUT}),
        ("fd exhaustion", j("def f():\n    return [open('/dev/null') for _ in range(10**5)]"), {S.RUNTIME_ERROR}),
        ("environment", j("def f():\n    return dict(getattr(__import__('o' + 's'), 'envi' + 'ron'))"), {S.OK}),
        ("/proc/self/environ", j("def f():\n    return open('/proc/self/environ', 'rb').read()"), {S.OK, S.RUNTIME_ERROR}),
        ("network interfaces", j("def f():\n    return open('/proc/self/net/dev').read()"), {S.OK}),
        ("input()", j("def f():\n    return input()"), {S.BANNED}),
        ("stdin read", j("import os\ndef f():\n    return os.read(0, 10)"), {S.OK}),
        ("hostile expr text", j("def f(x):\n    return x", "f(1); import os"), {S.SYNTAX_ERROR}),
        ("null bytes", j("def f():\n    return 1\x00"), {S.SYNTAX_ERROR}),
        ("absurd nesting", j("def f():\n    return " + "(" * 5000 + "1" + ")" * 5000), {S.SYNTAX_ERROR}),
        ("compile-time error", j("def f():\n    pass\nreturn 1"), {S.SYNTAX_ERROR}),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def outcomes(sandbox, canaries):
    """All hostile cases in one concurrent batch (siblings must not disturb each other)."""
    cases = hostile_cases(canaries)
    honest = Job("def f(x):\n    return x * 2", "f(21)")
    jobs = [job for _, job, _ in cases]
    mixed = [x for job in jobs for x in (job, honest)]  # interleave honest jobs
    verdicts = sandbox.run(mixed)
    return cases, verdicts[0::2], verdicts[1::2]


def test_at_least_30_cases(canaries):
    assert len(hostile_cases(canaries)) >= 30


def test_each_case_gets_its_status(outcomes):
    cases, verdicts, _ = outcomes
    wrong = [
        (name, v.status.value, v.error)
        for (name, _, want), v in zip(cases, verdicts, strict=True)
        if v.status not in want
    ]
    assert not wrong
    assert all(v.ok or v.error for v in verdicts)  # every failure says why


def test_honest_neighbours_unharmed(outcomes):
    _, _, honest = outcomes
    assert all(v.ok and v.output == "42" for v in honest)


def test_host_untouched(outcomes, canaries):
    for p in canaries:
        assert p.read_text() == "precious"
    assert not list(Path("/tmp").glob("lorapop-escape-*"))
    assert os.getpid()  # we are alive (the kill cases did not reach us)


def test_pool_keeps_serving(outcomes, sandbox):
    jobs = [Job("def f(x):\n    return x + 1", f"f({i})", deterministic=True) for i in range(8)]
    assert [v.output for v in sandbox.run(jobs)] == [str(i + 1) for i in range(8)]


def _named(outcomes, name):
    cases, verdicts, _ = outcomes
    return next(v for (n, _, _), v in zip(cases, verdicts, strict=True) if n == name)


def test_environment_is_clean(outcomes):
    os.environ.setdefault("HOME", "/root")
    for name in ("environment", "/proc/self/environ"):
        text = _named(outcomes, name).output
        if text is None:  # a uid-switched child is not dumpable: /proc/self is root's
            continue
        assert "HOME" not in text and "LORAPOP_SECRET" not in text
        assert "PYTHONHASHSEED" in text


def test_rebinding_builtins_does_not_fake_the_output(outcomes):
    assert _named(outcomes, "rebound builtins.repr").output == "1"


def test_stdin_is_empty(outcomes):
    assert _named(outcomes, "stdin read").output == "b''"


def test_no_network_interfaces_but_loopback(outcomes, sandbox):
    if not sandbox.isolation["net_isolated"]:
        pytest.skip("the kernel refused a network namespace here")
    text = _named(outcomes, "network interfaces").output
    lines = json.loads(json.dumps(eval(text))).splitlines()[2:]  # our own repr of a str
    assert [ln.split(":")[0].strip() for ln in lines] == ["lo"]


def test_runtime_error_names_the_exception(sandbox):
    (v,) = sandbox.run([Job("def f():\n    return {}['k']", "f()")])
    assert v.status is S.RUNTIME_ERROR and v.error == "KeyError: 'k'"


def test_server_death_is_survived(sandbox):
    srv = sandbox._servers[0]
    srv.proc.kill()
    srv.proc.wait()
    (v,) = sandbox.run([Job("def f():\n    return 5", "f()")])
    assert v.ok and v.output == "5"


def test_env_secret_of_the_caller_does_not_leak(monkeypatch):
    monkeypatch.setenv("LORAPOP_SECRET", "hunter2")
    with Sandbox(workers=1, timeout_s=1.0) as sb:
        env = "def f():\n    return dict(getattr(__import__('os'), 'envi' + 'ron'))"
        (v,) = sb.run([Job(env, "f()")])
    assert v.ok and "hunter2" not in v.output
