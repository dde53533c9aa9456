"""`Sandbox`: run untrusted programs in confined processes and return verdicts.

The caller's process only parses programs (static checks) and reads JSON; every program runs in
a child forked by a fork server (`lorapop.verify.server`). A second server with another
PYTHONHASHSEED re-runs jobs marked `deterministic`, because a forked child inherits its
server's hash secret and so could never show set- or dict-order dependence on its own.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

from lorapop.verify import static
from lorapop.verify.child import cpu_limit
from lorapop.verify.policy import Policy, resolve
from lorapop.verify.verdict import Job, Status, Verdict
from lorapop.verify.wire import decode_result, encode_frame, encode_job, split_frames

log = logging.getLogger(__name__)
_warned: set[str] = set()

#: First uid of the per-slot users when isolating as root; unassigned ids far above real users.
UID_BASE = 0x7F000000
#: uids per fork server: it keeps up to workers + max(workers, 8) children alive (running, idle).
UID_SPAN = 2000
NOGROUP = 65534
_RESOURCE = (Status.TIMEOUT, Status.MEMORY, Status.CRASHED)


class _Server:
    """One fork-server process and the pipes to it."""

    def __init__(self, config: dict, hash_seed: int) -> None:
        import lorapop

        src = str(Path(lorapop.__file__).resolve().parent.parent)
        env = {
            "PYTHONHASHSEED": str(hash_seed),
            "PYTHONPATH": src,
            "PYTHONDONTWRITEBYTECODE": "1",
            "PATH": os.defpath,
            "LC_ALL": "C.UTF-8",
        }
        cmd = [sys.executable, "-S", "-m", "lorapop.verify.server", json.dumps(config)]
        self.hash_seed = hash_seed
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd="/",
            start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.fd = self.proc.stdin, self.proc.stdout.fileno()
        self.buf = bytearray()
        self.info: dict = self._hello(timeout=60.0)

    def _hello(self, timeout: float) -> dict:
        """The server's first line, `{"hello": {...}}`: what isolation it achieved."""
        deadline = time.monotonic() + timeout
        sel = selectors.DefaultSelector()
        sel.register(self.fd, selectors.EVENT_READ)
        try:
            while b"\n" not in self.buf:
                left = deadline - time.monotonic()
                chunk = os.read(self.fd, 1 << 16) if left > 0 and sel.select(left) else b""
                if not chunk:
                    self.kill()
                    raise RuntimeError("the sandbox fork server did not start")
                self.buf += chunk
        finally:
            sel.close()
        end = self.buf.index(b"\n")
        line = bytes(self.buf[:end])
        del self.buf[: end + 1]
        return json.loads(line)["hello"]

    def read(self) -> list[tuple[int, bytes]] | None:
        """The complete (request id, result bytes) frames of one read (call when readable);
        None at EOF."""
        chunk = os.read(self.fd, 1 << 20)
        if not chunk:
            return None
        self.buf += chunk
        return [(int(head[0]), body) for head, body in split_frames(self.buf)]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        try:
            self.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        self.proc.stdout.close()  # type: ignore[union-attr]


def _parse(data: bytes) -> Verdict:
    """A child's result bytes (hostile: a job can write its own) as a verdict."""
    res = decode_result(data)
    if res is None:
        return Verdict(Status.CRASHED, None, "malformed result from the sandbox", 0.0)
    status = Status(res["status"])
    output = res["output"] if status is Status.OK else None
    return Verdict(status, output, res["error"], res["duration"])  # type: ignore[arg-type]


def _combine(a: Verdict, b: Verdict, seeds: tuple[int, int]) -> Verdict:
    """Merge the runs under two hash seeds: equal status and output, or not deterministic."""
    duration = max(a.duration, b.duration)
    if a.status is b.status and a.output == b.output:
        return Verdict(a.status, a.output, a.error, duration)
    for v in (a, b):
        if v.status in _RESOURCE:  # resource limits are not evidence of nondeterminism
            return Verdict(v.status, None, v.error, duration)

    def show(v: Verdict) -> str:
        text = v.output if v.status is Status.OK else f"{v.status.value} ({v.error})"
        return str(text)[:200]

    error = f"PYTHONHASHSEED={seeds[0]}: {show(a)} != PYTHONHASHSEED={seeds[1]}: {show(b)}"
    return Verdict(Status.NONDETERMINISTIC, None, error, duration)


