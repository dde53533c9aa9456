"""Pack attention: each completion of a pack sees the prompt and its own earlier tokens only,
computed piecewise with fused kernels; checked against a dense masked reference."""

from __future__ import annotations

import pytest
import torch

from lorapop.engine.pack_attention import PackLayout, lower_right_attention, pack_attention

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
    seg = _segments()
    causal = torch.ones(WIDTH, WIDTH, dtype=torch.bool).tril()
    allowed = causal & ((seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None]))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _qkv(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    n = len(PROMPTS)
    return tuple(torch.randn(n, h, WIDTH, 8, generator=g, dtype=torch.float64).requires_grad_()
                 for h in (4, 2, 2))  # grouped-query: 4 query heads over 2 key/value heads


def test_pack_attention_equals_the_dense_mask_with_gradients():
    q, k, v = _qkv()
    layout = PackLayout.build(PROMPTS, COMPLETIONS, WIDTH, torch.device("cpu"))
    assert [g.prompt for g in layout.groups] == [5, 3]  # equal prompts share their calls
    out = pack_attention(layout, q, k, v, scaling=0.3)
    ref = _reference(q, k, v, 0.3)
    real = _segments() >= 0
    torch.testing.assert_close(out[real], ref[real])
    assert out[~real].abs().sum() == 0  # padding outputs are zeros
    w = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(1))
    grads = [torch.autograd.grad((x[real] * w[real]).sum(), (q, k, v)) for x in (out, ref)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)
    # the layout matters: plain causal attention over the packs differs from it
    plain = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=0.3, enable_gqa=True).transpose(1, 2)
    assert not torch.allclose(plain[real], ref[real])


def test_lower_right_attention_with_and_without_repeated_heads():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 5, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out = lower_right_attention(q, k, v, 0.25, gqa=True)
    torch.testing.assert_close(out, lower_right_attention(q, k, v, 0.25, gqa=False))
    # query j sees keys [0, 4 + j]: the last query sees every key, the first all but 4
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    mask = torch.ones(5, 9, dtype=torch.bool).tril(4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("completions", [[[0, 0], [1]], [[], [1]]])
def test_layout_of_packs_without_completion_tokens(completions):
    """A pack whose completions are all empty is its prompt alone."""
    q, k, v = (x.detach() for x in _qkv())
    q, k, v = q[:2], k[:2], v[:2]
    layout = PackLayout.build([4, 4], [c for c in completions], WIDTH, torch.device("cpu"))
    out = pack_attention(layout, q, k, v, scaling=0.3)
    alone = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, :4], k[:, :, :4], v[:, :, :4], is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out[:, :4], alone.transpose(1, 2))
    assert out[0, 4:].abs().sum() == 0 and out[1, 5:].abs().sum() == 0
