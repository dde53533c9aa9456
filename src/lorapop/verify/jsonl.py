"""Batch verification of teacher proposals from JSON lines (the `lorapop verify` command).

Each line is `{"program": str, "input": str}`; the job is `f(<input>)`, checked as a teacher
proposal: static checks, then a run under two hash seeds. The input must be an argument list
of one call of `f` ("1), (2" would smuggle in a second expression), checked on the AST.
Every size is capped before anything is parsed: a line before JSON, the input before Python.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Iterator
from typing import BinaryIO

from lorapop.verify.sandbox import Sandbox
from lorapop.verify.static import MAX_SOURCE_CHARS, parse
from lorapop.verify.verdict import Job, Status, Verdict

BAD_REQUEST = "bad_request"
#: A longer line is refused unread (JSON escapes take up to 6 bytes per source character).
MAX_LINE_BYTES = 6 * MAX_SOURCE_CHARS + 1024


def _reply(status: str, error: str | None) -> dict[str, object]:
    return {"status": status, "output": None, "error": error, "duration": 0.0}


def parse_task(line: bytes | str) -> Job | dict[str, object]:
    """A line -> the Job to run, or the reply for a line that cannot be one."""
    if len(line) > MAX_LINE_BYTES:
        return _reply(BAD_REQUEST, f"line longer than {MAX_LINE_BYTES} bytes")
    try:
        task = json.loads(line)
    except (ValueError, RecursionError) as e:
        return _reply(BAD_REQUEST, f"not JSON: {str(e)[:200]}")
    if not isinstance(task, dict):
        return _reply(BAD_REQUEST, "a task must be a JSON object")
    program, arg = task.get("program"), task.get("input")
    if not isinstance(program, str) or not isinstance(arg, str):
        return _reply(BAD_REQUEST, 'a task needs string fields "program" and "input"')
    if len(program) + len(arg) > MAX_SOURCE_CHARS:
        return _reply(
            Status.SYNTAX_ERROR.value, f"source longer than {MAX_SOURCE_CHARS} characters"
        )
    expr = f"f({arg})"
    try:
        tree = parse(expr, "eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return _reply(Status.SYNTAX_ERROR.value, f"input: {type(e).__name__}: {e}"[:300])
    call = tree.body
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "f"):
        return _reply(Status.SYNTAX_ERROR.value, "input is not an argument list of f(...)")
    return Job(program, expr, entry="f", deterministic=True)


def read_lines(stream: BinaryIO, limit: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """The lines of `stream`, each read up to `limit` + 1 bytes: the rest of a longer line is
    skipped unkept (and the line, one byte too long, is refused by `parse_task`)."""
    while line := stream.readline(limit + 1):
        if len(line) > limit and not line.endswith(b"\n"):
            while (rest := stream.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
        yield line


def verify_lines(
    lines: Iterable[bytes | str], sandbox: Sandbox, chunk: int = 256
) -> Iterator[dict[str, object]]:
    """One reply per line, in order, so the n-th output line answers the n-th input line (a
    blank line gets a `bad_request` reply); runs `chunk` tasks per sandbox call."""
    batch: list[Job | dict[str, object]] = []

    def flush() -> Iterator[dict[str, object]]:
        jobs = [t for t in batch if isinstance(t, Job)]
        verdicts: Iterator[Verdict] = iter(sandbox.run(jobs))
        for t in batch:
            yield next(verdicts).to_json() if isinstance(t, Job) else t
        batch.clear()

    for line in lines:
        batch.append(_reply(BAD_REQUEST, "blank line") if not line.strip() else parse_task(line))
        if len(batch) >= chunk:
            yield from flush()
    yield from flush()
