"""Triton kernels built once where Triton is installed, None where it is not; a failure warns
once with its first line."""

from __future__ import annotations

import sys
import types

import pytest

from lorapop.kernels import built, failed


def test_kernels_are_built_once_where_triton_imports(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setitem(sys.modules, "triton.language", types.ModuleType("triton.language"))
    calls = []
    kernels = built(lambda: calls.append(1) or ("shrink", "expand"))
    assert kernels() == ("shrink", "expand") and kernels() == ("shrink", "expand")
    assert calls == [1]


def test_no_kernels_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import raises ImportError
    kernels = built(lambda: pytest.fail("built without Triton"))
    assert kernels() is None


def test_a_failure_warns_with_its_first_line():
    with pytest.warns(UserWarning, match=r"^the kernel unavailable \(RuntimeError: no PTX\); "
                                         r"using torch$"):
        line = failed(RuntimeError("no PTX\nthe compiler's log"), "the kernel", "using torch")
    assert line == "RuntimeError: no PTX"
