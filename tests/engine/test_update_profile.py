"""benchmarks/update_profile.py's paper case, on its CPU smoke model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from script_env import run_main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from update_profile import main  # noqa: E402


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_says_when_a_slots_rows_fit_one_micro_batch(tmp_path, capsys) -> None:
    """A micro-batch holds one slot's rows, so with few rows per slot every `--max-tokens`
    gives the same micro-batches (two budgets compared that way measure nothing): the profile
    records each slot's tokens and warns for the kind of rows the budget does not shape.
    (The script under its command line, in this process: a child would add ~4 s of imports.)"""
    out = tmp_path / "profile.json"
    assert run_main(main, ROOT / "benchmarks" / "update_profile.py", "--smoke", "--tasks", "2",
                    "--teachers", "2", "--student-prompt", "12", "--teacher-prompt", "30",
                    "--completion", "16", "--max-tokens", "60", "--out", str(out)) == 0  # fmt: skip
    stderr = capsys.readouterr().err
    # 4 student and 4 teacher slots: one pack of 12 + 4 x 16 tokens, one row of 30 + 16
    paper = json.loads(out.read_text())["paper"]
    assert paper["slot_tokens"] == {"student": 76, "teacher": 46}
    # the profiled micro-batches' operators, each filed under the code that ran it
    profiled = [r for r in paper["runs"] if "kernels" in r]
    assert profiled and all(any("lorapop/lora/" in op["where"] for op in r["ops"])
                            for r in profiled)
    warning = next(line for line in stderr.splitlines() if line.startswith("warning:"))
    assert "teacher rows fit one micro-batch of --max-tokens 60" in warning
    assert "student" not in warning


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_default_only_times_the_loops_own_mode(tmp_path) -> None:
    """`--default-only`: the student and teacher rows in the loop's default mode alone (auto
    memory plan, prompts shared, bank held), and the update predicted from those two."""
    out = tmp_path / "profile.json"
    assert run_main(main, ROOT / "benchmarks" / "update_profile.py", "--smoke", "--tasks", "2",
                    "--teachers", "2", "--student-prompt", "12", "--teacher-prompt", "30",
                    "--completion", "16", "--default-only", "--out", str(out)) == 0  # fmt: skip
    paper = json.loads(out.read_text())["paper"]
    assert [(r["rows"], r["share"], r["mode"], r["held_copy"]) for r in paper["runs"]] == [
        ("student", True, "auto", True), ("teacher", False, "auto", True)]
    assert list(paper["paper_step"]["predicted_update_s"]) == ["auto_shared (default)"]
