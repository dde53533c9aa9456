"""The fork server: a long-lived process that forks one confined child per job.

Started by `Sandbox` as `python -S -m lorapop.verify.server CONFIG` with a clean environment and
its own PYTHONHASHSEED (children inherit the hash secret, so determinism needs two servers).
It pre-imports the allowed modules once, so a job costs a fork, not an interpreter start.

When isolating as root it enters a fresh network namespace (no interfaces up: no network) and a
mount namespace with private tmpfs over the world-writable dirs (/tmp, /var/tmp, /dev/shm,
/run/lock), so a job can neither reach the network nor leave files behind; each child then drops
to its own unprivileged uid (one per slot, so a job cannot signal its siblings either).

Protocol (JSON lines): stdin `{"id", "program", "expr"}`; stdout first `{"hello": {...}}`, then
one `{"id", "status", "output", "error", "duration"}` per job, in completion order. EOF on stdin
shuts the server down (children are killed).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import selectors
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field

from lorapop.verify.child import ALLOWED_MODULES, Limits, run_child

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
_PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
#: Bytes read back from one child at most; more is a flood and counts as output_too_large.
_SLACK = 1 << 16
_HAS_PIDFD = hasattr(os, "pidfd_open")


def _unshare(flags: int) -> None:
    if hasattr(os, "unshare"):  # Python 3.12+
        os.unshare(flags)
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    if libc.mount(enc[0], enc[1], enc[2], flags, enc[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _enter_namespaces() -> dict[str, object]:
    """Network + mount namespaces for this server and its children; report what worked."""
    info: dict[str, object] = {"net_isolated": False, "fs_isolated": False, "notes": []}
    notes: list[str] = info["notes"]  # type: ignore[assignment]
    try:
        _unshare(CLONE_NEWNET)
        info["net_isolated"] = True
    except OSError as e:
        notes.append(f"no network namespace ({e})")
    try:
        _unshare(CLONE_NEWNS)
        _mount("none", "/", None, _MS_REC | _MS_PRIVATE, None)
        for d in _PRIVATE_DIRS:
            if os.path.isdir(d) and not os.path.islink(d):
                flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
                _mount("tmpfs", d, "tmpfs", flags, "size=64m,mode=1777")
        info["fs_isolated"] = True
    except OSError as e:
        notes.append(f"no private /tmp ({e})")
    for name in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]
    return info


@dataclass
class Config:
    workers: int
    limits: Limits
    uid_base: int | None  # first per-slot uid, None: keep the server's uid
    gid: int

    @classmethod
    def from_json(cls, text: str) -> Config:
        d = json.loads(text)
        return cls(d["workers"], Limits(**d["limits"]), d["uid_base"], d["gid"])


@dataclass
class _Running:
    job_id: object
    pid: int
    fd: int | None
    slot: int
    workdir: str
    start: float
    deadline: float
    pidfd: int | None = None
    data: bytearray = field(default_factory=bytearray)
    flooded: bool = False


class Server:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.sel = selectors.DefaultSelector()
        self.pending: list[dict[str, object]] = []
        self.running: dict[int, _Running] = {}  # pid -> job
        self.free = list(range(cfg.workers))
        self.inbuf = bytearray()
        self.seq = 0
        self.closing = False
        self.root = f"/tmp/lorapop-sandbox-{os.getpid()}-{os.urandom(4).hex()}"
        os.mkdir(self.root, 0o711)

    # --- jobs -----------------------------------------------------------------------------
    def _spawn(self, job: dict[str, object]) -> None:
        slot = self.free.pop()
        self.seq += 1
        workdir = f"{self.root}/{slot}-{self.seq}"
        os.mkdir(workdir, 0o700)
        uid = None if self.cfg.uid_base is None else self.cfg.uid_base + slot
        if uid is not None:
            os.chown(workdir, uid, self.cfg.gid)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            try:
                if w != 3:
                    os.dup2(w, 3)
                run_child(job, self.cfg.limits, workdir, uid, self.cfg.gid)
            finally:
                os._exit(70)
        os.close(w)
        with contextlib.suppress(OSError):  # the child did it first, or already exited
            os.setpgid(pid, pid)
        os.set_blocking(r, False)
        now = time.monotonic()
        run = _Running(job["id"], pid, r, slot, workdir, now, now + self.cfg.limits.timeout_s)
        self.running[pid] = run
        self.sel.register(r, selectors.EVENT_READ, run)
        if _HAS_PIDFD:  # readable when the child exits: no polling for the reap
            run.pidfd = os.pidfd_open(pid)
            self.sel.register(run.pidfd, selectors.EVENT_READ, (run,))

    def _close_fd(self, run: _Running) -> None:
        if run.fd is not None:
            self.sel.unregister(run.fd)
            os.close(run.fd)
            run.fd = None

    def _reap(self, run: _Running, block: bool) -> bool:
        """Collect an exited child: drain its pipe and send its verdict."""
        pid, status = os.waitpid(run.pid, 0 if block else os.WNOHANG)
        if not pid:
            return False
        while run.fd is not None and not run.flooded:  # the writer is gone: read to EOF
            if not self._read_child(run):
                self._close_fd(run)
        self._finish(run, status, timed_out=False)
        return True

    def _kill(self, run: _Running) -> None:
        with contextlib.suppress(OSError):
            os.killpg(run.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(run.pid, signal.SIGKILL)

    def _finish(self, run: _Running, wait_status: int | None, timed_out: bool) -> None:
        self._close_fd(run)
        if run.pidfd is not None:
            self.sel.unregister(run.pidfd)
            os.close(run.pidfd)
            run.pidfd = None
        del self.running[run.pid]
        self.free.append(run.slot)
        try:
            os.rmdir(run.workdir)
        except OSError:
            shutil.rmtree(run.workdir, ignore_errors=True)
        wall = time.monotonic() - run.start
        res = self._verdict(run, wait_status, timed_out)
        res.setdefault("duration", wall)
        res["id"] = run.job_id
        self._send(res)

    def _verdict(self, run: _Running, wait_status: int | None, timed_out: bool) -> dict:
        limit = self.cfg.limits.timeout_s
        if timed_out:
            return {"status": "timeout", "output": None, "error": f"exceeded {limit:g} s"}
        if run.flooded:
            return {"status": "output_too_large", "output": None, "error": "result flood"}
        sig = (
            os.WTERMSIG(wait_status)
            if wait_status is not None and os.WIFSIGNALED(wait_status)
            else None
        )
        if sig == signal.SIGXCPU:
            return {"status": "timeout", "output": None, "error": f"CPU time over {limit:g} s"}
        try:
            res = json.loads(run.data.decode())
            ok = (
                isinstance(res, dict)
                and isinstance(res.get("status"), str)
                and isinstance(res.get("output"), str | None)
                and isinstance(res.get("error"), str | None)
                and isinstance(res.get("duration", 0.0), float | int)
            )
        except ValueError:
            ok = False
        if ok and sig is None:
            return {k: res[k] for k in ("status", "output", "error", "duration") if k in res}
        if sig is not None:
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
            return {"status": "crashed", "output": None, "error": f"killed by signal {name}"}
        code = os.WEXITSTATUS(wait_status) if wait_status is not None else None
        return {"status": "crashed", "output": None, "error": f"exited ({code}) without a result"}

    # --- io -------------------------------------------------------------------------------
    def _send(self, obj: dict) -> None:
        if self.closing:
            return
        view = memoryview((json.dumps(obj) + "\n").encode())
        while view:
            view = view[os.write(1, view) :]

    def _read_stdin(self) -> bool:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            return False
        self.inbuf += chunk
        *lines, rest = self.inbuf.split(b"\n")
        self.inbuf = bytearray(rest)
        self.pending.extend(json.loads(line) for line in lines if line.strip())
        return True

    def _read_child(self, run: _Running) -> bool:
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

    def serve(self) -> None:
        self.sel.register(0, selectors.EVENT_READ, None)
        open_stdin = True
        while open_stdin or self.running or self.pending:
            while self.pending and self.free:
                self._spawn(self.pending.pop(0))
            now = time.monotonic()
            waits = [r.deadline - now for r in self.running.values()]
            if not _HAS_PIDFD and any(r.fd is None for r in self.running.values()):
                waits.append(0.002)  # result pipe closed: poll for the exit
            timeout = max(0.0, min(waits)) if waits else None
            for key, _ in self.sel.select(timeout):
                if key.data is None:
                    if not self._read_stdin():
                        open_stdin = False
                        self.closing = True
                        self.sel.unregister(0)
                        self.pending.clear()
                        for run in list(self.running.values()):
                            self._kill(run)
                elif isinstance(key.data, tuple):  # a pidfd: the child exited
                    self._reap(key.data[0], block=True)
                elif key.data.pid in self.running:
                    self._read_child(key.data)
            now = time.monotonic()
            for run in list(self.running.values()):
                if run.pidfd is None and (run.fd is None or run.flooded) and self._reap(run, False):
                    continue
                if now > run.deadline:
                    self._kill(run)
                    _, status = os.waitpid(run.pid, 0)
                    self._finish(run, status, timed_out=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def main() -> None:
    cfg = Config.from_json(sys.argv[1])
    info: dict[str, object] = {"net_isolated": False, "fs_isolated": False, "notes": []}
    if cfg.limits.isolate and os.geteuid() == 0:
        info = _enter_namespaces()
    elif cfg.limits.isolate:
        info["notes"] = ["not root: no namespaces, no uid switch"]
    info["uid_isolated"] = cfg.limits.isolate and cfg.uid_base is not None and os.geteuid() == 0
    if not info["uid_isolated"]:
        cfg.uid_base = None
    for name in ALLOWED_MODULES:
        importlib.import_module(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    gc.collect()
    gc.freeze()  # keep pre-imported objects out of the collector: fewer copy-on-write faults
    server = Server(cfg)
    server._send({"hello": info, "pid": os.getpid(), "hash_seed": os.environ.get("PYTHONHASHSEED")})
    try:
        server.serve()
    finally:
        server.close()


if __name__ == "__main__":
    main()
