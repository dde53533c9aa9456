"""Mixed-adapter generation: reproducible, per-row exact, logprobs = teacher forcing, stops."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from lorapop.engine.byte_tokenizer import byte_tokenizer
from lorapop.engine.generate import (
    GenerateSpec,
    KeptDecoders,
    Prompt,
    compile_buckets,
    generate,
)
from lorapop.engine.logprobs import sequence_logprobs
from lorapop.engine.memory import prefill_bytes, row_bytes
from lorapop.engine.sampling import SamplingParams, row_uniforms, sample
from lorapop.lora.bank import AdapterBank
from tiny_models import ARCHS, tiny_model

PROMPTS = ["def f(x):", "a", "assert f(3) ==", "hello world, this is long", "xy"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, eos_token_ids=())
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, eos_token_ids=())


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def setup(request, tok):
    """A tiny model with a 3-slot bank whose slots differ from each other and the base."""
    model = tiny_model(request.param, len(tok)).requires_grad_(False)
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8.0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in bank.targets.values():
            t.b.copy_(torch.randn(t.b.shape, generator=gen) * 0.5)
    return model, bank


def _same(a, b) -> None:
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.text for g in a] == [g.text for g in b]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs))


def test_same_seed_same_output_and_other_seed_differs(setup, tok):
    model, bank = setup
    slots = [0, 1, 2, 1, 0]
    a = generate(model, bank, tok, PROMPTS, slots, GenerateSpec(params=SAMPLED, seed=7))
    b = generate(model, bank, tok, PROMPTS, slots, GenerateSpec(params=SAMPLED, seed=7))
    c = generate(model, bank, tok, PROMPTS, slots, GenerateSpec(params=SAMPLED, seed=8))
    _same(a, b)
    assert [g.token_ids for g in a] != [g.token_ids for g in c]
    assert all(len(g.token_ids) == 12 and g.finish == "length" for g in a)


def test_sample_independent_of_batch_composition_and_size(setup, tok):
    model, bank = setup
    slots = [0, 1, 2, 1, 0]
    full = generate(model, bank, tok, PROMPTS, slots, GenerateSpec(params=SAMPLED, seed=3))
    chunked = generate(model, bank, tok, PROMPTS, slots,
                       GenerateSpec(params=SAMPLED, seed=3, batch_size=2))
    _same(full, chunked)
    # duplicated prompts (n samples of one task) get different samples
    dup = generate(model, bank, tok, [PROMPTS[0]] * 4, [1] * 4, GenerateSpec(params=SAMPLED, seed=3))
    assert len({tuple(g.token_ids) for g in dup}) > 1


def test_timing_accounts_for_the_run(setup, tok):
    """A caller can see where a generation's time went, and the accounting adds up."""
    model, bank = setup
    timing: dict[str, float] = {}
    out = generate(model, bank, tok, PROMPTS, [0, 1, 2, 1, 0],
                   GenerateSpec(params=SAMPLED, seed=3, batch_size=2), timing=timing)
    assert timing["batch"] == 2
    # 5 prompts in 2 rows of 11 decode steps each (the first token comes from the prefill)
    assert timing["steps"] >= 3 * (SAMPLED.max_new_tokens - 1)
    assert timing["steps"] <= timing["row_steps"] <= 2 * timing["steps"]
    assert min(timing["prefill_s"], timing["capture_s"], timing["decode_s"]) >= 0
    assert timing["prefill_s"] > 0 and timing["decode_s"] > 0
    assert [len(g.token_ids) for g in out] == [SAMPLED.max_new_tokens] * 5
    # every prompt fed once (a forward per admission here: rows end together), padding included
    assert timing["prefill_tokens"] >= sum(len(g.prompt_ids) for g in out)
    assert 3 <= timing["prefills"] <= 5
    # copies of one prompt and slot admitted together: one prefill of the prompt alone
    shared: dict[str, float] = {}
    out = generate(model, bank, tok, [PROMPTS[0]] * 4, [1] * 4,
                   GenerateSpec(params=SAMPLED, seed=3), timing=shared)
    assert (shared["prefills"], shared["prefill_tokens"]) == (1, len(out[0].prompt_ids))


