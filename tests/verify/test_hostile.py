"""Hostile programs: each gets a clear verdict, none reaches the host, the pool keeps serving.

Cases are grouped by the class of attack they try (ten classes, 0: the earlier ones; the
newer classes are in test_isolation.py). The kernel layers must hold against a job that can
call libc, so the batch runs under `FFI` (AZR's policy with ctypes granted) and the kernel
probes take ctypes' C types from object's subclasses (`REACH`); under the shipped policies
no job can reach them (test_ffi.py). Every case runs in one concurrent batch, interleaved
with honest jobs; then the host is checked: no file changed or left behind, no process left,
the same server alive, the honest neighbours exact.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pyseccomp
import pytest

from conftest import FFI, ROOT, left_behind, processes_of
from lorapop.verify import Job, Sandbox, Status
from lorapop.verify.kernel import REQUIRED
from lorapop.verify.sandbox import MAX_ERROR_CHARS

S = Status
TOKEN = f"lorapop-escape-{uuid.uuid4().hex[:8]}"

#: Defines find(name), the first class of that name among object's subclasses, and libc() and
#: clock(id) built from the C types of ctypes found that way (where a policy grants ctypes, or
#: the kernel calls fall back to it): the kernel layers are probed with a foreign-function
#: interface in hand.
REACH = """
def find(name):
    seen, stack = set(), [object]
    while stack:
        for s in type.__subclasses__(stack.pop()):
            if s not in seen:
                if s.__name__ == name:
                    return s
                seen.add(s)
                stack.append(s)
    raise LookupError(name)
class _Lib:
    _handle = 0
    def __getattr__(self, name):
        class Fn(find('CFuncPtr')):
            _flags_ = 1
            _restype_ = find('c_int')
        return Fn((name, self))
def libc():
    return _Lib()
def clock(which):
    ts = (find('c_long') * 2)()
    libc().clock_gettime(which, ts)
    return ts[0] + ts[1] / 1e9
