"""The fork server: a long-lived process that forks one confined child per job.

Started by `Sandbox` as `python -S -m lorapop.verify.server CONFIG` with a clean environment and
its own PYTHONHASHSEED (children inherit the hash secret, so determinism needs two servers).
It pre-imports its policy's modules once, so a job costs a fork, not an interpreter start. It
forks each child ahead of its job: an idle child confines itself and waits on a pipe, so
starting a job is one pipe write and the fork overlaps the jobs that are running. Each child
still runs exactly one job and never sees another job's state.

Isolation (`lorapop.verify.kernel`): after its imports the server enters its own user, network,
IPC, UTS, time and mount namespaces, swaps its root for an empty read-only tmpfs holding one
small tmpfs per child slot, and loads a seccomp allow-list; each child is cloned into its own
pid namespace, chroots into its slot and drops its capabilities. After a job the server
remounts the slot's tmpfs (never walking what the job left). What this kernel allowed is in the
hello line.

Protocol (`lorapop.verify.wire`): stdin carries frames `<id> <wall-clock limit s>` + the job's
bytes for the child, which the server passes on unread; stdout carries first one JSON line
`{"hello": {...}}`, then one frame `<id>` + result bytes per job, in completion order: the
child's own bytes when it exited normally (the caller checks their shape), else the server's
verdict (timeout, flood, killed by a signal, no result). EOF on stdin shuts the server down
(children are killed).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import selectors
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from lorapop.verify import kernel
from lorapop.verify.child import Limits, Prepared, prepare, run_child
from lorapop.verify.wire import encode_frame, encode_result, split_frames

#: Bytes read back from one child at most; more is a flood and counts as output_too_large.
_SLACK = 1 << 16
_HAS_PIDFD = hasattr(os, "pidfd_open")
#: Idle children a refill makes at least (a refill starts when fewer than `workers` are idle).
SPARE = 8
#: Modules the server itself loads that no job may import (its own tools into the kernel).
INTERNAL = ("lorapop", "ctypes", "_ctypes", "pyseccomp", "landlock")


@dataclass
class ServerConfig:
    workers: int
    limits: Limits
    clock_skew_s: float  # offset of the jobs' monotonic and boot-time clocks
    modules: tuple[str, ...]  # pre-imported for jobs (the policy's)
    hidden: tuple[str, ...]  # top-level packages removed from the jobs' sys.modules

    @classmethod
    def from_json(cls, text: str) -> ServerConfig:
        d = json.loads(text)
        return cls(
            d["workers"], Limits(**d["limits"]), d["clock_skew_s"],
            tuple(d["modules"]), tuple(d["hidden"]),
        )  # fmt: skip


@dataclass
class _Child:
    pid: int
    fd: int | None  # read end of the result pipe
    job_fd: int | None  # write end of the job pipe, until the job is sent
    slot: int  # index of its tmpfs slot
    job_id: bytes = b""
    limit: float = 0.0  # the job's wall-clock limit, seconds
    start: float = 0.0
    deadline: float = float("inf")
    pidfd: int | None = None
    data: bytearray = field(default_factory=bytearray)
    flooded: bool = False


class Server:
    def __init__(
        self, cfg: ServerConfig, prep: Prepared, jk: kernel.JobKernel, slots: list[str] | None
    ) -> None:
        self.cfg, self.prep, self.kernel, self.slots = cfg, prep, jk, slots
        self.sel = selectors.DefaultSelector()
        self.pending: deque[tuple[bytes, float, bytes]] = deque()  # (id, limit, job bytes)
        self.idle: list[_Child] = []  # forked and confined, waiting for a job
        self.running: dict[int, _Child] = {}  # pid -> child
        self.spare = max(cfg.workers, SPARE)  # idle children after a refill
        self.free = list(range(cfg.workers + self.spare))  # slots: one per live child
        self.inbuf = bytearray()
        self.outbuf: list[bytes] = []
        self.closing = False

    # --- children ---------------------------------------------------------------------------
    def _fork(self) -> bool:
        """Fork an idle child: it confines itself and waits for its job on a pipe. False when
        the kernel refuses (no free slot, no memory for a process or a pipe)."""
        if not self.free:
            return False
        slot = self.free.pop()
        fds: list[int] = []
        try:
            res_r, res_w = os.pipe()
            fds += (res_r, res_w)
            job_r, job_w = os.pipe()
            fds += (job_r, job_w)
            pid = self.kernel.fork()
        except OSError:
            for fd in fds:
                os.close(fd)
            self.free.append(slot)
            return False
        if pid == 0:  # child
            try:
                where = None if self.slots is None else self.slots[slot]
                run_child((res_w, job_r), self.prep, self.kernel, where)
            finally:
                os._exit(70)
        os.close(res_w)
        os.close(job_r)
        with contextlib.suppress(OSError):  # the child did it first, or already exited
            os.setpgid(pid, pid)
        self.idle.append(_Child(pid, res_r, job_w, slot))
        return True

    def _start(self, job_id: bytes, limit: float, data: bytes) -> None:
        """Hand a job to an idle child; a child that died idle is replaced (never reused)."""
        for _ in range(3):
            if not self.idle and not self._fork():
                continue
            child = self.idle.pop(0)
            try:
                view = memoryview(data)
                while view:  # blocking: the child is reading
                    view = view[os.write(child.job_fd, view) :]  # type: ignore[arg-type]
                os.close(child.job_fd)  # type: ignore[arg-type]
                child.job_fd = None
                break
            except OSError:
                self._discard(child)
        else:
            why = "sandbox children die before their job, or none can be started"
            self._send(job_id, encode_result("crashed", None, why, 0.0))
            return
        now = time.monotonic()
        child.job_id, child.start, child.limit = job_id, now, limit
        child.deadline = now + limit
        self.running[child.pid] = child
        os.set_blocking(child.fd, False)  # type: ignore[arg-type]
        self.sel.register(child.fd, selectors.EVENT_READ, child)  # type: ignore[arg-type]

    def _discard(self, child: _Child) -> None:
        """Kill and reap a child that never got (or will never get) a job."""
        self._kill(child)
        os.waitpid(child.pid, 0)
        for fd in (child.fd, child.job_fd):
            if fd is not None:
                os.close(fd)
        self._free_slot(child)

    def _free_slot(self, child: _Child) -> None:
        """Return a dead child's slot, with a fresh tmpfs (a slot that cannot get one is
        dropped: the server runs on with fewer idle children)."""
        if self.slots is not None:
            try:
                self.kernel.new_slot(self.slots[child.slot])
            except OSError:
                return
        self.free.append(child.slot)

    def _close_fd(self, run: _Child) -> None:
        if run.fd is not None:
            self.sel.unregister(run.fd)
            os.close(run.fd)
            run.fd = None

    def _exited(self, run: _Child) -> None:
        """The result pipe is closed: reap the child now if it is gone, else wait on a pidfd."""
        pid, status = os.waitpid(run.pid, os.WNOHANG)
        if pid:
            self._finish(run, status, timed_out=False)
        elif _HAS_PIDFD and run.pidfd is None:  # readable when the child exits
            run.pidfd = os.pidfd_open(run.pid)
            self.sel.register(run.pidfd, selectors.EVENT_READ, (run,))

    def _reap(self, run: _Child, block: bool) -> bool:
        """Collect an exited child: drain its pipe and send its verdict."""
        pid, status = os.waitpid(run.pid, 0 if block else os.WNOHANG)
        if not pid:
            return False
        while run.fd is not None and not run.flooded:  # the writer is gone: read to EOF
            if not self._read_child(run):
                self._close_fd(run)
        self._finish(run, status, timed_out=False)
        return True

    def _kill(self, run: _Child) -> None:
        with contextlib.suppress(OSError):
            os.killpg(run.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(run.pid, signal.SIGKILL)

    def _finish(self, run: _Child, wait_status: int | None, timed_out: bool) -> None:
        self._close_fd(run)
        if run.pidfd is not None:
            self.sel.unregister(run.pidfd)
            os.close(run.pidfd)
            run.pidfd = None
        del self.running[run.pid]
        self._free_slot(run)
        verdict = self._verdict(run, wait_status, timed_out)
        if verdict is None:  # exited normally with a result: pass the child's bytes on
            self._send(run.job_id, bytes(run.data))
        else:
            self._send(run.job_id, encode_result(*verdict, time.monotonic() - run.start))

    def _verdict(
        self, run: _Child, wait_status: int | None, timed_out: bool
    ) -> tuple[str, None, str] | None:
        """The server's (status, output, error) for a child without a result of its own."""
        limit = run.limit
        if timed_out:
            return "timeout", None, f"exceeded {limit:g} s"
        if run.flooded:
            return "output_too_large", None, "result flood"
        sig = (
            os.WTERMSIG(wait_status)
            if wait_status is not None and os.WIFSIGNALED(wait_status)
            else None
        )
        if sig == signal.SIGXCPU:
            return "timeout", None, f"CPU time over {limit:g} s"
        if sig is not None:
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
            return "crashed", None, f"killed by signal {name}"
        if run.data:
            return None
        code = os.WEXITSTATUS(wait_status) if wait_status is not None else None
        return "crashed", None, f"exited ({code}) without a result"

    # --- io -------------------------------------------------------------------------------
    def _send(self, job_id: bytes, result: bytes) -> None:
        if not self.closing:
            self.outbuf.append(encode_frame(job_id, result))

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

    def _read_child(self, run: _Child) -> bool:
        """Read what is there; False when nothing was (would block)."""
        cap = 8 * self.cfg.limits.max_output_chars + _SLACK
        try:
            chunk = os.read(run.fd, 1 << 16) if run.fd is not None else b""
        except BlockingIOError:
            return False
        if not chunk:
            self._close_fd(run)
            return True
        run.data += chunk
        if len(run.data) > cap:
            run.flooded = True
            self._kill(run)
            self._close_fd(run)
        return True

    def _shutdown(self) -> None:
        self.closing = True
        self.sel.unregister(0)
        self.pending.clear()
        for run in list(self.running.values()):
            self._kill(run)
        while self.idle:
            self._discard(self.idle.pop())

    def serve(self) -> None:
        self.sel.register(0, selectors.EVENT_READ, None)
        workers = self.cfg.workers
        open_stdin = True
        while open_stdin or self.running or self.pending:
            while self.pending and len(self.running) < workers and not self.closing:
                self._start(*self.pending.popleft())
            if open_stdin and len(self.idle) < workers:
                # Refill in a burst: after each fork the server's own next writes copy pages
                # it shares with the children, and forks in a row share that cost.
                while len(self.idle) < self.spare and self._fork():
                    pass
            if self.outbuf:
                self._flush()
            now = time.monotonic()
            waits = [r.deadline - now for r in self.running.values()]
            if not _HAS_PIDFD and any(r.fd is None for r in self.running.values()):
                waits.append(0.002)  # result pipe closed: poll for the exit
            timeout = max(0.0, min(waits)) if waits else None
            for key, _ in self.sel.select(timeout):
                if key.data is None:
                    if not self._read_stdin():
                        open_stdin = False
                        self._shutdown()
                elif isinstance(key.data, tuple):  # a pidfd: the child exited
                    if key.data[0].pid in self.running:
                        self._reap(key.data[0], block=True)
                elif key.data.pid in self.running:
                    self._read_child(key.data)
                    if key.data.fd is None:  # EOF, or a flood (killed)
                        self._exited(key.data)
            now = time.monotonic()
            for run in list(self.running.values()):
                if run.pidfd is None and (run.fd is None or run.flooded) and self._reap(run, False):
                    continue
                if now > run.deadline:
                    self._kill(run)
                    _, status = os.waitpid(run.pid, 0)
                    self._finish(run, status, timed_out=True)
        if self.outbuf:
            self._flush()


