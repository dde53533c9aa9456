"""The byte format between the fork server and a job child, in both directions.

Length-prefixed text rather than JSON: in a freshly forked child every page that Python writes
costs a copy-on-write fault, and the json module's first call touches ~80 pages (a quarter of a
job's cost); slicing and `str.encode` touch almost none. The server parses what a child sends
as hostile bytes: anything malformed is None, never an exception.

    job:    b"<len(program)> <cpu seconds>\\n" + program + expr      (UTF-8, surrogates kept)
    result: b"<status> <len(output)|-1> <len(error)|-1> <duration>\\n" + output + error
"""

from __future__ import annotations

import math

from lorapop.verify.verdict import Status

_ENC = ("utf-8", "surrogatepass")
_STATUSES = frozenset(s.value.encode() for s in Status)


def encode_job(program: str, expr: str, cpu_s: int) -> bytes:
    p = program.encode(*_ENC)
    return b"%d %d\n" % (len(p), cpu_s) + p + expr.encode(*_ENC)


def decode_job(data: bytes) -> tuple[str, str, int]:
    """(program, expr, RLIMIT_CPU seconds); the server's own bytes, so not parsed defensively."""
    head, _, body = data.partition(b"\n")
    n, cpu = head.split(b" ")
    k = int(n)
    return body[:k].decode(*_ENC), body[k:].decode(*_ENC), int(cpu)


def encode_result(status: str, output: str | None, error: str | None, duration: float) -> bytes:
    out = b"" if output is None else output.encode(*_ENC)
    err = b"" if error is None else error.encode(*_ENC)
    n_out = -1 if output is None else len(out)
    n_err = -1 if error is None else len(err)
    return f"{status} {n_out} {n_err} {duration!r}\n".encode() + out + err


def decode_result(data: bytes) -> dict[str, object] | None:
    """The fields of a result, or None when `data` is not exactly one well-formed result."""
    head, sep, body = data.partition(b"\n")
    parts = head.split(b" ")
    if not sep or len(parts) != 4 or parts[0] not in _STATUSES:
        return None
    try:
        n_out, n_err, duration = int(parts[1]), int(parts[2]), float(parts[3])
        if n_out < -1 or n_err < -1 or max(n_out, 0) + max(n_err, 0) != len(body):
            return None
        if not math.isfinite(duration) or duration < 0:
            return None
        out = None if n_out < 0 else body[:n_out].decode(*_ENC)
        err = None if n_err < 0 else body[max(n_out, 0) :].decode(*_ENC)
    except ValueError:  # includes UnicodeDecodeError
        return None
    return {"status": parts[0].decode(), "output": out, "error": err, "duration": duration}
