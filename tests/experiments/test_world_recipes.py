"""experiments/regime/world_recipes.py: several recipes built at once and measured, one JSON."""

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from safetensors.torch import load_file

from script_env import run_main

ROOT = Path(__file__).resolve().parents[2]


def _driver(capsys, *args: str) -> subprocess.CompletedProcess:
    """The driver in this process (its builds and measurements are still child processes)."""
    from world_recipes import main

    capsys.readouterr()
    code = run_main(lambda: main(list(args)), ROOT / "experiments" / "regime" / "world_recipes.py")
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def test_smoke_builds_and_measures_every_variant_on_one_shared_corpus(tmp_path, capsys) -> None:
    out, ret = tmp_path / "r", tmp_path / "ret"
    proc = _driver(capsys, "--smoke", "--out", str(out), "--workers", "2", "--pack", str(ret), "world",
                   "world-refs,max_refs=1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((out / "world_recipes.json").read_text())
    assert res["smoke"] and res["machine"]["device"] == "cpu" and "world_recipes.py" in res["command"]
    assert list(res["corpora"]) == ["world_30_s0"]  # both on the world table: made once
    assert res["corpora"]["world_30_s0"]["programs"] == 150
    for label in ("world", "world-refs,max_refs=1"):
        v = res["variants"][label]
        assert v["status"] == "done", v.get("log_tail")
        assert v["training"]["levels"] == "world" and v["training"]["max_refs"] == 1
        assert v["training"]["corpus_programs"] == 150 and v["training"]["token_budget"]
        assert set(v["checks"]) >= {"valid_at_least_0.8_every_type", "solves_0.3_to_0.7_of_levels_1_3"}
        assert set(v["valid_rate_by_level"]["code_o"]) == {"1", "2", "3", "4", "5"}
        m = json.loads(Path(v["tiny_world"]).read_text())
        assert m["settings"]["level_table"] == "world" and m["settings"]["references"] == 1
    assert res["variants"]["world-refs,max_refs=1"]["training"]["variant_share"] == 0.5
    # each built model came back packed: parts that join into the model dir, weights in bf16
    parts = res["variants"]["world"]["packed"]
    assert parts and all(n.startswith("world_bf16.tgz.part") for n in parts)
    blob = b"".join((ret / n).read_bytes() for n in parts)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
        tf.extractall(tmp_path / "back", filter="data")
    back, orig = tmp_path / "back" / "world", out / "world"
    measured = {"tiny_world.json"}  # written after packing
    assert {f.name for f in back.iterdir()} == {f.name for f in orig.iterdir()} - measured
    w, w0 = load_file(back / "model.safetensors"), load_file(orig / "model.safetensors")
    assert w.keys() == w0.keys() and all(str(t.dtype) == "torch.bfloat16" for t in w.values())
    assert all((w[k].float() - w0[k]).abs().max() <= w0[k].abs().max() / 64 for k in w)


def test_a_deadline_stops_the_builds_and_still_writes_the_json(tmp_path, capsys) -> None:
    proc = _driver(capsys, "--smoke", "--out", str(tmp_path), "--workers", "1", "--deadline", "0.5", "world")
    assert proc.returncode == 1
    v = json.loads((tmp_path / "world_recipes.json").read_text())["variants"]["world"]
    assert v["status"] == "build timeout"


def test_a_bad_variant_is_a_one_line_error(tmp_path, capsys) -> None:
    from world_recipes import main  # in this process: any other exception fails the test

    for spec in ("huge", "world,stepz=3", "world,steps", "world,levels=moon", "world,size={'x': 1}"):
        with pytest.raises(SystemExit) as stop:
            main(["--out", str(tmp_path), spec])
        assert stop.value.code == 2
        assert spec in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_variant_may_override_a_field_with_a_dict_of_several_items() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from world_recipes import parse_variant

    levels = {"teacher": {1: 1, 2: 1}, "student": {1: 6, 2: 4, 3: 2}}
    size, ov = parse_variant(f"world-natural,steps=2600,token_levels={levels!r},levels='natural'")
    assert size == "world-natural"
    assert ov == {"steps": 2600, "token_levels": levels, "levels": "natural"}