def test_logprobs_equal_teacher_forced_forward(setup, tok):
    model, bank = setup
    slots = [2, 0, 1, 1, 2]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=10, eos_token_ids=())
    gens = generate(model, bank, tok, PROMPTS, slots, GenerateSpec(params=params, seed=5))
    lp, mask = sequence_logprobs(
        model, bank, [g.prompt_ids for g in gens], [g.token_ids for g in gens], slots
    )
    assert mask.all()
    torch.testing.assert_close(lp, torch.tensor([g.logprobs for g in gens]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_cuda_decode_path_gives_the_teacher_forced_logprobs(arch, tok, monkeypatch):
    """The decode step as CUDA runs it, here eagerly: merged q/k/v and gate/up GEMMs that
    also give the LoRA shrinks (`reserve_lora_rows`), each LoRA term added in place into its
    column slice, the fused rotary and SwiGLU passes on those strided slices
    (`fused._inference` forced): each token's log-prob is the one the update's training
    forward gives it (the same float32 passes)."""
    from lorapop.engine import fused
    from lorapop.engine.patches import attach_lora, patch_base_model

    model = tiny_model(arch, len(tok)).requires_grad_(False)
    for source, current in list(fused._rotary_sources(model)):  # the process's, restored after
        monkeypatch.setattr(source, "apply_rotary_pos_emb",
                            getattr(current, "lorapop_original", current))
    assert patch_base_model(model)["merged_groups"] == 2 * model.config.num_hidden_layers
    bank = attach_lora(model, n_slots=3, rank=4, alpha=8.0)  # the GEMMs give the shrinks
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for t in bank.targets.values():
            t.b.copy_(torch.randn(t.b.shape, generator=gen) * 0.5)
    monkeypatch.setattr(fused, "_inference", lambda x: True)
    seen = set()  # (pass, its first input contiguous) at inference
    real = fused.fast_pass

    def spy(fn, *args, plain=True):
        if not plain:
            seen.add((fn.__name__, args[0].is_contiguous()))
        return real(fn, *args, plain=plain)

    monkeypatch.setattr(fused, "fast_pass", spy)
    slots = [2, 0, 1, 1, 2]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, eos_token_ids=())
    gens = generate(model, bank, tok, PROMPTS, slots, GenerateSpec(params=params, seed=5))
    # decode steps hand the passes column slices of the merged outputs, uncopied
    assert {("_rope", False), ("_silu_mul", False)} <= seen
    lp, mask = sequence_logprobs(
        model, bank, [g.prompt_ids for g in gens], [g.token_ids for g in gens], slots
    )
    assert mask.all() and lp.requires_grad  # the training forward's passes
    torch.testing.assert_close(lp.detach(), torch.tensor([g.logprobs for g in gens]),
                               atol=1e-4, rtol=1e-4)


def test_sequence_logprobs_has_grad_and_masks_ragged_rows(setup):
    model, bank = setup
    lp, mask = sequence_logprobs(model, bank, [[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], [0, 1])
    assert mask.tolist() == [[True, True, False], [True, True, True]]
    assert lp[0, 2] == 0 and (lp[mask] < 0).all()
    lp[mask].sum().backward()
    grads = [p.grad for p in bank.parameters_of_bank()]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    bank.zero_grad()


def test_mixed_batch_rows_equal_each_row_alone(setup, tok):
    model, bank = setup
    slots = [0, 1, 2, 2, 1]
    batch = generate(model, bank, tok, PROMPTS, slots, GenerateSpec(params=GREEDY))
    for i, (prompt, slot) in enumerate(zip(PROMPTS, slots, strict=True)):
        alone = generate(model, bank, tok, [prompt], [slot], GenerateSpec(params=GREEDY))
        _same([batch[i]], alone)
    # the slots really differ: the same prompt under another slot gives other tokens
    others = generate(model, bank, tok, [PROMPTS[0]] * 3, [0, 1, 2], GenerateSpec(params=GREEDY))
    assert len({tuple(g.token_ids) for g in others}) == 3


def test_left_padding_does_not_change_a_row(setup, tok):
    model, bank = setup
    short = generate(model, bank, tok, ["a"], [1], GenerateSpec(params=GREEDY))
    padded = generate(model, bank, tok, ["a", "x" * 40], [1, 1], GenerateSpec(params=GREEDY))
    _same(short, padded[:1])


def test_stop_strings_cut_rows_individually(setup, tok):
    model, bank = setup
    slots = [0, 1, 2, 1, 0]
    free = generate(model, bank, tok, PROMPTS, slots, GenerateSpec(params=GREEDY))
    stop = free[0].text[4:6]  # occurs in row 0; other rows stop only if it occurs there too
    params = SamplingParams(temperature=0.0, max_new_tokens=12, eos_token_ids=(), stop=(stop,))
    cut = generate(model, bank, tok, PROMPTS, slots, GenerateSpec(params=params))
    assert cut[0].finish == "stop"
    for f, c in zip(free, cut, strict=True):
        if stop not in f.text:
            _same([f], [c])
            continue
        n = len(c.token_ids)
        assert c.finish == "stop" and c.token_ids == f.token_ids[:n]
        assert c.logprobs == pytest.approx(f.logprobs[:n], abs=1e-5)
        assert stop in tok.decode(c.token_ids) and stop not in tok.decode(c.token_ids[:-1])
        assert c.text == tok.decode(c.token_ids).split(stop)[0] and stop not in c.text
    kept = generate(model, bank, tok, PROMPTS[:1], [0],
                    GenerateSpec(params=replace(params, include_stop=True)))
    assert kept[0].text == cut[0].text + stop


def test_eos_stops_rows_individually(setup, tok):
    model, bank = setup
    slots = [0, 1, 2, 1, 0]
    free = generate(model, bank, tok, PROMPTS, slots, GenerateSpec(params=GREEDY))
    eos = free[1].token_ids[3]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, eos_token_ids=(eos,))
    cut = generate(model, bank, tok, PROMPTS, slots, GenerateSpec(params=params))
    for f, c in zip(free, cut, strict=True):
        if eos not in f.token_ids:
            _same([f], [c])
            continue
        n = f.token_ids.index(eos) + 1
        assert c.finish == "eos" and c.token_ids == f.token_ids[:n]  # EOS is returned
        assert c.text == tok.decode(f.token_ids[: n - 1], skip_special_tokens=True)
    assert len(cut[1].token_ids) <= 4


def test_tokenizer_eos_is_the_default(tok):
    model = tiny_model("qwen2", len(tok)).requires_grad_(False)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    free = generate(model, None, tok, ["zz"], [0],
                    GenerateSpec(params=replace(params, eos_token_ids=())))
    # make the first greedy token the tokenizer's EOS by swapping the two output rows
    first = free[0].token_ids[0]
    with torch.no_grad():
        w = model.lm_head.weight
        w[[first, tok.eos_token_id]] = w[[tok.eos_token_id, first]]
    g = generate(model, None, tok, ["zz"], [0], GenerateSpec(params=params))[0]
    assert g.finish == "eos" and g.token_ids == [tok.eos_token_id] and g.text == ""


def test_tiny_top_p_is_greedy(setup, tok):
    model, bank = setup
    slots = [0, 1, 2, 1, 0]
    nucleus = SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=12, eos_token_ids=())
    _same(
        generate(model, bank, tok, PROMPTS, slots, GenerateSpec(params=GREEDY)),
        generate(model, bank, tok, PROMPTS, slots, GenerateSpec(params=nucleus, seed=11)),
    )


