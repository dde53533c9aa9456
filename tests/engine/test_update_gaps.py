"""benchmarks/update_gaps.py: how a profiled pass's idle time is found and tallied."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from script_env import run_main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from update_gaps import gap_table, idle_gaps, main  # noqa: E402


def test_idle_time_is_what_no_kernel_covers() -> None:
    """Kernels overlap across streams (and one may sit inside another): busy time is their
    union, and a gap is time no kernel covers, not the space after each kernel."""
    kernels = [(0, 10), (2, 5), (5, 30), (40, 50), (45, 48), (1050, 1060), (1060, 1065)]
    busy, gaps = idle_gaps(kernels)
    assert busy == 30 + 10 + 15
    assert gaps == [(1000, 50), (10, 30)]  # longest first, (length, start)
    assert gap_table(gaps) == {"<20us": 0.01, "20-100us": 0.0, "0.1-1ms": 0.0, ">1ms": 1.0}
    assert idle_gaps([]) == (0.0, [])


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_smoke_run_writes_its_report(tmp_path) -> None:
    """The script under its command line, in this process (a child would add ~4 s of imports)."""
    out = tmp_path / "gaps.json"
    assert run_main(main, ROOT / "benchmarks" / "update_gaps.py", "--smoke", "--tasks", "2",
                    "--teachers", "2", "--student-prompt", "12", "--teacher-prompt", "30",
                    "--completion", "16", "--out", str(out)) == 0  # fmt: skip
    report = json.loads(out.read_text())
    # on a CPU nothing can synchronise; on a GPU only the pass's set-up does (the benchmark's
    # inputs and `group_token_counts`, once per update), never the micro-batch loop
    syncs = {site.split(":")[0] for site, _ in report["student_pass_syncs"]}
    assert syncs <= ({"update_profile.py", "loss.py"} if torch.cuda.is_available() else set())
    for name in ("teacher", "student"):
        assert report[name]["micro_batches"] >= 1 and report[name]["unprofiled_s"] > 0
