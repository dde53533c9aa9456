"""Puts experiments/regime on sys.path: its scripts import their sibling modules
(`regime_recipes`, `regime_measure`) as they do when run from that directory."""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorapop.verify import Sandbox

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "regime"))


@pytest.fixture(scope="session")
def tiny_sandbox() -> Iterator[Sandbox]:
    with Sandbox(workers=2, timeout_s=2.0) as sb:
        yield sb
