import pytest

from lorapop.verify import Sandbox


@pytest.fixture(scope="session")
def sandbox():
    """One sandbox for the whole verify suite (starting fork servers costs ~0.2 s each)."""
    with Sandbox(workers=2, timeout_s=1.0, memory_mb=512, max_output_chars=20_000) as sb:
        yield sb
