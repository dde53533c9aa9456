"""Decode attention: the reference equals attention over each row's own positions; on a GPU the
Triton kernel equals the reference, in a step and in whole generations."""

from __future__ import annotations

import pytest
import torch

from lorapop.engine import decode_attention
from lorapop.engine.byte_tokenizer import byte_tokenizer
from lorapop.engine.decode_attention import attend, reference, splits_for, usable
from lorapop.engine.generate import GenerateSpec, generate
from lorapop.engine.logprobs import sequence_logprobs
from lorapop.engine.sampling import SamplingParams
from lorapop.lora.bank import AdapterBank

KERNEL = torch.cuda.is_available() and decode_attention._triton() is not None


def _case(rows, heads, kv_heads, width, d, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(rows, 1, heads, d, generator=gen, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(rows, kv_heads, width, d, generator=gen, device=device, dtype=dtype)
    v = torch.randn(rows, kv_heads, width, d, generator=gen, device=device, dtype=dtype)
    pos = torch.randint(0, width, (rows,), generator=gen, device=device)
    pos[0] = width - 1  # one row at the full width, one at its first position
    pos[-1] = 0
    return q, k, v, pos


def _each_row_alone(q, k, v, pos, scale):
    """Row by row, head by head: softmax over positions [0, pos] of the head's KV group."""
    b, heads, _, d = q.shape
    group = heads // k.shape[1]
    out = torch.empty(b, heads, 1, d, dtype=torch.float64)
    for r in range(b):
        n = int(pos[r]) + 1
        for h in range(heads):
            keys, vals = k[r, h // group, :n].double(), v[r, h // group, :n].double()
            w = torch.softmax(q[r, h, 0].double() @ keys.T * scale, dim=-1)
            out[r, h, 0] = w @ vals
    return out


def test_reference_reads_each_rows_own_positions_with_grouped_heads():
    q, k, v, pos = _case(rows=5, heads=6, kv_heads=2, width=40, d=8)
    got = reference(q, k, v, pos, 0.3)
    torch.testing.assert_close(got.double(), _each_row_alone(q, k, v, pos, 0.3), atol=1e-6,
                               rtol=1e-5)
    # what lies past a row's position changes nothing
    k2, v2 = k.clone(), v.clone()
    for r in range(5):
        k2[r, :, int(pos[r]) + 1 :] = 1e4
        v2[r, :, int(pos[r]) + 1 :] = -1e4
    torch.testing.assert_close(reference(q, k2, v2, pos, 0.3), got)


def test_attend_on_cpu_is_the_reference_in_the_output_layout():
    q, k, v, pos = _case(rows=3, heads=4, kv_heads=4, width=16, d=16)
    assert not usable(q)
    out = attend(q, k, v, pos, 0.25)
    assert out.shape == (3, 1, 4, 16) and out.is_contiguous()
    torch.testing.assert_close(out, reference(q, k, v, pos, 0.25).transpose(1, 2))


def test_a_kernel_that_fails_warns_once_and_the_reference_takes_over(monkeypatch):
    """An older GPU or Triton that cannot build the kernel slows generation; it never stops it."""
    q, k, v, pos = _case(rows=3, heads=4, kv_heads=2, width=16, d=16)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("PassManager::run failed\nmore detail")

    monkeypatch.setattr(decode_attention, "failure", None)
    monkeypatch.setattr(decode_attention, "usable", lambda q, kernel="auto": kernel == "auto"
                        and decode_attention.failure is None)
    monkeypatch.setattr(decode_attention, "_triton_attend", broken)
    want = reference(q, k, v, pos, 0.25).transpose(1, 2)
    with pytest.warns(UserWarning, match="PassManager::run failed"):
        torch.testing.assert_close(attend(q, k, v, pos, 0.25), want)
    torch.testing.assert_close(attend(q, k, v, pos, 0.25), want)  # not retried, no warning
    assert calls == [1]
    assert decode_attention.failure == "RuntimeError: PassManager::run failed"
    assert not decode_attention.applies(torch.device("cuda"), torch.bfloat16, 128)


def test_splits_fill_the_gpu_only_when_rows_are_few():
    assert splits_for(rows=384, kv_heads=4, width=4096, processors=132) == 1
    assert splits_for(rows=8, kv_heads=4, width=4096, processors=132) == 8  # capped by width
    assert splits_for(rows=8, kv_heads=4, width=512, processors=132) == 1
    assert splits_for(rows=1, kv_heads=1, width=200_000, processors=132) == 264


@pytest.mark.skipif(not KERNEL, reason="the Triton kernel needs a GPU")
@pytest.mark.parametrize("rows,heads,kv_heads,width,d,dtype", [
    (384, 28, 4, 1024, 128, torch.bfloat16),  # Qwen2.5-7B's heads, a full batch: one part
    (3, 28, 4, 4096, 128, torch.bfloat16),  # a phase's tail: each row split in parts
    (17, 8, 8, 700, 64, torch.float16),  # no grouping, a width off the block size
    (5, 12, 2, 2048, 80, torch.bfloat16),  # a head size that is not a power of two
])
def test_kernel_equals_the_reference(rows, heads, kv_heads, width, d, dtype):
    q, k, v, pos = _case(rows, heads, kv_heads, width, d, dtype, "cuda")
    assert usable(q)
    got = attend(q, k, v, pos, d**-0.5)
    want = reference(q.float(), k.float(), v.float(), pos, d**-0.5).transpose(1, 2)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    ref_low = reference(q, k, v, pos, d**-0.5).transpose(1, 2).float()  # SDPA in `dtype`
    assert (got.float() - want).abs().max() <= 2 * (ref_low - want).abs().max() + 1e-3


def _with_new(rows, heads, kv_heads, length, d, dtype, device, width):
    """A case whose step key/value are given apart, its rows below `width` but the last
    (a row that no longer runs, at a position past the width)."""
    q, k, v, pos = _case(rows, heads, kv_heads, length, d, dtype, device, seed=1)
    pos = pos.clamp(max=width - 1)
    pos[-1] = length - 1
    gen = torch.Generator(device=device).manual_seed(2)
    key, value = (torch.randn(rows, kv_heads, 1, d, generator=gen, device=device, dtype=dtype)
                  for _ in range(2))
    return q, k, v, pos, key, value


def _written(k, v, pos, key, value):
    """The cache with the step's key and value at each row's position (a copy)."""
    k, v = k.clone(), v.clone()
    rows = torch.arange(k.shape[0], device=k.device)
    k[rows, :, pos], v[rows, :, pos] = key[:, :, 0], value[:, :, 0]
    return k, v


@pytest.mark.parametrize("kernel", ["auto", "sdpa"])
def test_the_step_key_and_value_are_written_at_each_rows_position(kernel):
    """`new` goes into the cache at every row's position, past the width too, and the rows
    attend over it as if it had been written first; the reference reads `width` positions."""
    q, k, v, pos, key, value = _with_new(5, 4, 2, 48, 8, torch.float32, "cpu", width=32)
    want_k, want_v = _written(k, v, pos, key, value)
    want = reference(q, want_k[:, :, :32], want_v[:, :, :32], pos.clamp(max=31), 0.3)
    got = attend(q, k, v, pos, 0.3, kernel, new=(key, value), width=32)
    torch.testing.assert_close(k, want_k)
    torch.testing.assert_close(v, want_v)
    torch.testing.assert_close(got[:-1], want.transpose(1, 2)[:-1])  # (the last: not running)


@pytest.mark.skipif(not KERNEL, reason="the Triton kernel needs a GPU")
@pytest.mark.parametrize("rows,length,width", [(64, 1536, 1024), (3, 4608, 4096)])
def test_kernel_writes_the_step_key_and_value(rows, length, width):
    """The kernel writes the step's key and value where the rows run (one part or split in
    parts) and attends as the reference does after a scatter."""
    q, k, v, pos, key, value = _with_new(rows, 28, 4, length, 128, torch.bfloat16, "cuda",
                                         width)
    want_k, want_v = _written(k, v, pos, key, value)
    want = reference(q.float(), want_k.float(), want_v.float(), pos, 128**-0.5).transpose(1, 2)
    got = attend(q, k, v, pos, 128**-0.5, new=(key, value), width=width)
    assert decode_attention.failure is None
    running = pos < width
    torch.testing.assert_close(k[running], want_k[running], atol=0, rtol=0)
    torch.testing.assert_close(v[running], want_v[running], atol=0, rtol=0)
    torch.testing.assert_close(got.float()[running], want[running], atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not KERNEL, reason="the Triton kernel needs a GPU")
def test_generations_with_the_kernel_equal_the_reference_path():
    """Whole generations (CUDA graphs, refills, the tail's shrinking) sample what the SDPA
    reference samples, up to rounding at an inverse-CDF boundary, and their log-probs are the
    teacher-forced forward's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = byte_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=224, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=7, num_key_value_heads=1,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval().to("cuda", torch.float16).requires_grad_(False)
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8.0)
    prompts = [("def f(x):" * (1 + i % 7))[: 5 + 37 * i % 300] for i in range(24)]
    slots = [i % 3 for i in range(24)]
    params = SamplingParams(temperature=1.0, max_new_tokens=160, eos_token_ids=())
    stop = lambda i, toks: len(toks) if len(toks) >= 20 + 13 * i % 140 else None  # noqa: E731
    runs = {a: generate(model, bank, tok, prompts, slots,
                        GenerateSpec(params=params, seed=3, batch_size=8, attention=a),
                        stop_fn=stop)
            for a in ("auto", "sdpa")}
    fast, ref = runs["auto"], runs["sdpa"]
    diverged = 0
    for f, r in zip(fast, ref, strict=True):
        same = next((j for j, (a, b) in enumerate(zip(f.token_ids, r.token_ids, strict=False))
                     if a != b), None)
        if same is None:
            assert f.token_ids == r.token_ids
            torch.testing.assert_close(f.logprobs, r.logprobs, atol=5e-2, rtol=0)
            continue
        # rounding moved the row's uniform across a boundary of the inverse CDF: the
        # neighbouring token in vocabulary order (anything else would be a wrong kernel)
        diverged += 1
        assert abs(f.token_ids[same] - r.token_ids[same]) == 1, (same, f.token_ids[same])
        torch.testing.assert_close(f.logprobs[:same], r.logprobs[:same], atol=5e-2, rtol=0)
    assert diverged <= len(prompts) // 4
    lp, mask = sequence_logprobs(model, bank, [g.prompt_ids for g in fast],
                                 [g.token_ids for g in fast], slots)
    forced = [lp[i][mask[i]].tolist() for i in range(len(fast))]
    torch.testing.assert_close(torch.tensor([x for row in forced for x in row]),
                               torch.tensor([x for g in fast for x in g.logprobs]),
                               atol=5e-2, rtol=0)
