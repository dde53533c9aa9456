"""The fork server: a long-lived process that runs each job in its own confined process tree.

Started by `Sandbox` as `python -S -c BOOT CONFIG` (`lorapop.verify.child.BOOT`) with a clean
environment and its own PYTHONHASHSEED (children inherit the hash secret, so determinism
needs two servers). It pre-imports its policy's modules once, enters the kernel's layers
(`lorapop.verify.kernel`), then forks a zygote before it reads any job: the zygote drops
everything of the server and makes one init per child slot (`lorapop.verify.child`), so a
job's image holds nothing of other jobs or of the server's work. An init runs its slot's jobs
one after another, each a new process forked before its bytes come, so starting a job is one
pipe write; an init never reads a job's bytes nor its result (the kernel copies it).

An init's parent is this process (CLONE_PARENT): it kills an init when its job's wall-clock
limit passes (its pid namespace, and so its job, dies with it), reaps it and renews its slot's
tmpfs; it takes its ends of an init's pipes with pidfd_getfd. What this kernel allowed is in
the hello line.

Protocol (`lorapop.verify.wire`): stdout carries first, where a time namespace was made,
`{"timens": true}` (the caller writes the children's clock offsets into /proc/PID/timens_offsets
and answers `go` on stdin: this process never knows them), then one JSON line
`{"hello": {...}}`, then one frame `<id> <duration>` + result bytes per job, in completion order:
the job's own bytes when it exited normally (the caller checks their shape), else the server's
verdict (timeout, flood, killed by a signal, no result). stdin carries frames
`<id> <wall-clock limit s>` + the job's bytes, which the server passes on unread (as
`<length>\n` + bytes) to the job. An init answers `<exit code> <length>\n` + the result.
EOF on stdin shuts the server down (children are killed).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import selectors
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from lorapop.verify import child, kernel
from lorapop.verify.child import ZYGOTE_FDS, Limits
from lorapop.verify.wire import encode_frame, encode_result, split_frames

#: Bytes read back from one child at most; more is a flood and counts as output_too_large.
_SLACK = 1 << 16
#: Idle children a refill makes at least (a refill starts when fewer than `workers` are idle).
SPARE = 8
#: Modules the server itself loads that no job may import (its own tools into the kernel).
INTERNAL = ("lorapop", "pyseccomp", "landlock")
#: Further modules only the server uses: dropped from the jobs' image as well, unless the
#: policy grants them (ctypes: only where the kernel calls fall back to it).
SERVER_ONLY = (
    "selectors", "select", "resource", "gc", "zipimport", "threading",
    "subprocess", "_posixsubprocess", "socket", "_socket", "ctypes", "_ctypes",
)  # fmt: skip


@dataclass
class ServerConfig:
    workers: int
    limits: Limits
    modules: tuple[str, ...]  # pre-imported for jobs (the policy's)
    hidden: tuple[str, ...]  # top-level packages removed from the jobs' image
    seccomp: dict[str, bytes] | None  # `kernel.filters()`: the BPF programs, built by the caller
    notes: tuple[str, ...]  # why layers are missing, as the caller knows (no seccomp programs)
    sysno: dict[str, int]  # `kernel.syscall_numbers()`, for the ctypes fallback
    native: bool  # the kernel calls through `lorapop.verify._kernel` where it is built

    @classmethod
    def from_json(cls, text: str) -> ServerConfig:
        d = json.loads(text)
        progs = d["seccomp"]
        return cls(
            d["workers"], Limits(**d["limits"]), tuple(d["modules"]), tuple(d["hidden"]),
            None if progs is None else {k: bytes.fromhex(v) for k, v in progs.items()},
            tuple(d["notes"]), d["sysno"], d["native"],
        )  # fmt: skip


@dataclass
class _Child:
    pid: int  # the init's
    fd: int | None  # read end of its result pipe
    job_fd: int | None  # write end of its job pipe
    slot: int  # index of its tmpfs slot
    job_id: bytes = b""
    limit: float = 0.0  # the job's wall-clock limit, seconds
    start: float = 0.0
    deadline: float = float("inf")
    data: bytearray = field(default_factory=bytearray)


class Server:
    def __init__(
        self, cfg: ServerConfig, jk: kernel.JobKernel, slots: list[str] | None, zygote: int,
        ctl: int, report: int,
    ) -> None:  # fmt: skip
        self.cfg, self.kernel, self.slots = cfg, jk, slots
        self.zygote, self.ctl, self.report = zygote, ctl, report
        self.sel = selectors.DefaultSelector()
        self.pending: deque[tuple[bytes, float, bytes]] = deque()  # (id, limit, job bytes)
        self.idle: list[_Child] = []  # inits waiting for a job (each one's job forked ahead)
        self.asked = 0  # inits asked of the zygote, not reported yet
        self.running: dict[int, _Child] = {}  # pid -> init
        self.free = list(range(cfg.workers + max(cfg.workers, SPARE)))  # a slot per live init
        self.cap = 8 * cfg.limits.max_output_chars + _SLACK
        self.inbuf = bytearray()
        self.repbuf = b""
        self.outbuf: list[bytes] = []
        self.closing = False

    # --- inits ------------------------------------------------------------------------------
    def _ask(self) -> None:
        """Ask the zygote for inits up to `workers` idle ones (one per free slot)."""
        n = min(self.cfg.workers - len(self.idle) - self.asked, len(self.free))
        if n <= 0:
            return
        slots = [self.free.pop() for _ in range(n)]
        self.asked += n
        os.write(self.ctl, b"".join(b"%d\n" % slot for slot in slots))

    def _reported(self) -> None:
        """The zygote's lines `pid slot job_w res_r`: take our ends of each new init's pipes."""
        chunk = os.read(self.report, 1 << 16)
        if not chunk:  # the zygote died: nothing more can run here (the caller re-runs)
            raise SystemExit("the sandbox zygote died")
        *lines, self.repbuf = (self.repbuf + chunk).split(b"\n")
        for line in lines:
            pid, slot, job_w, res_r = map(int, line.split())
            self.asked -= 1
            if pid < 0:
                self._release(slot)
                continue
            fds: list[int] = []
            try:
                pidfd = os.pidfd_open(pid)
                try:
                    for fd in (job_w, res_r):
                        fds.append(self.kernel.getfd(pidfd, fd))
                finally:
                    os.close(pidfd)
            except OSError:  # it died already
                for fd in fds:
                    os.close(fd)
                self._discard(_Child(pid, None, None, slot))
                continue
            self.idle.append(_Child(pid, fds[1], fds[0], slot))

    def _start(self, job_id: bytes, limit: float, data: bytes) -> bool:
        """Hand a job to an idle init; False when none is idle (the job waits). An init that
        died idle is replaced. The init idle longest goes first: it has renewed its tmpfs and
        forked its next job by now, while one that just answered may still be at it."""
        while self.idle:
            run = self.idle.pop(0)
            try:
                view = memoryview(b"%d\n" % len(data) + data)
                while view:  # blocking: the job is reading
                    view = view[os.write(run.job_fd, view) :]  # type: ignore[arg-type]
            except OSError:
                self._discard(run)
                continue
            now = time.monotonic()
            run.job_id, run.start, run.limit = job_id, now, limit
            run.deadline = now + limit
            self.running[run.pid] = run
            os.set_blocking(run.fd, False)  # type: ignore[arg-type]
            self.sel.register(run.fd, selectors.EVENT_READ, run)  # type: ignore[arg-type]
            return True
        return False

    def _discard(self, run: _Child) -> int:
        """Kill and reap an init, close our ends, renew its slot; its wait status."""
        self._kill(run)
        _, status = os.waitpid(run.pid, 0)
        for fd in (run.fd, run.job_fd):
            if fd is not None:
                os.close(fd)
        run.fd = run.job_fd = None
        self._release(run.slot)
        return status

    def _release(self, slot: int) -> None:
        """Return a dead init's slot, with a fresh tmpfs (a slot that cannot get one is
        dropped: the server runs on with fewer inits)."""
        if self.slots is not None:
            try:
                self.kernel.new_slot(self.slots[slot])
            except OSError:
                return
        self.free.append(slot)

    def _kill(self, run: _Child) -> None:
        with contextlib.suppress(OSError):
            os.kill(run.pid, signal.SIGKILL)  # its pid namespace, and so its job, dies with it

    def _read_child(self, run: _Child) -> None:
        """Read what is there: a whole `<exit code> <length>\\n` + result ends the job (the
        init runs the next); EOF is the init's death, too many bytes a flood."""
        try:
            chunk = os.read(run.fd, 1 << 16)  # type: ignore[arg-type]
        except BlockingIOError:
            return
        if not chunk:
            self._dead(run, "")
            return
        run.data += chunk
        end = run.data.find(b"\n")
        if end < 0 or len(run.data) > self.cap + 64:
            if len(run.data) > self.cap + 64:
                self._dead(run, "flood")
            return
        code, length = map(int, bytes(run.data[:end]).split())
        if len(run.data) < end + 1 + length:
            return
        if len(run.data) > end + 1 + length:  # more than one result: a job forged this
            self._dead(run, "flood")
            return
        if length > self.cap:  # the init forwards one byte more than the cap: a flood
            self._stop(run)
            self.idle.append(run)
            self._send_verdict(run, self._verdict(run, code, "flood"), b"")
            run.data = bytearray()
            return
        self._stop(run)
        self.idle.append(run)
        self._send_verdict(run, self._verdict(run, code, ""), bytes(run.data[end + 1 :]))
        run.data = bytearray()

    def _stop(self, run: _Child) -> None:
        self.sel.unregister(run.fd)  # type: ignore[arg-type]
        del self.running[run.pid]

    def _dead(self, run: _Child, why: str) -> None:
        """A running init ended or is ended (`why`: "", "timeout" or "flood")."""
        self._stop(run)
        status = self._discard(run)
        code = None
        if os.WIFSIGNALED(status) and why == "":
            code = 128 + os.WTERMSIG(status)
        self._send_verdict(run, self._verdict(run, code, why or "died"), b"")

    def _send_verdict(
        self, run: _Child, verdict: tuple[str, None, str] | None, body: bytes
    ) -> None:
        duration = time.monotonic() - run.start
        if verdict is None:  # exited normally with a result: pass the job's bytes on
            self._send(run.job_id, body, duration)
        else:
            self._send(run.job_id, encode_result(*verdict, duration), duration)

    def _verdict(self, run: _Child, code: int | None, why: str) -> tuple[str, None, str] | None:
        """The server's (status, output, error) for a job without a result of its own. An init
        reports its job's exit code (128 + the signal that killed it)."""
        limit = run.limit
        if why == "timeout":
            return "timeout", None, f"exceeded {limit:g} s"
        if why == "flood":
            return "output_too_large", None, "result flood"
        if code is None:
            return "crashed", None, "the job's init died"
        sig = code - 128 if code >= 128 else None
        if sig == signal.SIGXCPU:
            return "timeout", None, f"CPU time over {limit:g} s"
        if sig is not None:
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
            return "crashed", None, f"killed by signal {name}"
        if run.data.partition(b"\n")[2]:
            return None
        return "crashed", None, f"exited ({code}) without a result"

    # --- io -------------------------------------------------------------------------------
    def _send(self, job_id: bytes, result: bytes, duration: float) -> None:
        if not self.closing:
            self.outbuf.append(encode_frame(b"%s %r" % (job_id, round(duration, 6)), result))

    def _flush(self) -> None:
        """Write the verdicts of one loop turn at once: one wake-up of the caller, not many."""
        view = memoryview(b"".join(self.outbuf))
        self.outbuf.clear()
        while view:
            view = view[os.write(1, view) :]

    def _read_stdin(self) -> bool:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            return False
        self.inbuf += chunk
        for (job_id, limit), data in split_frames(self.inbuf):
            self.pending.append((job_id, float(limit), data))
        return True

    def _shutdown(self) -> None:
        self.closing = True
        self.sel.unregister(0)
        self.pending.clear()
        for run in list(self.running.values()):
            self._dead(run, "timeout")
        while self.idle:
            self._discard(self.idle.pop())

    def serve(self) -> None:
        self.sel.register(0, selectors.EVENT_READ, None)
        self.sel.register(self.report, selectors.EVENT_READ, "report")
        workers = self.cfg.workers
        open_stdin = True
        while open_stdin or self.running or self.pending:
            while self.pending and len(self.running) < workers and not self.closing:
                if not self._start(*self.pending[0]):
                    break
                self.pending.popleft()
            if open_stdin and len(self.idle) + self.asked < workers:
                self._ask()
            if self.outbuf:
                self._flush()
            now = time.monotonic()
            waits = [r.deadline - now for r in self.running.values()]
            timeout = max(0.0, min(waits)) if waits else None
            for key, _ in self.sel.select(timeout):
                if key.data is None:
                    if not self._read_stdin():
                        open_stdin = False
                        self._shutdown()
                elif key.data == "report":
                    self._reported()
                elif key.data.pid in self.running:
                    self._read_child(key.data)
            now = time.monotonic()
            for run in list(self.running.values()):
                if now > run.deadline:
                    self._dead(run, "timeout")
        if self.outbuf:
            self._flush()
        os.close(self.ctl)  # the zygote exits
        while self.asked:  # inits it made meanwhile are killed
            try:
                self._reported()
            except SystemExit:
                break
            while self.idle:
                self._discard(self.idle.pop())
        os.waitpid(self.zygote, 0)


