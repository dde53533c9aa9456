"""Progress of a run, fed one metrics row per step.

On a terminal: a rich progress bar with the latest step's summary. Anywhere else (`nohup`, a
batch scheduler's log file): one plain line per step, flushed, so the log shows the run as it
goes. Both show an ETA from the measured seconds per step.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from datetime import timedelta
from statistics import fmean
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

PHASE_NAMES = {"matchmaking": "match", "proposal": "propose", "verification": "verify",
               "solving": "solve", "update": "update", "replacement": "replace"}


def summary(row: dict[str, Any]) -> str:
    """One line: valid-proposal rate, student solve rate, throughput."""
    members = row["members"].values()
    valid = [m["valid_rate"] for m in members if m.get("valid_rate") is not None]
    solve = [m["solve_rate"] for m in members if m.get("solve_rate") is not None]
    v = f"{fmean(valid):.2f}" if valid else "-"
    s = f"{fmean(solve):.2f}" if solve else "-"
    return f"valid {v}  solve {s}  {row['tokens_per_s']:.0f} tok/s"


def duration(seconds: float | None) -> str:
    """`1:02:03` (hours may exceed 24), or `-` when unknown."""
    if seconds is None:
        return "-"
    return str(timedelta(seconds=round(seconds)))


class Eta:
    """Seconds left from the mean duration of the last `window` steps of this session (the
    first counts from the start, so one step is enough for an estimate)."""

    def __init__(self, total: int, done: int = 0, window: int = 20,
                 clock: Any = time.monotonic) -> None:
        self.total, self.done, self.clock = total, done, clock
        self.times: deque[float] = deque([clock()], maxlen=window + 1)

    def update(self, step: int) -> float | None:
        self.done = step
        self.times.append(self.clock())
        return self.remaining()

    def per_step(self) -> float | None:
        n = len(self.times) - 1
        return (self.times[-1] - self.times[0]) / n if n else None

    def remaining(self) -> float | None:
        rate = self.per_step()
        return None if rate is None else rate * max(0, self.total - self.done)


def plain_line(row: dict[str, Any], total: int, eta: Eta) -> str:
    """The batch-log line of a step: step, phase times, rates, throughput, speed and ETA."""
    phases = " ".join(f"{PHASE_NAMES.get(k, k)} {v:.1f}s" for k, v in row["phase_s"].items())
    per_step = eta.per_step()
    speed = f"{per_step:.1f} s/step" if per_step is not None else "- s/step"
    return (f"step {row['step']}/{total} | {phases} | {summary(row)} | {speed} "
            f"ETA {duration(eta.remaining())}")


class RunDisplay:
    """A progress bar on a terminal, plain lines elsewhere; nothing when disabled."""

    def __init__(self, total: int, done: int = 0, enabled: bool = True,
                 console: Console | None = None, stream: IO[str] | None = None) -> None:
        self.total = total
        self.enabled = enabled
        self.console = console or Console()
        self.stream = stream or sys.stdout
        self.live = enabled and self.console.is_terminal
        self.eta = Eta(total, done)
        self.progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("ETA {task.fields[eta]}"), TextColumn("{task.fields[info]}"),
            console=self.console, disable=not self.live,
        )
        self.task = self.progress.add_task("train", total=total, completed=done, info="",
                                           eta="-")

    def __enter__(self) -> RunDisplay:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def update(self, row: dict[str, Any]) -> None:
        left = self.eta.update(row["step"])
        if self.live:
            self.progress.update(self.task, completed=row["step"], info=summary(row),
                                 eta=duration(left))
        elif self.enabled:
            print(plain_line(row, self.total, self.eta), file=self.stream, flush=True)
