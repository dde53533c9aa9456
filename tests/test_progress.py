"""The live display's summary line and the TensorBoard scalars of a metrics row."""

import sys
import types

import pytest

from lorapop.progress import TensorBoardLog, summary

ROW = {
    "step": 3,
    "members": {
        "T0": {"valid_rate": 0.5, "mu": 24.0, "role": "teacher"},
        "S0": {"solve_rate": 0.25, "mu": 26.0, "role": "student"},
    },
    "programs": {"code_o": {"ast_depth": 4.0, "coverage": 7}},
    "phase_s": {"proposal": 1.5},
    "tokens_per_s": 120.0,
}


def test_summary_line():
    assert summary(ROW) == "valid 0.50  solve 0.25  120 tok/s"


def test_tensorboard_scalars(monkeypatch, tmp_path):
    written = []

    class Writer:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            pass

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    log = TensorBoardLog(str(tmp_path))
    log(ROW)
    log.close()
    assert ("member/T0/valid_rate", 0.5, 3) in written
    assert ("programs/code_o/ast_depth", 4.0, 3) in written
    assert ("phase/proposal", 1.5, 3) in written
    assert not any(tag.endswith("/role") for tag, _, _ in written)


def test_tensorboard_missing_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(RuntimeError, match="pip install 'lorapop\\[tensorboard\\]'"):
        TensorBoardLog(str(tmp_path))
