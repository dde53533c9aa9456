import os
import uuid
from pathlib import Path

import pytest

from lorapop.verify import Sandbox

ROOT = os.geteuid() == 0


@pytest.fixture(scope="session")
def sandbox():
    """One sandbox for the whole verify suite (starting fork servers costs ~0.2 s each)."""
    with Sandbox(workers=2, timeout_s=1.0, memory_mb=512, max_output_chars=20_000) as sb:
        yield sb


@pytest.fixture(scope="module")
def canaries(tmp_path_factory):
    """Root-owned files a job might try to delete or overwrite: one under /tmp, and one outside
    /tmp in a root-only directory that children can see (when running as root)."""
    paths = [tmp_path_factory.mktemp("canary") / "canary.txt"]
    if ROOT and os.access("/run", os.W_OK):
        d = Path("/run") / f"lorapop-canary-{uuid.uuid4().hex[:8]}"
        d.mkdir(mode=0o755)
        paths.append(d / "canary.txt")
    for p in paths:
        p.write_text("precious")
        p.chmod(0o644)
    yield paths
    for p in paths[1:]:
        p.unlink(missing_ok=True)
        p.parent.rmdir()
