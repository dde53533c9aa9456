"""The update's packing: rows into length-grouped micro-batches and packs, packs shared out
by cost (the policy step itself is tested through the loop, tests/selfplay/test_loop.py)."""

import pytest
import torch

from lorapop.engine.logprobs import pack_widths, shared_prompt_packs
from lorapop.selfplay.update import (
    attention_pair_weight,
    micro_batches,
    pack_costs,
    pack_micro_batches,
    split_packs,
)
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
    slots = [0, 1, 0, 1, 0, 1, 0, 1, 0]  # with slots: the longest of each slot together
    assert micro_batches(lengths, 10_000, 3, slots) == [[4, 6, 8], [0, 2], [1, 3, 7], [5]]
    with pytest.raises(ValueError, match=">= 1"):
        micro_batches(lengths, 0, 3)


def test_pack_micro_batches_keep_packs_whole_and_apart_from_lone_rows():
    prompts = [[1] * 10, [1] * 10, [2] * 30, [1] * 10, [3] * 5, [3] * 5]
    completions = [[0] * 4, [0] * 6, [0] * 8, [0] * 2, [0] * 3, [0] * 3]
    packs = shared_prompt_packs(prompts, [0] * 6)
    widths = pack_widths(packs, prompts, completions)
    assert packs == [[0, 1, 3], [2], [4, 5]] and widths == [22, 38, 11]
    for max_tokens in (1, 30, 60, 1000):
        batches = pack_micro_batches(packs, widths, max_tokens, max_rows=4)
        groups = [rows for rows, _ in batches]
        assert sorted(i for g in groups for i in g) == list(range(6))
        for g in groups:
            assert 2 not in g or g == [2]  # the lone row never shares a forward with a pack
            for pack in packs:
                assert set(pack) <= set(g) or not set(pack) & set(g)
    # padded tokens: two packs (widest 22) in one forward, the lone row alone
    assert pack_micro_batches(packs, widths, 1000, 4) == [([0, 1, 3, 4, 5], 44), ([2], 38)]
    # rows' slots: packs of different slots go apart
    assert pack_micro_batches(packs, widths, 1000, 4, [0, 0, 1, 0, 1, 1]) == [
        ([0, 1, 3], 22), ([4, 5], 11), ([2], 38)]


def test_split_packs_cut_wide_packs_into_parts_within_the_limit():
    """A pack wider than the limit goes in consecutive parts that each fit with their own
    copy of the prompt; narrower packs and a lone row wider than the limit stay whole."""
    prompts = [[1] * 10] * 4 + [[2] * 30, [3] * 5, [3] * 5]
    completions = [[0] * 4, [0] * 6, [0] * 8, [0] * 2, [0] * 8, [0] * 3, [0] * 3]
    packs = shared_prompt_packs(prompts, [0] * 7)
    assert packs == [[0, 1, 2, 3], [4], [5, 6]]
    assert split_packs(packs, prompts, completions, 1000) == packs
    parts = split_packs(packs, prompts, completions, 20)
    assert parts == [[0, 1], [2, 3], [4], [5, 6]]
    assert [w for w, g in zip(pack_widths(parts, prompts, completions), parts, strict=True)
            if len(g) > 1] == [20, 20, 11]  # every part of several rows within the limit
    assert split_packs(packs, prompts, completions, 1) == [[i] for i in range(7)]


def test_pack_costs_count_tokens_and_every_attended_pair():
    """A pack's cost is its tokens plus the (query, key) pairs its attention computes: the
    prompt causally, each completion over the prompt and its own prefix, never another's."""
    prompts = [[1] * 7, [1] * 7, [2] * 20]
    completions = [[0] * 3, [0] * 5, [0] * 4]
    packs = shared_prompt_packs(prompts, [0] * 3)
    assert pack_costs(packs, prompts, completions, 0.0) == pack_widths(packs, prompts, completions)

    def pairs(prompt: int, lengths: list[int]) -> int:  # brute force over the pack's positions
        owner = [None] * prompt + [k for k, n in enumerate(lengths) for _ in range(n)]
        return sum(1 for q in range(len(owner)) for k in range(q + 1)
                   if owner[k] is None or owner[k] == owner[q])

    expected = [pairs(7, [3, 5]), pairs(20, [4])]
    costs = pack_costs(packs, prompts, completions, 0.5)
    assert costs == [w + 0.5 * n for w, n in
                     zip(pack_widths(packs, prompts, completions), expected, strict=True)]
    # a long-context row costs more than the same tokens spread over short rows
    assert pack_costs([[0]], [[1] * 90], [[0] * 10], 0.5)[0] > \
        2 * pack_costs([[0]], [[1] * 40], [[0] * 10], 0.5)[0]


def test_attention_pair_weight_is_attention_flops_over_weight_flops():
    model = tiny_model()
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    assert attention_pair_weight(model) == pytest.approx(
        2 * cfg.num_hidden_layers * cfg.hidden_size / params)
    assert attention_pair_weight(torch.nn.Linear(3, 3)) == 0.0  # no config: tokens alone
