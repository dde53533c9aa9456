"""Parametrises the lora tests over the tiny Qwen2 and Llama models."""

from __future__ import annotations

import pytest
from lora_fixtures import ARCHS


@pytest.fixture(params=sorted(ARCHS))
def arch(request) -> str:
    return request.param
