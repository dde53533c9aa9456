from collections.abc import Iterator

import pytest

from lorapop.verify import Sandbox


@pytest.fixture(scope="session")
def tiny_sandbox() -> Iterator[Sandbox]:
    with Sandbox(workers=2, timeout_s=2.0) as sb:
        yield sb
