"""benchmarks/decode_step.py on its CPU smoke model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lorapop.engine import fused, merged
from lorapop.lora import bank as bank_mod
from lorapop.lora import decode_kernel
from script_env import run_main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from decode_step import main  # noqa: E402


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_records_each_case_with_and_without_the_fused_passes(tmp_path) -> None:
    """Each ROWS:CONTEXT case is a decoder whose rows sit at CONTEXT cached positions, its step
    replayed and profiled, once with the fused inference passes and once without, and once
    with the LoRA shrinks outside the GEMMs; the switches are back on afterwards (the
    process's later generations keep them)."""
    out = tmp_path / "decode.json"
    assert run_main(main, ROOT / "benchmarks" / "decode_step.py", "--smoke", "--cases",
                    "4:32,2:100", "--reps", "3", "--profile", "--and-unfused",
                    "--and-shrink-kernel", "--out", str(out)) == 0  # fmt: skip
    cases = json.loads(out.read_text())["cases"]
    assert [(c["rows"], c["context"], c["fused_inference"], c["shrink_in_gemm"])
            for c in cases] == [(4, 32, True, True), (4, 32, False, True), (4, 32, True, False),
                                (2, 100, True, True), (2, 100, False, True), (2, 100, True, False)]
    for c in cases:
        assert c["ms_per_step"] > 0 and c["kernels_per_step"] > 0
        assert sum(c["kernel_ms_per_step"].values()) > 0 and c["top_kernels"]
        assert c["bound_ms"] is None  # no roofline without a known GPU
    assert fused.INFERENCE and merged.LORA_ROWS


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_records_one_admissions_prefill_at_each_shape(tmp_path) -> None:
    """`--prefill ROWS:LENGTH,...`: one admission's prompts fed as the decoder feeds them,
    timed and profiled, with the positions it fed (no MFU without a known GPU); with
    `--and-other-prefills` again as GEMM pairs and with each slot's factors cast, the
    switches back on after."""
    out = tmp_path / "prefill.json"
    assert run_main(main, ROOT / "benchmarks" / "decode_step.py", "--smoke", "--cases", "",
                    "--prefill", "2:24,3:16", "--reps", "3", "--profile", "--and-other-prefills",
                    "--out", str(out)) == 0  # fmt: skip
    prefills = json.loads(out.read_text())["prefills"]
    paths = ["kernels", "runs", "cast"]
    assert [(p["prefill_rows"], p["length"], p["path"]) for p in prefills] == [
        (2, 24, path) for path in paths] + [(3, 16, path) for path in paths]
    for p in prefills:
        assert p["tokens"] == 48 and p["ms"] > 0 and p["kernels"] > 0 and "mfu" not in p
    # the smoke model is bf16 over an fp32 bank: cast factors are kernels the cache saves
    assert prefills[1]["kernels"] < prefills[2]["kernels"]
    assert bank_mod.PREFILL_FROM_CACHE and decode_kernel.ENABLED
