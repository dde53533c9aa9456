"""benchmarks/loop_step.py: where a profile's GPU time is filed, and what the update's token
counts count (its MFU is read from them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]


def _loop_step():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("loop_step", ROOT / "benchmarks" / "loop_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compiled_passes_are_not_filed_as_copies() -> None:
    """torch.compile's kernels name the casts they fuse (`_to_copy`), but they are the SwiGLU,
    rotary and head passes; the driver's `Memcpy` and `Memset` are copies. A profile that filed
    them the other way sent the search for waste to the wrong kernels."""
    kernels = {  # name: device microseconds, as torch.profiler's key_averages gives them
        "triton_poi_fused__to_copy_mul_silu_0": 10_000,
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<cutlass::bfloat16_t>>": 4_000,
        "nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_NNN": 50_000,
        "Memcpy DtoD (Device -> Device)": 3_000,
        "void at::native::vectorized_elementwise_kernel<8, CUDAFunctor_add<BFloat16>>": 2_000,
        "aten::mm": 0,  # an operator, no device time of its own
    }
    prof = SimpleNamespace(key_averages=lambda: [
        SimpleNamespace(key=k, device_type="DeviceType.CUDA", device_time_total=us)
        for k, us in kernels.items()])
    assert _loop_step().kernel_kinds(prof) == {
        "attention": 4.0, "gemm": 50.0, "compiled": 10.0, "copy_cast": 3.0, "other": 2.0}


def test_update_count_runs_a_shared_prompt_once_in_its_forward_tokens() -> None:
    """The MFU on forward tokens is the GPU's own rate: a student's answers to one task train as
    one sequence with the prompt once, so counting the prompt per answer overstates it."""
    counter = _loop_step().UpdateCount()
    seen = []
    fn = counter(lambda model, bank, prompts, completions, slots, **kw: seen.append(kw))
    prompts = [[1, 2, 3, 4]] * 3 + [[5, 6]]
    completions = [[7, 8], [9], [10, 11, 12], [13]]
    with torch.enable_grad():
        fn(None, None, prompts, completions, [0, 0, 1, 1], share_prompts=True)
        fn(None, None, prompts, completions, [0, 0, 0, 1], share_prompts=False)
    with torch.no_grad():  # a rollout's log-probs, not the update's: not counted
        fn(None, None, prompts, completions, [0, 0, 0, 1], share_prompts=True)
    assert len(seen) == 3  # every call still reaches the function
    rows = 4 * 3 + 2 + 2 + 1 + 3 + 1  # every row's prompt and completion
    # shared: slot 0's two rows of one prompt are one pack (4 + 2 + 1); slot 1's two rows
    # have different prompts (4 + 3, 2 + 1)
    assert counter.real == 2 * rows
    assert counter.forward == (4 + 2 + 1) + (4 + 3) + (2 + 1) + rows
    assert counter.micro_batches == 2


def test_op_table_says_which_code_ran_each_operator() -> None:
    """The kernel table names an add or a copy but not who asked for it; the op table files
    each operator under the lorapop (or transformers) code that called it, and a backward's
    operators under the autograd node that ran them."""
    from torch import profiler

    from lorapop.engine.fused import _rotate

    x = torch.randn(64, 4, 16, requires_grad=True)
    cos, sin = torch.randn(2, 64, 1, 16).unbind()
    loop_step = _loop_step()
    with loop_step.stack_profile(profiler.ProfilerActivity.CPU) as prof:
        (_rotate(x, cos, sin) * 2).sum().backward()
    table = loop_step.op_table(prof, n=100)
    assert all(set(row) == {"op", "where", "calls", "cpu_ms"} for row in table)
    assert [r["cpu_ms"] for r in table] == sorted((r["cpu_ms"] for r in table), reverse=True)
    where = {(r["op"], r["where"]) for r in table}
    assert any(op == "aten::cat" and "lorapop/engine/fused.py" in w and "_rotate" in w
               for op, w in where)
    assert ("aten::mul", "MulBackward0") in where  # the backward of `* 2`, on the autograd thread


def test_decode_roofline_counts_weights_adapters_and_cache_per_phase(monkeypatch) -> None:
    """Each phase's decode bound: the weights once a step, the adapters its rows use, every
    cached position each row reads; the fraction is the bound's share of the measured time."""
    from lorapop.engine.kvcache import kv_bytes_per_token
    from lorapop.lora.bank import AdapterBank
    from tiny_models import tiny_model

    ls = _loop_step()
    model = tiny_model()
    bank = AdapterBank(model, n_slots=4, rank=2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = [{"phase": "proposal", "rows": 2, "steps": 10, "row_steps": 15, "decode_s": 1.0,
              "kv_token_reads": 100, "slots": 2, "prefill_s": 0.5, "prefill_tokens": 40},
             {"phase": "solving", "rows": 4, "steps": 5, "row_steps": 20, "decode_s": 2.0,
              "kv_token_reads": 300, "slots": 1}]
    out = ls.decode_roofline(model, bank, calls)
    n, item = ls.flop_params(model), 4
    want = 10 * (n * item + 2 * bank.slot_numel * item) + 100 * kv_bytes_per_token(model)
    assert out["proposal"]["bytes"] == want
    assert out["proposal"]["ms_per_step"] == 100.0 and out["solving"]["ms_per_step"] == 400.0
    bound = max(want / 4.8e12, out["proposal"]["flops"] / 989e12)
    assert out["proposal"]["fraction_of_bound"] == bound / 1.0
    # prefill positions run every weight but the embeddings (the head: the last one only)
    body = n - model.get_output_embeddings().weight.numel()
    assert out["proposal"]["prefill_mfu"] == 2 * body * 40 / 0.5 / 989e12
    assert "prefill_mfu" not in out["solving"]  # no prefill time: nothing to rate
