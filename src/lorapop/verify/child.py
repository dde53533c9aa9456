"""What a forked job process does: confine itself, wait for its job, run it, report one result.

Runs inside the fork server, after `fork()`. The server forks children ahead of time: each one
confines itself (process group, fds, its tmpfs as root, capabilities, rlimits) with no job yet
(`lorapop.verify.kernel` did the rest once in the server), then blocks
reading its single job (code objects compiled by the caller) from fd 4, so a job starts with a
pipe write instead of a fork. A failure to confine reports `crashed` without running the job.
The result is length-prefixed text (never a pickle) written to fd 3 (`lorapop.verify.wire`);
the server reads at most a capped amount and the caller trusts only its shape.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import resource
import sys
import time
import types
from dataclasses import dataclass
from types import CodeType
from typing import NoReturn

from lorapop.verify.kernel import JobKernel
from lorapop.verify.wire import decode_job, encode_result

RESULT_FD = 3
JOB_FD = 4
# Bound at import, so a program that rebinds builtins.repr or pickle.dumps cannot fake a result.
_repr, _dumps, _str, _type, _len = repr, pickle.dumps, str, type, len

# The fork server pre-imports its policy's modules (`lorapop.verify.policy`); a job can import
# those and nothing else (the import system is switched off in the child, which also makes
# behaviour independent of which stdlib files the unprivileged user could read).


@dataclass(frozen=True)
class Limits:
    """Limits applied with setrlimit. `timeout_s` is the default; a job may carry its own (the
    child sets RLIMIT_CPU once it has read its job)."""

    timeout_s: float
    memory_mb: int
    max_output_chars: int
    max_stdout_chars: int = 65_536
    nofile: int = 16
    isolate: bool = True


class _CappedText(io.TextIOBase):
    """A stdout/stderr that keeps the first `cap` characters and drops the rest."""

    def __init__(self, cap: int) -> None:
        self.cap, self.parts, self.size = cap, [], 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        if self.size < self.cap:
            self.parts.append(s[: self.cap - self.size])
            self.size += len(self.parts[-1])
        return len(s)


@dataclass(frozen=True)
class Prepared:
    """What every child of one server needs, built once in the server before it forks.

    Doing this work (and hiding modules, dropping import caches) in each child instead would
    run more Python there, and every page a child writes costs a copy-on-write fault.
    """

    limits: Limits
    rlimits: tuple[tuple[int, tuple[int, int]], ...]
    devnull: int
    streams: tuple[io.StringIO, _CappedText, _CappedText]  # each child mutates its own copy
    importer: tuple[object, ...]  # the server's import state, which children unbind
    main: types.ModuleType  # the job's __main__, already in sys.modules
    server_main: object  # the server's own __main__, kept alive


def prepare(limits: Limits, hidden: tuple[str, ...], devnull: int, tmpfs: bool) -> Prepared:
    """Call once in the server, after its imports: hide the `hidden` top-level packages from
    jobs, build the shared parts. RLIMIT_CPU is not among them: it depends on the job. With
    `tmpfs` each job has its own (files up to its size); without, no file can grow."""
    hide = frozenset(hidden)
    for name in list(sys.modules):  # the server keeps its own references
        if name.split(".")[0] in hide:
            del sys.modules[name]
    sys.path_importer_cache.clear()  # a cache: freeing it in each child would touch every entry
    fsize = 16 << 20 if tmpfs else 0
    rlimits = [
        (resource.RLIMIT_FSIZE, (fsize, fsize)),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_NOFILE, (limits.nofile, limits.nofile)),
    ]
    if limits.memory_mb > 0:
        cap = limits.memory_mb << 20
        rlimits.append((resource.RLIMIT_AS, (cap, cap)))
    if limits.isolate:
        # No fork or clone (seccomp refuses them too; this holds without it, while the server
        # shares the uid).
        rlimits.append((resource.RLIMIT_NPROC, (0, 0)))
    cap = limits.max_stdout_chars
    streams = (io.StringIO(""), _CappedText(cap), _CappedText(cap))
    importer = (sys.meta_path, sys.path_hooks, sys.path_importer_cache, sys.path)
    # A real module as __main__ (as `python prog.py` has), so dataclasses, pickle and
    # `if __name__ == "__main__"` behave as in plain execution. Made here, not per child: making
    # it and swapping sys.modules["__main__"] in a child costs ~30 page faults.
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    server_main, sys.modules["__main__"] = sys.modules.get("__main__"), main
    return Prepared(limits, tuple(rlimits), devnull, streams, importer, main, server_main)


def _confine(prep: Prepared, kernel: JobKernel, slot_dir: str | None) -> None:
    os.setpgid(0, 0)
    os.closerange(JOB_FD + 1, 1 << 16)
    kernel.enter(slot_dir)
    for which, value in prep.rlimits:
        resource.setrlimit(which, value)
    sys.stdin, sys.stdout, sys.stderr = prep.streams
    # Import system off. Rebinding (not clearing) leaves the server's objects alone: freeing
    # them here would write to every page they lie on. `prep.importer` keeps them alive.
    sys.meta_path, sys.path_hooks, sys.path_importer_cache, sys.path = [], [], {}, []


def _describe(e: BaseException) -> str:
    try:
        name = _str(_type(e).__name__)
        text = _str(e)
        return f"{name}: {text}"[:2000] if text else str(name)
    except BaseException:  # a hostile __str__
        return "unprintable exception"


def execute(
    program: CodeType, expr: CodeType, ns: dict, max_output_chars: int
) -> tuple[str, str | None, str | None]:
    """Run `program` then `expr` in the namespace `ns`: (status, output repr, error)."""
    try:
        exec(program, ns)
        value = eval(expr, ns)
    except MemoryError:
        return "memory", None, "MemoryError"
    except BaseException as e:
        return "runtime_error", None, _describe(e)
    try:
        _dumps(value)
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
    if _len(text) > max_output_chars:
        return (
            "output_too_large",
            None,
            f"repr has {_len(text)} characters (cap {max_output_chars})",
        )
    return "ok", text, None


def cpu_limit(timeout_s: float) -> int:
    """RLIMIT_CPU seconds for a wall-clock limit: a backstop above it (the server enforces the
    wall clock; the soft limit's SIGXCPU reads as a timeout)."""
    return int(timeout_s) + 1


def _limit_cpu(seconds: int) -> None:
    """Soft limit `seconds`, hard one more; never above a hard limit the server inherited."""
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft, new_hard = seconds, seconds + 1
    if hard != resource.RLIM_INFINITY:
        soft, new_hard = min(soft, hard), min(new_hard, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, new_hard))


