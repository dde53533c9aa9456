"""experiments/regime/tiny_execution.py: a model trained on one table's level, scored on another's."""

import json
from pathlib import Path

from script_env import run_main
from tiny_execution import main

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "regime" / "tiny_execution.py"


def _run(out: Path, *args: str) -> dict:
    code = run_main(main, SCRIPT, "--table", "natural", "--eval-table", "direct", "--programs",
                    "200", "--steps", "4", "--eval", "8", "--workers", "1", "--out", str(out),
                    *args)  # fmt: skip
    assert code == 0
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


def test_a_shape_the_size_does_not_have_is_one_line(capsys) -> None:
    assert run_main(main, SCRIPT, "--shape", "depth=3") == 2
    assert "--shape 'depth=3'" in capsys.readouterr().err.strip().splitlines()[-1]