def test_sampler_matches_the_tempered_nucleus_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    u = row_uniforms(0, range(20000), 1)[:, 0]
    tokens, lps = sample(logits.expand(len(u), -1), u, temperature=0.5, top_p=0.95)
    probs = torch.softmax(logits[0] / 0.5, -1)
    kept = probs.cumsum(0) - probs < 0.95
    expected = torch.where(kept, probs, 0.0) / probs[kept].sum()
    freq = torch.bincount(tokens, minlength=5).float() / len(u)
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)
    torch.testing.assert_close(lps, torch.log_softmax(logits[0], -1)[tokens])  # temperature 1


def test_bad_input_gives_clear_errors(setup, tok):
    model, bank = setup
    with pytest.raises(ValueError, match="slot ids"):
        generate(model, bank, tok, ["a", "b"], [0], GenerateSpec(params=GREEDY))
    with pytest.raises(ValueError, match="slot ids"):
        generate(model, bank, tok, ["a"], [3], GenerateSpec(params=GREEDY))
    with pytest.raises(ValueError, match="empty"):
        generate(model, bank, tok, [[]], [0], GenerateSpec(params=GREEDY))
    with pytest.raises(ValueError, match="exceed"):
        generate(model, bank, tok, ["a" * 250], [0], GenerateSpec(params=GREEDY))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="</answer>")  # type: ignore[arg-type]
    assert generate(model, bank, tok, [], [], GenerateSpec(params=GREEDY)) == []


