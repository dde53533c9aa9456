"""The update's memory plan holds on an 80 GB card whatever the answers' lengths (GPU only):
`benchmarks/update_memory.py` runs the paper config's update over length mixes back to back
(uniform short, uniform at the cap, log-normal at several medians and sigmas, bimodal, one row
at the cap among short ones) with the allocator as lorapop sets it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from script_env import script_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_length_mix_runs_the_update_out_of_memory(tmp_path):
    out = tmp_path / "sweep.json"
    env = {k: v for k, v in script_env().items()
           if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}  # lorapop's default
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "update_memory.py"),
                    "--card-gib", "79.6", "--out", str(out)], check=True, env=env, cwd=ROOT)
    rec = json.loads(out.read_text())
    assert len(rec["mixes"]) == 7
    for mix in rec["mixes"]:
        assert not mix["oom"], mix
        assert mix["peak_above_start_gib"] <= mix["budget_gib"], mix
        # the plan's estimate of its widest micro-batch is an upper bound of what it used
        assert mix.get("peak_over_estimate", 0.0) <= 1.0, mix
