"""The update's log-prob pass: length-grouped micro-batches, a chunked LM head with the same
values and gradients."""

from __future__ import annotations

import pytest
import torch

from lorapop.engine.logprobs import micro_batches, sequence_logprobs
from lorapop.lora.bank import AdapterBank
from tiny_models import tiny_model


def test_micro_batches_cover_every_row_within_the_token_budget():
    lengths = [5, 90, 12, 40, 41, 7, 300, 12, 39]
    for max_tokens in (1, 50, 100, 160, 10_000):
        groups = micro_batches(lengths, max_tokens, max_rows=3)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            assert g == sorted(g) and len(g) <= 3
            assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= max_tokens
    assert micro_batches(lengths, 10_000, 3)[0] == [1, 4, 6]  # the longest rows together
    with pytest.raises(ValueError, match=">= 1"):
        micro_batches(lengths, 0, 3)


def test_chunked_head_gives_the_same_logprobs_and_gradients():
    model = tiny_model()
    bank = AdapterBank(model, n_slots=2, rank=4, alpha=8.0)
    with torch.no_grad():
        bank.weights.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(2))
    prompts, completions = [[5, 6, 7], [8], [9, 10]], [[11, 12], [13, 14, 15, 16], [17]]
    results = []
    for chunk in (1, 4096):
        bank.zero_grad()
        lp, mask = sequence_logprobs(model, bank, prompts, completions, [1, 0, 1], chunk)
        lp[mask].sum().backward()
        results.append((lp.detach(), bank.grads.clone()))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    assert results[0][1].abs().sum() > 0
    bank.zero_grad()
