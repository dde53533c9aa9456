"""The verdict vocabulary shared by the sandbox, the task families and the CLI."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

#: The longest time limit a job, a Sandbox or `lorapop verify` accepts (one day).
MAX_TIMEOUT_S = 86_400.0


def check_timeout(seconds: object, what: str = "timeout_s") -> float:
    """`seconds` as a float in (0, MAX_TIMEOUT_S], else ValueError with a one-line reason."""
    ok = isinstance(seconds, int | float) and not isinstance(seconds, bool)
    if not ok or not 0 < seconds <= MAX_TIMEOUT_S:  # also false for nan
        raise ValueError(
            f"{what} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], not {seconds!r}"
        )
    return float(seconds)


class Status(str, Enum):
    """Why a program was accepted or rejected. A `str` enum so it serialises as its value."""

    OK = "ok"
    SYNTAX_ERROR = "syntax_error"
    NO_ENTRY = "no_entry"
    BANNED = "banned"
    RUNTIME_ERROR = "runtime_error"
    TIMEOUT = "timeout"
    MEMORY = "memory"
    NONDETERMINISTIC = "nondeterministic"
    OUTPUT_TOO_LARGE = "output_too_large"
    UNPICKLABLE = "unpicklable"
    CRASHED = "crashed"


@dataclass(frozen=True)
class Job:
    """One evaluation: exec `program` in a fresh namespace, then evaluate `expr` there.

    timeout_s: this job's wall-clock limit (RLIMIT_CPU follows it), overriding the Sandbox's
    `timeout_s`; None keeps the Sandbox's.
    """

    program: str
    expr: str
    entry: str | None = "f"
    deterministic: bool = False
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.timeout_s is not None:
            check_timeout(self.timeout_s, "Job.timeout_s")


@dataclass(frozen=True)
class Verdict:
    """The outcome of a job; `output` is the full repr of the value of `expr` when ok."""

    status: Status
    output: str | None
    error: str | None
    duration: float

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def to_json(self) -> dict[str, object]:
        return {
            "status": self.status.value,
            "output": self.output,
            "error": self.error,
            "duration": round(self.duration, 6),
        }