def test_token_id_prompts_and_restored_attention(setup, tok):
    model, bank = setup
    before = model.config._attn_implementation  # (sdpa, or the update's after a log-prob pass)
    ids = tok(PROMPTS[2])["input_ids"]
    a = generate(model, bank, None, [ids], [1], GenerateSpec(params=GREEDY))
    b = generate(model, bank, tok, [PROMPTS[2]], [1], GenerateSpec(params=GREEDY))
    assert a[0].token_ids == b[0].token_ids and a[0].text == ""
    assert model.config._attn_implementation == before


def test_generation_sees_slot_changes_between_calls(tok):
    """The decode cache must follow the bank: modify a slot, generate again."""
    model = tiny_model("qwen2", len(tok)).requires_grad_(False)
    bank = AdapterBank(model, n_slots=2, rank=4, alpha=8.0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for t in bank.targets.values():
            t.b.copy_(torch.randn(t.b.shape, generator=gen) * 0.5)
    prompts = PROMPTS[:3]
    first = generate(model, bank, tok, prompts, [1, 1, 1], GenerateSpec(params=GREEDY))
    as_zero = generate(model, bank, tok, prompts, [0, 0, 0], GenerateSpec(params=GREEDY))
    assert [g.token_ids for g in first] != [g.token_ids for g in as_zero]
    bank.copy_slot(0, 1)
    _same(generate(model, bank, tok, prompts, [1, 1, 1], GenerateSpec(params=GREEDY)), as_zero)
    with torch.no_grad():
        bank.weights[1].mul_(0.0)  # slot 1 = the base model now
    with bank.disabled():
        base = generate(model, bank, tok, prompts, [0, 0, 0], GenerateSpec(params=GREEDY))
    _same(generate(model, bank, tok, prompts, [1, 1, 1], GenerateSpec(params=GREEDY)), base)


def test_compile_failure_falls_back_to_the_plain_step(setup, tok, monkeypatch):
    model, bank = setup

    def broken(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("no compiler here")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the default on CPU: no compilation
        want = generate(model, bank, tok, PROMPTS, [0, 1, 2, 1, 0],
                        GenerateSpec(params=SAMPLED, seed=4))
    with pytest.warns(UserWarning, match="torch.compile of the decode step failed"):
        got = generate(model, bank, tok, PROMPTS, [0, 1, 2, 1, 0],
                       GenerateSpec(params=SAMPLED, seed=4, compile=True))
    _same(got, want)


def test_compiled_decode_gives_the_eager_tokens(tok):
    """The real inductor path on CPU: same tokens as eager, logprobs to float rounding."""
    torch._dynamo.reset()
    model = tiny_model("qwen2", len(tok), seed=2).requires_grad_(False)
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8.0)
    with torch.no_grad():
        bank.weights.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(5))
    slots = [2, 0, 1, 1, 0]
    want = generate(model, bank, tok, PROMPTS, slots, GenerateSpec(params=SAMPLED, seed=6))
    with warnings.catch_warnings():
        # a compile failure would only warn and fall back to the eager forward
        warnings.filterwarnings("error", message="torch.compile of the decode step failed")
        got = generate(model, bank, tok, PROMPTS, slots,
                       GenerateSpec(params=SAMPLED, seed=6, compile=True))
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0
        )
    torch._dynamo.reset()


