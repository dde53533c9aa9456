"""A job's processes: the zygote that makes them, the job's init, and the job itself.

The fork server (`lorapop.verify.server`) forks one zygote before it reads any job; the zygote
never reads one either. Before its first child it drops everything of the server: every module
the job may not import (the server's own tools, the policy's hidden ones, the references other
modules keep to them), the import machinery's creators, the server's objects; the collector
then frees them. What it keeps lives in one small namespace (`zygote_namespace`), so no class
or module of this package remains in a job's image.

For each child slot the server asks for, the zygote clones an *init*: pid 1 of a new pid
namespace whose parent is the server (CLONE_PARENT), so the server reaps and kills it
directly. The init dies with the server (PDEATHSIG, which the seccomp filter lets nobody
clear; the kernel then kills its whole pid namespace) and runs its slot's jobs one after
another: for each it makes fds 0-3 new files in the slot's tmpfs, forks the job as pid 2
(clone3 with set_tid; signals a job sends itself act as in CPython) before its bytes come,
waits for it, forwards its result (fd 3) with the kernel's sendfile, and gives the slot a new
tmpfs. The job reads its own bytes, chroots into the tmpfs and drops its capabilities; it
never holds a pipe, nor any file outside its tmpfs, and the init never holds a job's bytes.
With the kernel-call extension that loop is C (`lorapop.verify._kernel.serve_slot`): no
Python runs in an init between jobs, so it dirties almost none of the pages its jobs share.

Each job changes pages it shares with its init, and each change costs a copy-on-write fault:
so what every job would do alike is done once in the zygote (`_job_image`, `_warm`: the
streams, the recursion limit, a specialized per-job path) and the per-job path is short.

The job's code runs from the interpreter's bottom frame: every function here returns into the
server's `-c` script before the job's code starts (`BOOT`), so frames, tracebacks and the
recursion depth a job sees are those of a script. The result is length-prefixed text (never a
pickle) that the caller parses as hostile bytes (`lorapop.verify.wire`).
"""

from __future__ import annotations

import _signal
import builtins
import contextlib
import gc
import io
import marshal
import os
import pickle
import signal
import sys
import types
from dataclasses import dataclass
from typing import Any

RESULT_FD = 3
#: Bytes of a job's tmpfs kept for its result (a job that fills the rest can still report).
RESERVED = 1 << 16
#: Where the zygote keeps its pipes (clear of 0-3, which a job's init makes its own).
ZYGOTE_FDS = (100, 101, 102)  # control (server -> zygote), report (zygote -> server), lifeline
#: Where an init holds its pipes: job read and write ends, result read and write ends.
PIPE_FDS = (200, 201, 202, 203)
_RLIMIT_CPU, _RLIMIT_FSIZE, _RLIMIT_NPROC, _RLIMIT_NOFILE, _RLIMIT_CORE, _RLIMIT_AS = (
    0, 1, 6, 7, 4, 9,
)  # fmt: skip
_O_TMPFILE = getattr(os, "O_TMPFILE", 0o20200000)

#: The server's `-c` script. `main()` never returns in the server; the zygote gets its loop, a
#: job its context manager. Each name is popped before use, so the frame below a job's code
#: holds nothing of the server: the job's code runs at depth 2, as a script's body would.
BOOT = """from lorapop.verify.server import main as _m
_z = _m()
del _m
_w = globals().pop('_z')()
with globals().pop('_w') as _o:
    exec(_o[0], _o[1])
    _o.append(eval(_o[2], _o[1]))
__import__('os')._exit(70)
"""


@dataclass(frozen=True)
class Limits:
    """Limits applied with setrlimit. `timeout_s` is the default; a job may carry its own (the
    job sets RLIMIT_CPU once its init has read it)."""

    timeout_s: float
    memory_mb: int
    max_output_chars: int
    max_stdout_chars: int = 65_536
    nofile: int = 16
    isolate: bool = True


def cpu_limit(timeout_s: float) -> int:
    """RLIMIT_CPU seconds for a wall-clock limit: a backstop above it (the server enforces the
    wall clock; the soft limit's SIGXCPU reads as a timeout)."""
    return int(timeout_s) + 1


# --- what runs in the zygote, its inits and jobs (rebound into `zygote_namespace`) ----------

