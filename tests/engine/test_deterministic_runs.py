"""benchmarks/deterministic_runs.py: three runs of one seed, their rows and adapters compared,
and where runs that do not repeat part."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from lorapop.selfplay.records import without_timings
from script_env import run_main

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["tasks.types=[code_o, code_i]", "tasks.references=1", "tasks.proposals_per_type=2",
         "sampling.teacher_max_new_tokens=48", "sampling.student_max_new_tokens=8", "seed=1"]


def _module():
    spec = importlib.util.spec_from_file_location(
        "deterministic_runs", ROOT / "benchmarks" / "deterministic_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bare(rows: list[dict]) -> list[dict]:
    return [without_timings(r) for r in rows]


def test_three_cpu_runs_repeat_and_are_compared_without_their_timings(tmp_path, monkeypatch) -> None:
    """The script as its command line runs it; its three `lorapop train` children run in this
    process, through the command line's own entry point (each a fresh process would cost ~5 s of
    interpreter and imports; on CPU a process gives the runs nothing else to differ by)."""
    from lorapop.cli import app

    m = _module()
    children = []

    def child(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        assert cmd[:4] == [sys.executable, "-m", "lorapop", "train"]
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT / "src")
        children.append(cmd[cmd.index("--out") + 1])
        with pytest.raises(SystemExit) as done:
            app(cmd[3:], prog_name="lorapop")
        return subprocess.CompletedProcess(cmd, done.value.code)

    monkeypatch.setattr(m, "subprocess", types.SimpleNamespace(run=child))
    out = tmp_path / "res.json"
    assert run_main(m.main, ROOT / "benchmarks" / "deterministic_runs.py", "--config",
                    str(ROOT / "configs" / "tiny.yaml"), "--steps", "2", "--runs",
                    str(tmp_path / "runs"), "--out", str(out), *SMALL) == 0  # fmt: skip
    assert children == [str(tmp_path / "runs" / n) for n in
                        ("deterministic_a", "deterministic_b", "default")]  # fmt: skip
    res = json.loads(out.read_text())
    assert res["steps"] == {"deterministic_a": 2, "deterministic_b": 2, "default": 2}
    assert res["deterministic_repeat"] and res["adapters_equal"]
    assert res["deterministic_first_difference"] is None
    assert res["default_parts_at_step"] is None  # CPU kernels are deterministic anyway
    assert res["kernels"]["deterministic_a"] == {"deterministic_kernels": True,
                                                 "no_deterministic_kernel": None}  # fmt: skip
    assert res["kernels"]["default"]["deterministic_kernels"] is False
    assert res["times"]["default"]["update_s"] > 0


def test_runs_that_part_are_found_at_their_first_different_step(tmp_path) -> None:
    m = _module()
    rows = [{"step": s, "members": {"A0": {"loss": 0.5}}, "phase_s": {"update": 1.0}}
            for s in (1, 2, 3)]  # fmt: skip
    timed = [{**r, "phase_s": {"update": 9.0}, "tokens_per_s": 1.0} for r in rows]
    assert m.first_difference(_bare(rows), _bare(timed)) is None
    parted = [rows[0], {**rows[1], "members": {"A0": {"loss": 0.6}}}, rows[2]]
    assert m.first_difference(_bare(rows), _bare(parted)) == 2
    assert m.first_difference(rows, rows[:2]) == 3  # one run stopped early
    (tmp_path / "checkpoints").mkdir()
    assert m.adapter_digests(tmp_path) == {}  # no checkpoint: nothing to compare
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "deterministic_runs.py"),
                           "--steps", "1", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "--steps must be >= 2" in proc.stderr
