"""Decode batches sized to a memory budget: never above it, one clear error when nothing fits;
the update keeps its activations only when they fit."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import lorapop.engine.generate as gen_mod
import lorapop.engine.memory as memory
from lorapop.engine.byte_tokenizer import byte_tokenizer
from lorapop.engine.decoder import Decoder
from lorapop.engine.generate import GenerateSpec, generate
from lorapop.engine.memory import (
    GenerationMemoryError,
    fit_batch,
    plan_update,
    prefill_bytes,
    row_bytes,
    update_bytes_per_token,
    update_fixed_bytes,
)
from lorapop.engine.sampling import SamplingParams
from tiny_models import tiny_model

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8, eos_token_ids=())


def _allocated(dec: Decoder) -> int:
    """Bytes of every tensor the decoder holds for its rows."""
    tensors = [t for t in vars(dec).values() if isinstance(t, torch.Tensor)]
    return dec.kv.nbytes + sum(t.numel() * t.element_size() for t in tensors)


def test_batch_never_exceeds_the_budget():
    model = tiny_model()
    length, steps, chunk = 96, 32, 64
    fixed, per_row = prefill_bytes(model, length, chunk), row_bytes(model, length, steps)
    for budget in range(fixed + per_row, fixed + 40 * per_row, per_row // 3):
        batch = fit_batch(model, 1000, length, steps, chunk, budget)
        assert fixed + batch * per_row <= budget < fixed + (batch + 1) * per_row
        params = SamplingParams(max_new_tokens=steps)
        assert _allocated(Decoder(model, None, batch, length, params, [])) <= budget - fixed
    assert fit_batch(model, 3, length, steps, chunk, 10**12) == 3  # never above the request
    assert fit_batch(model, 3, length, steps, chunk, None) == 3  # no budget: as asked


def test_lowered_batch_is_logged_once(caplog):
    model = tiny_model()
    budget = prefill_bytes(model, 64, 32) + 5 * row_bytes(model, 64, 8)
    with caplog.at_level(logging.WARNING, logger="lorapop.engine.memory"):
        for _ in range(3):
            assert fit_batch(model, 64, 64, 8, 32, budget) == 5
    assert len(caplog.records) == 1 and "lowered from 64 to 5" in caplog.text


def test_generate_uses_the_budget_and_fails_before_any_work(monkeypatch):
    tok = byte_tokenizer()
    model = tiny_model("qwen2", len(tok))
    prompts = ["abc", "hello", "x" * 20, "yz", "q"] * 3
    sizes = []

    class Spy(Decoder):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            sizes.append(self.batch)

    monkeypatch.setattr(gen_mod, "Decoder", Spy)
    length = 64  # 20 + 8 - 1 tokens, rounded up to 64
    budget = prefill_bytes(model, length, 128) + 4 * row_bytes(model, length, 8)
    small = generate(model, None, tok, prompts, [0] * 15,
                     GenerateSpec(params=PARAMS, seed=1, prefill_tokens=128, memory_budget=budget))  # fmt: skip
    assert sizes == [4]
    full = generate(model, None, tok, prompts, [0] * 15,
                    GenerateSpec(params=PARAMS, seed=1, prefill_tokens=128))
    assert [g.token_ids for g in small] == [g.token_ids for g in full]
    with pytest.raises(GenerationMemoryError, match="one sampling row needs .* GiB"):
        generate(model, None, tok, prompts, [0] * 15,
                 GenerateSpec(params=PARAMS, memory_budget=budget // 8))
    assert len(sizes) == 2  # no decoder was built: no cache, no forward


def test_update_keeps_activations_of_what_fits_the_budget(caplog, monkeypatch):
    monkeypatch.setattr(memory, "_logged", set())
    model = tiny_model()
    per_token, fixed = update_bytes_per_token(model), update_fixed_bytes(model, 64)
    # layers x (10 hidden + 4 intermediate + 2 kv_heads x head_dim) x fp32
    assert per_token == 2 * (10 * 32 + 4 * 48 + 2 * 2 * 8) * 4
    with caplog.at_level(logging.INFO, logger="lorapop.engine.memory"):
        for budget in range(fixed, fixed + 300 * per_token, per_token // 2 + 1):
            keep, tokens = plan_update(model, 100, 250, 64, budget)
            fit = (budget - fixed) // per_token
            if fit >= 100:  # a micro-batch sized to the budget (capped) holds the longest row
                assert keep == fit and tokens == min(250, fit)
                assert fixed + tokens * per_token <= budget
            else:
                assert keep == 0 and tokens == 250
        for _ in range(3):
            assert plan_update(model, 100, 250, 64, None) == (0, 250)  # no limit: as today
        # a sequence longer than what fits: micro-batches of what fits keep their activations,
        # the long one (alone) checkpoints; too little room for that: all checkpoint
        budget = fixed + 3000 * per_token
        assert plan_update(model, 9000, 16384, 64, budget) == (3000, 3000)
        budget = fixed + (memory.MIN_KEEP_TOKENS - 1) * per_token
        assert plan_update(model, 9000, 16384, 64, budget) == (0, 16384)
    assert caplog.text.count("without activation checkpointing") == 1  # each choice once
    assert caplog.text.count(" with activation checkpointing, micro-batches of <= 250") == 2
    assert caplog.text.count("partly with activation checkpointing, micro-batches of <= 3000") == 1
    assert "(no memory limit, longest sequence 100)" in caplog.text


def test_the_fused_passes_keep_fewer_activations_per_token(monkeypatch):
    """The fused SwiGLU keeps no act (3 intermediate widths, not 4); with the fused rotary too
    (and the norms' one kernel) a token keeps 8 hidden widths a layer, not the eager 10, so
    the plan fits more tokens where the model runs them."""
    model = tiny_model()  # layers x (hidden + intermediate + 2 kv_heads x head_dim) x fp32
    for swiglu, rotary, hidden, inter in [(False, False, 10, 4), (False, True, 10, 4),
                                          (True, False, 10, 3), (True, True, 8, 3)]:
        monkeypatch.setattr(memory, "mlps_fused", lambda m, v=swiglu: v)
        monkeypatch.setattr(memory, "rotary_fused", lambda m, v=rotary: v)
        assert update_bytes_per_token(model) == 2 * (hidden * 32 + inter * 48 + 32) * 4


def _saved_bytes_per_token(dropout: float) -> tuple[float, int]:
    """Bytes autograd keeps a token through a training forward of the loop's patched model
    with LoRA attached, and the estimate's bytes a token."""
    from lorapop.engine.patches import attach_lora, patch_base_model
    from tiny_models import VOCAB

    model = tiny_model()
    patch_base_model(model)
    bank = attach_lora(model, 2, rank=4, dropout=dropout)
    model.train()
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    with bank.route([0, 1]), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(ids)
    return sum(storages.values()) / ids.numel(), update_bytes_per_token(model)


def test_lora_dropout_is_counted_with_what_it_keeps():
    """LoRA dropout keeps every target's dropped input (and its mask) for the backward: the
    estimate grows by at least what autograd then keeps, so a user's `lora.dropout` does not
    run the update out of memory."""
    kept, estimate = _saved_bytes_per_token(0.0)
    kept_dropout, estimate_dropout = _saved_bytes_per_token(0.1)
    assert kept_dropout > kept
    assert estimate_dropout - estimate >= kept_dropout - kept


def test_a_compiled_head_reserves_its_logits_and_their_gradient_alone():
    """The compiled LM-head passes keep their float32 work inside fused kernels, so the plan
    reserves the [positions, vocabulary] logits and gradient in the model's dtype, a quarter
    of the eager passes' bytes in bf16, and fits more tokens of activations in one budget."""
    model = tiny_model().to(torch.bfloat16)
    vocab = model.config.vocab_size
    eager, compiled = update_fixed_bytes(model, 64), update_fixed_bytes(model, 64, True)
    assert eager == 64 * vocab * (2 * 2 + 3 * 4) and compiled == 64 * vocab * 2 * 2
    per_token = update_bytes_per_token(model)
    budget = eager + 500 * per_token
    keep, _ = plan_update(model, 100, 10**6, 64, budget)
    keep_compiled, _ = plan_update(model, 100, 10**6, 64, budget, compiled_head=True)
    assert keep == 500 and keep_compiled == 500 + (eager - compiled) // per_token


def _mix(rng, kind: str, cap: int) -> int:
    if kind == "uniform":
        return cap
    if kind == "bimodal":
        return cap if rng.random() < 0.3 else rng.randint(1, 100)
    return max(1, min(cap, round(rng.lognormvariate(5.5, 1.2))))


@pytest.mark.parametrize("kind", ["uniform", "bimodal", "lognormal"])
def test_every_micro_batch_of_any_length_mix_fits_the_plan(kind, monkeypatch):
    """Whatever the lengths, the update's plan holds: each micro-batch that keeps its
    activations fits the budget (fixed head bytes + padded tokens x bytes per token); a wider
    one is one row alone (checkpointed, nothing smaller exists); every row is trained once."""
    import random

    from lorapop.engine.logprobs import pack_widths, shared_prompt_packs
    from lorapop.selfplay.update import pack_micro_batches, split_packs

    monkeypatch.setattr(memory, "_logged", set())
    model = tiny_model()
    per_token, fixed = update_bytes_per_token(model), update_fixed_bytes(model, 64)
    overhead = memory.pack_overhead(model)  # what a shared pack's attention keeps, counted
    rng = random.Random(kind)
    for trial in range(40):
        cap = rng.choice([64, 512, 2048])
        prompts, comps, slots = [], [], []
        for task in range(rng.randint(1, 30)):
            prompt = [task + 1] * rng.randint(1, 700)
            for _ in range(rng.choice([1, 4])):
                prompts.append(prompt)
                comps.append([7] * _mix(rng, kind, cap))
                slots.append(task % 3)
        packs = shared_prompt_packs(prompts, slots)
        widths = pack_widths(packs, prompts, comps, overhead)
        budget = fixed + rng.randint(10, 6000) * per_token
        keep, max_tokens = plan_update(model, max(widths), 16384, 64, budget)
        if keep:
            packs = split_packs(packs, prompts, comps, keep, overhead)
        seen = []
        for rows, padded in pack_micro_batches(packs, pack_widths(packs, prompts, comps, overhead),
                                               max_tokens, 8, slots):
            seen += rows
            if keep and padded <= keep:
                assert fixed + padded * per_token <= budget, (trial, padded, keep)
            elif keep:  # too wide to keep: one row, alone
                assert len(rows) == 1, (trial, rows, padded, keep)
            else:  # everything checkpoints: micro-batches of the configured size
                assert padded <= max_tokens or len({id(prompts[i]) for i in rows}) == 1
        assert sorted(seen) == list(range(len(comps)))


def test_the_allocator_gets_expandable_segments_unless_the_user_chose(monkeypatch):
    """A mix of micro-batch widths fragments the default allocator's fixed segments into an
    OOM with GiBs free; lorapop sets expandable segments itself before CUDA starts, and keeps
    a setting the user made."""
    for key in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert memory.configure_allocator() == "expandable_segments:True"
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert memory.configure_allocator() == "expandable_segments:False"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:native")
    assert memory.configure_allocator() == "backend:native"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_the_update_plans_for_more_of_the_free_memory_only_under_expandable_segments(
        monkeypatch):
    """Expandable segments keep freed memory usable at any size, so the update's plan takes
    `UPDATE_MARGIN` of the free memory; under an allocator the user set otherwise it keeps
    generation's 0.9 (fragmentation unknown)."""
    monkeypatch.setattr(memory, "free_memory", lambda model, margin=0.9: margin)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    for conf, margin in [("expandable_segments:True", memory.UPDATE_MARGIN),
                         ("backend:native,expandable_segments: true", memory.UPDATE_MARGIN),
                         ("expandable_segments:False", 0.9), ("backend:native", 0.9)]:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
        assert memory.update_budget(None) == margin, conf
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert memory.update_budget(None) == 0.9
    settings = []  # set by lorapop after CUDA started: through the allocator's setter
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append,
                        raising=False)
    assert memory.configure_allocator() == "expandable_segments:True" and settings
    assert memory.update_budget(None) == memory.UPDATE_MARGIN
    assert 0.9 < memory.UPDATE_MARGIN < 1
    assert memory.update_budget(None, 0.7) == 0.7  # `train.memory_share`: the user's choice


def test_a_shared_pack_is_planned_with_what_its_attention_keeps():
    """A shared pack's attention keeps padded queries and gathered keys beyond its tokens: the
    plan counts them (a lone row keeps none), and a pack is split to parts that fit so counted."""
    from lorapop.engine.logprobs import pack_widths
    from lorapop.selfplay.update import split_packs

    model = tiny_model()
    overhead = memory.pack_overhead(model)
    assert 0 < overhead[1] < overhead[0] < 1
    prompts, comps = [[1] * 100] * 4 + [[2] * 50], [[3] * 200] * 4 + [[4] * 10]
    packs = [[0, 1, 2, 3], [4]]
    plain, counted = pack_widths(packs, prompts, comps), pack_widths(packs, prompts, comps, overhead)
    assert plain == [900, 60] and counted[1] == 60
    assert counted[0] == 900 + math.ceil(overhead[0] * 800 + overhead[1] * 4 * 100)
    parts = split_packs(packs, prompts, comps, 900, overhead)
    assert parts[:-1] != [[0, 1, 2, 3]] and sum(map(len, parts)) == 5
    assert all(w <= 900 for w in pack_widths(parts[:-1], prompts, comps, overhead))
