"""Puts tests/ on sys.path so every test directory can import the shared `tiny_models`, and
orders the tests for pytest-xdist (`make test`)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Modules whose tests take the longest on the 2-core machine (seconds, single process, roughly).
# Under `--dist worksteal` each worker gets a contiguous share of the collected tests, by count,
# runs it in order and, when idle, takes the last half of another's queue. Each share starts with
# its part of these modules, the heaviest first, so no worker is left alone at the end with a
# long test while the other waits; the quick tests after them are what the stealing balances.
SLOW_MODULES = {
    "selfplay/test_loop_dist.py": 40,
    "experiments/test_world_experiment.py": 35,
    "experiments/test_protocol.py": 30,
    "selfplay/test_difficulty.py": 25,
    "selfplay/test_loop.py": 25,
    "experiments/test_world_recipes.py": 24,
    "tiny/test_tiny_pretrain.py": 20,
    "experiments/test_world_levels.py": 15,
    "run/test_report.py": 14,
    "test_first_run.py": 11,
    "engine/test_generate.py": 10,
    "test_cli.py": 10,
    "engine/test_update_profile.py": 8,
    "verify/test_isolation.py": 8,
    "engine/test_deterministic_runs.py": 7,
    "experiments/test_tiny_execution.py": 6,
    "experiments/test_base_speed.py": 5,
    "engine/test_decode_step.py": 5,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    root = Path(__file__).parent
    modules: dict[str, list[pytest.Item]] = {}  # collection order, each module kept whole
    for item in items:  # (its module-scoped fixtures are then set up once per worker)
        path = item.path.relative_to(root) if item.path.is_relative_to(root) else item.path
        modules.setdefault(path.as_posix(), []).append(item)
    slow = sorted((m for m in modules if m in SLOW_MODULES), key=lambda m: -SLOW_MODULES[m])
    shares: list[list[str]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for m in slow:  # the heaviest module to the share with the least so far
        w = min(range(workers), key=lambda i: (load[i], i))
        shares[w].append(m)
        load[w] += SLOW_MODULES[m]
    quick = [it for m, its in modules.items() if m not in SLOW_MODULES for it in its]
    ordered: list[pytest.Item] = []
    left = len(items)
    for w, share in enumerate(shares):
        size = left // (workers - w)  # what xdist sends this worker first
        mine = [it for m in share for it in modules[m]]
        fill = max(0, size - len(mine))
        ordered += mine + quick[:fill]
        quick = quick[fill:]
        left -= len(mine) + fill
    ordered += quick
    assert len(ordered) == len(items)
    items[:] = ordered
