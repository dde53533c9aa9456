"""Every change lorapop makes to a Hugging Face model, applied from here and nowhere else.

A forward of the base model is `model(...)`, but these patches decide what it runs. Each one
computes what it replaces (to float rounding, in float32 where it rounds once instead of
several times), and each has a test that compares it with the original:

| patch (applied by)                 | what it replaces                             | active in            | reference test                                                        |
|------------------------------------|----------------------------------------------|----------------------|-----------------------------------------------------------------------|
| fused RMSNorm (`patch_base_model`) | each Llama-style RMSNorm's forward: one      | every forward        | tests/engine/test_fused.py::test_norm_weight_in_the_kernel_gives_the_same_logits_and_gradients |
|                                    | `F.rms_norm` kernel, weight inside           |                      |                                                                       |
| fused SwiGLU (`patch_base_model`)  | each SwiGLU MLP's forward: silu(gate) * up   | training forwards;   | tests/engine/test_fused.py::test_fused_mlps_give_the_same_logits_and_gradients |
|                                    | as one autograd function (`fused._SwiGLU`);  | inference on CUDA    | tests/lora/test_decode_cache.py::test_the_swiglu_epilogue_adds_the_gate_and_up_terms_once, |
|                                    | at inference with a bank, the gate/up LoRA   |                      | ::test_the_swiglu_kernel_equals_the_expand_and_the_swiglu_pass (GPU)  |
|                                    | terms' expand computes it (`AdapterBank.     |                      |                                                                       |
|                                    | fused_swiglu`), skipping their two hooks     |                      |                                                                       |
| fused rotary (`patch_base_model`)  | `apply_rotary_pos_emb` inside transformers'  | training forwards;   | tests/engine/test_fused.py::test_fused_rotary_gives_the_same_logits_and_gradients |
|                                    | modeling module, for the whole process       | inference on CUDA    |                                                                       |
|                                    | (`fused._Rotary`; other calls: the original) |                      |                                                                       |
| merged projections                 | q/k/v and gate/up: weights become row blocks | decode steps (one    | tests/engine/test_merged.py::test_merged_model_gives_the_same_logits_and_gradients |
| (`patch_base_model`)               | of one tensor; one GEMM per group            | token a row, no grad)|                                                                       |
| packed attention                   | the attention function (`pack_attention`):   | the update's         | tests/engine/test_pack_attention.py::test_pack_attention_equals_the_dense_mask_with_gradients |
| (`use_pack_attention`)             | prompt-shared packs attend piecewise; other  | forwards             |                                                                       |
|                                    | forwards run transformers' SDPA              |                      |                                                                       |
| static KV cache (`static_kv`)      | the attention function (`kvcache`): keys and | generation (prefill  | tests/engine/test_kvcache.py::test_chunked_prefill_equals_causal_attention, |
|                                    | values in a preallocated cache, per-row      | and decode steps)    | tests/engine/test_generate.py::test_logprobs_equal_teacher_forced_forward, |
|                                    | positions; decode attention over each row's  |                      | tests/engine/test_decode_attention.py (the Triton kernel against its   |
|                                    | own positions (`decode_attention`)           |                      | SDPA reference, per call and in whole generations; GPU)               |
| LoRA hooks (`attach_lora`)         | nothing: a forward hook on each target       | every forward        | tests/lora/test_peft_io.py::test_mixed_batch_rows_equal_peft_with_that_adapter |
|                                    | Linear adds its row's slot's B @ A @ x       |                      |                                                                       |

Where a decode step happens and what it computes: `engine/decoder.py`, at its top.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from lorapop.engine import kvcache, pack_attention
from lorapop.engine.fused import fuse_mlps, fuse_rms_norms, fuse_rotary
from lorapop.engine.merged import merge_projections, reserve_lora_rows
from lorapop.lora.bank import AdapterBank


def patch_base_model(model: nn.Module) -> dict[str, int]:
    """The load-time patches of a placed, frozen base model (call after `model.to(device)`):
    fused norms, SwiGLU and rotary, merged projections. Returns how many modules each
    changed (0 for an architecture outside the listed families: it runs as Hugging Face's)."""
    return {"rms_norms": fuse_rms_norms(model), "mlps": fuse_mlps(model),
            "rotary_attentions": fuse_rotary(model), "merged_groups": merge_projections(model)}


def use_pack_attention(model: Any) -> None:
    """Route the model's attention through `pack_attention` (idempotent). Left installed: a
    checkpointed forward replays its attention during the backward, after the call that laid
    it out; forwards without a pack layout run transformers' SDPA path."""
    if model.config._attn_implementation != pack_attention.NAME:
        model.set_attn_implementation(pack_attention.NAME)


@contextmanager
def static_kv(model: Any, kv: kvcache.StaticKV) -> Iterator[None]:
    """Route the model's attention through the static KV cache `kv` inside the block; the
    attention implementation it had is restored on exit."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(kvcache.NAME)
    kvcache.activate(kv)
    try:
        yield
    finally:
        kvcache.activate(None)
        model.set_attn_implementation(previous)


def attach_lora(model: nn.Module, n_slots: int, **kwargs: Any) -> AdapterBank:
    """N LoRA slots on `model` (`lora.bank.AdapterBank`, keywords as its): a forward hook on
    each target projection adds the LoRA delta of each row's slot; the frozen projections'
    weights get rows for the decode cache's A (`merged.reserve_lora_rows`), so a decode
    step's GEMMs also give the LoRA shrink."""
    bank = AdapterBank(model, n_slots, **kwargs)
    reserve_lora_rows(model, bank)
    return bank
