"""Deterministic GPU kernels, so that training repeats bit for bit from its seed on the same
kind of GPU and number of ranks.

Without them the GPU's atomics (flash attention's backward, the backward of a gather or an
index, among them) sum in whatever order threads finish: two 2-rank H100 builds of the
world-nocount-77m base ended at losses 0.410 and 0.403. Strict mode, since flash
attention's backward runs its deterministic kernel only then; a probe (one forward and backward
of the kernels to be made deterministic) first finds whether some op has none, and then the
work goes on warning instead. On CPU the update runs in this mode too, always (`loop`'s
`_update_kernels`): a multi-threaded CPU backward of an index with repeated entries adds with
atomics unless it is on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch


def fix_cublas_workspace() -> None:
    """cuBLAS is deterministic only with a fixed workspace, whose size the process reads when
    it first uses cuBLAS: call this before any CUDA work. It stays set (it only sizes a
    buffer)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@contextlib.contextmanager
def deterministic_algorithms(warn_only: bool = False) -> Iterator[None]:
    """torch's deterministic algorithms inside the block (uninitialised memory not filled:
    nothing reads it); the caller's settings come back afterwards."""
    from torch.utils import deterministic

    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              deterministic.fill_uninitialized_memory)  # fmt: skip
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        deterministic.fill_uninitialized_memory = before[2]


def missing_kernel(probe: Callable[[], None]) -> str | None:
    """Run `probe` in strict mode: the first line of the error of an op it calls that has no
    deterministic kernel, or None when all have one. Other errors propagate."""
    with deterministic_algorithms():
        try:
            probe()
        except RuntimeError as e:
            if "deterministic" not in str(e):
                raise
            return str(e).strip().splitlines()[0]
    return None


@contextlib.contextmanager
def deterministic_kernels(probe: Callable[[], None]) -> Iterator[str | None]:
    """Deterministic kernels inside the block: strict when `probe` finds every op it calls has
    one, warning otherwise; yields that op's error (None when strict)."""
    fix_cublas_workspace()
    missing = missing_kernel(probe)
    with deterministic_algorithms(warn_only=missing is not None):
        yield missing