"""


def nr(name: str) -> int:
    return pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)


@dataclass(frozen=True)
class Case:
    cls: int  # issue 13's class of attack (0: the earlier cases)
    name: str
    job: Job
    want: frozenset[Status]
    output: object = None  # an exact output, or a predicate on it (when ok)
    checks: tuple = field(default=())


def case(cls, name, body, want, expr="f()", det=False, output=None, reach=False):  # noqa: ANN001
    program = (REACH if reach else "") + body
    return Case(cls, name, Job(program, expr, deterministic=det), frozenset(want), output)


def all_refused(text: str) -> bool:
    values = eval(text)  # our own repr of a list of ints
    return bool(values) and all(v == -1 for v in values)


def under(limit: int):  # noqa: ANN201
    return lambda text: (
        eval(text)[0] < limit and eval(text)[1] in (28, 27, 31)
    )  # ENOSPC/EFBIG/EMLINK


def hostile_cases(canaries: list[Path]) -> list[Case]:
    c0, cl, gold = str(canaries[0]), str(canaries[-2]), str(canaries[-1])
    me = os.getpid()
    esc = f"/tmp/{TOKEN}"
    sc = f"[libc().syscall({nr('socket')}, 2, 1, 0), libc().syscall({nr('socket')}, 1, 1, 0)]"
    return [
        # --- 0: the earlier review's cases -------------------------------------------------
        case(0, "infinite loop", "def f():\n    while True:\n        pass", {S.TIMEOUT}),
        case(0, "memory hog, one block", "def f():\n    return bytearray(1 << 34)", {S.MEMORY}),
        case(0, "memory hog, growing", "def f():\n    xs = []\n    while True:\n        xs.append(bytes(1 << 24))", {S.MEMORY}),
        case(0, "deep recursion", "def f(n=0):\n    return f(n + 1)", {S.RUNTIME_ERROR}),
        case(0, "recursion past the C stack", "import sys\nsys.setrecursionlimit(10**8)\ndef g(n):\n    return g(n + 1) + 1\ndef f():\n    return g(0)", {S.CRASHED, S.MEMORY, S.TIMEOUT}),
        case(0, "fork bomb", "import os\ndef f():\n    while True:\n        os.fork()", {S.RUNTIME_ERROR}),
        case(0, "thread", "import _thread\ndef f():\n    return _thread.start_new_thread(print, ())", {S.RUNTIME_ERROR}),
        case(0, "subprocess via computed name", "def f():\n    return __import__('sub' + 'process').run(['id'])", {S.RUNTIME_ERROR}),
        case(0, "socket via computed import", "def f():\n    s = __import__('_so' + 'cket')", {S.RUNTIME_ERROR}),
        case(0, "delete a file outside", f"import os\ndef f():\n    os.remove({c0!r})\n    os.remove({cl!r})", {S.RUNTIME_ERROR}),
        case(0, "overwrite a file outside", f"def f():\n    open({cl!r}, 'w').write('pwned')", {S.RUNTIME_ERROR}),
        case(0, "kill own process group", "import os\ndef f():\n    os.killpg(0, 9)\n    return 1", {S.OK, S.CRASHED}),
        case(0, "os._exit", "import os\ndef f():\n    os._exit(0)", {S.CRASHED}),
        case(0, "os.abort", "import os\ndef f():\n    os.abort()", {S.CRASHED}),
        case(0, "segfault via ctypes", "def f():\n    return libc().strlen(0)", {S.CRASHED}, reach=True),
        case(0, "huge return value", "def f():\n    return 'x' * 10**6", {S.OUTPUT_TOO_LARGE}),
        case(0, "print flood", "def f():\n    for _ in range(10**5):\n        print('x' * 100)\n    return 1", {S.OK}, output="1"),
        case(0, "result pipe flood", "import os\ndef f():\n    while True:\n        os.write(3, b'x' * 65536)", {S.OUTPUT_TOO_LARGE}),
        case(0, "set order", "def f(n):\n    return list({str(i) for i in range(n)})", {S.NONDETERMINISTIC}, expr="f(40)", det=True),
        case(0, "hostile __repr__ loops", "class A:\n    def __repr__(self):\n        while True:\n            pass\ndef f():\n    return A()", {S.TIMEOUT}),
        case(0, "rebound builtins.repr", "import builtins\ndef f():\n    builtins.repr = lambda x: '42'\n    return 1", {S.OK}, output="1"),
        case(0, "ignored signals", "import signal\ndef f():\n    for s in (signal.SIGTERM, signal.SIGXCPU, signal.SIGINT):\n        signal.signal(s, signal.SIG_IGN)\n    while True:\n        pass", {S.TIMEOUT}),
        case(0, "fd exhaustion", "def f():\n    return [open('x', 'w') for _ in range(10**5)]", {S.RUNTIME_ERROR}),
        case(0, "stdin read", "import os\ndef f():\n    return os.read(0, 10)", {S.OK}, output="b''"),
        case(0, "hostile expr text", "def f(x):\n    return x", {S.SYNTAX_ERROR}, expr="f(1); import os"),
        # --- 1: uids shared between sandboxes: signal everything --------------------------
        case(1, "kill -1", "import os\ndef f():\n    try:\n        os.kill(-1, 9)\n    except OSError as e:\n        return e.errno\n    return 0", {S.OK}, output=lambda t: t in ("0", "3")),
        case(1, "kill every pid", "import os\ndef f():\n    n = 0\n    for p in range(3, 1 << 15):\n        try:\n            os.kill(p, 9)\n            n += 1\n        except OSError:\n            pass\n    return n", {S.OK}, output="0"),
        case(1, "kill every process group", "import os\ndef f():\n    n = 0\n    for g in range(3, 1 << 13):\n        try:\n            os.killpg(g, 9)\n            n += 1\n        except OSError:\n            pass\n    return n", {S.OK}, output="0"),
        case(1, "kill the server (the job's init)", "import os\ndef f():\n    os.kill(os.getppid(), 9)\n    return os.getppid()", {S.OK}, output="1"),
        case(1, "kill the test process", f"import os\ndef f():\n    os.kill({me}, 9)", {S.RUNTIME_ERROR}),
        case(1, "kill via libc", f"def f():\n    return [libc().kill({me}, 9), libc().kill(-1, 9) * 0 - 1]", {S.OK}, output="[-1, -1]", reach=True),
        case(1, "private uid", "import os\ndef f():\n    return os.getresuid(), os.getresgid(), os.getgroups()", {S.OK}, output="((1000, 1000, 1000), (1000, 1000, 1000), [])"),
        # --- 2: syscalls: namespaces, mounts, ptrace, sockets, keyctl, bpf, perf, ... --------
        case(2, "kernel calls through the server's libc", "def f():\n    c = libc()\n    return [\n"
             f"        c.unshare(0x10000000), c.unshare(0x20000), c.unshare(0x40000000),\n"
             f"        c.syscall({nr('setns')}, 0, 0), c.mount(b'none', b'/', b'tmpfs', 0, None),\n"
             f"        c.syscall({nr('umount2')}, b'/', 2), c.chroot(b'/'), c.syscall({nr('ptrace')}, 0, 0, 0, 0),\n"
             f"        c.syscall({nr('bpf')}, 0, 0, 0), c.syscall({nr('perf_event_open')}, 0, 0, -1, -1, 0),\n"
             f"        c.syscall({nr('keyctl')}, 0, 0), c.syscall({nr('add_key')}, 0, 0, 0, 0, 0),\n"
             f"        c.syscall({nr('io_uring_setup')}, 1, 0), c.syscall({nr('userfaultfd')}, 0),\n"
             f"        c.syscall({nr('personality')}, 0xffffffff), c.setuid(0), c.setgid(0),\n"
             f"        c.syscall({nr('pivot_root')}, b'/', b'/'), c.syscall({nr('kexec_load')}, 0, 0, 0, 0),\n"
             f"        c.syscall({nr('init_module')}, 0, 0, 0), c.syscall({nr('process_vm_readv')}, 1, 0, 0, 0, 0, 0),\n"
             f"        c.syscall({nr('seccomp')}, 1, 0, 0), c.syscall({nr('memfd_create')}, b'x', 0),\n"
             f"        c.syscall({nr('mknodat')}, -100, b'n', 0o20666, 0x103), c.syscall({nr('chown')}, b'/', 0, 0),\n"
             "    ]", {S.OK}, output=all_refused, reach=True),
        case(2, "sockets through the server's libc", f"def f():\n    return {sc}", {S.OK}, output=all_refused, reach=True),
        case(2, "clone an init as the zygote does", f"def f():\n    return [libc().syscall({nr('clone')}, 0x20008011, 0, 0, 0, 0), libc().syscall({nr('clone')}, 17, 0, 0, 0, 0)]", {S.OK}, output=all_refused, reach=True),
        case(2, "raw clone of a new user namespace", f"def f():\n    return [libc().syscall({nr('clone')}, 0x10000000 | 17, 0, 0, 0, 0), libc().fork()]", {S.OK}, output=all_refused, reach=True),
        case(2, "unshare via os", "import os\ndef f():\n    return os.unshare(0x10000000)", {S.RUNTIME_ERROR}),
        case(2, "regain root", "import os\ndef f():\n    os.setuid(0)", {S.RUNTIME_ERROR}),
        case(2, "raise own rlimits", "def f():\n    big = (find('c_ulong') * 2)(2**64 - 1, 2**64 - 1)\n    return [libc().setrlimit(9, big), libc().setrlimit(6, big)]", {S.OK}, output=all_refused, reach=True),
        # --- 3: execve and forged verdicts from an exec'd shell ----------------------------
        case(3, "os.execv a shell", f"import os\ndef f():\n    os.execv('/bin/sh', ['sh', '-c', 'rm -f {cl}; echo ok 1 -1 0.0 >&3; echo 7 >&3'])", {S.RUNTIME_ERROR}),
        case(3, "execve through libc", f"def f():\n    return [libc().execve(b'/bin/sh', None, None), libc().syscall({nr('execveat')}, -100, b'/bin/sh', 0, 0, 0)]", {S.OK}, output=all_refused, reach=True),
        case(3, "os.system", f"import os\ndef f():\n    return os.system('echo x > {esc}; rm -f {cl}')", {S.OK, S.RUNTIME_ERROR}),
        case(3, "posix_spawn", f"import os\ndef f():\n    return os.posix_spawn('/bin/rm', ['rm', '{cl}'], {{}})", {S.RUNTIME_ERROR}),
        case(3, "exec python", "import os, sys\ndef f():\n    os.execv(sys.executable, ['python', '-c', 'print(1)'])", {S.RUNTIME_ERROR}),
        # --- 4: kill or stall the server through the work directory ------------------------
        case(4, "nested directories", "import os\ndef f():\n    n = 0\n    try:\n        while True:\n            os.mkdir('d')\n            os.chdir('d')\n            n += 1\n    except OSError as e:\n        return n, e.errno", {S.OK}, output=under(1100)),
        case(4, "150k directories", "import os\ndef f():\n    n = 0\n    try:\n        for i in range(150_000):\n            os.mkdir(f'd{i}')\n            n += 1\n    except OSError as e:\n        return n, e.errno", {S.OK}, output=under(1100)),
        case(4, "fill the tmpfs", "def f():\n    n = 0\n    try:\n        with open('big', 'wb') as fh:\n            while True:\n                fh.write(b'x' * (1 << 20))\n                fh.flush()\n                n += 1\n    except OSError as e:\n        return n, e.errno", {S.OK}, output=under(17)),
        case(4, "hard links", "import os\ndef f():\n    open('a', 'w').close()\n    n = 0\n    try:\n        while True:\n            os.link('a', f'l{n}')\n            n += 1\n    except OSError as e:\n        return n, e.errno", {S.OK}, output=under(1100)),
        case(4, "symlinks", "import os\ndef f():\n    n = 0\n    try:\n        while True:\n            os.symlink('x' * 4000, f's{n}')\n            n += 1\n    except OSError as e:\n        return n, e.errno", {S.OK}, output=under(1100)),
        case(4, "leave a tree and go", "import os\ndef f():\n    for i in range(200):\n        os.makedirs(f'a/{i}/b/c')\n    return 'left'", {S.OK}, output="'left'"),
        # --- 5: state left for later jobs (/tmp, /dev/shm, SysV IPC, message queues) -------
        case(5, "shared memory and message queues", f"def f():\n    c = libc()\n    return [c.syscall({nr('shmget')}, 0, 4096, 0o1666), c.syscall({nr('msgget')}, 0, 0o1666),\n            c.syscall({nr('semget')}, 0, 1, 0o1666), c.syscall({nr('mq_open')}, b'q', 0o100, 0o666, 0)]", {S.OK}, output=all_refused, reach=True),
        case(5, "abstract unix socket", f"def f():\n    return [libc().syscall({nr('socket')}, 1, 2, 0)]", {S.OK}, output=all_refused, reach=True),
        case(5, "a counter in a file", "def f():\n    try:\n        n = int(open('/counter').read())\n    except FileNotFoundError:\n        n = 0\n    open('/counter', 'w').write(str(n + 1))\n    return n + 1", {S.OK}, output="1", det=True),
        case(5, "/dev/shm of the host", f"def f():\n    open('/dev/shm/{TOKEN}', 'w').write('x')", {S.RUNTIME_ERROR}),
        # --- 6: results that vary between runs must differ between the two runs -------------
        case(6, "identity", "import os\ndef f():\n    return os.getuid(), os.getgid(), os.getpid(), os.getppid(), os.getcwd(), sorted(getattr(os, 'envi' + 'ron').items()), os.listdir('/')", {S.OK}, det=True, output="(1000, 1000, 2, 1, '/', [('LC_ALL', 'C.UTF-8'), ('PATH', '/bin:/usr/bin')], [])"),
        case(6, "monotonic clock in days", "def f():\n    return int(clock(1)) // 86400", {S.NONDETERMINISTIC}, det=True, reach=True),
        case(6, "boot-time clock in hours", "def f():\n    return int(clock(7)) // 3600", {S.NONDETERMINISTIC}, det=True, reach=True),
        case(6, "monotonic clock in years", "def f():\n    return int(clock(1)) // (365 * 86400)", {S.NONDETERMINISTIC}, det=True, reach=True),
        case(6, "an address", "def f():\n    return id(object()) // 4096", {S.NONDETERMINISTIC}, det=True),
        case(6, "a default repr", "class A:\n    pass\ndef f():\n    return repr(A())", {S.NONDETERMINISTIC}, det=True),
        case(6, "/proc/uptime", "def f():\n    return open('/proc/uptime').read().split()[0]", {S.RUNTIME_ERROR}, det=True),
        case(6, "os.times", "import os\ndef f():\n    return os.times().elapsed", {S.CRASHED}, det=True),
        case(6, "string hash", "def f(s):\n    return hash(s)", {S.NONDETERMINISTIC}, expr="f('abc')", det=True),
        # --- 7: size caps before parsing ----------------------------------------------------
        case(7, "5 MB program", "x = 1\n" * 800_000 + "def f():\n    return x", {S.SYNTAX_ERROR}),
        case(7, "5 MB expression", "def f(x):\n    return 1", {S.SYNTAX_ERROR}, expr="f(" + "1+" * 2_500_000 + "1)"),
        case(7, "absurd nesting", "def f():\n    return " + "(" * 5000 + "1" + ")" * 5000, {S.SYNTAX_ERROR}),
        # --- 8: the host's files --------------------------------------------------------------
        case(8, "/etc/passwd", "def f():\n    return open('/etc/passwd').read()", {S.RUNTIME_ERROR}),
        case(8, "a run's gold buffer", f"def f():\n    return open({gold!r}).read()", {S.RUNTIME_ERROR}),
        case(8, "list the root", "import os\ndef f():\n    return os.listdir('/')", {S.OK}, output="[]"),
        case(8, "climb out", "import os\ndef f():\n    for _ in range(20):\n        os.chdir('..')\n    return os.listdir('.'), os.getcwd()", {S.OK}, output="([], '/')"),
        case(8, "/proc of others", "def f():\n    return open('/proc/1/environ', 'rb').read()", {S.RUNTIME_ERROR}),
        case(8, "libc open", f"def f():\n    return [libc().open(b'/etc/shadow', 0), libc().open({gold.encode()!r}, 0)]", {S.OK}, output=all_refused, reach=True),
        case(8, "the python installation", "import os\ndef f():\n    return open(os.__file__).read(10)", {S.RUNTIME_ERROR}),
        # --- 9: forged results on the result descriptor ---------------------------------------
        case(9, "800k-character ok", "import os\ndef f():\n    os.write(3, b'ok 800000 -1 0.0\\n' + b'7' * 800000)\n    os._exit(0)", {S.OUTPUT_TOO_LARGE}),
        case(9, "50k-character ok", "import os\ndef f():\n    os.write(3, b'ok 50000 -1 0.0\\n' + b'7' * 50000)\n    os._exit(0)", {S.OUTPUT_TOO_LARGE}),
        case(9, "ok with no output", "import os\ndef f():\n    os.write(3, b'ok -1 -1 0.0\\n')\n    os._exit(0)", {S.CRASHED}),
        case(9, "two results", "import os\ndef f():\n    os.write(3, b'ok 1 -1 0.0\\n1ok 1 -1 0.0\\n2')\n    os._exit(0)", {S.CRASHED}),
        case(9, "nan duration", "import os\ndef f():\n    os.write(3, b'ok 1 -1 nan\\n1')\n    os._exit(0)", {S.CRASHED}),
        case(9, "unknown status", "import os\ndef f():\n    os.write(3, b'pwned 1 -1 0.0\\n1')\n    os._exit(0)", {S.CRASHED}),
        case(9, "forge, then return", "import os\ndef f():\n    os.write(3, b'ok 1 -1 0.0\\n7')\n    return 8", {S.CRASHED}),
        case(9, "forge, then hang", "import os\ndef f():\n    os.write(3, b'ok 2 -1 0.0\\n42')\n    while True:\n        pass", {S.TIMEOUT}),
    ]  # fmt: skip


HUGE_ERROR = Job(
    "import os\ndef f():\n    os.write(3, b'runtime_error -1 100000 0.0\\n' + b'e' * 100000)\n"
    "    os._exit(0)",
    "f()",
)
HONEST = Job("def f(x):\n    return x * 2", "f(21)")


@pytest.fixture(scope="module")
def outcomes(ffi, canaries):
    """All hostile cases in one concurrent batch (siblings must not disturb each other), then
    a snapshot of the host: the server's pid before and after, the processes of the jobs' uid."""
    sandbox = ffi
    cases = hostile_cases(canaries)
    server = sandbox._servers[0].proc.pid  # private: the test checks it is never replaced
    jobs = [c.job for c in cases] + [HUGE_ERROR]
    mixed = [x for job in jobs for x in (job, HONEST)]  # interleave honest jobs
    verdicts = sandbox.run(mixed)
    after = sandbox._servers[0].proc.pid
    procs = processes_of(sandbox.isolation["outer_uid"])
    return cases, verdicts[0::2], verdicts[1::2], (server, after, procs)


def test_the_layers_are_active(sandbox):
    """Here (root, and the kernel allows user namespaces) every layer must be on."""
    layers = sandbox.isolation["layers"]
    assert all(layers[name] for name in REQUIRED), sandbox.isolation
    assert layers["time_ns"]
    if ROOT:
        assert sandbox.isolation["outer_uid"] >= 0x7F000000


def test_each_case_gets_its_status(outcomes):
    cases, verdicts, _, _ = outcomes
    wrong = [
        (c.cls, c.name, v.status.value, v.error, (v.output or "")[:100])
        for c, v in zip(cases, verdicts, strict=False)
        if v.status not in c.want
    ]
    assert not wrong
    assert all(v.ok or v.error for v in verdicts)  # every failure says why


def test_each_case_gets_its_output(outcomes):
    cases, verdicts, _, _ = outcomes
    wrong = []
    for c, v in zip(cases, verdicts, strict=False):
        if not v.ok or c.output is None:
            continue
        good = c.output(v.output) if callable(c.output) else v.output == c.output
        if not good:
            wrong.append((c.cls, c.name, v.output[:200]))
    assert not wrong


def test_every_class_is_attacked_several_ways():
    counts: dict[int, int] = {}
    for c in hostile_cases([Path("/nonexistent")] * 3):
        counts[c.cls] = counts.get(c.cls, 0) + 1
    assert all(counts.get(k, 0) >= 3 for k in range(1, 10)), counts  # 10: test_limits.py


def test_error_read_back_is_capped(outcomes):
    v = outcomes[1][-1]
    assert v.status is S.RUNTIME_ERROR and v.error == "e" * MAX_ERROR_CHARS


def test_honest_neighbours_exact(outcomes):
    _, _, honest, _ = outcomes
    assert [(v.status, v.output) for v in honest] == [(S.OK, "42")] * len(honest)


def test_host_untouched(outcomes, canaries):
    for p in canaries:
        assert p.read_text() == "precious"
    assert not left_behind(TOKEN)
    assert os.getpid()  # we are alive (the kill cases did not reach us)


def test_server_survived_and_no_process_left(outcomes, ffi):
    sandbox = ffi
    _, _, _, (before, after, procs) = outcomes
    assert before == after and sandbox._servers[0].alive()
    # Every process of the jobs' uid is the server, its zygote, an idle init it keeps (made
    # ahead), or such an init's job process (forked ahead, waiting for its bytes).
    assert before in procs
    kids = {pid for pid, ppid in procs.items() if ppid == before}
    assert all(pid == before or ppid == before or ppid in kids for pid, ppid in procs.items())


def test_pool_keeps_serving(outcomes, sandbox):
    jobs = [Job("def f(x):\n    return x + 1", f"f({i})", deterministic=True) for i in range(8)]
    assert [v.output for v in sandbox.run(jobs)] == [str(i + 1) for i in range(8)]


def test_later_jobs_find_nothing_of_earlier_ones(sandbox):
    """Class 5: each job has its own tmpfs; what a job leaves is gone for every later job."""
    write = (
        "import os\ndef f():\n    os.makedirs('/tmp/x')\n    os.makedirs('/dev/shm')\n"
        "    for p in ('/tmp/x/m', '/dev/shm/m', 'm'):\n        open(p, 'w').write('left')\n"
        "    os.symlink('/tmp', 'link')\n    return sorted(os.listdir('/'))"
    )
    read = (
        "import os\ndef f():\n    try:\n        open('/tmp/x/m')\n    except OSError:\n"
        "        return os.listdir('/'), False\n    return os.listdir('/'), True"
    )
    n = 3 * sandbox.workers + 8  # more than the live children: every slot is reused
    first = sandbox.run([Job(write, "f()") for _ in range(n)] + [Job(read, "f()")] * n)
    assert {v.output for v in first[:n]} == {"['dev', 'link', 'm', 'tmp']"}
    assert {v.output for v in first[n:]} == {"([], False)"}
    assert {v.output for v in sandbox.run([Job(read, "f()")] * n)} == {"([], False)"}


def test_two_sandboxes_cannot_affect_each_other(canaries):
    """Class 1: two sandboxes on one host at once (two trainers, two users' runs): one's jobs
    signal every pid and group they can name and fill their tmpfs while the other runs honest
    jobs; the other's verdicts are all exact and its server is never replaced."""
    import threading

    attack = [c.job for c in hostile_cases(canaries) if c.cls in (1, 4)]
    honest = [Job("def f(x):\n    return sorted(str(x * 7))", f"f({i})") for i in range(300)]
    with (
        Sandbox(workers=2, timeout_s=2.0, policy=FFI) as a,
        Sandbox(workers=2, timeout_s=2.0) as b,
    ):
        if ROOT:
            assert a.isolation["outer_uid"] != b.isolation["outer_uid"]
        b_server = b._servers[0].proc.pid
        hits: list = []
        t = threading.Thread(target=lambda: hits.extend(a.run(attack * 3)))
        t.start()
        got = b.run(honest)
        t.join()
        assert len(hits) == 3 * len(attack)
        assert [v.output for v in got] == [repr(sorted(str(i * 7))) for i in range(300)]
        assert b._servers[0].proc.pid == b_server and b._servers[0].alive()
        assert b.run([HONEST])[0].output == "42"
    for p in canaries:
        assert p.read_text() == "precious"


def test_environment_is_clean_and_fixed(monkeypatch):
    monkeypatch.setenv("LORAPOP_SECRET", "hunter2")
    with Sandbox(workers=1, timeout_s=1.0) as sb:
        env = "def f():\n    return dict(getattr(__import__('os'), 'envi' + 'ron'))"
        (v,) = sb.run([Job(env, "f()", deterministic=True)])
    assert v.ok and eval(v.output) == {"PATH": "/bin:/usr/bin", "LC_ALL": "C.UTF-8"}


def test_runtime_error_names_the_exception(sandbox):
    (v,) = sandbox.run([Job("def f():\n    return {}['k']", "f()")])
    assert v.status is S.RUNTIME_ERROR and v.error == "KeyError: 'k'"
