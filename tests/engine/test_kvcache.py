"""The static KV cache's attention: chunked prefill and per-row decode equal plain attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lorapop.engine import kvcache
from lorapop.engine.kvcache import Prefill, StaticKV, kv_bytes_per_token
from lorapop.engine.patches import static_kv
from tiny_models import tiny_model

B, HEADS, KV_HEADS, D, LENGTH = 3, 4, 2, 8, 16


class Layer(torch.nn.Module):
    layer_idx = 0


def _qkv(n: int, heads: int, seed: int) -> torch.Tensor:
    return torch.randn(B, heads, n, D, generator=torch.Generator().manual_seed(seed))


def _reference(q, k, v, causal: bool = True) -> torch.Tensor:
    """Attention with K/V repeated per query head: [B, n, heads, D]."""
    k, v = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)


@pytest.fixture
def kv(monkeypatch):
    cache = StaticKV(1, B, KV_HEADS, LENGTH, D, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(kvcache, "_active", cache)
    return cache


def test_chunked_prefill_equals_causal_attention(kv):
    q, k, v = _qkv(10, HEADS, 0), _qkv(10, KV_HEADS, 1), _qkv(10, KV_HEADS, 2)
    rows = torch.tensor([2, 0, 1])  # cache rows in another order than the batch
    outs = []
    for s, e in ((0, 4), (4, 7), (7, 10)):
        kv.prefill = Prefill(rows, s)
        out, _ = kvcache._attention(Layer(), q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], None)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), _reference(q, k, v))
    torch.testing.assert_close(kv.k[0][rows, :, :10], k)
    torch.testing.assert_close(kv.v[0][rows, :, :10], v)


def test_decode_writes_and_reads_each_row_at_its_own_position(kv):
    kv.k[0].normal_(generator=torch.Generator().manual_seed(3))
    kv.v[0].normal_(generator=torch.Generator().manual_seed(4))
    kv.pos.copy_(torch.tensor([0, 5, 11]))
    q, k, v = _qkv(1, HEADS, 5), _qkv(1, KV_HEADS, 6), _qkv(1, KV_HEADS, 7)
    ok = torch.arange(LENGTH) <= kv.pos[:, None]
    mask = torch.where(ok, 0.0, float("-inf")).view(B, 1, 1, LENGTH)
    out, _ = kvcache._attention(Layer(), q, k, v, mask)
    for b, p in enumerate(kv.pos.tolist()):
        torch.testing.assert_close(kv.k[0][b, :, p], k[b, :, 0])
        keys, values = kv.k[0][b : b + 1, :, : p + 1], kv.v[0][b : b + 1, :, : p + 1]
        want = _reference(q[b : b + 1], keys, values, causal=False)  # keys 0..p, no others
        torch.testing.assert_close(out[b : b + 1], want)


def test_static_kv_restores_the_attention_implementation():
    model = tiny_model()
    before = model.config._attn_implementation
    cache = StaticKV(2, 1, KV_HEADS, LENGTH, D, torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError), static_kv(model, cache):
        assert model.config._attn_implementation == kvcache.NAME
        raise RuntimeError("boom")
    assert model.config._attn_implementation == before and kvcache._active is None
    assert kv_bytes_per_token(model) == 2 * 2 * KV_HEADS * D * 4  # 2 layers, fp32