class Sandbox:
    """A pool of isolated, pre-forked workers; see the module docstring.

    workers: jobs in flight at once per fork server. timeout_s: wall-clock (and, rounded up, CPU)
    limit of a job that names none (`Job.timeout_s`). memory_mb: RLIMIT_AS per job (0: none).
    isolate: uid switch, namespaces, no fork (turn off only for trusted code). policy: "azr"
    (AZR's banned modules refused and hidden: self-play tasks) or "benchmark" (nothing refused,
    random/hashlib/time/... importable: benchmark programs), or a `Policy`
    (`lorapop.verify.policy`); OS isolation is the same under every policy.
    max_output_chars: a longer repr is `output_too_large`. hash_seeds: PYTHONHASHSEED of the
    main and the determinism server.
    """

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 2.0,
        memory_mb: int = 1024,
        isolate: bool = True,
        *,
        max_output_chars: int = 100_000,
        hash_seeds: tuple[int, int] = (1, 2),
        policy: str | Policy = "azr",
    ) -> None:
        if workers < 1 or workers > 999:
            raise ValueError("workers must be in 1..999")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.workers, self.timeout_s, self.isolate = workers, timeout_s, isolate
        self.hash_seeds = hash_seeds
        self.policy = resolve(policy)
        self._limits = {
            "timeout_s": timeout_s,
            "memory_mb": memory_mb,
            "max_output_chars": max_output_chars,
            "isolate": isolate,
        }
        self._servers: list[_Server | None] = [None, None]
        self._lock = threading.Lock()
        self._next_id = 0
        self._closed = False
        self._server(0)  # start the main server now: fail early, and be warm for the first run
        self._finalizer = weakref.finalize(self, Sandbox._shutdown, self._servers)

    # --- servers ----------------------------------------------------------------------------
    def _server(self, i: int) -> _Server:
        srv = self._servers[i]
        if srv is not None and srv.alive():
            return srv
        if srv is not None:
            srv.kill()
        config = {
            "workers": self.workers,
            "limits": self._limits,
            "uid_base": UID_BASE + UID_SPAN * i if self.isolate else None,
            "gid": NOGROUP,
            "modules": list(self.policy.modules),
            "hidden": list(self.policy.hidden),
        }
        srv = _Server(config, self.hash_seeds[i])
        self._servers[i] = srv
        for note in srv.info.get("notes", []) if self.isolate else []:
            if note not in _warned:
                _warned.add(note)
                log.warning("lorapop sandbox: %s", note)
        return srv

    @property
    def isolation(self) -> dict:
        """What the main fork server achieved: net_isolated, fs_isolated, uid_isolated, notes."""
        return dict(self._server(0).info)

    @staticmethod
    def _shutdown(servers: list[_Server | None]) -> None:
        for srv in servers:
            if srv is not None:
                srv.close()

    # --- running ----------------------------------------------------------------------------
    def run(self, jobs: Sequence[Job]) -> list[Verdict]:
        """Verdicts for `jobs`, in order. Never raises for bad programs."""
        if self._closed:
            raise RuntimeError("Sandbox is closed")
        with self._lock:
            verdicts: list[Verdict | None] = [None] * len(jobs)
            batches: dict[int, dict[int, int]] = {0: {}, 1: {}}  # server -> request id -> job
            payloads: dict[int, list[tuple[int, bytes]]] = {0: [], 1: []}  # (id, frame)
            stall = 0.0
            pol = self.policy
            for i, job in enumerate(jobs):
                code = static.compile_job(
                    job.program, job.expr, job.entry, pol.banned, pol.ban_input
                )
                if isinstance(code[0], Status):
                    verdicts[i] = Verdict(code[0], None, code[1], 0.0)  # type: ignore[arg-type]
                    continue
                limit = job.timeout_s or self.timeout_s
                stall = max(stall, limit)
                data = encode_job(*code, cpu_limit(limit))  # type: ignore[arg-type]
                for s in (0, 1) if job.deterministic else (0,):
                    self._next_id += 1
                    batches[s][self._next_id] = i
                    head = b"%d %s" % (self._next_id, repr(limit).encode())
                    payloads[s].append((self._next_id, encode_frame(head, data)))
            results = self._exchange(payloads, stall + 15.0)
            runs: dict[int, list[Verdict]] = {}
            for s in (0, 1):
                for rid, i in batches[s].items():
                    runs.setdefault(i, []).append(results[s][rid])
            for i, vs in runs.items():
                verdicts[i] = vs[0] if len(vs) == 1 else _combine(vs[0], vs[1], self.hash_seeds)
            return [v for v in verdicts if v is not None]

    def _exchange(
        self, payloads: dict[int, list[tuple[int, bytes]]], stall: float
    ) -> dict[int, dict[int, Verdict]]:
        """Send each server its request frames (from a thread) and collect all answers; a
        server silent for `stall` seconds is killed and its jobs crashed."""
        out: dict[int, dict[int, Verdict]] = {0: {}, 1: {}}
        active = [s for s in (0, 1) if payloads[s]]
        servers = {s: self._server(s) for s in active}
        waiting = {s: {rid for rid, _ in payloads[s]} for s in active}
        writers = []
        for s in active:
            data = b"".join(frame for _, frame in payloads[s])
            t = threading.Thread(target=_write, args=(servers[s].stdin, data), daemon=True)
            t.start()
            writers.append(t)
        last = {s: time.monotonic() for s in active}
        sel = selectors.DefaultSelector()
        for s in active:
            sel.register(servers[s].fd, selectors.EVENT_READ, s)
        while any(waiting.values()):
            ready = {key.data for key, _ in sel.select(timeout=1.0)}
            now = time.monotonic()
            for s in active:
                if not waiting[s]:
                    continue
                lines = servers[s].read() if s in ready else []
                if lines:
                    last[s] = now
                    self._absorb(lines, waiting[s], out[s])
                elif lines is None or now - last[s] > stall:
                    why = "sandbox server died" if lines is None else "sandbox server stalled"
                    sel.unregister(servers[s].fd)
                    servers[s].kill()  # restarted on next use
                    for rid in waiting[s]:
                        out[s][rid] = Verdict(Status.CRASHED, None, why, 0.0)
                    waiting[s] = set()
        sel.close()
        for t in writers:
            t.join(timeout=5.0)
        return out

    @staticmethod
    def _absorb(
        frames: list[tuple[int, bytes]], waiting: set[int], out: dict[int, Verdict]
    ) -> None:
        for rid, data in frames:
            if rid in waiting:
                waiting.discard(rid)
                out[rid] = _parse(data)

    def close(self) -> None:
        """Stop the fork servers (their running children are killed)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write(stream, data: bytes) -> None:  # noqa: ANN001 - a binary pipe
    try:
        stream.write(data)
        stream.flush()
    except (BrokenPipeError, OSError, ValueError):
        pass  # the server died; the reader reports it
