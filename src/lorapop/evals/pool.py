"""Sandboxes by time limit, and a round-based runner of multi-step checks.

`lorapop.verify.Sandbox` has one timeout per instance, so a limit is rounded up to a ladder
(`min_s * 2**k`, capped) and each rung gets its own (cheap) sandbox. A `Case` is a list of steps
(a job, its time limit, a judge); steps run in rounds across all cases at once and a case stops
at its first failing step, as evalplus' fast check does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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
    """Lazily created sandboxes, one per rung of the time-limit ladder."""

    def __init__(
        self, workers: int = 2, min_s: float = 4.0, cap_s: float = 60.0, memory_mb: int = 4096,
        max_output_chars: int = 2_000_000, sandbox_kwargs: dict | None = None,
    ) -> None:  # fmt: skip
        self.workers, self.min_s, self.cap_s = workers, min_s, cap_s
        self.memory_mb, self.max_output_chars = memory_mb, max_output_chars
        self.sandbox_kwargs = dict(sandbox_kwargs or {})  # e.g. a module policy, where supported
        self._boxes: dict[float, Sandbox] = {}

    def rung(self, limit_s: float) -> float:
        t = self.min_s
        while t < limit_s and t < self.cap_s:
            t *= 2
        return min(t, self.cap_s)

    def run(self, jobs: Sequence[tuple[Job, float]]) -> list[Verdict]:
        """Verdicts in order; each job runs under the rung at or above its limit."""
        out: list[Verdict | None] = [None] * len(jobs)
        by_rung: dict[float, list[int]] = {}
        for i, (_, lim) in enumerate(jobs):
            by_rung.setdefault(self.rung(lim), []).append(i)
        for r, idx in sorted(by_rung.items()):
            if r not in self._boxes:
                self._boxes[r] = Sandbox(
                    workers=self.workers, timeout_s=r, memory_mb=self.memory_mb,
                    max_output_chars=self.max_output_chars, **self.sandbox_kwargs,
                )  # fmt: skip
            for i, v in zip(idx, self._boxes[r].run([jobs[i][0] for i in idx]), strict=False):
                out[i] = v
        return [v for v in out if v is not None]

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
        for box in self._boxes.values():
            box.close()
        self._boxes.clear()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
