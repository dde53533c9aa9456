"""`Sandbox`: run untrusted programs in confined processes and return verdicts.

The caller's process only parses and compiles programs (static checks) and reads result frames,
which it parses as hostile bytes; every program runs in a child forked by a fork server
(`lorapop.verify.server`), behind the kernel's layers (`lorapop.verify.kernel`). A second
server with another PYTHONHASHSEED, its own address-space layout and skewed clocks re-runs jobs
marked `deterministic`: a forked child inherits its server's hash secret and addresses, so
only a second server can show that a result depends on them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import queue
import secrets
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

from lorapop.verify import static
from lorapop.verify.child import BOOT, cpu_limit
from lorapop.verify.kernel import (
    CLOCK_RANDOM_S,
    CLOCK_SKEW_S,
    LAYERS,
    REQUIRED,
    filters,
    syscall_numbers,
)
from lorapop.verify.policy import Policy, resolve
from lorapop.verify.verdict import Job, Status, Verdict, check_timeout
from lorapop.verify.wire import decode_result, encode_frame, encode_job, split_frames

log = logging.getLogger(__name__)
_reported: set[str] = set()
_RESOURCE = (Status.TIMEOUT, Status.MEMORY, Status.CRASHED)
#: An error message read back from a job is cut to this many characters.
MAX_ERROR_CHARS = 4000
#: The error of a job left without a verdict (its server died on the job and on the re-run).
NO_VERDICT = "no verdict: the sandbox server died twice running it"


#: Make the servers' kernel calls through `lorapop.verify._kernel` where it is built (the tests
#: turn it off to check the ctypes fallback).
_NATIVE_CALLS = True


class SandboxError(RuntimeError):
    """The sandbox cannot run as asked (e.g. `isolate="strict"` and a layer is missing)."""


class _Server:
    """One fork-server process and the pipes to it."""

    def __init__(self, config: dict, hash_seed: int, clock_offset_s: float = 0.0) -> None:
        env = {
            "PYTHONHASHSEED": str(hash_seed),
            "PYTHONPATH": os.pathsep.join(_server_path()),
            "PYTHONDONTWRITEBYTECODE": "1",
            # every library's symbols bound at start: a job's first call of a function never
            # writes the shared binding tables (a copy-on-write fault and a lookup per job)
            "LD_BIND_NOW": "1",
            "PATH": os.defpath,
            "LC_ALL": "C.UTF-8",
        }
        cmd = [sys.executable, "-S", "-c", BOOT, json.dumps(config)]
        self.hash_seed = hash_seed
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd="/",
            start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.fd = self.proc.stdin, self.proc.stdout.fileno()
        self.buf = bytearray()
        deadline = time.monotonic() + 60.0
        first = self._line(deadline)
        note = None
        if "timens" in first:  # the children's clock offsets: written here, never sent
            note = _write_offsets(self.proc.pid, clock_offset_s)
            self.stdin.write(b"go\n")
            self.stdin.flush()
            first = self._line(deadline)
        self.info: dict = first["hello"]
        if note is not None:
            self.info["layers"]["time_ns"] = False
            self.info["notes"].append(note)

    def _line(self, deadline: float) -> dict:
        """The server's next JSON line: `{"timens": true}` or `{"hello": {...}}` (what
        isolation it achieved)."""
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
        return json.loads(line)

    def read(self) -> list[tuple[int, float, bytes]] | None:
        """The complete (request id, duration, result bytes) frames of one read (call when
        readable); None at EOF."""
        chunk = os.read(self.fd, 1 << 20)
        if not chunk:
            return None
        self.buf += chunk
        return [(int(head[0]), float(head[1]), body) for head, body in split_frames(self.buf)]

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


def server_config(
    workers: int, limits: dict, modules: Sequence[str], hidden: Sequence[str]
) -> dict:
    """A fork server's configuration (`lorapop.verify.server.ServerConfig`), with the seccomp
    programs built here (`kernel.filters`): the server never loads libseccomp."""
    progs, why = filters() if limits.get("isolate", True) else (None, None)
    return {
        "workers": workers,
        "limits": limits,
        "modules": list(modules),
        "hidden": list(hidden),
        "seccomp": None if progs is None else {k: v.hex() for k, v in progs.items()},
        "notes": [why] if why else [],
        "sysno": syscall_numbers(),
        "native": _NATIVE_CALLS,
    }


def _write_offsets(pid: int, seconds: float) -> str | None:
    """Offset the monotonic and boot-time clocks of a server's children; None, or why not."""
    sec, nsec = int(seconds), round((seconds - int(seconds)) * 1e9)
    text = f"monotonic {sec} {nsec}\nboottime {sec} {nsec}\n"
    try:
        with open(f"/proc/{pid}/timens_offsets", "w") as f:
            f.write(text)
    except OSError as e:
        return f"no clock offsets ({e.strerror or e})"
    return None


