"""Pack attention: each completion of a pack sees the prompt and its own earlier tokens only,
computed piecewise with fused kernels; checked against a dense masked reference."""

from __future__ import annotations

import pytest
import torch

from lorapop.engine.pack_attention import PackLayout, attend, lower_right_attention

# three sequences of width 16: two packs with a 5-token prompt (one group), one with a 3-token
# prompt, completions of different lengths (one empty), right padding after each pack
PROMPTS = [5, 5, 3]
COMPLETIONS = [[3, 1, 4], [2], [4, 0, 2]]
WIDTH = 16


def _segments() -> torch.Tensor:
    """[N, W]: 0 prompt, k completion k, -1 padding."""
    seg = torch.full((len(PROMPTS), WIDTH), -1)
    for s, (p, comps) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        seg[s, :p] = 0
        start = p
        for k, n in enumerate(comps, 1):
            seg[s, start : start + n] = k
            start += n
    return seg


def _reference(q, k, v, scale) -> torch.Tensor:
    """Dense masked attention [N, W, heads, d]: a query sees earlier keys of the prompt or of
    its own segment (padding queries see the prompt, so no row is empty)."""
    seg = _segments().to(q.device)
    causal = torch.ones(WIDTH, WIDTH, dtype=torch.bool, device=q.device).tril()
    allowed = causal & ((seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None]))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _qkv(seed: int = 0, device: str = "cpu", dtype=torch.float64, dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    n = len(PROMPTS)
    return tuple(torch.randn(n, h, WIDTH, dim, generator=g, dtype=torch.float64)
                 .to(device, dtype).requires_grad_()
                 for h in (4, 2, 2))  # grouped-query: 4 query heads over 2 key/value heads


# CPU in float64: exact; CUDA in bf16 (FlashAttention, head_dim 64), to bf16 tolerance, against
# the reference in float32 from the same inputs
CASES = [("cpu", torch.float64, 8, {}),
         pytest.param("cuda", torch.bfloat16, 64, {"atol": 2e-2, "rtol": 2e-2},
                      marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize(("device", "dtype", "dim", "tol"), CASES)
def test_pack_attention_equals_the_dense_mask_with_gradients(device, dtype, dim, tol):
    q, k, v = _qkv(0, device, dtype, dim)
    layout = PackLayout.build(PROMPTS, COMPLETIONS, WIDTH, torch.device(device))
    assert [g.prompt for g in layout.groups] == [5, 3]  # equal prompts share their calls
    out = attend(layout, q, k, v, scaling=0.3)
    ref = _reference(*(x.float() if dtype != torch.float64 else x for x in (q, k, v)), 0.3)
    real = (_segments() >= 0).to(device)
    torch.testing.assert_close(out[real].to(ref.dtype), ref[real], **tol)
    assert out[~real].abs().sum() == 0  # padding outputs are zeros
    w = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(1))
    w = w.to(device)
    grads = [torch.autograd.grad((x[real].to(ref.dtype) * w[real]).sum(), (q, k, v))
             for x in (out, ref)]
    grad_tol = {k: 2 * v for k, v in tol.items()}  # bf16: a few elements differ by 0.028 on an H100
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a.to(ref.dtype), b.to(ref.dtype), **grad_tol)
    # the layout matters: plain causal attention over the packs differs from it
    plain = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=0.3, enable_gqa=True).transpose(1, 2)
    assert not torch.allclose(plain[real].to(ref.dtype), ref[real], **tol)


@pytest.mark.parametrize(("device", "dtype", "dim", "tol"), CASES)
def test_lower_right_attention_with_and_without_repeated_heads(device, dtype, dim, tol):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 5, dim, generator=g, dtype=torch.float64).to(device, dtype)
    k, v = (torch.randn(3, 2, 9, dim, generator=g, dtype=torch.float64).to(device, dtype)
            for _ in range(2))
    out = lower_right_attention(q, k, v, 0.25)  # GQA where the kernel allows it
    torch.testing.assert_close(out, lower_right_attention(q, k, v, 0.25, gqa=False), **tol)
    # query j sees keys [0, 4 + j]: the last query sees every key, the first all but 4
    kr, vr = (x.repeat_interleave(2, 1).double() for x in (k, v))
    mask = torch.ones(5, 9, dtype=torch.bool, device=device).tril(4)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), kr, vr, attn_mask=mask,
                                                           scale=0.25)
    torch.testing.assert_close(out.double(), ref, **tol)


@pytest.mark.parametrize("completions", [[[0, 0], [1]], [[], [1]]])
def test_layout_of_packs_without_completion_tokens(completions):
    """A pack whose completions are all empty is its prompt alone."""
    q, k, v = (x.detach() for x in _qkv())
    q, k, v = q[:2], k[:2], v[:2]
    layout = PackLayout.build([4, 4], [c for c in completions], WIDTH, torch.device("cpu"))
    out = attend(layout, q, k, v, scaling=0.3)
    alone = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, :4], k[:, :, :4], v[:, :, :4], is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out[:, :4], alone.transpose(1, 2))
    assert out[0, 4:].abs().sum() == 0 and out[1, 5:].abs().sum() == 0


def test_gradients_return_in_the_projections_layout_without_copies():
    """transformers hands q/k/v over as transposed views of the projections' [N, W, heads * d]
    outputs: the packs' backward gives their gradients back in that layout, with no copy on
    the way (at 7B each copy is a full q-, k- or v-sized tensor per layer)."""
    n, d = len(PROMPTS), 8
    outputs = [torch.randn(n, WIDTH, heads * d, dtype=torch.float64, requires_grad=True)
               for heads in (4, 2, 2)]
    q, k, v = (x.view(n, WIDTH, -1, d).transpose(1, 2) for x in outputs)
    out = attend(PackLayout.build(PROMPTS, COMPLETIONS, WIDTH, torch.device("cpu")), q, k, v, 0.3)
    with torch.profiler.profile() as prof:
        grads = torch.autograd.grad(out.square().sum(), outputs)
    assert not [e.name for e in prof.events() if e.name in ("aten::clone", "aten::contiguous")]
    ref = _reference(q, k, v, 0.3)  # the same gradients as the dense reference
    real = _segments() >= 0
    expected = torch.autograd.grad(ref[real].square().sum(), outputs)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e)


def test_buckets_bound_the_padding_the_backward_keeps():
    """One answer at the cap among short ones, padded together, kept ~4x their tokens (a 7B
    update ran out of memory on an 80 GB card): each attention call's padded completion tokens
    stay within PAD_SLACK of its real ones, and every completion is in exactly one bucket."""
    import random

    from lorapop.engine.pack_attention import PAD_SLACK, buckets

    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([rng.randint(1, 64), 2048]) for _ in range(rng.randint(1, 24))]
        groups = buckets(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            assert len(g) * max(lengths[i] for i in g) <= PAD_SLACK * sum(lengths[i] for i in g)
    assert buckets([2048, 64, 64, 64]) == [[0], [1, 2, 3]]
    assert buckets([100, 100, 100, 100]) == [[0, 1, 2, 3]]  # equal lengths: one call