def test_compile_buckets_bound_recompilation(setup, tok, monkeypatch):
    """One compilation per (batch bucket, length bucket); the step follows the bank's state."""
    model, bank = setup
    torch._dynamo.reset()
    counter = CompileCounter()
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=counter, **kw))
    want = generate(model, bank, tok, PROMPTS, [0, 1, 2, 1, 0], GenerateSpec(params=SAMPLED, seed=2))
    got = generate(model, bank, tok, PROMPTS, [0, 1, 2, 1, 0],
                   GenerateSpec(params=SAMPLED, seed=2, compile=True))
    _same(got, want)
    assert counter.frame_count == 1
    # 6 or 7 rows -> batch bucket 8, prompts of other lengths in the same length bucket
    generate(model, bank, tok, PROMPTS + ["zz"], [1, 0, 2, 1, 0, 2],
             GenerateSpec(params=SAMPLED, compile=True))
    generate(model, bank, tok, PROMPTS[:3] * 2 + ["q"], [0] * 7,
             GenerateSpec(params=GREEDY, compile=True))
    assert counter.frame_count == 1
    generate(model, bank, tok, PROMPTS[:2], [1, 2], GenerateSpec(params=SAMPLED, compile=True))  # batch 2
    assert counter.frame_count == 2
    # the compiled step reads the bank's current weights, not those it was traced with
    with torch.no_grad():
        saved = bank.weights.clone()
        bank.weights[1].copy_(bank.weights[0])
    try:
        as_zero = generate(model, bank, tok, PROMPTS[:2], [0, 0],
                           GenerateSpec(params=SAMPLED, seed=9))
        _same(
            generate(model, bank, tok, PROMPTS[:2], [1, 1],
                     GenerateSpec(params=SAMPLED, seed=9, compile=True)), as_zero
        )
    finally:
        with torch.no_grad():
            bank.weights.copy_(saved)
    assert counter.frame_count == 2
    torch._dynamo.reset()


def test_compile_buckets():
    assert [compile_buckets(b, None, 64)[0] for b in (1, 2, 3, 5, 8, 9, 64, 65)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        64,
        128,
    ]
    assert compile_buckets(5, 6, 64) == (6, 64)  # never above batch_size
    sizes = [compile_buckets(1, None, n)[1] for n in (1, 64, 65, 96, 97, 129, 193, 257, 4000)]
    assert sizes == [64, 64, 96, 96, 128, 192, 256, 384, 4096]


def test_compiled_step_notices_a_bank_attached_later(tok, monkeypatch):
    """A forward compiled for the plain model must not be reused once LoRA hooks exist."""
    torch._dynamo.reset()
    counter = CompileCounter()
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=counter, **kw))
    model = tiny_model("qwen2", len(tok), seed=4).requires_grad_(False)
    slots = [1, 0, 1]
    base = generate(model, None, tok, PROMPTS[:3], slots, GenerateSpec(params=GREEDY, compile=True))
    bank = AdapterBank(model, n_slots=2, rank=4, alpha=8.0)
    with torch.no_grad():
        bank.weights.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(7))
    want = generate(model, bank, tok, PROMPTS[:3], slots, GenerateSpec(params=GREEDY))
    got = generate(model, bank, tok, PROMPTS[:3], slots, GenerateSpec(params=GREEDY, compile=True))
    _same(got, want)
    assert [g.token_ids for g in got] != [g.token_ids for g in base]
    assert counter.frame_count == 2
    bank.detach()  # and back: the plain model's compiled step again
    _same(generate(model, None, tok, PROMPTS[:3], slots, GenerateSpec(params=GREEDY, compile=True)), base)
    torch._dynamo.reset()


