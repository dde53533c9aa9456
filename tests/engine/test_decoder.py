"""Continuous batching: refilled rows give each prompt exactly what it gets alone."""

from __future__ import annotations

import pytest
import torch

import lorapop.engine.generate as gen_mod
from lorapop.engine.byte_tokenizer import byte_tokenizer
from lorapop.engine.decoder import Decoder, prefill_chunks
from lorapop.engine.generate import generate
from lorapop.engine.kvcache import static_kv
from lorapop.engine.sampling import SamplingParams
from lorapop.lora.bank import AdapterBank
from tiny_models import tiny_model

PROMPTS = ["def f(x):", "a", "assert f(3) ==", "hello world, this is long", "xy", "q" * 30, "zz"]
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=16, eos_token_ids=())
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _setup(tok, device: str):
    model = tiny_model("qwen2", len(tok)).requires_grad_(False).to(device)
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8.0)
    with torch.no_grad():
        bank.weights.normal_(0.0, 0.3, generator=torch.Generator(device).manual_seed(5))
    return model, bank


@pytest.fixture
def spy(monkeypatch):
    """The decoders `generate` builds, to read their refill counts."""
    made: list[Decoder] = []

    class Spy(Decoder):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(gen_mod, "Decoder", Spy)
    return made


def _lengths(i: int, toks: list[int]) -> int | None:
    """Rows end at very different lengths (1..16), so rows free up mid-batch."""
    want = [3, 16, 7, 1, 12, 5, 9][i]
    return want if len(toks) >= want else None


@pytest.mark.parametrize("device", DEVICES)
def test_refilled_rows_equal_each_prompt_alone(tok, spy, device):
    model, bank = _setup(tok, device)
    slots = [0, 1, 2, 1, 0, 2, 1]
    batch = generate(
        model, bank, tok, PROMPTS, slots, SAMPLED, seed=4, batch_size=2, stop_fn=_lengths
    )
    assert spy[-1].batch == 2 and spy[-1].refills == len(PROMPTS) - 2
    for i, g in enumerate(batch):
        assert len(g.token_ids) == [3, 16, 7, 1, 12, 5, 9][i]
        assert g.finish == ("length" if i == 1 else "stop")
        alone = generate(
            model, bank, tok, [PROMPTS[i]], [slots[i]], SAMPLED, seed=4, row_keys=[i]
        )[0]
        assert g.token_ids == alone.token_ids[: len(g.token_ids)]
        torch.testing.assert_close(
            torch.tensor(g.logprobs), torch.tensor(alone.logprobs[: len(g.logprobs)]),
            atol=1e-4 if device == "cuda" else 1e-5, rtol=0,
        )  # fmt: skip


def test_row_keys_make_a_row_independent_of_its_call(tok):
    """A prompt split off into another call (another rank) samples the same with its key."""
    model, bank = _setup(tok, "cpu")
    slots = [0, 1, 2, 1, 0, 2, 1]
    whole = generate(model, bank, tok, PROMPTS, slots, SAMPLED, seed=9, batch_size=3)
    part = generate(
        model, bank, tok, PROMPTS[4:], slots[4:], SAMPLED, seed=9, row_keys=[4, 5, 6]
    )
    assert [g.token_ids for g in part] == [g.token_ids for g in whole[4:]]
    other = generate(model, bank, tok, PROMPTS[4:], slots[4:], SAMPLED, seed=9)
    assert [g.token_ids for g in other] != [g.token_ids for g in part]
    with pytest.raises(ValueError, match="row keys"):
        generate(model, bank, tok, PROMPTS[:2], [0, 0], SAMPLED, row_keys=[1])


def test_chunked_prefill_equals_one_shot(tok, spy):
    """Prompts prefilled 3 tokens per forward: same cache, same first-token logits."""
    model, bank = _setup(tok, "cpu")
    slots = [2, 0, 1, 1, 0, 2, 1]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=1, eos_token_ids=())
    whole = generate(model, bank, tok, PROMPTS, slots, greedy, prefill_tokens=4096)
    chunked = generate(model, bank, tok, PROMPTS, slots, greedy, prefill_tokens=3)
    assert [g.token_ids for g in whole] == [g.token_ids for g in chunked]
    torch.testing.assert_close(
        torch.tensor([g.logprobs for g in whole]), torch.tensor([g.logprobs for g in chunked])
    )
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    caches = []
    for budget in (4096, 3):
        dec = Decoder(model, bank, len(ids), 64, greedy, [], prefill_tokens=budget)
        with torch.no_grad(), static_kv(model, dec.kv):
            dec.prefill(ids, slots, list(range(len(ids))), torch.zeros(len(ids), 1))
        caches.append([(k.clone(), v.clone()) for k, v in zip(dec.kv.k, dec.kv.v, strict=True)])
    for (k1, v1), (k2, v2) in zip(*caches, strict=True):
        for b, p in enumerate(ids):  # positions past a prompt hold padding: not compared
            torch.testing.assert_close(k1[b, :, : len(p)], k2[b, :, : len(p)])
            torch.testing.assert_close(v1[b, :, : len(p)], v2[b, :, : len(p)])


def test_prefill_chunks_stay_within_the_budget():
    widths = [5, 40, 3, 17, 17, 1]
    for budget in (1, 4, 16, 34, 100):
        groups = prefill_chunks(widths, budget)
        assert sorted(i for g, _ in groups for i in g) == list(range(len(widths)))
        for rows, chunk in groups:
            assert len(rows) * chunk <= max(budget, chunk)
            assert chunk == min(max(widths[i] for i in rows), budget)
