"""Hostile programs, by what a job must never see or outlive (the classes below, 11-16):

11. other jobs' data: programs, inputs and verdicts of the jobs around it, by any route;
12. shared open files: state one job leaves on its standard fds, host inodes behind them;
13. outliving the server: clearing PDEATHSIG, sleeping past the server's death or a limit;
14. pid 1 semantics: covered in test_parity.py (signals a job sends itself);
15. ways past the determinism check: host name, clock offsets, host-wide counters, hidden
    modules reached through frames, subclasses, sys.modules or any object;
16. (parity with CPython: test_parity.py).

Each case runs in one concurrent batch with secret-carrying neighbours; then the host checks
of test_hostile hold: no file changed, no process left, neighbours exact, the server alive.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from test_hostile import REACH, nr

from conftest import FFI, left_behind, processes_of
from lorapop.verify import Job, Sandbox, Status
from lorapop.verify.policy import AZR_HIDDEN
from lorapop.verify.server import INTERNAL, SERVER_ONLY

S = Status
SECRET = f"lorapop-secret-{uuid.uuid4().hex}"

#: A job whose program, input and output all carry SECRET (the neighbours to spy on).
NEIGHBOUR = Job(
    f"KEY = {SECRET!r}\ndef f(x):\n    return KEY + x",
    f"f({SECRET[::-1]!r})",
)
NEIGHBOUR_OUT = repr(SECRET + SECRET[::-1])

#: Looks for the secret (`needle`, each character shifted by one; both directions) wherever a job's Python can reach: every frame and its
#: globals and locals, every traceback, sys.modules and every module's globals, every class
#: among object's subclasses and the globals of its functions, the job's own fds 0-3.
SPY = """
import sys, os
def _strings(obj, out, depth=0, seen=None):
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 3:
        return
    seen.add(id(obj))
    if isinstance(obj, str):
        out.append(obj)
    elif isinstance(obj, bytes):
        out.append(obj.decode('latin-1'))
    elif isinstance(obj, dict):
        for k, v in list(obj.items()):
            _strings(k, out, depth + 1, seen)
            _strings(v, out, depth + 1, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in list(obj):
            _strings(v, out, depth + 1, seen)
    elif type(obj).__name__ == 'code':
        _strings(obj.co_consts, out, depth + 1, seen)
def f(needle):
    out = []
    fr = sys._getframe()
    while fr is not None:
        _strings(fr.f_globals, out)
        _strings(fr.f_locals, out)
        _strings(fr.f_code, out)
        fr = fr.f_back
    try:
        raise ValueError
    except ValueError as e:
        tb = e.__traceback__
        while tb is not None:
            _strings(tb.tb_frame.f_globals, out)
            tb = tb.tb_next
    for m in list(sys.modules.values()):
        _strings(getattr(m, '__dict__', {}), out)
    seen, stack = set(), [object]
    while stack:
        for c in type.__subclasses__(stack.pop()):
            if c not in seen:
                seen.add(c)
                stack.append(c)
                for v in list(vars(c).values()):
                    _strings(getattr(v, '__globals__', None), out)
    for fd in range(4):
        out.append(os.pread(fd, 1 << 20, 0).decode('latin-1'))
    shift = {i: i + 1 for i in range(32, 127)}  # the needle comes shifted: never itself here
    hits = [s for s in out if needle in s.translate(shift) or needle in s[::-1].translate(shift)]
    return len(out) > 1000, hits
"""


def _in_every_order(n: int) -> list[Job]:
    """Neighbours before, among and after the spies (more jobs than live children)."""
    shifted = "".join(chr(ord(c) + 1) for c in SECRET[:24])
    spy = Job(SPY, f"f({shifted!r})", timeout_s=30.0)
    return [NEIGHBOUR] * n + [x for _ in range(n) for x in (spy, NEIGHBOUR)] + [spy] * n


HIDDEN_ROUTES = """
import sys
def reach_all(names):
    found = {}
    def note(where, obj):
        mod = getattr(obj, '__name__', None) if type(obj) is type(sys) else None
        if mod and mod.split('.')[0] in names:
            found.setdefault(mod, where)
    for name, m in list(sys.modules.items()):
        note('sys.modules', m)
        for v in list(getattr(m, '__dict__', {}).values()):
            note('an attribute of ' + name, v)
    fr = sys._getframe()
    while fr is not None:
        for v in list(fr.f_globals.values()) + list(fr.f_locals.values()):
            note('a frame', v)
        fr = fr.f_back
    seen, stack = set(), [object]
    while stack:
        for c in type.__subclasses__(stack.pop()):
            if c in seen:
                continue
            seen.add(c)
            stack.append(c)
            for v in list(vars(c).values()):
                g = getattr(v, '__globals__', None)
                if isinstance(g, dict) and g:
                    for w in list(g.values()):
                        note('the globals of ' + c.__qualname__, w)
                    if str(g.get('__name__')).split('.')[0] in names:
                        found.setdefault(g['__name__'], 'the globals of ' + c.__qualname__)
    return found
"""


def cases() -> list[tuple[int, str, Job, set[Status], object]]:
    fcntl_probe = (
        "import os\ndef f():\n"
        "    return [(os.get_blocking(fd), os.get_inheritable(fd)) for fd in range(4)]"
    )
    return [
        # --- 12: shared open files --------------------------------------------------------
        (12, "set O_NONBLOCK and F_SETSIG on 0-3", Job(REACH + "import os\ndef f():\n    for fd in range(4):\n        os.set_blocking(fd, False)\n        libc().fcntl(fd, 10, 29)\n    return [os.get_blocking(fd) for fd in range(4)]", "f()"), {S.OK}, "[False, False, False, False]"),
        (12, "what the last job left on 0-3", Job(REACH + fcntl_probe.replace("os.get_inheritable(fd)", "libc().fcntl(fd, 11, 0)"), "f()"), {S.OK}, "[(True, 0), (True, 0), (True, 0), (True, 0)]"),
        (12, "fds 0-3 are the job's own files", Job("import os\ndef f():\n    root = os.stat('/').st_dev\n    return [(os.fstat(fd).st_ino, os.fstat(fd).st_nlink, os.fstat(fd).st_dev == root) for fd in range(4)]", "f()"), {S.OK}, "[(2, 0, True), (3, 0, True), (4, 0, True), (5, 0, True)]"),
        (12, "no fd beyond 0-3", Job("import os\ndef f():\n    out = []\n    for fd in range(4, 1024):\n        try:\n            os.fstat(fd)\n            out.append(fd)\n        except OSError:\n            pass\n    return out", "f()"), {S.OK}, "[]"),
        (12, "stdin holds nothing", Job("import os\ndef f():\n    return os.read(0, 100), os.pread(0, 100, 0)", "f()"), {S.OK}, "(b'', b'')"),
        # --- 13: outliving the server -------------------------------------------------------
        (13, "clear PDEATHSIG", Job(REACH + "def f():\n    return [libc().prctl(1, 0, 0, 0, 0), libc().prctl(1, 15, 0, 0, 0)]", "f()"), {S.OK}, "[-1, -1]"),
        (13, "sleep past the limit (signal.pause)", Job("import signal\ndef f():\n    signal.pause()", "f()", timeout_s=0.5), {S.TIMEOUT}, None),
        (13, "sleep past the limit, signals ignored", Job("import signal\ndef f():\n    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):\n        signal.signal(s, signal.SIG_IGN)\n    signal.pause()", "f()", timeout_s=0.5), {S.TIMEOUT}, None),
        (13, "fork a survivor", Job(REACH + f"def f():\n    args = (find('c_ulong') * 11)()\n    args[4] = 17\n    return [libc().syscall({nr('clone')}, 17, 0, 0, 0, 0), libc().syscall({nr('clone')}, 0x20008011, 0, 0, 0, 0), libc().syscall({nr('clone3')}, args, 88), libc().syscall({nr('unshare')}, 0x20000000)]", "f()"), {S.OK}, "[-1, -1, -1, -1]"),
        (13, "remount or leave its tmpfs", Job(REACH + f"def f():\n    return [libc().umount2(b'/', 2), libc().mount(b'x', b'/', b'tmpfs', 0, None), libc().chroot(b'/tmp'), libc().syscall({nr('wait4')}, -1, 0, 0, 0)]", "f()"), {S.OK}, "[-1, -1, -1, -1]"),
        # --- 15: ways past the determinism check ----------------------------------------------
        (15, "host name", Job("import os\ndef f():\n    return os.uname().nodename", "f()", deterministic=True), {S.OK}, "'sandbox'"),
        (15, "argv and environment carry no clock offset", Job("import sys, os\ndef f():\n    return sys.argv, sys.orig_argv, sorted(getattr(os, 'envi' + 'ron'))", "f()", deterministic=True), {S.OK}, "(['-c'], ['python', '-c', ''], ['LC_ALL', 'PATH'])"),
        (15, "a pipe's inode number", Job("import os\ndef f():\n    return os.fstat(os.pipe()[0]).st_ino // 10**6", "f()", deterministic=True), {S.RUNTIME_ERROR}, None),
        (15, "counters through raw calls", Job(REACH + f"def f():\n    buf = (find('c_long') * 64)()\n    return [libc().syscall({nr('sysinfo')}, buf), libc().syscall({nr('getcpu')}, buf, 0, 0), libc().syscall({nr('pipe2')}, buf, 0), libc().syscall({nr('getrusage')}, 0, buf)]", "f()", deterministic=True), {S.OK}, "[-1, -1, -1, -1]"),
        (15, "uptime and load", Job("def f():\n    return open('/proc/loadavg').read()", "f()", deterministic=True), {S.RUNTIME_ERROR}, None),
        (15, "time through frames", Job("import sys\ndef f():\n    fr = sys._getframe()\n    while fr is not None:\n        t = fr.f_globals.get('time') or fr.f_locals.get('time')\n        if t is not None:\n            return t.time()\n        fr = fr.f_back\n    return None", "f()"), {S.OK}, "None"),
        (15, "a dropped module's class does nothing", Job(HIDDEN_ROUTES + "def f():\n    seen, stack = set(), [object]\n    while stack:\n        for c in type.__subclasses__(stack.pop()):\n            if c not in seen:\n                seen.add(c)\n                stack.append(c)\n                if c.__name__ == 'zipimporter':\n                    return c('/x')", "f()"), {S.RUNTIME_ERROR}, None),
        (15, "selectors via subclasses", Job("def f():\n    seen, stack = set(), [object]\n    while stack:\n        for c in type.__subclasses__(stack.pop()):\n            if c not in seen:\n                seen.add(c)\n                stack.append(c)\n                if c.__module__ == 'selectors':\n                    return c\n    raise ModuleNotFoundError('selectors')", "f()"), {S.RUNTIME_ERROR}, None),
        (15, "a process's CPU time", Job("import os\ndef f():\n    return os.times()", "f()"), {S.CRASHED}, None),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def run(ffi, canaries):
    sandbox = ffi  # the kernel probes hold libc (`FFI`); the policy's hiding is AZR's
    server = sandbox._servers[0].proc.pid  # private: the test checks it is never replaced
    spies = _in_every_order(4)
    mine = cases()
    mixed = [x for _, _, job, _, _ in mine for x in (job, NEIGHBOUR)]
    verdicts = sandbox.run(spies + mixed)
    return {
        "spies": list(zip(spies, verdicts[: len(spies)], strict=True)),
        "cases": list(zip(mine, verdicts[len(spies) :: 2], strict=True)),
        "neighbours": verdicts[len(spies) + 1 :: 2],
        "server": (server, sandbox._servers[0].proc.pid),
        "procs": processes_of(sandbox.isolation["outer_uid"]),
    }


def test_11_no_job_sees_another_jobs_data(run):
    spied = [v for j, v in run["spies"] if j is not NEIGHBOUR]
    assert spied and all(v.ok for v in spied), [v.error for v in spied if not v.ok][:3]
    assert {v.output for v in spied} == {"(True, [])"}  # it searched a lot, found nothing
    neighbours = [v for j, v in run["spies"] if j is NEIGHBOUR]
    assert {v.output for v in neighbours} == {NEIGHBOUR_OUT}


def test_11_the_spy_finds_a_secret_within_its_reach(sandbox):
    """The search above works: a secret held by a module the job can import is found."""
    shifted = "".join(chr(ord(c) + 1) for c in SECRET[:24])
    plant = f"import json\njson.__dict__['x'] = {{'k': [{SECRET!r}]}}\n"
    (v,) = sandbox.run([Job(plant + SPY, f"f({shifted!r})", timeout_s=30.0)])
    assert v.ok and SECRET in v.output


def test_12_to_15_each_case(run):
    wrong = []
    for (cls, name, _, want, output), v in run["cases"]:
        if v.status not in want or (output is not None and v.output != output):
            wrong.append((cls, name, v.status.value, v.error, v.output))
    assert not wrong


def test_12_what_a_job_does_to_its_interpreter_is_its_own(sandbox):
    """Streams, the recursion limit, signal handlers and sys are set up once, in the zygote:
    each job changes only its own copy. Every job below undoes them after reading them."""
    job = Job(
        "import sys, signal\ndef f():\n"
        "    seen = (sys.stdout.closed, sys.stdin.closed, sys.stderr.closed, sys.getrecursionlimit(),"
        " signal.getsignal(signal.SIGINT) is signal.default_int_handler, hasattr(sys, 'mark'))\n"
        "    print('x', end='')\n"
        "    sys.stdout.close(); sys.stdin.close(); sys.stderr = None; sys.mark = 1\n"
        "    sys.setrecursionlimit(50); signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "    return seen",
        "f()",
    )
    n = 3 * (sandbox.workers + 8)  # more than the live children: every slot runs several
    verdicts = sandbox.run([job] * n)
    assert {(v.status, v.output) for v in verdicts} == {
        (S.OK, "(False, False, False, 1000, True, False)")
    }


def test_host_checks(run, canaries, ffi):
    sandbox = ffi
    assert {v.output for v in run["neighbours"]} == {NEIGHBOUR_OUT}
    before, after = run["server"]
    assert before == after and sandbox._servers[0].alive()
    procs = run["procs"]
    kids = {pid for pid, ppid in procs.items() if ppid == before}
    assert all(pid == before or ppid == before or ppid in kids for pid, ppid in procs.items())
    for p in canaries:
        assert p.read_text() == "precious"
    assert not left_behind("lorapop-secret")


@pytest.mark.parametrize("policy", ["azr", "benchmark"])
def test_15_hidden_modules_reached_by_no_route(policy):
    """What a policy hides (and the server's own modules) is in no job's reach: not in
    sys.modules, no module's attribute, no frame, no function's globals among object's
    subclasses. (C types such modules defined may remain: their methods reach no module;
    ctypes' are not loaded at all, test_ffi.py.)"""
    with Sandbox(workers=1, timeout_s=5.0, policy=policy) as sb:
        hidden = set(INTERNAL) | set(SERVER_ONLY) | set(sb.policy.hidden)
        hidden -= {m.split(".")[0] for m in sb.policy.modules}
        (v,) = sb.run([Job(HIDDEN_ROUTES, f"reach_all({sorted(hidden)!r})", entry=None)])
    assert v.ok and v.output == "{}", v.output or v.error
    if policy == "azr":
        assert {"time", "random", "selectors", "resource", "ctypes"} <= hidden
        assert set(AZR_HIDDEN) <= hidden


def test_15_clock_offsets_are_random_and_hidden():
    """Each server's clocks are offset by an amount its jobs cannot read, drawn anew."""
    prog = REACH + "def f():\n    return clock(1)"
    readings = []
    for _ in range(2):
        with Sandbox(workers=1, timeout_s=2.0, policy=FFI) as sb:
            host = time.monotonic()
            (v,) = sb.run([Job(prog, "f()")])
            readings.append(float(v.output) - host)
    assert all(abs(r) > 60 for r in readings)  # offset (below ~3 years, random)
    assert abs(readings[0] - readings[1]) > 1  # a new draw per server


def test_13_a_sleeping_job_dies_with_a_killed_server():
    """The job first tries to clear its death signal; its init's cannot be cleared, and the
    kernel kills the init's whole pid namespace with it."""
    sb = Sandbox(workers=1, timeout_s=30.0, policy=FFI)
    try:
        uid = sb.isolation["outer_uid"]
        srv = sb._servers[0]
        import threading

        job = Job(REACH + "import signal\ndef f():\n    libc().prctl(1, 0, 0, 0, 0)\n    signal.pause()", "f()", timeout_s=30.0)  # fmt: skip
        t = threading.Thread(target=lambda: sb.run([job]), daemon=True)
        t.start()
        time.sleep(1.0)
        assert len(processes_of(uid)) >= 3  # the server, the zygote, an init and its job
        os.kill(srv.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while processes_of(uid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not processes_of(uid)
    finally:
        sb.close()