def _shift_bank(bank, seed: int) -> None:
    """Change every slot's B in place, as an update step does."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in bank.targets.values():
            t.b.add_(torch.randn(t.b.shape, generator=gen).to(t.b) * 0.3)


def test_kept_decoders_reuse_a_shape_and_follow_the_bank(setup, tok):
    """A kept decoder serves a later call of the same shape after the adapters changed, with
    the samples and timings a fresh call gives."""
    model, bank = setup
    saved = {n: t.b.clone() for n, t in bank.targets.items()}
    slots = [0, 1, 2, 1, 0]
    kept = KeptDecoders(2)
    try:
        got, want, timings = [], [], []
        for call in range(2):
            timing: dict[str, float] = {}
            got.append(generate(model, bank, tok, PROMPTS, slots,
                                GenerateSpec(params=SAMPLED, seed=3, decoders=kept), timing=timing))
            timings.append(timing)
            timing = {}
            want.append(generate(model, bank, tok, PROMPTS, slots,
                                 GenerateSpec(params=SAMPLED, seed=3), timing=timing))
            timings.append(timing)
            _shift_bank(bank, call)
        assert (kept.made, kept.reused, len(kept.decoders)) == (1, 1, 1)
        for g, w in zip(got, want, strict=True):
            _same(g, w)
        assert [g.token_ids for g in got[0]] != [g.token_ids for g in got[1]]
        # each call reports its own share of the decoder's clock, not the running total
        assert len({t["steps"] for t in timings}) == 1
        assert [t["batch"] for t in timings] == [8, 5, 8, 5]  # kept: rounded up to a bucket
    finally:
        with torch.no_grad():
            for n, t in bank.targets.items():
                t.b.copy_(saved[n])


def test_kept_decoders_drop_the_least_recently_used_shape(setup, tok):
    model, bank = setup
    kept = KeptDecoders(1)
    short = replace(SAMPLED, max_new_tokens=4)
    for params in (SAMPLED, short, SAMPLED, SAMPLED):
        generate(model, bank, tok, PROMPTS[:2], [0, 1], GenerateSpec(params=params, decoders=kept))
    assert (kept.made, kept.reused, len(kept.decoders)) == (3, 1, 1)
    with pytest.raises(ValueError, match="capacity"):
        KeptDecoders(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_kept_cuda_graphs_replay_the_changed_adapters_bit_for_bit(tok):
    """Graphs captured in one call and replayed in the next, after the adapters changed in
    place, sample what a decoder captured anew for that call samples."""
    model = tiny_model("llama", len(tok)).to("cuda", torch.bfloat16).requires_grad_(False)
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8.0)
    _shift_bank(bank, 0)
    prompts, slots = PROMPTS * 3, [0, 1, 2] * 5
    params = replace(SAMPLED, max_new_tokens=40)
    kept = KeptDecoders(2)
    generate(model, bank, tok, prompts, slots, GenerateSpec(params=params, seed=5, decoders=kept))
    _shift_bank(bank, 1)
    again = generate(model, bank, tok, prompts, slots,
                     GenerateSpec(params=params, seed=5, decoders=kept))
    fresh = generate(model, bank, tok, prompts, slots,
                     GenerateSpec(params=params, seed=5, decoders=KeptDecoders(2)))
    assert kept.reused == 1 and next(iter(kept.decoders.values())).graphs
    assert [g.token_ids for g in again] == [g.token_ids for g in fresh]
    assert [g.logprobs for g in again] == [g.logprobs for g in fresh]


class _AnswerFeed:
    """Adds `copies` answers (a shorter prompt, its own seed, keys and cap) for each finished
    first prompt one check after it finished, as the self-play loop adds the answers of a
    proposal once it is verified."""

    def __init__(self, firsts: int, copies: int, cap: int, seed: int) -> None:
        self.max_new_tokens, self.copies, self.seed, self.firsts = cap, copies, seed, firsts
        self.left, self.pending, self.added = firsts, [], []

    def __call__(self, done, wait):
        ready, self.pending = self.pending, sorted(i for i in done if i < self.firsts)
        self.left -= len(self.pending)
        if wait and not ready:
            ready, self.pending = self.pending, []
        new = [Prompt(f"answer {i}:", i % 3, self.max_new_tokens, self.seed, 10 * i + n)
               for i in ready for n in range(self.copies)]
        self.added += new
        return new if new or self.left or self.pending else None


@pytest.mark.parametrize("long_first, first_cap, cap", [(True, 12, 12), (False, 4, 60)])
def test_a_feed_adds_rows_that_equal_a_call_of_their_own(setup, tok, long_first, first_cap, cap):
    """Prompts fed while others decode, with their own seed, key and cap, get the samples a
    separate call gives them. Once the feed is done the decoder re-grids: to more rows when
    the answers' shorter cache lets more fit the memory, to a longer cache when the answers'
    cap outgrows the first prompts' (those answers wait for it)."""
    _feed_rows_equal_their_own_call(*setup, tok, long_first, first_cap, cap)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_feed_and_its_regrid_in_cuda_graphs(tok):
    """The same on the GPU: rows added to captured steps, graphs captured again after the
    re-grid."""
    model = tiny_model("qwen2", len(tok)).cuda().requires_grad_(False)
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8.0)
    _shift_bank(bank, 3)
    _feed_rows_equal_their_own_call(model, bank, tok, True, 12, 12)