def _server_path() -> list[str]:
    """sys.path of a fork server (started with -S: no site-packages): lorapop's source and the
    directories of the kernel-layer libraries, where installed."""
    import lorapop

    path = [str(Path(lorapop.__file__).resolve().parent.parent)]
    for name in ("pyseccomp", "landlock"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            where = Path(spec.origin).parent  # a module's directory, or a package's
            where = str(where.parent if spec.submodule_search_locations else where)
            if where not in path:
                path.append(where)
    return path


def _parse(data: bytes, max_output_chars: int, duration: float = 0.0) -> Verdict:
    """A child's result bytes (hostile: a job can write its own) as a verdict, capped here
    whatever the child claims; the duration is the server's measure."""
    res = decode_result(data)
    if res is None:
        return Verdict(Status.CRASHED, None, "malformed result from the sandbox", duration)
    status, output, error = Status(res["status"]), res["output"], res["error"]
    if status is not Status.OK:
        output = None
    elif not isinstance(output, str):
        return Verdict(Status.CRASHED, None, "malformed result: ok without an output", duration)
    elif len(output) > max_output_chars:
        why = f"repr has {len(output)} characters (cap {max_output_chars})"
        return Verdict(Status.OUTPUT_TOO_LARGE, None, why, duration)
    if isinstance(error, str):
        error = error[:MAX_ERROR_CHARS]
    return Verdict(status, output, error, duration)  # type: ignore[arg-type]


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

    error = (
        f"PYTHONHASHSEED={seeds[0]}: {show(a)} != PYTHONHASHSEED={seeds[1]}, other addresses"
        f" and clocks: {show(b)}"
    )
    return Verdict(Status.NONDETERMINISTIC, None, error, duration)


class Sandbox:
    """A pool of isolated, pre-forked workers; see the module docstring.

    workers: jobs in flight at once per fork server. timeout_s: wall-clock (and, rounded up, CPU)
    limit of a job that names none (`Job.timeout_s`). memory_mb: RLIMIT_AS per job (0: none).
    isolate: True enters every kernel layer the machine allows and warns once about the rest;
    "strict" raises `SandboxError` when a layer of `kernel.REQUIRED` is missing; False runs
    jobs with rlimits only (trusted code). policy: "azr" (AZR's banned modules refused and
    hidden: self-play tasks) or "benchmark" (nothing refused, random/hashlib/time/...
    importable: benchmark programs), or a `Policy` (`lorapop.verify.policy`); OS isolation is
    the same under every policy. max_output_chars: a longer repr is `output_too_large`.
    hash_seeds: PYTHONHASHSEED of the main and the determinism server.
    """

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 2.0,
        memory_mb: int = 1024,
        isolate: bool | str = True,
        *,
        max_output_chars: int = 100_000,
        hash_seeds: tuple[int, int] = (1, 2),
        policy: str | Policy = "azr",
    ) -> None:
        if not isinstance(workers, int) or not 1 <= workers <= 999:
            raise ValueError("workers must be in 1..999")
        timeout_s = check_timeout(timeout_s)
        if not isinstance(memory_mb, int) or not 0 <= memory_mb <= 1 << 20:
            raise ValueError("memory_mb must be in 0..1048576 (0: no cap)")
        if not isinstance(max_output_chars, int) or not 1 <= max_output_chars <= 1 << 27:
            raise ValueError("max_output_chars must be in 1..134217728")
        if isolate not in (True, False, "strict"):
            raise ValueError(f"isolate must be true, false or 'strict', not {isolate!r}")
        self.workers, self.timeout_s, self.isolate = workers, timeout_s, isolate
        self.hash_seeds = hash_seeds
        self.policy = resolve(policy)
        self.max_output_chars = max_output_chars
        self._limits = {
            "timeout_s": timeout_s,
            "memory_mb": memory_mb,
            "max_output_chars": max_output_chars,
            "isolate": bool(isolate),
        }
        self._servers: list[_Server | None] = [None, None]
        self._lock = threading.Lock()
        self._next_id = 0
        self._closed = False
        #: Jobs that got no verdict (their server died on them twice); `lorapop verify` fails.
        self.lost = 0
        self._finalizer = weakref.finalize(self, Sandbox._shutdown, self._servers)
        self._server(0)  # start the main server now: fail early, and be warm for the first run

    # --- servers ----------------------------------------------------------------------------
    def _server(self, i: int) -> _Server:
        srv = self._servers[i]
        if srv is not None and srv.alive():
            return srv
        if srv is not None:
            srv.kill()
        config = server_config(
            self.workers, self._limits, self.policy.modules, self.policy.hidden
        )
        # Random for each server, never sent to it; the second's ~31 years further.
        offset = secrets.randbelow(int(CLOCK_RANDOM_S * 1e6)) / 1e6 + CLOCK_SKEW_S * i
        srv = _Server(config, self.hash_seeds[i], offset)
        self._servers[i] = srv
        if self.isolate:
            missing = [name for name in REQUIRED if not srv.info["layers"].get(name)]
            if missing and self.isolate == "strict":
                self._servers[i] = None
                srv.close()
                notes = "; ".join(srv.info.get("notes", []))
                raise SandboxError(
                    f"isolate=strict: this machine lacks sandbox layers {', '.join(missing)}"
                    f" ({notes})"
                )
            _report(srv.info)
        return srv

    @property
    def isolation(self) -> dict:
        """What the main fork server achieved: "layers" (name -> active, `kernel.LAYERS`),
        "notes" (why a layer is missing), "outer_uid" (the jobs' uid outside their namespace)."""
        return dict(self._server(0).info)

    @staticmethod
    def _shutdown(servers: list[_Server | None]) -> None:
        for srv in servers:
            if srv is not None:
                srv.close()

    # --- running ----------------------------------------------------------------------------
    def run(self, jobs: Sequence[Job]) -> list[Verdict]:
        """Verdicts for `jobs`, in order. Never raises for bad programs. Jobs of a server that
        dies are re-run once on a fresh one; a job left without a verdict then is `crashed`
        with the error `NO_VERDICT` and counted in `lost`."""
        if self._closed:
            raise RuntimeError("Sandbox is closed")
        with self._lock:
            verdicts: list[Verdict | None] = [None] * len(jobs)
            batches: dict[int, dict[int, int]] = {0: {}, 1: {}}  # server -> request id -> job
            payloads: dict[int, list[tuple[int, bytes]]] = {0: [], 1: []}  # (id, frame)
            stall = 0.0
            pol = self.policy
            feeds: dict[int, _Feed] = {}  # frames go out while later jobs compile
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
                    if s not in feeds:
                        feeds[s] = _Feed(self._server(s))
                    feeds[s].put(payloads[s][-1][1])
            for feed in feeds.values():
                feed.close()
            results: dict[int, dict[int, Verdict]] = {0: {}, 1: {}}
            for _ in range(2):  # the first try, and a re-run of what a dead server lost
                lost = self._exchange(payloads, stall + 15.0, results, feeds)
                payloads = {s: [p for p in payloads[s] if p[0] in lost[s]] for s in (0, 1)}
                feeds = {}
            for s in (0, 1):
                for rid, _ in payloads[s]:
                    results[s][rid] = Verdict(Status.CRASHED, None, NO_VERDICT, 0.0)
                    self.lost += 1
            runs: dict[int, list[Verdict]] = {}
            for s in (0, 1):
                for rid, i in batches[s].items():
                    runs.setdefault(i, []).append(results[s][rid])
            for i, vs in runs.items():
                verdicts[i] = vs[0] if len(vs) == 1 else _combine(vs[0], vs[1], self.hash_seeds)
            return [v for v in verdicts if v is not None]

    def _exchange(
        self,
        payloads: dict[int, list[tuple[int, bytes]]],
        stall: float,
        out: dict[int, dict[int, Verdict]],
        feeds: dict[int, _Feed],
    ) -> dict[int, set[int]]:
        """Send each server its request frames (from a thread; `feeds`: those already being
        sent, each to its server) and collect the answers into `out`; a server that dies, or is
        silent for `stall` seconds (then killed), loses its unanswered requests: their ids are
        returned."""
        lost: dict[int, set[int]] = {0: set(), 1: set()}
        active = [s for s in (0, 1) if payloads[s]]
        servers = {s: feeds[s].server if s in feeds else self._server(s) for s in active}
        waiting = {s: {rid for rid, _ in payloads[s]} for s in active}
        writers = [feed.thread for feed in feeds.values()]
        for s in active:
            if s in feeds:
                continue
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
                frames = servers[s].read() if s in ready else []
                if frames:
                    last[s] = now
                    for rid, duration, data in frames:
                        if rid in waiting[s]:
                            waiting[s].discard(rid)
                            out[s][rid] = _parse(data, self.max_output_chars, duration)
                elif frames is None or now - last[s] > stall:
                    why = "died" if frames is None else f"was silent for {stall:g} s"
                    log.warning("lorapop sandbox: a fork server %s; re-running its jobs", why)
                    sel.unregister(servers[s].fd)
                    servers[s].kill()  # restarted on next use
                    lost[s], waiting[s] = waiting[s], set()
        sel.close()
        for t in writers:
            t.join(timeout=5.0)
        return lost

    def close(self) -> None:
        """Stop the fork servers (their running children are killed)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _report(info: dict) -> None:
    """Say once per process (per distinct outcome) which kernel layers are active."""
    on = [name for name in LAYERS if info["layers"].get(name)]
    off = [name for name in LAYERS if not info["layers"].get(name)]
    line = f"lorapop sandbox layers: active {', '.join(on) or 'none'}"
    if off:
        line += f"; missing {', '.join(off)} ({'; '.join(info.get('notes', []))})"
    if line in _reported:
        return
    _reported.add(line)
    missing_required = any(name in off for name in REQUIRED)
    log.log(logging.WARNING if missing_required else logging.INFO, line)


class _Feed:
    """Frames written to one server from a thread as the caller puts them, so that the servers
    run the first jobs while the caller still compiles the rest (what is queued by the time a
    write ends goes out in one write)."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._send, daemon=True)
        self.thread.start()

    def put(self, frame: bytes) -> None:
        self.queue.put(frame)

    def close(self) -> None:
        self.queue.put(None)

    def _send(self) -> None:
        done = False
        while not done:
            parts = [self.queue.get()]
            with contextlib.suppress(queue.Empty):
                while parts[-1] is not None:
                    parts.append(self.queue.get_nowait())
            if parts[-1] is None:
                parts.pop()
                done = True
            if parts:
                _write(self.server.stdin, b"".join(parts))  # type: ignore[arg-type]


def _write(stream, data: bytes) -> None:  # noqa: ANN001 - a binary pipe
    try:
        stream.write(data)
        stream.flush()
    except (BrokenPipeError, OSError, ValueError):
        pass  # the server died; the reader reports it
