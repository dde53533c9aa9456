import os
import uuid
from pathlib import Path

import pytest

from lorapop.verify import Sandbox
from lorapop.verify.policy import AZR, BENCHMARK, Policy

ROOT = os.geteuid() == 0
#: AZR's policy with ctypes granted (pre-imported, importable): the kernel layers are probed by
#: jobs that hold libc, as a job could where the sandbox's kernel calls fall back to ctypes.
FFI = Policy(
    "ffi", AZR.banned, AZR.ban_input, (*AZR.modules, "ctypes"),
    tuple(h for h in AZR.hidden if h not in ("ctypes", "_ctypes")),
)  # fmt: skip
#: The benchmark policy with ctypes granted, likewise.
BENCHMARK_FFI = Policy(
    "benchmark-ffi", BENCHMARK.banned, BENCHMARK.ban_input, (*BENCHMARK.modules, "ctypes"),
    BENCHMARK.hidden,
)  # fmt: skip


@pytest.fixture(scope="session")
def sandbox():
    """One sandbox for the whole verify suite (starting fork servers costs ~0.2 s each)."""
    with Sandbox(workers=2, timeout_s=1.0, memory_mb=512, max_output_chars=20_000) as sb:
        yield sb


@pytest.fixture(scope="session")
def ffi():
    """A sandbox like `sandbox` whose jobs may use ctypes (`FFI`): for the kernel probes."""
    with Sandbox(
        workers=2, timeout_s=1.0, memory_mb=512, max_output_chars=20_000, policy=FFI
    ) as sb:
        yield sb


@pytest.fixture(scope="module")
def canaries(tmp_path_factory):
    """Files a job might try to read, delete or overwrite: a root-owned one under /tmp, one in
    a root-only directory outside /tmp (when running as root), and a run directory's gold
    buffer (world-readable, as a run writes it)."""
    paths = [tmp_path_factory.mktemp("canary") / "canary.txt"]
    if ROOT and os.access("/run", os.W_OK):
        d = Path("/run") / f"lorapop-canary-{uuid.uuid4().hex[:8]}"
        d.mkdir(mode=0o755)
        paths.append(d / "canary.txt")
    run = tmp_path_factory.mktemp("run") / "buffers"
    run.mkdir()
    paths.append(run / "code_o.jsonl")
    for p in paths:
        p.write_text("precious")
        p.chmod(0o644)
    yield paths
    for p in paths[1:-1]:
        p.unlink(missing_ok=True)
        p.parent.rmdir()


def processes_of(uid: int) -> dict[int, int]:
    """pid -> parent pid of every process whose real uid is `uid`."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid:
            out[int(entry.name)] = int(fields["PPid"])
    return out


def left_behind(token: str) -> list[str]:
    """Paths named with `token` in the host's shared writable directories (a job that wrote
    there escaped its tmpfs)."""
    found = []
    for d in ("/tmp", "/dev/shm", "/var/tmp", "/run/lock", "/"):
        if os.path.isdir(d):
            found += [os.path.join(d, n) for n in os.listdir(d) if token in n]
    return found
