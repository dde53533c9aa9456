"""experiments/regime/tiny_execution.py: a model trained on one table's level, scored on another's."""

import json
import subprocess
import sys
from pathlib import Path

from script_env import script_env

ROOT = Path(__file__).resolve().parents[2]


def _run(out: Path, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "regime" / "tiny_execution.py"), "--table", "natural",
         "--eval-table", "direct", "--programs", "200", "--steps", "4", "--eval", "8",
         "--workers", "1", "--out", str(out), *args],
        capture_output=True, text=True, timeout=600,
        env=script_env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


SHAPE = ("--shape", "hidden=64,layers=6,heads=4,kv_heads=2,intermediate=96")  # deeper, smaller


def test_trains_on_one_tables_level_and_scores_another_tables_level(tmp_path) -> None:
    rec = _run(tmp_path / "exec.json", *SHAPE)
    assert (rec["table"], rec["eval_table"], rec["examples"]) == ("natural", "direct", 4 * 64)
    assert (rec["shape"]["hidden"], rec["shape"]["layers"], rec["shape"]["intermediate"]) == (64, 6, 96)
    assert 0 < rec["parameters"] < 1_000_000
    # every level-1 program of the direct table is one line, so all scored tasks count there
    assert rec["greedy"]["one_line"] == rec["greedy"]["all"] and 0 <= rec["t1"]["all"] <= 1
    assert "curve" not in rec
    # a learning curve scores along the way without changing the training or its end point
    curved = _run(tmp_path / "curve.json", *SHAPE, "--eval-every", "3")
    assert [p["step"] for p in curved["curve"]] == [3, 4]
    assert [p["examples"] for p in curved["curve"]] == [3 * 64, 4 * 64]
    assert (curved["loss"], curved["final_loss"]) == (rec["loss"], rec["final_loss"])
    assert curved["curve"][-1]["greedy"] == rec["greedy"]["all"]
    assert curved["curve"][-1]["t1"] == rec["t1"]["all"]


def test_a_shape_the_size_does_not_have_is_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "regime" / "tiny_execution.py"), "--shape", "depth=3"],
        capture_output=True, text=True, timeout=120, env=script_env())
    assert proc.returncode == 2 and "--shape 'depth=3'" in proc.stderr.strip().splitlines()[-1]