def _feed_rows_equal_their_own_call(model, bank, tok, long_first, first_cap, cap) -> None:
    firsts = [PROMPTS[3] * (8 if long_first else 1), *PROMPTS[:3], PROMPTS[4]]
    slots = [0, 1, 2, 1, 0]
    params = replace(SAMPLED, max_new_tokens=first_cap, eos_token_ids=(7,))
    budget = None
    if long_first:  # two rows of the first prompts' cache fit, more of the answers'
        steps, chunk = max(first_cap, cap), 256
        length = -(-(len(tok(firsts[0])["input_ids"]) + first_cap - 1) // 64) * 64
        budget = prefill_bytes(model, length, chunk) + 5 * row_bytes(model, length, steps) // 2
        assert (budget - prefill_bytes(model, 64, chunk)) // row_bytes(model, 64, steps) > 4
    spec = GenerateSpec(params=params, seed=5, batch_size=8, memory_budget=budget,
                        prefill_tokens=256)
    feed = _AnswerFeed(len(firsts), 2, cap, seed=11)
    timing: dict = {}
    out = generate(model, bank, tok, firsts, slots, spec, timing=timing, feed=feed)
    assert len(out) == 3 * len(firsts) == len(firsts) + len(feed.added)
    _same(out[: len(firsts)], generate(model, bank, tok, firsts, slots, spec))
    fed = feed.added
    _same(out[len(firsts):], generate(
        model, bank, tok, [p.ids for p in fed], [p.slot for p in fed],
        GenerateSpec(params=replace(params, max_new_tokens=cap), seed=11, batch_size=3),
        row_keys=[p.key for p in fed]))
    assert timing["regrids"] >= 1
    assert timing["batch"] > (2 if long_first else 5)  # the first prompts had 2 or 5 rows


def test_a_feed_with_bad_input_stops_with_one_line(setup, tok):
    model, bank = setup
    spec = GenerateSpec(params=SAMPLED, seed=1)

    class Bad:
        max_new_tokens = 12

        def __init__(self, prompt) -> None:
            self.prompt, self.sent = prompt, False

        def __call__(self, done, wait):
            if self.sent:
                return None
            self.sent = True
            return [Prompt(self.prompt, 0, 12, 1, 99)]

    with pytest.raises(ValueError, match=r"feed added \(key 99\): .*token ids outside"):
        generate(model, bank, tok, PROMPTS[:2], [0, 1], spec, feed=Bad([10**7]))
    with pytest.raises(ValueError, match=r"feed added \(key 99\): .*empty"):
        generate(model, bank, tok, PROMPTS[:2], [0, 1], spec, feed=Bad([]))
    with pytest.raises(ValueError, match="a feed needs refills and no kept decoders"):
        generate(model, bank, tok, PROMPTS[:2], [0, 1],
                 replace(spec, decoders=KeptDecoders(1)), feed=Bad("x"))
