from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO.parent / "shared" / "data"
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not (DATA / "README.md").is_file():
        pytest.skip(f"benchmark data not found at {DATA} (the repo's ../shared/data)")
    return DATA


@pytest.fixture(scope="session")
def pool():
    from lorapop.evals.pool import Pool

    with Pool(workers=2) as p:
        yield p
