"""Continuous batching: refilled rows give each prompt exactly what it gets alone."""

from __future__ import annotations

import pytest
import torch

import lorapop.engine.generate as gen_mod
from lorapop.engine.byte_tokenizer import byte_tokenizer
from lorapop.engine.decoder import Decoder, admit_at, prefill_chunks
from lorapop.engine.generate import GenerateSpec, generate
from lorapop.engine.patches import static_kv
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


def _spy(monkeypatch, **opts) -> list[Decoder]:
    made: list[Decoder] = []

    class Spy(Decoder):
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, **opts})
            made.append(self)

    monkeypatch.setattr(gen_mod, "Decoder", Spy)
    return made


@pytest.fixture
def spy(monkeypatch):
    """The decoders `generate` builds, to read their refill and sharing counts."""
    return _spy(monkeypatch)


@pytest.fixture
def narrow(monkeypatch):
    """Decoders whose decode width grows in steps of 4 cache positions."""
    return _spy(monkeypatch, width_step=4)


def _lengths(i: int, toks: list[int]) -> int | None:
    """Rows end at very different lengths (1..16), so rows free up mid-batch."""
    want = [3, 16, 7, 1, 12, 5, 9][i]
    return want if len(toks) >= want else None


@pytest.mark.parametrize("device", DEVICES)
def test_refilled_rows_equal_each_prompt_alone(tok, spy, device):
    model, bank = _setup(tok, device)
    slots = [0, 1, 2, 1, 0, 2, 1]
    batch = generate(model, bank, tok, PROMPTS, slots,
                     GenerateSpec(params=SAMPLED, seed=4, batch_size=2), stop_fn=_lengths)
    assert spy[-1].batch == 2 and spy[-1].refills == len(PROMPTS) - 2
    for i, g in enumerate(batch):
        assert len(g.token_ids) == [3, 16, 7, 1, 12, 5, 9][i]
        assert g.finish == ("length" if i == 1 else "stop")
        alone = generate(model, bank, tok, [PROMPTS[i]], [slots[i]],
                         GenerateSpec(params=SAMPLED, seed=4), row_keys=[i])[0]
        assert g.token_ids == alone.token_ids[: len(g.token_ids)]
        torch.testing.assert_close(
            torch.tensor(g.logprobs), torch.tensor(alone.logprobs[: len(g.logprobs)]),
            atol=1e-4 if device == "cuda" else 1e-5, rtol=0,
        )  # fmt: skip


def test_static_batches_give_the_same_rows_in_more_steps(tok, monkeypatch):
    """`refill=False` (the benchmarks' static baseline) admits the next batch only when the
    whole batch is free: same tokens per prompt, more decode steps."""
    steps: list[int] = []

    class Counting(Decoder):
        def _step(self) -> None:
            steps[-1] += 1
            super()._step()

    monkeypatch.setattr(gen_mod, "Decoder", Counting)
    model, bank = _setup(tok, "cpu")
    slots = [0, 1, 2, 1, 0, 2, 1]
    runs = {}
    for refill in (True, False):
        steps.append(0)
        runs[refill] = generate(model, bank, tok, PROMPTS, slots,
                                GenerateSpec(params=SAMPLED, seed=4, batch_size=2, refill=refill),
                                stop_fn=_lengths)
    assert [g.token_ids for g in runs[False]] == [g.token_ids for g in runs[True]]
    continuous, static = steps
    assert static > continuous
    # admitted longest prompt first, in pairs; a pair decodes until its longer row ends
    # (host checks every 8 steps round each wait up)
    lengths = [[3, 16, 7, 1, 12, 5, 9][i] for i in sorted(range(7), key=lambda i: -len(PROMPTS[i]))]
    pairs = [max(lengths[j : j + 2]) for j in range(0, 7, 2)]
    assert static >= sum(pairs)


def test_admitting_several_rows_at_once_keeps_each_rows_results(tok, monkeypatch):
    """`admit_min`: prompts wait until that many rows are free (or all that wait fit, or no row
    runs), so fewer, larger prefills run; each prompt's tokens and log-probs are those it gets
    when admitted at every host check."""
    admissions: list[int] = []  # prompts admitted per prefill

    class Counting(Decoder):
        def _admit(self, q, free):
            admissions.append(min(len(free), len(q.waiting)))
            super()._admit(q, free)

    monkeypatch.setattr(gen_mod, "Decoder", Counting)
    model, bank = _setup(tok, "cpu")
    prompts = PROMPTS * 3
    slots = [i % 3 for i in range(len(prompts))]

    def lengths(i: int, toks: list[int]) -> int | None:  # rows end one by one
        want = 1 + (5 * i) % 16
        return want if len(toks) >= want else None

    runs = {}
    for admit_min in (1, 3):
        admissions.clear()
        runs[admit_min] = (generate(model, bank, tok, prompts, slots,
                                    GenerateSpec(params=SAMPLED, seed=4, batch_size=4,
                                                 admit_min=admit_min), stop_fn=lengths),
                           list(admissions))
    (one, each), (three, grouped) = runs[1], runs[3]
    assert [g.token_ids for g in three] == [g.token_ids for g in one]
    for a, b in zip(three, one, strict=True):  # prefilled in other groups: float rounding
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=1e-5, rtol=0)
    assert sum(each) == sum(grouped) == len(prompts)
    assert len(grouped) < len(each)
    # after the first batch, an admission takes 3 prompts or more, or the last ones waiting
    assert all(n >= 3 for n in grouped[1:-1])
    with pytest.raises(ValueError, match="admit_min must be >= 0"):
        generate(model, bank, tok, prompts, slots, GenerateSpec(params=SAMPLED, admit_min=-1))


