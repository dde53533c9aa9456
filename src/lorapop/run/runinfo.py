"""What ran, where and for how long: RUN_DIR/run.json, shown at the top of the report.

Each `lorapop train` session (the first and every `--resume`) appends its command, lorapop
version and commit, machine, the update's kernels (`train.deterministic`) and start time, and
moves its end time on after every step, so a killed run still reports the wall time it used.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lorapop

FILE = "run.json"


def git_commit(path: Path = Path(lorapop.__file__).parent) -> str | None:
    """The commit of the source tree lorapop runs from (`+dirty` with local changes), or None
    for an installed package."""
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(path), *args], capture_output=True,
                                  text=True, timeout=10, check=True).stdout.strip()

        commit = git("rev-parse", "HEAD")
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no")
                         else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "host": socket.gethostname(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def read(run_dir: str | Path) -> list[dict[str, Any]]:
    """The sessions recorded in RUN_DIR/run.json (none for runs from before it existed)."""
    path = Path(run_dir) / FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return data.get("sessions", []) if isinstance(data, dict) else []


def wall_seconds(sessions: list[dict[str, Any]]) -> float:
    return sum(s.get("end_unix", 0) - s.get("start_unix", 0) for s in sessions)


class RunInfo:
    """Records this session in RUN_DIR/run.json; call it with each metrics row."""

    def __init__(self, run_dir: str | Path, command: str, first_step: int,
                 facts: dict[str, Any] | None = None) -> None:
        """`facts`: more of what ran, e.g. the update's kernels (`SelfPlay.kernels`)."""
        self.path = Path(run_dir) / FILE
        self.sessions = read(run_dir)
        t = time.time()
        self.session = {
            "command": command, "lorapop": lorapop.__version__, "commit": git_commit(),
            "machine": machine(), **(facts or {}), "start": _now(), "start_unix": t,
            "end": _now(), "end_unix": t, "first_step": first_step + 1, "last_step": first_step,
        }
        self.sessions.append(self.session)
        self._write()

    def __call__(self, row: dict[str, Any]) -> None:
        self.session.update(end=_now(), end_unix=time.time(), last_step=row["step"])
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"sessions": self.sessions}, indent=1))
        os.replace(tmp, self.path)
