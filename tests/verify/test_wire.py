"""The server parses what a child writes as hostile bytes; fresh processes stay fresh."""

import pytest

from lorapop.verify import Job
from lorapop.verify.static import compile_job
from lorapop.verify.wire import (
    decode_job,
    decode_result,
    encode_frame,
    encode_job,
    encode_result,
    split_frames,
)


@pytest.mark.parametrize(
    "fields",
    [
        ("ok", "'a\\x00b'", None, 0.25),
        ("runtime_error", None, "ValueError: \udcff bad", 0.0),
        ("ok", "x" * 100_000, "", 1e-6),
        ("ok", "\n 3 4 \n", None, 2.0),
    ],
)
def test_result_round_trip(fields):
    keys = ("status", "output", "error", "duration")
    data = encode_result(*fields)
    assert decode_result(data) == dict(zip(keys, fields, strict=True))


def test_job_round_trip():
    code = compile_job("def f(s):\n    return s + 'é'\n", "f('\\n12\\n')")
    program, expr, cpu = decode_job(encode_job(*code, 3))
    assert (program, expr, cpu) == (*code, 3)
    ns: dict = {}
    exec(program, ns)
    assert eval(expr, ns) == "\n12\né"


def test_frames_split_only_when_complete():
    buf = bytearray(encode_frame(b"7 2.5", b"a\nb") + encode_frame(b"8 1.0", b""))
    whole = bytes(buf)
    assert split_frames(buf) == [([b"7", b"2.5"], b"a\nb"), ([b"8", b"1.0"], b"")] and not buf
    part = bytearray(whole[:-4])
    assert split_frames(part) == [([b"7", b"2.5"], b"a\nb")]
    assert bytes(part) == whole[len(encode_frame(b"7 2.5", b"a\nb")) : -4]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"ok 1 -1 0.0",  # no newline
        b"ok 1 -1 0.0\nab",  # more than announced
        b"ok 3 -1 0.0\nab",  # less than announced
        b"ok -5 -1 0.0\n",
        b"ok 1 -1 nan\n1",
        b"ok 1 -1 -1.0\n1",
        b"o k 1 -1 0.0\n1",
        b"pwned 1 -1 0.0\n1",
        b"ok 1 -1 0.0 7\n1",
        b"ok 99999999999999999999999 -1 0.0\n",
        b"ok 2 -1 0.0\n\xff\xfe",
        b'{"status": "ok", "output": "1"}',
        b"junk" + encode_result("ok", "1", None, 0.1),
    ],
)
def test_malformed_results_are_none(data):
    assert decode_result(data) is None


def test_every_job_gets_a_fresh_process(sandbox):
    """Module state and files are never shared, though children are forked ahead; every job
    sees the same pid, uid and working directory (its own namespaces)."""
    prog = (
        "import math, os\n"
        "def f():\n"
        "    seen = getattr(math, 'marker', None)\n"
        "    math.marker = 1\n"
        "    files = os.listdir('.')\n"
        "    open('mine', 'w').close()\n"
        "    return seen, os.getpid(), os.getuid(), os.getcwd(), files"
    )
    verdicts = sandbox.run([Job(prog, "f()") for _ in range(24)])
    assert {v.output for v in verdicts} == {"(None, 2, 1000, '/', [])"}


def test_a_job_cannot_reach_the_idle_children(sandbox):
    """kill(-1) reaches only the job's own uid: the pre-forked children run the next jobs."""
    killer = Job("import os\ndef f():\n    os.kill(-1, 9)\n    return 0", "f()")
    honest = [Job("def f(x):\n    return x * 2", f"f({i})") for i in range(12)]
    verdicts = sandbox.run([killer, *honest, killer, *honest])
    outputs = [v.output for v in verdicts]
    expected = [str(i * 2) for i in range(12)]
    assert outputs[1:13] == expected and outputs[14:] == expected
