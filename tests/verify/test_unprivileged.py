"""The sandbox started by an unprivileged user (most cluster users): a subprocess that drops
from root to `nobody` before it starts Python, once where the kernel allows unprivileged user
namespaces (every layer), once where it does not (simulated: a seccomp filter refuses them),
where Landlock and seccomp must still keep jobs off the host and `strict` must refuse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_hostile import REACH

import lorapop
from conftest import ROOT
from lorapop.verify.kernel import CLONE_NEWNS, mount, unshare

NOBODY = 65534
ESCAPE = f"/tmp/lorapop-unpriv-escape-{os.getpid()}"
pytestmark = pytest.mark.skipif(not ROOT, reason="dropping to another user needs root")

SCRIPT = r"""
import dataclasses, json, os, sys
from lorapop.verify import Job, Sandbox
from lorapop.verify.policy import AZR
from lorapop.verify.sandbox import SandboxError
spec = json.load(sys.stdin)
# jobs that hold libc (ctypes granted) probe the kernel layers
FFI = dataclasses.replace(AZR, name="ffi", modules=(*AZR.modules, "ctypes"),
                          hidden=tuple(h for h in AZR.hidden if h not in ("ctypes", "_ctypes")))
out = {"uid": os.getuid()}
try:
    with Sandbox(workers=2, timeout_s=1.0, isolate="strict"):
        out["strict"] = "ran"
except SandboxError as e:
    out["strict"] = str(e)
with Sandbox(workers=2, timeout_s=1.0, max_output_chars=1000, policy=FFI) as sb:
    out["info"] = sb.isolation
    jobs = [Job(p, e, deterministic=d) for p, e, d in spec]
    out["verdicts"] = [[v.status.value, v.output, v.error] for v in sb.run(jobs)]
print(json.dumps(out))
"""


def _jobs(canary: Path) -> list[tuple[str, str, bool]]:
    return [
        ("def f(x):\n    return x * 2", "f(21)", True),
        ("def f():\n    return open('/etc/passwd').read()", "f()", False),
        (f"def f():\n    return open({str(canary)!r}).read()", "f()", False),
        (f"import os\ndef f():\n    os.remove({str(canary)!r})", "f()", False),
        (f"def f():\n    open({ESCAPE!r}, 'w').write('x')", "f()", False),
        ("import os\ndef f():\n    return os.fork()", "f()", False),
        ("import os\ndef f():\n    os.execv('/bin/sh', ['sh'])", "f()", False),
        (REACH + "def f():\n    return [libc().unshare(0x10000000), libc().unshare(0x20000)]", "f()", False),
        ("def f():\n    return __import__('_so' + 'cket')", "f()", False),
        ("import os\ndef f():\n    os.write(3, b'ok 5000 -1 0.0\\n' + b'7' * 5000)\n    os._exit(0)", "f()", False),
        (f"import os\ndef f():\n    os.kill({os.getpid()}, 9)", "f()", False),
    ]  # fmt: skip


def _blocked(paths: list[str]) -> list[tuple[str, str]]:
    """(directory others cannot enter, its child on the way) for each path's first such
    ancestor: they are made passable in the subprocess's own mount namespace."""
    out = []
    for p in paths:
        parts = Path(p).resolve().parts
        for i in range(1, len(parts)):
            d = os.path.join(*parts[:i])
            if not os.stat(d).st_mode & 0o001:
                if (d, parts[i]) not in out:
                    out.append((d, parts[i]))
                break
    return out


def _drop(no_userns: bool, blocked: list[tuple[str, str]]):  # noqa: ANN202 - a preexec_fn
    def preexec() -> None:
        if blocked:  # a private mount namespace: the host's directories keep their modes
            unshare(CLONE_NEWNS)
            mount(None, "/", None, (1 << 14) | (1 << 18), None)
            mount("keep", "/mnt", "tmpfs", 0, "mode=755")
            for i, (d, child) in enumerate(blocked):
                os.mkdir(f"/mnt/{i}")
                mount(os.path.join(d, child), f"/mnt/{i}", None, 4096 | (1 << 14), None)
                mount("pass", d, "tmpfs", 0, "mode=755")
                os.mkdir(os.path.join(d, child))
                mount(f"/mnt/{i}", os.path.join(d, child), None, 4096 | (1 << 14), None)
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
        if no_userns:  # as a kernel that refuses unprivileged user namespaces would
            import pyseccomp as sc

            f = sc.SyscallFilter(sc.ALLOW)
            new_user = 0x10000000
            for call in ("unshare", "clone"):
                f.add_rule(sc.ERRNO(1), call, sc.Arg(0, sc.MASKED_EQ, new_user, new_user))
            f.add_rule(sc.ERRNO(38), "clone3")
            f.load()

    return preexec


def _run_as_nobody(canary: Path, no_userns: bool) -> dict:
    src = str(Path(lorapop.__file__).resolve().parent.parent)
    blocked = _blocked([sys.executable, sys.prefix, sys.base_prefix, src])
    env = {"PATH": os.defpath, "HOME": "/nonexistent", "PYTHONPATH": src}
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], input=json.dumps(_jobs(canary)), capture_output=True,
        text=True, env=env, cwd="/", preexec_fn=_drop(no_userns, blocked), timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def canary(tmp_path_factory):
    d = tmp_path_factory.mktemp("unpriv")
    d.chmod(0o777)  # nobody may even delete in it: only the sandbox stops the job
    p = d / "canary.txt"
    p.write_text("precious")
    p.chmod(0o666)
    yield p


def _common(out: dict, canary: Path) -> list:
    assert out["uid"] == NOBODY
    v = out["verdicts"]
    assert v[0] == ["ok", "42", None]
    assert all(s in ("runtime_error", "crashed") for s, _, _ in [*v[1:7], v[8]]), v
    assert v[7] == ["ok", "[-1, -1]", None]  # no namespaces: refused by seccomp
    assert v[9][0] == "output_too_large"
    assert canary.read_text() == "precious"
    assert not Path(ESCAPE).exists()
    return v


def test_unprivileged_user_gets_every_layer(canary):
    out = _run_as_nobody(canary, no_userns=False)
    layers = out["info"]["layers"]
    assert out["strict"] == "ran", out
    assert all(
        layers[k] for k in ("seccomp", "user_ns", "pid_ns", "net_ns", "fs_view", "job_tmpfs")
    )
    assert out["info"]["outer_uid"] == NOBODY
    v = _common(out, canary)
    assert v[10][0] == "runtime_error"  # the test process is not even visible


def test_without_user_namespaces_landlock_and_seccomp_hold(canary):
    out = _run_as_nobody(canary, no_userns=True)
    layers = out["info"]["layers"]
    assert layers["seccomp"] and layers["landlock"], out["info"]
    assert not layers["user_ns"] and not layers["pid_ns"]
    assert out["strict"].startswith("isolate=strict: this machine lacks sandbox layers user_ns")
    v = _common(out, canary)
    assert v[10][0] == "runtime_error"  # nobody may not signal root's processes