def test_by_default_prompts_wait_for_an_eighth_of_the_batch():
    assert [admit_at(0, b) for b in (1, 8, 16, 170, 292)] == [1, 1, 2, 21, 36]
    assert admit_at(3, 292) == 3


def test_row_keys_make_a_row_independent_of_its_call(tok):
    """A prompt split off into another call (another rank) samples the same with its key."""
    model, bank = _setup(tok, "cpu")
    slots = [0, 1, 2, 1, 0, 2, 1]
    whole = generate(model, bank, tok, PROMPTS, slots,
                     GenerateSpec(params=SAMPLED, seed=9, batch_size=3))
    part = generate(model, bank, tok, PROMPTS[4:], slots[4:], GenerateSpec(params=SAMPLED, seed=9),
                    row_keys=[4, 5, 6])
    assert [g.token_ids for g in part] == [g.token_ids for g in whole[4:]]
    other = generate(model, bank, tok, PROMPTS[4:], slots[4:], GenerateSpec(params=SAMPLED, seed=9))
    assert [g.token_ids for g in other] != [g.token_ids for g in part]
    with pytest.raises(ValueError, match="row keys"):
        generate(model, bank, tok, PROMPTS[:2], [0, 0], GenerateSpec(params=SAMPLED), row_keys=[1])


def test_chunked_prefill_equals_one_shot(tok, spy):
    """Prompts prefilled 3 tokens per forward: same cache, same first-token logits."""
    model, bank = _setup(tok, "cpu")
    slots = [2, 0, 1, 1, 0, 2, 1]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=1, eos_token_ids=())
    whole = generate(model, bank, tok, PROMPTS, slots,
                     GenerateSpec(params=greedy, prefill_tokens=4096))
    chunked = generate(model, bank, tok, PROMPTS, slots,
                       GenerateSpec(params=greedy, prefill_tokens=3))
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


def _alone(model, bank, tok, prompt, slot, key, params=SAMPLED, seed=4):
    return generate(model, bank, tok, [prompt], [slot], GenerateSpec(params=params, seed=seed),
                    row_keys=[key])[0]


def _assert_prefix_of(g, alone, atol=1e-5):
    assert g.token_ids == alone.token_ids[: len(g.token_ids)]
    torch.testing.assert_close(
        torch.tensor(g.logprobs), torch.tensor(alone.logprobs[: len(g.logprobs)]),
        atol=atol, rtol=0,
    )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_identical_prompts_share_one_prefill_and_stay_exact(tok, spy, device):
    """Four answers per task (same slot, same prompt) and one copy under another slot: the
    copies reuse one prefill, within an admission and across refills, and every row still
    gets what its prompt gets alone; copies differ from each other (own uniforms)."""
    model, bank = _setup(tok, device)
    tasks = [("def f(x): return x", 0), ("assert g(1) ==", 1), ("zz", 2), ("def f(x): return x", 1)]
    prompts, slots = [], []
    for p, s in tasks:
        prompts += [p] * 4
        slots += [s] * 4
    want = [3, 16, 7, 1, 12, 5, 9, 2, 6, 16, 4, 8, 11, 1, 14, 10]

    def lengths(i, toks):
        return want[i] if len(toks) >= want[i] else None

    batch = generate(model, bank, tok, prompts, slots,
                     GenerateSpec(params=SAMPLED, seed=4, batch_size=6), stop_fn=lengths)
    dec = spy[-1]
    assert dec.refills == len(prompts) - 6
    # 4 distinct (slot, prompt): at most one prefill each while a copy of it runs
    assert dec.shared >= len(prompts) - 2 * len(tasks)
    for i, g in enumerate(batch):
        assert len(g.token_ids) == want[i]
        _assert_prefix_of(g, _alone(model, bank, tok, prompts[i], slots[i], i),
                          atol=1e-4 if device == "cuda" else 1e-5)
    for t in range(len(tasks)):
        firsts = {tuple(g.token_ids[:3]) for g in batch[4 * t : 4 * t + 4] if len(g.token_ids) >= 3}
        assert len(firsts) > 1


