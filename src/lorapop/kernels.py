"""Triton kernels built on first use, with the caller's torch path in their place where they
cannot run: Triton not installed (CPU builds of torch: `built` gives None), or a kernel that
fails to compile or launch (an older GPU, a Triton without a feature it needs: `failed`
warns once, and the caller keeps the returned line as its module's `failure` and takes its
torch path from then on). Used by `engine.decode_attention`, `engine.sampling_kernel` and
`lora.decode_kernel`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def built(build: Callable[[], T]) -> Callable[[], T | None]:
    """A function giving `build()`'s kernels, built on its first call and kept, or None
    where Triton is not installed."""

    @functools.cache
    def kernels() -> T | None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
        except ImportError:
            return None
        return build()

    return kernels


def failed(error: Exception, what: str, instead: str, stacklevel: int = 2) -> str:
    """Warn that `what` is unavailable because of `error` and that `instead` runs; returns
    the error's first line (the caller's `failure`). `stacklevel` as for the caller's own
    `warnings.warn`."""
    lines = str(error).strip().splitlines() or [""]
    failure = f"{type(error).__name__}: {lines[0]}"
    warnings.warn(f"{what} unavailable ({failure[:200]}); {instead}", stacklevel=stacklevel + 1)
    return failure
