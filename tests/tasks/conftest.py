from collections.abc import Iterator

import pytest

from lorapop.verify import Sandbox


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    with Sandbox(workers=2, timeout_s=2.0) as sb:
        yield sb
