"""A static KV cache, plugged into a Hugging Face model through its attention interface.

The cache is preallocated ([layers, batch, kv_heads, length, head_dim]) and written in place
at a position held in a device tensor, so a decode step has fixed shapes and addresses and
can be captured in a CUDA graph. It lives in a registered attention function rather than in
a transformers `Cache` so that (1) the cache API, which changes between transformers
releases, stays out of the way, and (2) decode attention can fold the query heads of each
KV group into the query-length axis: grouped-query attention then reads every cached key
once, where transformers' masked SDPA path would first copy K/V for every query head.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "lorapop_static_kv"


class StaticKV:
    """Keys and values of every layer for a fixed batch size and length.

    One tensor per layer ([batch, kv_heads, length, head_dim]), so that under torch.compile
    the in-place cache write mutates a whole graph input rather than a view of a shared one.
    `pos` is the cache index that the next decoded token is written to. During prefill
    (`prefilling`), the first q positions are written and attention runs over them only.
    """

    def __init__(
        self,
        layers: int,
        batch: int,
        kv_heads: int,
        length: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (batch, kv_heads, length, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.length = length
        self.prefilling = False

    @property
    def nbytes(self) -> int:
        return sum(2 * k.numel() * k.element_size() for k in self.k)


_active: StaticKV | None = None


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    kv = _active
    if kv is None:  # a forward outside generation: plain SDPA
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    window = kwargs.get("sliding_window")
    if window is not None and kv.length > window:
        raise ValueError(f"sequence of {kv.length} tokens exceeds the sliding window ({window})")
    i = module.layer_idx
    if kv.prefilling:
        q_len = query.shape[2]
        kv.k[i][:, :, :q_len].copy_(key)
        kv.v[i][:, :, :q_len].copy_(value)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=0.0, scaling=scaling, **kwargs
        )
    # decode: one query token per row, mask [B, 1, 1, length]
    k, v = kv.k[i], kv.v[i]
    k.index_copy_(2, kv.pos.view(1), key)
    v.index_copy_(2, kv.pos.view(1), value)
    b, heads, q_len, d = query.shape
    groups = heads // k.shape[1]
    q = query.reshape(b, k.shape[1], groups * q_len, d)  # heads are ordered kv-group-major
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, heads, q_len, d).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, _attention)


@contextmanager
def static_kv(model: Any, kv: StaticKV) -> Iterator[None]:
    """Route the model's attention through `kv` for the duration of the block."""
    global _active
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    _active = kv
    try:
        yield
    finally:
        _active = None
        model.set_attn_implementation(previous)
