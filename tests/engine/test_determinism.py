"""Deterministic kernels: strict when the probe passes, warnings when an op has none, and the
caller's settings back afterwards."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils import deterministic

from lorapop.engine.determinism import deterministic_algorithms, deterministic_kernels


def _settings() -> tuple[bool, bool, bool]:
    return (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            deterministic.fill_uninitialized_memory)  # fmt: skip


def test_strict_when_the_probe_passes_and_the_settings_come_back() -> None:
    before = _settings()
    probed = []
    with deterministic_kernels(lambda: probed.append(_settings())) as op:
        assert op is None and _settings() == probed[0] == (True, False, False)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"]  # (a value the user set is kept)
    assert _settings() == before
    torch.use_deterministic_algorithms(True, warn_only=True)  # a caller's own setting
    try:
        with deterministic_algorithms():
            assert _settings()[:2] == (True, False)
        assert _settings()[:2] == (True, True)
    finally:
        torch.use_deterministic_algorithms(False)


def test_an_op_without_a_deterministic_kernel_makes_the_work_warn_not_fail() -> None:
    """Flash attention's backward is deterministic only in strict mode, so work runs strict;
    an op the probe finds without a deterministic kernel turns it to warnings (the op is
    yielded, for the record), and errors of other kinds still end the work."""

    def missing() -> None:
        raise RuntimeError("foo_cuda does not have a deterministic implementation, but you set ...")

    with deterministic_kernels(missing) as op:
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert op.startswith("foo_cuda") and not torch.are_deterministic_algorithms_enabled()

    def broken() -> None:
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="out of memory"), deterministic_kernels(broken):
        pass
    assert not torch.are_deterministic_algorithms_enabled()
