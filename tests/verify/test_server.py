"""The fork server (`lorapop.verify.server`) through its own protocol, and its failure modes."""

import os
import signal
import threading
import time

import pytest

from conftest import processes_of
from lorapop.verify import Job, Sandbox, Status
from lorapop.verify.child import cpu_limit
from lorapop.verify.kernel import LAYERS
from lorapop.verify.policy import BASE_MODULES
from lorapop.verify.sandbox import NO_VERDICT, _Server, server_config
from lorapop.verify.static import compile_job
from lorapop.verify.wire import decode_result, encode_frame, encode_job

CONFIG = server_config(
    2,
    {"timeout_s": 1.0, "memory_mb": 256, "max_output_chars": 1000, "isolate": True},
    BASE_MODULES,
    ["lorapop"],
)
SLEEP = "def f(n):\n    x = 0\n    for i in range(n):\n        x += i\n    return n"


def frame(rid: int, program: str, expr: str, limit: float = 1.0) -> bytes:
    code = compile_job(program, expr, "f", (), False)
    return encode_frame(b"%d %r" % (rid, limit), encode_job(*code, cpu_limit(limit)))


def answers(srv: _Server, n: int, timeout: float = 20.0) -> list[tuple[int, dict | None]]:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        frames = srv.read()
        assert frames is not None, "the server died"
        got += [(rid, decode_result(data)) for rid, _, data in frames]
    return got


@pytest.fixture
def server():
    srv = _Server(CONFIG, hash_seed=3)
    yield srv
    srv.close()


def test_hello_reports_every_layer(server):
    assert set(server.info["layers"]) == set(LAYERS)
    assert isinstance(server.info["notes"], list) and server.info["outer_uid"] >= 0


def test_answers_come_in_completion_order(server):
    server.stdin.write(frame(1, SLEEP, "f(3_000_000)") + frame(2, SLEEP, "f(5)"))
    server.stdin.flush()
    got = answers(server, 2)
    assert [rid for rid, _ in got] == [2, 1]
    assert [r["output"] for _, r in got] == ["5", "3000000"]


def test_deadline_is_the_servers(server):
    server.stdin.write(frame(7, "def f():\n    while True:\n        pass", "f()", limit=0.3))
    server.stdin.flush()
    ((rid, res),) = answers(server, 1)
    assert rid == 7 and res["status"] == "timeout" and res["error"] == "exceeded 0.3 s"


def test_each_job_gets_a_fresh_tmpfs(server):
    """A slot's tmpfs is remounted after each job: 40 jobs each fill most of theirs."""
    fill = "def f():\n    open('big', 'wb').write(b'x' * (15 << 20))\n    return len(open('big', 'rb').read())"
    server.stdin.write(b"".join(frame(i, fill, "f()", limit=5.0) for i in range(40)))
    server.stdin.flush()
    got = answers(server, 40, timeout=120)
    assert sorted(rid for rid, _ in got) == list(range(40))
    assert {r["output"] for _, r in got} == {str(15 << 20)}


def test_eof_stops_the_server_and_its_children():
    srv = _Server(CONFIG, hash_seed=3)
    uid = srv.info["outer_uid"]
    srv.stdin.write(frame(1, SLEEP, "f(10)"))
    srv.stdin.flush()
    answers(srv, 1)
    assert len(processes_of(uid)) > 1  # the server and its idle children
    srv.close()
    assert srv.proc.returncode == 0
    assert _gone(uid)


def test_children_die_with_a_killed_server():
    srv = _Server(CONFIG, hash_seed=3)
    uid = srv.info["outer_uid"]
    srv.stdin.write(frame(1, "def f():\n    while True:\n        pass", "f()", limit=30.0))
    srv.stdin.flush()
    time.sleep(0.2)
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait()
    assert _gone(uid)
    srv.close()


def _gone(uid: int, wait: float = 5.0) -> bool:
    deadline = time.monotonic() + wait
    while processes_of(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not processes_of(uid)


# --- a dead server's jobs are re-run; without a verdict `lost` counts them -----------------

SLOW = Job("import time\ndef f(x):\n    time.sleep(0.6)\n    return x", "f(4)", timeout_s=5.0)


def _killer(sb: Sandbox, times: int, stop: threading.Event) -> None:
    killed: set[int] = set()
    while len(killed) < times and not stop.is_set():
        srv = sb._servers[0]
        if srv is not None and srv.proc.pid not in killed and srv.alive():
            time.sleep(0.3)  # let it take the jobs
            killed.add(srv.proc.pid)
            os.kill(srv.proc.pid, signal.SIGKILL)
        time.sleep(0.02)


@pytest.mark.parametrize("kills, lost", [(1, 0), (2, 4)])
def test_jobs_of_a_dead_server_are_rerun_once(kills, lost):
    with Sandbox(workers=4, timeout_s=2.0, policy="benchmark") as sb:
        stop = threading.Event()
        t = threading.Thread(target=_killer, args=(sb, kills, stop))
        t.start()
        verdicts = sb.run([SLOW] * 4)
        stop.set()
        t.join()
        if lost:
            assert {(v.status, v.error) for v in verdicts} == {(Status.CRASHED, NO_VERDICT)}
        else:
            assert [v.output for v in verdicts] == ["4"] * 4
        assert sb.lost == lost
        assert sb.run([Job("def f():\n    return 1", "f()")])[0].output == "1"  # serves on


def test_layers_are_reported_once(caplog):
    import logging

    import lorapop.verify.sandbox as sandbox_module

    sandbox_module._reported.clear()
    with (
        caplog.at_level(logging.INFO, logger="lorapop.verify.sandbox"),
        Sandbox(workers=1),
        Sandbox(workers=1, policy="benchmark") as b,
    ):
        b.run([Job("def f():\n    return 1", "f()", deterministic=True)])  # a 2nd server
    lines = [r.getMessage() for r in caplog.records if "sandbox layers" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "lorapop sandbox layers: active seccomp, user_ns, pid_ns, net_ns, fs_view, job_tmpfs,"
        " native_calls, time_ns"
    )