def main() -> None:
    cfg = ServerConfig.from_json(sys.argv[1])
    for name in cfg.modules:
        importlib.import_module(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    devnull = os.open(os.devnull, os.O_RDWR)  # before the host's filesystem goes
    n_slots = cfg.workers + max(cfg.workers, SPARE)
    if cfg.limits.isolate:
        info, jk, slots = kernel.confine_server(n_slots, cfg.clock_skew_s)
    else:
        info = {
            "layers": dict.fromkeys(kernel.LAYERS, False),
            "notes": ["isolation is off"],
            "outer_uid": os.geteuid(),
        }
        jk, slots = kernel.JobKernel(signal.SIGCHLD, drop_caps=False), None
    # Identical in both determinism runs (the hash seed was read at start-up).
    os.environ.clear()
    os.environ.update({"PATH": os.defpath, "LC_ALL": "C.UTF-8"})
    prep = prepare(cfg.limits, cfg.hidden + INTERNAL, devnull, tmpfs=slots is not None)
    gc.collect()
    gc.freeze()  # keep pre-imported objects out of the collector: fewer copy-on-write faults
    server = Server(cfg, prep, jk, slots)
    hello = {"hello": info, "pid": os.getpid()}
    server.outbuf.append((json.dumps(hello) + "\n").encode())
    server._flush()
    server.serve()


if __name__ == "__main__":
    main()
