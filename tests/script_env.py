"""How tests run the repository's scripts: as child processes, or in the test's own process."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def script_env() -> dict[str, str]:
    """The caller's environment with src/ put first on PYTHONPATH, not replacing it: packages
    installed there (e.g. `pip install --target`) must stay importable in the child."""
    kept = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), kept] if kept else [str(SRC)])}


def run_main(main: Callable[[], object], script: Path, *args: str) -> int:
    """`python SCRIPT ARGS...` in this process: the script's `main()` under that command line,
    its exit status as the interpreter would give it (a SystemExit message goes to stderr).
    A child process would pay ~4 s for the interpreter and the torch imports, and the tests
    read the same files and output either way."""
    argv, sys.argv = sys.argv, [str(script), *args]
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = argv
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1
