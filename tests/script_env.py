"""The environment in which tests run the repository's scripts as child processes."""

from __future__ import annotations

import os
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def script_env() -> dict[str, str]:
    """The caller's environment with src/ put first on PYTHONPATH, not replacing it: packages
    installed there (e.g. `pip install --target`) must stay importable in the child."""
    kept = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), kept] if kept else [str(SRC)])}
