"""The byte formats between the caller, the fork server and a job child.

Length-prefixed bytes rather than JSON: in a freshly forked child every page that Python writes
costs a copy-on-write fault, and the json module's first call touches ~80 pages (a quarter of a
job's cost); slicing and `str.encode` touch almost none. The server passes a job's bytes to its
child and the child's result bytes back to the caller without parsing either, so the caller
parses what a child wrote as hostile bytes: anything malformed is None, never an exception.

    job (caller -> child):    b"<cpu seconds>\\n" + marshal((program code, expr code))
    result (child -> caller): b"<status> <len(output)|-1> <len(error)|-1> <duration>\\n"
                              + output + error      (UTF-8, surrogates kept)
    frame (caller <-> server): b"<id> <wall-clock limit s> <len(body)>\\n" + body   (to the server)
                               b"<id> <len(body)>\\n" + body                        (from it)

The code objects are compiled in the caller (`lorapop.verify.static.compile_job`): compiling
runs nothing, and a child that only unmarshals them skips the compiler's allocations (a third of
its page faults). The caller and the server run the same interpreter, so marshal's format agrees.
"""

from __future__ import annotations

import marshal
import math
from types import CodeType

from lorapop.verify.verdict import Status

_ENC = ("utf-8", "surrogatepass")
_STATUSES = frozenset(s.value.encode() for s in Status)


def encode_job(program: CodeType, expr: CodeType, cpu_s: int) -> bytes:
    return b"%d\n" % cpu_s + marshal.dumps((program, expr))


def decode_job(data: bytes) -> tuple[CodeType, CodeType, int]:
    """(program code, expr code, RLIMIT_CPU seconds); the caller's own bytes, so not parsed
    defensively."""
    head, _, body = data.partition(b"\n")
    program, expr = marshal.loads(body)
    return program, expr, int(head)


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


def encode_frame(header: bytes, body: bytes) -> bytes:
    """`header` (space-separated fields, no newline) + the body's length, a newline, the body."""
    return b"%s %d\n" % (header, len(body)) + body


def split_frames(buf: bytearray) -> list[tuple[list[bytes], bytes]]:
    """Remove the complete frames at the start of `buf`: (header fields, body) each."""
    frames, pos = [], 0
    while True:
        end = buf.find(b"\n", pos)
        if end < 0:
            break
        fields = bytes(buf[pos:end]).split(b" ")
        start = end + 1
        stop = start + int(fields[-1])
        if stop > len(buf):
            break
        frames.append((fields[:-1], bytes(buf[start:stop])))
        pos = stop
    del buf[:pos]
    return frames
