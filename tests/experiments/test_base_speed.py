"""experiments/regime/base_speed.py: a recipe's training speed per model shape, and `reshape`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lorapop.tiny.pretrain import ModelSize, reshape
from script_env import script_env

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "regime" / "base_speed.py"), "--size", "world-nocount",
         "--n-per-level", "10", "--steps", "1", "--device", "cpu", "--workers", "1", *args],
        capture_output=True, text=True, timeout=600,
        env=script_env())  # fmt: skip


def test_reshape_changes_the_named_fields_and_names_a_bad_one() -> None:
    assert reshape(ModelSize(), "hidden=96,layers=6") == ModelSize(hidden=96, layers=6)
    assert reshape(ModelSize(), "") == ModelSize()
    with pytest.raises(ValueError, match="'depth=3'"):
        reshape(ModelSize(), "depth=3")
    with pytest.raises(ValueError, match="'wide' is not an integer"):
        reshape(ModelSize(), "hidden=wide")


def test_each_shape_gets_its_parameters_speed_and_the_recipes_training_time(tmp_path) -> None:
    out = tmp_path / "speed.json"
    shape = "hidden=32,layers=1,heads=2,kv_heads=1,intermediate=64"
    proc = _run("--shape", shape, "--shape", shape.replace("layers=1", "layers=2"),
                "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    one, two = rec["shapes"]
    assert (one["status"], two["model"]["layers"]) == ("ok", 2)
    assert 0 < one["parameters"] < two["parameters"]
    assert one["recipe_train_s"] == pytest.approx(rec["recipe_steps"] * one["step_ms"] / 1000, rel=0.01)


def test_a_bad_shape_is_a_one_line_error_before_any_work() -> None:
    proc = _run("--shape", "depth=3")
    assert proc.returncode == 2 and "--shape 'depth=3'" in proc.stderr.strip().splitlines()[-1]
