"""experiments/regime/base_speed.py: a recipe's training speed per model shape, and `reshape`."""

import json
from pathlib import Path

import pytest

from base_speed import main
from lorapop.tiny.pretrain import ModelSize, reshape
from script_env import run_main

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "regime" / "base_speed.py"


def _run(*args: str) -> int:
    return run_main(main, SCRIPT, "--size", "world-nocount", "--n-per-level", "10", "--steps", "1",
                    "--device", "cpu", "--workers", "1", *args)  # fmt: skip


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
    assert _run("--shape", shape, "--shape", shape.replace("layers=1", "layers=2"),
                "--out", str(out)) == 0
    rec = json.loads(out.read_text())
    one, two = rec["shapes"]
    assert (one["status"], two["model"]["layers"]) == ("ok", 2)
    assert 0 < one["parameters"] < two["parameters"]
    assert one["recipe_train_s"] == pytest.approx(rec["recipe_steps"] * one["step_ms"] / 1000, rel=0.01)


def test_a_bad_shape_is_a_one_line_error_before_any_work(tmp_path, capsys) -> None:
    assert _run("--shape", "depth=3", "--out", str(tmp_path / "x.json")) == 2
    assert "--shape 'depth=3'" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "x.json").exists()