def test_shared_prefill_copies_the_cache(tok):
    """A copied row's cache and first-token logits equal its own prefill's."""
    model, bank = _setup(tok, "cpu")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, eos_token_ids=())
    ids = [tok(p)["input_ids"] for p in ("def f(x):", "def f(x):", "hello", "def f(x):")]
    slots = [1, 1, 0, 2]
    dup = generate(model, bank, tok, ids, slots, GenerateSpec(params=greedy))
    own = [generate(model, bank, tok, [p], [s], GenerateSpec(params=greedy))[0] for p, s in zip(ids, slots, strict=True)]
    for a, b in zip(dup, own, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
    assert dup[0].token_ids == dup[1].token_ids  # greedy: a copy decodes the same
    dec = Decoder(model, bank, 2, 32, greedy, [])
    with torch.no_grad(), static_kv(model, dec.kv):
        dec.prefill(ids[:1], slots[:1], [0], torch.zeros(1, 4))
        dec.kv.copy_rows([1], [0], len(ids[0]))
        copied = [(k[1].clone(), v[1].clone()) for k, v in zip(dec.kv.k, dec.kv.v, strict=True)]
        dec.prefill(ids[:1], slots[:1], [1], torch.zeros(1, 4))
        for (k, v), (kc, vc) in zip(zip(dec.kv.k, dec.kv.v, strict=True), copied, strict=True):
            torch.testing.assert_close(kc[:, : len(ids[0])], k[1, :, : len(ids[0])])
            torch.testing.assert_close(vc[:, : len(ids[0])], v[1, :, : len(ids[0])])


@pytest.mark.parametrize("device", DEVICES)
def test_decode_width_grows_with_the_rows_and_keeps_them_exact(tok, narrow, device):
    """Early steps attend over fewer cache positions (several widths, each a multiple of
    the step), with refills; each row equals its prompt alone at the full width."""
    model, bank = _setup(tok, device)
    slots = [0, 1, 2, 1, 0, 2, 1]
    batch = generate(model, bank, tok, PROMPTS, slots,
                     GenerateSpec(params=SAMPLED, seed=4, batch_size=3), stop_fn=_lengths)
    dec = narrow[-1]
    assert len(dec.widths) > 2 and all(w % 4 == 0 or w == dec.length for w in dec.widths)
    assert min(dec.widths) < dec.length
    for i, g in enumerate(batch):
        _assert_prefix_of(g, _alone(model, bank, tok, PROMPTS[i], slots[i], i),
                          atol=1e-4 if device == "cuda" else 1e-5)


def test_stop_function_sees_each_rows_tokens_so_far(tok, spy):
    """Tokens reach the stop function incrementally, also for rows refilled mid-batch."""
    model, bank = _setup(tok, "cpu")
    slots = [0, 1, 2, 1, 0, 2, 1]
    seen: dict[int, list[list[int]]] = {i: [] for i in range(len(PROMPTS))}

    def record(i, toks):
        seen[i].append(list(toks))
        return _lengths(i, toks)

    batch = generate(model, bank, tok, PROMPTS, slots,
                     GenerateSpec(params=SAMPLED, seed=4, batch_size=2), stop_fn=record)
    assert spy[-1].refills == len(PROMPTS) - 2
    for i, g in enumerate(batch):
        full = _alone(model, bank, tok, PROMPTS[i], slots[i], i).token_ids
        assert seen[i] and all(full[: len(t)] == t for t in seen[i])
        assert [len(t) for t in seen[i]] == sorted(len(t) for t in seen[i])
        assert len(seen[i][-1]) >= len(g.token_ids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch_size", [7, 4])
def test_shrinking_batch_moves_the_last_rows_and_keeps_them_exact(tok, monkeypatch, device,
                                                                   batch_size):
    """Once no prompt waits, the step runs over half the rows whenever the running ones fit
    (rows move to the front with their cache and streams): fewer row-steps, and every row
    still equals its prompt alone (also after refills, with narrow decode widths)."""
    row_steps: list[int] = []

    class Counting(Decoder):
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "shrink_min": 1, "width_step": 4})
            made.append(self)

        def _at_width(self, width):
            step = super()._at_width(width)  # eager, or a graph's replay on CUDA

            def counted():
                row_steps[-1] += self.rows
                step()

            return counted

    made: list[Decoder] = []
    monkeypatch.setattr(gen_mod, "Decoder", Counting)
    model, bank = _setup(tok, device)
    slots = [0, 1, 2, 1, 0, 2, 1]
    runs = []
    for refill in (True, False):
        row_steps.append(0)
        runs.append(generate(model, bank, tok, PROMPTS, slots,
                             GenerateSpec(params=SAMPLED, seed=4, batch_size=batch_size,
                                          refill=refill),
                             stop_fn=_lengths))
    batch, static = runs
    dec = made[0]
    assert max(dec.row_counts) == batch_size and min(dec.row_counts) < batch_size
    assert made[1].row_counts == {batch_size}  # static batches never shrink
    assert [g.token_ids for g in static] == [g.token_ids for g in batch]
    assert row_steps[0] < row_steps[1]
    for i, g in enumerate(batch):
        assert len(g.token_ids) == [3, 16, 7, 1, 12, 5, 9][i]
        _assert_prefix_of(g, _alone(model, bank, tok, PROMPTS[i], slots[i], i),
                          atol=1e-4 if device == "cuda" else 1e-5)
