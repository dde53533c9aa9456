"""One benchmark-policy sandbox with per-job time limits, and a round-based runner of
multi-step checks.

Benchmark programs import random, hashlib, time, ... (HumanEval/39, /162), so the sandbox runs
under the `benchmark` module policy (same OS isolation as self-play, no banned modules); each
job carries its own limit (`Job.timeout_s`), so evalplus' per-test limits apply exactly. A
`Case` is a list of steps (a job, its time limit, a judge); steps run in rounds across all
cases at once and a case stops at its first failing step, as evalplus' fast check does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from lorapop.verify import Job, Sandbox, Verdict

#: judge(verdict) -> None when the step passed, else a short failure reason.
Judge = Callable[[Verdict], "str | None"]


@dataclass
class Step:
    job: Job
    limit_s: float
    judge: Judge


@dataclass
class Case:
    steps: list[Step]
    passed: bool | None = None
    reason: str | None = None
    done_steps: int = field(default=0)


class Pool:
    """A lazily started sandbox (policy "benchmark" unless `sandbox_kwargs` names another) whose
    jobs each run under their own limit, clamped to [min_s, cap_s]."""

    def __init__(
        self, workers: int = 2, min_s: float = 0.0, cap_s: float = 60.0, memory_mb: int = 4096,
        max_output_chars: int = 2_000_000, sandbox_kwargs: dict | None = None,
    ) -> None:  # fmt: skip
        if cap_s <= 0 or min_s > cap_s:
            raise ValueError("Pool needs 0 < cap_s and min_s <= cap_s")
        self.workers, self.min_s, self.cap_s = workers, min_s, cap_s
        self.memory_mb, self.max_output_chars = memory_mb, max_output_chars
        self.sandbox_kwargs = {"policy": "benchmark", **(sandbox_kwargs or {})}
        self._box: Sandbox | None = None

    def limit(self, limit_s: float) -> float:
        """The time limit a job asking for `limit_s` runs under."""
        return min(self.cap_s, max(self.min_s, limit_s))

    def run(self, jobs: Sequence[tuple[Job, float]]) -> list[Verdict]:
        """Verdicts in order; each job runs under its own (clamped) limit."""
        if not jobs:
            return []
        if self._box is None:
            self._box = Sandbox(
                workers=self.workers, timeout_s=self.cap_s, memory_mb=self.memory_mb,
                max_output_chars=self.max_output_chars, **self.sandbox_kwargs,
            )  # fmt: skip
        return self._box.run([replace(job, timeout_s=self.limit(lim)) for job, lim in jobs])

    def run_cases(self, cases: Sequence[Case]) -> None:
        """Run every case's steps in rounds until each passed all steps or failed one."""
        while True:
            live = [c for c in cases if c.passed is None]
            for c in live:
                if c.done_steps >= len(c.steps):
                    c.passed = True
            live = [c for c in live if c.passed is None]
            if not live:
                return
            steps = [c.steps[c.done_steps] for c in live]
            for c, s, v in zip(live, steps, self.run([(s.job, s.limit_s) for s in steps]), strict=False):
                c.done_steps += 1
                why = s.judge(v)
                if why is not None:
                    c.passed, c.reason = False, why

    def close(self) -> None:
        if self._box is not None:
            self._box.close()
            self._box = None

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
