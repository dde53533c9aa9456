"""The records that flow between a task family and the training loop.

A `Task` is a verified problem (it went through the sandbox); `Draft` is what a teacher's
text parsed into before verification; `FormatError` is what unparsable text becomes (parsing
never raises); `Validity` and `Grade` are the per-item results of the batched sandbox calls,
from which the rewards are computed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass(frozen=True)
class Task:
    """A verified task. Field meaning is per family; for the code families:

    `program` defines `f`; `inputs[i]` is the argument text of `f(<inputs[i]>)` and
    `outputs[i]` the repr of its value as the sandbox computed it (one pair for code_o and
    code_i, N pairs for code_f); `message` is code_f's hint. `teacher` and `step` say who
    wrote it and when (None for seeds); `meta` holds anything else a family wants to keep.
    """

    type: str
    program: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    message: str = ""
    teacher: str | None = None
    step: int | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def input(self) -> str:
        return self.inputs[0]

    @property
    def output(self) -> str:
        return self.outputs[0]

    @property
    def key(self) -> str:
        """Dedup key: identical program and inputs (whitespace-normalised) give the same key."""
        text = "\x00".join([self.type, _norm(self.program), *(_norm(i) for i in self.inputs)])
        return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "program": self.program,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "message": self.message,
            "teacher": self.teacher,
            "step": self.step,
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, d: Any) -> Task:
        """Inverse of `to_json`; raises ValueError with a one-line reason on a bad record."""
        if not isinstance(d, dict):
            raise ValueError(f"task record must be an object, got {type(d).__name__}")
        missing = [k for k in ("type", "program", "inputs", "outputs") if k not in d]
        if missing:
            raise ValueError(f"bad task record: missing {', '.join(missing)}")
        if not isinstance(d["inputs"], list) or not isinstance(d["outputs"], list):
            raise ValueError("bad task record: inputs and outputs must be lists")
        meta = d.get("meta") or {}
        if not isinstance(meta, dict):
            raise ValueError("bad task record: meta must be an object")
        task = cls(
            type=d["type"],
            program=d["program"],
            inputs=tuple(d["inputs"]),
            outputs=tuple(d["outputs"]),
            message=d.get("message", ""),
            teacher=d.get("teacher", d.get("proposer")),  # "proposer": buffers of older runs
            step=d.get("step"),
            meta=dict(meta),
        )
        strs = [task.type, task.program, task.message, *task.inputs, *task.outputs]
        if not all(isinstance(s, str) for s in strs):
            raise ValueError("bad task record: type, program, message, inputs, outputs are text")
        if not (task.teacher is None or isinstance(task.teacher, str)):
            raise ValueError("bad task record: teacher must be text or null")
        if not (
            task.step is None or (isinstance(task.step, int) and not isinstance(task.step, bool))
        ):
            raise ValueError("bad task record: step must be an integer or null")
        if len(task.inputs) != len(task.outputs) or not task.inputs:
            raise ValueError("bad task record: inputs and outputs must be non-empty, same length")
        return task

    def dumps(self) -> str:
        return json.dumps(self.to_json(), ensure_ascii=False)


def _norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


@dataclass(frozen=True)
class Draft:
    """A teacher's text after parsing, before the sandbox has seen it."""

    program: str
    inputs: tuple[str, ...]
    message: str = ""


@dataclass(frozen=True)
class FormatError:
    """Text that could not be parsed; `reason` says why (for logs, never for the model)."""

    reason: str


class Outcome(str, Enum):
    """A student's answer, judged. Rewards map these to numbers (rl/rewards.py)."""

    CORRECT = "correct"
    WRONG = "wrong"
    FORMAT_ERROR = "format_error"


@dataclass(frozen=True)
class Validity:
    """A proposal, judged. `task` is set iff `valid`; `format_error` tells unparsable text
    apart from parsed-but-rejected proposals; `reason` is "" when valid, else e.g.
    "format: no ```input block", "runtime_error: ZeroDivisionError: ...", "nondeterministic".
    """

    valid: bool
    reason: str = ""
    task: Task | None = None
    format_error: bool = False


@dataclass(frozen=True)
class Grade:
    """A student's answer, judged: the outcome, the parsed answer (None on format error) and
    a short detail ("match", "mismatch", "runtime_error: ...", "format: ...")."""

    outcome: Outcome
    answer: str | None = None
    detail: str = ""