def _read_job() -> tuple[CodeType, CodeType, int] | None:
    """(program, expr, cpu seconds) the server writes to fd 4, then EOF; None when closed."""
    parts = []
    while chunk := os.read(JOB_FD, 1 << 16):
        parts.append(chunk)
    os.close(JOB_FD)
    return decode_job(b"".join(parts)) if parts else None


def run_child(
    fds: tuple[int, int], prep: Prepared, kernel: JobKernel, slot_dir: str | None
) -> NoReturn:
    """Entry point right after fork(): `fds` = (result pipe write end, job pipe read end)."""
    try:
        # Park the three fds above every fd we were given, then move them down: 0-2 /dev/null,
        # 3 the result pipe, 4 the job pipe (the rest is closed before the job runs).
        high = max(*fds, prep.devnull) + 1
        for i, fd in enumerate((prep.devnull, *fds)):
            os.dup2(fd, high + i)
        for fd in (0, 1, 2, RESULT_FD, JOB_FD):
            os.dup2(high + max(0, fd - 2), fd)
        try:
            _confine(prep, kernel, slot_dir)
            failure = None
        except BaseException as e:
            failure = "confinement: " + _describe(e)
        job = _read_job()
        if job is None:  # the server is shutting down
            os._exit(0)
        program, expr, cpu = job
        if failure is None:
            try:
                _limit_cpu(cpu)
            except BaseException as e:
                failure = "confinement: " + _describe(e)
        if failure is not None:
            data = encode_result("crashed", None, failure, 0.0)
        else:
            t0 = time.perf_counter()
            res = execute(program, expr, prep.main.__dict__, prep.limits.max_output_chars)
            data = encode_result(*res, time.perf_counter() - t0)
        view = memoryview(data)
        while view:
            view = view[os.write(RESULT_FD, view) :]
    finally:
        os._exit(0)