# Bound at import, so a program that rebinds builtins.repr or pickle.dumps cannot fake a result.
_repr, _str, _type, _len = repr, str, type, len
#: Result types that always pickle (str and bytes when short): `_verdict` skips the check.
_PLAIN = frozenset((int, float, complex, bool, type(None), str, bytes))
_dumps, _loads, _contextmanager = pickle.dumps, marshal.loads, contextlib.contextmanager
# The rest of the zygote's namespace, bound by `zygote_namespace` from the server's values
# (`lorapop.verify.kernel.JobKernel.values`, `lorapop.verify.server.main`); None here.
CLONE_INIT: Any = None  # () -> pid: an init (pid 1 of a new pid namespace, the server's child)
FORK_JOB: Any = None  # () -> pid: a plain child
CLONE_JOB: Any = None  # () -> pid: a job, as pid 2 where the init is pid 1
RENEW: Any = None  # (path, options): a new tmpfs at path, the old one discarded
SLOT_OPTIONS: Any = None  # a slot's tmpfs options
PRCTL: Any = None
SETRLIMIT: Any = None  # (which, soft, hard)
RLIMITS: Any = None  # the job's limits (but RLIMIT_CPU) as (which, soft, hard)
CPU_HARD: Any = None  # RLIMIT_CPU's hard limit where the server started
DROP_CAPS: Any = None  # (): no capabilities; None where the server has none to drop
SECCOMP: Any = None  # (program): load a seccomp filter
JOB_FILTER: Any = None  # the job's seccomp program (BPF bytes), or None
TRIM: Any = None  # (): malloc_trim, or None
SERVE: Any = None  # the extension's init loop (`lorapop.verify._kernel.serve_slot`), or None
SLOTS: Any = None  # each slot's tmpfs, or None without a private filesystem
DEVNULL: Any = None  # the zygote's fd of /dev/null, for when there is no private tmpfs
STREAMS: Any = None  # the job's sys.stdin, stdout, stderr
MAIN: Any = None  # the job's __main__ module
MAX_OUTPUT: Any = None  # a longer repr is output_too_large
RESULT_CAP: Any = None  # result bytes an init forwards at most
HIDE: Any = None  # top-level names of the modules the zygote drops
RECURSION: Any = None  # the job's sys.getrecursionlimit, setrecursionlimit (`_recursion`)
RECURSION_GET: Any = None  # the real sys.getrecursionlimit
SIGNAL: Any = None  # _signal.signal (signal.signal's enum conversions cost every job)
DEFAULT_INT: Any = None  # signal.default_int_handler
RECURSION_SET: Any = None  # the real sys.setrecursionlimit
RUNNER: Any = None  # _contextmanager(_runner), wrapped once in the zygote
NOOP: Any = None  # _contextmanager(_noop), likewise
_get: Any = None  # the real sys.getrecursionlimit, in `_recursion`'s functions
_set: Any = None  # the real sys.setrecursionlimit, in `_recursion`'s functions


def _describe(e: BaseException) -> str:
    try:
        name = _str(_type(e).__name__)
        text = _str(e)
        return f"{name}: {text}"[:2000] if text else str(name)
    except BaseException:  # a hostile __str__
        return "unprintable exception"


def _encode(status: str, output: str | None, error: str | None) -> bytes:
    """`lorapop.verify.wire.encode_result`'s format; the duration is the server's to measure."""
    out = b"" if output is None else output.encode("utf-8", "surrogatepass")
    err = b"" if error is None else error.encode("utf-8", "surrogatepass")
    n_out = -1 if output is None else _len(out)
    n_err = -1 if error is None else _len(err)
    return f"{status} {n_out} {n_err} 0.0\n".encode() + out + err


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _verdict(box: list) -> tuple[str, str | None, str | None]:
    value = box[3]
    try:
        if _type(value) not in _PLAIN or (_type(value) in (str, bytes) and _len(value) > 4096):
            _dumps(value)  # what always pickles (short) needs no pickler
    except MemoryError:
        return "memory", None, "MemoryError while pickling"
    except BaseException as e:
        return "unpicklable", None, _describe(e)
    try:
        text = _repr(value)
    except MemoryError:
        return "memory", None, "MemoryError in repr"
    except BaseException as e:
        return "runtime_error", None, "repr: " + _describe(e)
    if _type(text) is not _str:
        return "runtime_error", None, "repr: not a str"
    if _len(text) > MAX_OUTPUT:
        return "output_too_large", None, f"repr has {_len(text)} characters (cap {MAX_OUTPUT})"
    return "ok", text, None


