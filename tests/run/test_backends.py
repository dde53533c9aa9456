"""TensorBoard and W&B get the same numbers from a metrics row, and the config as hparams."""

import sys
import time

import pytest

from lorapop.run.backends import TensorBoardLog, WandbLog, flat_config, flat_metrics

ROW = {
    "step": 3,
    "members": {
        "T0": {"slot": 0, "role": "teacher", "individual": "T0.g1", "valid_rate": 0.5,
               "mu": 24.0, "grad_norm": None},
        "S0": {"slot": 1, "role": "student", "individual": "S0.g0", "solve_rate": 0.25},
        "S1": {"slot": 2, "role": "student", "solve_rate": 0.75},
    },
    "matchups": [{"teacher": "T0", "student": "S0", "answers": 4, "solve_rate": 0.25}],
    "programs": {"code_o": {"ast_depth": 4.0, "coverage": 7}},
    "phase_s": {"proposal": 1.5},
    "tokens_per_s": 120.0,
    "generation": {"proposal": {"prefill_s": 0.25, "capture_s": 0.5, "decode_s": 0.75, "steps": 12}},
    "replacements": [{"target": "T0"}],
}
CONFIG = {"seed": 0, "lora": {"rank": 8, "target_modules": ["q_proj"]}, "tasks": {"seed_tasks": None}}


def test_flat_metrics_numbers_only():
    flat = flat_metrics(ROW)
    assert flat["member/T0/valid_rate"] == 0.5
    assert flat["role/student/solve_rate"] == 0.5
    assert flat["programs/code_o/coverage"] == 7.0
    assert flat["matchup/T0-S0/solve_rate"] == 0.25
    assert flat["phase/proposal"] == 1.5 and flat["replacements"] == 1.0
    assert flat["generation/proposal/capture_s"] == 0.5 and flat["generation/proposal/steps"] == 12
    assert not any(k.endswith(("/slot", "/role", "/individual", "/grad_norm")) for k in flat)


def test_flat_config():
    assert flat_config(CONFIG) == {"seed": 0, "lora.rank": 8,
                                   "lora.target_modules": '["q_proj"]', "tasks.seed_tasks": "null"}


def test_tensorboard_scalars_and_hparams(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = TensorBoardLog(tmp_path, CONFIG)
    log(ROW)
    log.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert {"member/T0/valid_rate", "programs/code_o/ast_depth", "phase/proposal"} <= scalars
    assert not any(t.endswith(("/slot", "/role")) for t in scalars)
    assert acc.Scalars("member/S0/solve_rate")[0].step == 3
    plugin = acc.PluginTagToContent("hparams")
    session = plugin["_hparams_/session_start_info"]
    assert b"lora.rank" in session and b"q_proj" in session
    assert b"role/student/solve_rate" in plugin["_hparams_/experiment"]


def test_tensorboard_missing_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(RuntimeError, match="pip install 'lorapop\\[tensorboard\\]'"):
        TensorBoardLog(str(tmp_path))


def test_wandb_offline(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = WandbLog(tmp_path, CONFIG, "lorapop-test")
    log(ROW)
    log(ROW | {"step": 4, "tokens_per_s": 80.0})
    assert log.run.config["lora"]["rank"] == 8
    run_id = log.run.id
    log.close()
    assert (tmp_path / "wandb_id").read_text() == run_id
    files = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert files
    for _ in range(300):  # wandb's service process writes the file after finish() returns
        if b"member/S0/solve_rate" in files[0].read_bytes():
            break
        time.sleep(0.1)
    assert b"member/S0/solve_rate" in files[0].read_bytes()
    # a resumed run logs into the same W&B run
    again = WandbLog(tmp_path, CONFIG, "lorapop-test")
    assert again.run.id == run_id
    again.close()


def test_wandb_missing_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(RuntimeError, match="pip install 'lorapop\\[wandb\\]'"):
        WandbLog(tmp_path, CONFIG, "x")


def test_flat_metrics_tags_the_fixed_solvers_solve_rate():
    row = {**ROW, "difficulty": {"solver": "base", "tasks": 3, "answers": 6, "solve_rate": 0.25,
                                 "by_teacher": {"T0": 0.5, "T1": None},
                                 "by_type": {"code_o": 0.25}}}
    flat = flat_metrics(row)
    assert flat["difficulty/solve_rate"] == 0.25 and flat["difficulty/T0/solve_rate"] == 0.5
    assert flat["difficulty/code_o/solve_rate"] == 0.25 and "difficulty/T1/solve_rate" not in flat
    assert not any(k.startswith("difficulty") for k in flat_metrics(ROW))
