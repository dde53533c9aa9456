"""Decode batches sized to a memory budget: never above it, one clear error when nothing fits;
the update keeps its activations only when they fit."""

from __future__ import annotations

import logging

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