def _runner(program: object, expr: object) -> Any:
    """The job's context manager (a generator: no class of ours for a job to find): BOOT runs
    the job inside it; whatever happens, the result goes to fd 3 and the process exits."""
    box = [program, MAIN.__dict__, expr]
    try:
        yield box
        res = _verdict(box)
    except MemoryError:
        res = "memory", None, "MemoryError"
    except BaseException as e:
        res = "runtime_error", None, _describe(e)
    try:
        _write_all(RESULT_FD, _encode(*res))
    finally:
        os._exit(0)


def _confine() -> None:
    """In the job (pid 2), while it waits for its bytes: limits, no capabilities (the jobs'
    seccomp filter is its init's, but without a private tmpfs)."""
    os.setpgid(0, 0)
    for which, soft, hard in RLIMITS:
        SETRLIMIT(which, soft, hard)
    if DROP_CAPS is not None:
        DROP_CAPS()
    if SLOTS is None:
        _load_filter()


def _load_filter() -> None:
    """The jobs' seccomp filter, on top of the server's."""
    if JOB_FILTER is not None:
        SECCOMP(JOB_FILTER)


def _read_job(fd: int) -> bytes | None:
    """`<length>\\n` + the job's bytes, from the server; None when it closed the pipe. (The
    server writes an init's next job only once this one has answered: nothing follows.)"""
    buf = os.read(fd, 1 << 16)
    while b"\n" not in buf:
        chunk = os.read(fd, 64)
        if not chunk:
            return None
        buf += chunk
    head, _, rest = buf.partition(b"\n")
    parts, left = [rest], int(head) - len(rest)
    while left > 0:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    os.close(fd)
    return rest if len(parts) == 1 else b"".join(parts)


def _job(program: object, expr: object, cpu: int) -> Any:
    """The job's CPU limit and SIGINT, then its context manager (its standard streams and
    recursion limit are the zygote's: `_job_image`)."""
    hard = CPU_HARD
    SETRLIMIT(_RLIMIT_CPU, min(cpu, hard), min(cpu + 1, hard))
    SIGNAL(2, DEFAULT_INT)  # SIGINT: KeyboardInterrupt, as in any script (the server ignores it)
    return RUNNER(program, expr)


def _job_image() -> None:
    """Once, in the zygote: what every job starts with, set before any is forked (each job
    changes only its own copy): its standard streams, and a script's recursion limit."""
    sys.stdin, sys.stdout, sys.stderr = STREAMS
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = STREAMS
    sys.getrecursionlimit, sys.setrecursionlimit = RECURSION
    RECURSION_SET(RECURSION_GET() + FRAMES_BELOW)


def _files(slot: int, devnull: int) -> None:
    """fds 0-3 for the init's next job: 0-2 and the result file, each new, no names, in the
    job's own tmpfs (without one: the server's null, and an anonymous file)."""
    if SLOTS is None:
        for fd in range(3):
            os.dup2(devnull, fd)
        if os.memfd_create("result") != RESULT_FD:
            raise OSError("the result file is not fd 3")
        return
    for want in range(4):
        if os.open(SLOTS[slot], _O_TMPFILE | os.O_RDWR, 0o600) != want:
            raise OSError(f"fd {want} is taken")
    os.posix_fallocate(RESULT_FD, 0, RESERVED)  # room for the result in a full tmpfs