def _clock_handshake() -> None:
    """Let the caller write the children's clock offsets (this process never knows them)."""
    os.write(1, b'{"timens": true}\n')
    got = b""
    while len(got) < 3:
        chunk = os.read(0, 3 - len(got))
        if not chunk:
            raise SystemExit("the caller left before the clock offsets")
        got += chunk
    if got != b"go\n":
        raise SystemExit(f"expected go, got {got!r}")


def main() -> object:
    """The server's whole life (it never returns here: it exits); the zygote gets its loop."""
    cfg = ServerConfig.from_json(sys.argv[1])
    for name in cfg.modules:
        importlib.import_module(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    devnull = os.open(os.devnull, os.O_RDWR)  # before the host's filesystem goes
    n_slots = cfg.workers + max(cfg.workers, SPARE)
    api, note = kernel.calls(cfg.native, cfg.sysno)
    if cfg.limits.isolate:
        notes = [*cfg.notes, *([note] if note else [])]
        info, jk, slots = kernel.confine_server(n_slots, api, cfg.seccomp, notes)
    else:
        info = {
            "layers": dict.fromkeys(kernel.LAYERS, False),
            "notes": ["isolation is off"],
            "outer_uid": os.geteuid(),
        }
        jk = kernel.JobKernel(api, kernel.INIT_FLAGS[1], drop_caps=False)
        slots = None
    if info["layers"]["time_ns"]:
        _clock_handshake()
    # Identical in both determinism runs (the hash seed was read at start-up).
    os.environ.clear()
    os.environ.update({"PATH": os.defpath, "LC_ALL": "C.UTF-8"})
    limits = cfg.limits
    fsize = 16 << 20  # the job's tmpfs (or, without one, its anonymous result file)
    rlimits = [
        (resource.RLIMIT_FSIZE, fsize, fsize),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NOFILE, limits.nofile, limits.nofile),
    ]
    if limits.memory_mb > 0:
        rlimits.append((resource.RLIMIT_AS, limits.memory_mb << 20, limits.memory_mb << 20))
    if limits.isolate:  # no fork or clone (the jobs' seccomp filter refuses them too)
        rlimits.append((resource.RLIMIT_NPROC, 0, 0))
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    values = jk.values(rlimits, (1 << 64) - 1 if hard == resource.RLIM_INFINITY else hard)
    cap = 8 * limits.max_output_chars + _SLACK
    values.update(
        SLOTS=None if slots is None else tuple(slots),
        STREAMS=child.streams(),
        MAIN=child.job_main(),
        MAX_OUTPUT=limits.max_output_chars,
        RESULT_CAP=cap + 1,
        DEVNULL=ZYGOTE_FDS[2] + 1,
        HIDE=frozenset(cfg.hidden + INTERNAL)
        | (frozenset(SERVER_ONLY) - {m.split(".")[0] for m in cfg.modules}),
    )
    loop = child.zygote_namespace(values)
    ctl_r, ctl_w = os.pipe()
    rep_r, rep_w = os.pipe()
    life_r, life_w = os.pipe()  # its write end lives as long as this process
    me = os.getpid()
    try:
        pid = values["FORK_JOB"]()  # type: ignore[operator]
    except OSError as e:
        raise SystemExit(f"the sandbox zygote could not be forked ({e})") from None
    if pid == 0:  # the zygote
        values["PRCTL"](1, signal.SIGKILL)  # type: ignore[operator]
        if os.getppid() != me:
            os._exit(0)
        for fd, where in zip((ctl_r, rep_w, life_r, devnull), (*ZYGOTE_FDS, ZYGOTE_FDS[2] + 1),
                             strict=True):  # fmt: skip
            os.dup2(fd, where)
        os.closerange(0, ZYGOTE_FDS[0])
        os.closerange(ZYGOTE_FDS[2] + 2, 1 << 16)
        os.set_blocking(ZYGOTE_FDS[2], False)
        return loop
    for fd in (ctl_r, rep_w, life_r):
        os.close(fd)
    del loop, values
    server = Server(cfg, jk, slots, pid, ctl_w, rep_r)
    hello = {"hello": info, "pid": os.getpid()}
    server.outbuf.append((json.dumps(hello) + "\n").encode())
    server._flush()
    try:
        server.serve()
    except BaseException as e:  # the caller sees EOF, re-runs the jobs on a new server
        tb, where = e.__traceback__, []
        while tb is not None:
            where.append(f"{tb.tb_frame.f_code.co_name}:{tb.tb_lineno}")
            tb = tb.tb_next
        os.write(
            2, f"lorapop sandbox server: {type(e).__name__}: {e} ({' '.join(where)})\n".encode()
        )
        os._exit(1)
    os._exit(0)
