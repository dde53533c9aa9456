"""Live terminal display of a run (rich), and optional TensorBoard scalars, fed one metrics row
per step."""

from __future__ import annotations

from statistics import fmean
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def summary(row: dict[str, Any]) -> str:
    """One line: valid-proposal rate, student solve rate, throughput."""
    members = row["members"].values()
    valid = [m["valid_rate"] for m in members if m.get("valid_rate") is not None]
    solve = [m["solve_rate"] for m in members if m.get("solve_rate") is not None]
    v = f"{fmean(valid):.2f}" if valid else "-"
    s = f"{fmean(solve):.2f}" if solve else "-"
    return f"valid {v}  solve {s}  {row['tokens_per_s']:.0f} tok/s"


class RunDisplay:
    """Progress bar with ETA and the latest step's summary; a no-op when disabled."""

    def __init__(self, total: int, done: int = 0, enabled: bool = True,
                 console: Console | None = None) -> None:
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
            console=console, disable=not enabled,
        )
        self.task = self.progress.add_task("train", total=total, completed=done, info="")

    def __enter__(self) -> RunDisplay:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def update(self, row: dict[str, Any]) -> None:
        self.progress.update(self.task, completed=row["step"], info=summary(row))


class TensorBoardLog:
    """Scalars of each metrics row under member/<name>/<key>, programs/<type>/<key>, phase/."""

    def __init__(self, log_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise RuntimeError(
                "run.tensorboard needs the tensorboard package: pip install 'lorapop[tensorboard]'"
            ) from e
        self.writer = SummaryWriter(log_dir)

    def __call__(self, row: dict[str, Any]) -> None:
        step = row["step"]
        for name, m in row["members"].items():
            for k, v in m.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.writer.add_scalar(f"member/{name}/{k}", v, step)
        for t, m in row["programs"].items():
            for k, v in m.items():
                if isinstance(v, (int, float)):
                    self.writer.add_scalar(f"programs/{t}/{k}", v, step)
        for k, v in row["phase_s"].items():
            self.writer.add_scalar(f"phase/{k}", v, step)
        self.writer.add_scalar("tokens_per_s", row["tokens_per_s"], step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