def _init(slot: int) -> Any:
    """In a new init (pid 1 of the jobs' pid namespace; its parent is the server), holding
    its pipes at PIPE_FDS. It runs jobs one at a time, each a new process forked as pid 2
    before its bytes come; after each it sends `<exit code> <length>\\n` and the job's result
    (the kernel copies it: no job's bytes enter this process) and gives the slot a new tmpfs.
    Returns only in a job process: its context manager."""
    job_r, job_w, res_r, res_w = PIPE_FDS
    try:
        PRCTL(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: die with the server
        try:
            if os.read(ZYGOTE_FDS[2], 1) == b"":  # the server died before the line above
                os._exit(0)
        except BlockingIOError:
            pass
        devnull = os.dup2(DEVNULL, PIPE_FDS[3] + 1)
        os.closerange(0, PIPE_FDS[0])  # the zygote's pipes, 0-3
        os.closerange(devnull + 1, 1 << 16)
        os.chdir("/")
        if SLOTS is not None:
            _load_filter()
    except BaseException:
        os._exit(70)
    if SERVE is not None and SLOTS is not None:
        try:  # the extension's loop: returns only in a job, confined but for its filter's...
            SERVE(SLOTS[slot], SLOT_OPTIONS, RESULT_CAP, RLIMITS, DROP_CAPS is not None, job_w,
                  devnull)  # fmt: skip
        except BaseException as e:
            _crashed(e)
        return _begin(job_r)  # ...which it inherits from this init
    while True:
        try:
            _files(slot, devnull)
            pid = CLONE_JOB()  # pid 2, ahead of its bytes: starting it is one pipe write
        except BaseException:
            os._exit(70)
        if pid == 0:
            try:
                os.closerange(job_w, devnull + 1)  # job_w, res_r, res_w, devnull
                if SLOTS is not None:
                    os.chroot(SLOTS[slot])
                    os.chdir("/")
                _confine()
            except BaseException as e:
                _crashed(e)
            return _begin(job_r)
        try:
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            left = min(os.lseek(RESULT_FD, 0, os.SEEK_CUR), RESULT_CAP)
            _write_all(res_w, b"%d %d\n" % (128 - code if code < 0 else min(code, 127), left))
            offset = 0
            while left > 0 and (n := os.sendfile(res_w, RESULT_FD, offset, left)) > 0:
                offset, left = offset + n, left - n
            if left > 0:
                raise OSError("the result file shrank")
            os.closerange(0, 4)
            if SLOTS is not None:  # what the job left is discarded whole
                RENEW(SLOTS[slot], SLOT_OPTIONS)
        except BaseException:
            os._exit(70)


def _crashed(e: BaseException) -> None:
    """A job that could not be confined or started: its verdict, and its end."""
    try:
        _write_all(RESULT_FD, _encode("crashed", None, "confinement: " + _describe(e)))
    finally:
        os._exit(0)


def _begin(job_r: int) -> Any:
    """In a confined job: read its bytes; its context manager."""
    try:
        data = _read_job(job_r)
        if data is None:  # the server is shutting down
            os._exit(0)
        head, _, body = data.partition(b"\n")
        program, expr = _loads(body)
        return _job(program, expr, int(head))
    except BaseException as e:
        _crashed(e)


def _zygote() -> Any:
    """The zygote's loop: each line on the control pipe names a slot; it clones an init for it
    and reports `pid slot job_w res_r` (its fds, for the server to copy: pidfd_getfd). Returns
    only in a job process."""
    collector, hide = _forget()
    collector.collect()  # here: _forget's frame no longer holds what its loops last saw
    _sever(collector, hide)
    _job_image()
    _warm()
    collector.collect()
    collector.freeze()  # kept objects out of the collector: fewer copy-on-write faults per job
    del collector, hide
    if TRIM is not None:
        TRIM()  # what the dropped modules held goes back: fewer pages for each clone to map
    ctl, report, _ = ZYGOTE_FDS
    buf = b""
    while True:
        chunk = os.read(ctl, 4096)
        if not chunk:
            os._exit(0)
        *lines, buf = (buf + chunk).split(b"\n")
        out = []
        for line in lines:
            slot = int(line)
            fds: list[int] = []
            try:
                for _ in range(2):
                    fds += os.pipe()
                for i, fd in enumerate(fds):  # where the init keeps them: the server copies
                    os.dup2(fd, PIPE_FDS[i])  # them from there while it runs
                    os.close(fd)
                fds = list(PIPE_FDS)
                pid = CLONE_INIT()
            except OSError:
                for fd in fds:
                    os.close(fd)
                out.append(b"-1 %d 0 0\n" % slot)
                continue
            if pid == 0:
                return _init(slot)
            for fd in fds:
                os.close(fd)
            out.append(b"%d %d %d %d\n" % (pid, slot, PIPE_FDS[1], PIPE_FDS[2]))
        _write_all(report, b"".join(out))


def _forget() -> tuple[Any, frozenset[str]]:
    """Once, in the zygote: drop every module a job may not import and everything of the
    server, so that the collector (returned) frees them before any job exists."""
    hide = HIDE
    gone = {id(m) for name, m in sys.modules.items() if name.split(".")[0] in hide}
    for name in [n for n in sys.modules if n.split(".")[0] in hide]:
        del sys.modules[name]

    def hidden(v: object) -> bool:
        if id(v) in gone:
            return True
        owner = getattr(v, "__self__", None) if _type(v) is types.BuiltinFunctionType else None
        if owner is not None and id(owner) in gone:
            return True
        mod = getattr(v, "__module__", None) if isinstance(v, type | types.FunctionType) else None
        return isinstance(mod, str) and mod.split(".")[0] in hide

    for mod in list(sys.modules.values()):  # e.g. statistics.random: the kept ones' references
        d = getattr(mod, "__dict__", None)
        if isinstance(d, dict):
            for k, v in list(d.items()):
                if hidden(v):
                    d[k] = None
    for obj in gc.get_objects():  # modules kept alive only as others' attributes (ctypes.util)
        if isinstance(obj, types.ModuleType):
            d = obj.__dict__
            for k, v in list(d.items()):
                if isinstance(v, types.ModuleType) and v is not obj and id(v) in gone:
                    d[k] = None
    imp = sys.modules.get("_imp")
    for name in ("create_builtin", "create_dynamic", "exec_builtin", "exec_dynamic",
                 "init_frozen", "get_frozen_object", "find_frozen"):  # fmt: skip
        if imp is not None and hasattr(imp, name):
            delattr(imp, name)  # no module can be made again from the interpreter's tables
    sys.meta_path, sys.path_hooks, sys.path_importer_cache, sys.path = [], [], {}, []
    sys.argv, sys.orig_argv = ["-c"], ["python", "-c", ""]
    ns = globals()
    return ns.pop("gc"), ns.pop("HIDE")


def _sever(collector: Any, hide: frozenset[str]) -> None:
    """Empty the globals of the dropped modules something still keeps alive (random and
    threading, whose at-fork hooks the interpreter holds; ctypes where the kernel calls fall
    back to it): their functions and classes, should a job reach them, fail as a missing
    import would. The zygote's own kernel calls need no module globals (the extension's
    functions, or `kernel_ctypes`' in a namespace of their own)."""
    for obj in collector.get_objects():
        if isinstance(obj, types.ModuleType) and obj is not collector:
            d = obj.__dict__
        elif isinstance(obj, dict) and "__builtins__" in obj:  # a freed module's globals
            d = obj
        else:
            continue
        name = d.get("__name__")
        if isinstance(name, str) and name.split(".")[0] in hide and d is not globals():
            d.clear()


def _noop() -> Any:
    yield None


def _warm() -> None:
    """Once, in the zygote: run the per-job path that needs no job (unmarshal a sample job of
    the server's own, judge and encode results of the usual types, a generator context
    manager) until CPython has specialized it, so that each job, which runs it once, writes
    fewer shared pages (its warm-up counters, type and method caches): fewer copy-on-write
    faults per job. Nothing of any job is involved."""
    for _ in range(WARM_ROUNDS):
        program, expr = _loads(WARM_JOB)
        for value in (0, 1.5, "s", b"b", None, True, [1, "a"], (1, 2.0), {"k": [1]}, {1, 2}):
            _encode(*_verdict([program, None, expr, value]))
        with NOOP():
            pass


#: Rounds of `_warm`: CPython 3.11 specializes a function's code after 8 calls.
WARM_ROUNDS = 16
#: `_warm`'s sample job (marshalled code objects, as a job's bytes carry them).
WARM_JOB = marshal.dumps(
    (compile("def f():\n    return 1", "<warm>", "exec"), compile("f()", "<warm>", "eval"))
)

#: Rebound into the zygote's namespace, in this order.
_FUNCTIONS = (
    _describe, _encode, _write_all, _verdict, _runner, _confine, _load_filter, _read_job, _job,
    _files, _init, _crashed, _begin,
    _zygote, _forget, _sever, _noop, _warm, _job_image,
)  # fmt: skip


#: Frames below a job's code that a script's code has not: BOOT's and the expr's own.
FRAMES_BELOW = 2


def _getrecursionlimit() -> int:
    """sys.getrecursionlimit, less the frames below the job's code (a script's limit)."""
    return _get() - FRAMES_BELOW


def _setrecursionlimit(limit: int) -> None:
    """sys.setrecursionlimit, plus the frames below the job's code; its errors are CPython's."""
    if _type(limit) is not int or limit < 1:
        _set(limit)
    _set(limit + FRAMES_BELOW)


def _recursion() -> tuple[types.FunctionType, types.FunctionType]:
    """The job's sys.getrecursionlimit and setrecursionlimit: the usable depth and the limit
    read back are a script's (a job runs two frames deeper). Their globals hold only the real
    two."""
    ns = {"__builtins__": builtins, "_get": sys.getrecursionlimit,
          "_set": sys.setrecursionlimit, "_type": type, "FRAMES_BELOW": FRAMES_BELOW}  # fmt: skip
    return tuple(
        types.FunctionType(fn.__code__, ns, fn.__name__[1:])
        for fn in (_getrecursionlimit, _setrecursionlimit)
    )  # type: ignore[return-value]


def zygote_namespace(values: dict[str, object]) -> types.FunctionType:
    """The zygote's loop, as a function whose globals are a new dict holding only `values`
    and this module's process functions (none of this package's modules or classes)."""
    ns: dict[str, object] = {
        "__builtins__": builtins,
        "__name__": "__sandbox__",
        "os": os,
        "sys": sys,
        "gc": gc,
        "types": types,
        "_contextmanager": _contextmanager,
        "_loads": _loads,
        "_dumps": _dumps,
        "_repr": _repr,
        "_str": _str,
        "_type": _type,
        "_len": _len,
        "_PLAIN": _PLAIN,
        "RESULT_FD": RESULT_FD,
        "RESERVED": RESERVED,
        "ZYGOTE_FDS": ZYGOTE_FDS,
        "PIPE_FDS": PIPE_FDS,
        "_RLIMIT_CPU": _RLIMIT_CPU,
        "RECURSION": _recursion(),
        "RECURSION_GET": sys.getrecursionlimit,
        "SIGNAL": _signal.signal,
        "DEFAULT_INT": signal.default_int_handler,
        "RECURSION_SET": sys.setrecursionlimit,
        "FRAMES_BELOW": FRAMES_BELOW,
        "_O_TMPFILE": _O_TMPFILE,
        "WARM_ROUNDS": WARM_ROUNDS,
        "WARM_JOB": WARM_JOB,
        **values,
    }
    for fn in _FUNCTIONS:
        ns[fn.__name__] = types.FunctionType(
            fn.__code__, ns, fn.__name__, fn.__defaults__, fn.__closure__
        )
    ns["RUNNER"] = _contextmanager(ns["_runner"])
    ns["NOOP"] = _contextmanager(ns["_noop"])
    return ns["_zygote"]  # type: ignore[return-value]


def streams() -> tuple[io.TextIOWrapper, io.TextIOWrapper, io.TextIOWrapper]:
    """sys.stdin/stdout/stderr as CPython makes them for files (fds 0-2 are each job's own),
    built once in the server; each job mutates its own copy."""

    def std(fd: int, mode: str, **kw: object) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        raw.name = ("<stdin>", "<stdout>", "<stderr>")[fd]  # type: ignore[misc]
        buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        text = io.TextIOWrapper(buffered, encoding="utf-8", **kw)  # type: ignore[arg-type]
        text.mode = mode  # type: ignore[misc]
        return text

    return (
        std(0, "r", errors="surrogateescape"),
        std(1, "w", errors="surrogateescape"),
        std(2, "w", errors="backslashreplace", line_buffering=True),
    )


def job_main() -> types.ModuleType:
    """The job's `__main__` (a real module, as `python prog.py` has: dataclasses, pickle and
    `if __name__ == "__main__"` behave as in plain execution), registered in sys.modules."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    return main
