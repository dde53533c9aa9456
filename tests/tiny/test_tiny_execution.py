"""benchmarks/tiny_execution.py: a model trained on one table's level, scored on another's."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_trains_on_one_tables_level_and_scores_another_tables_level(tmp_path) -> None:
    out = tmp_path / "exec.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tiny_execution.py"), "--table", "natural",
         "--eval-table", "direct", "--programs", "200", "--steps", "3", "--eval", "8",
         "--workers", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert (rec["table"], rec["eval_table"], rec["examples"]) == ("natural", "direct", 3 * 64)
    # every level-1 program of the direct table is one line, so all scored tasks count there
    assert rec["greedy"]["one_line"] == rec["greedy"]["all"] and 0 <= rec["t1"]["all"] <= 1
