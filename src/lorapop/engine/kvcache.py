"""A static KV cache, plugged into a Hugging Face model through its attention interface.

The cache is preallocated ([layers, batch, kv_heads, length, head_dim]); each row holds one
sequence from cache index 0, so a token's cache index is its position id. Decode writes every
row's new key at that row's own position (held in a device tensor), so a step has fixed shapes
and addresses and can be captured in a CUDA graph, while rows of different lengths and ages
share the batch (continuous batching). It lives in a registered attention function rather
than in a transformers `Cache` so that (1) the cache API, which changes between transformers
versions, stays out of the way, and (2) decode attention can fold the query heads of each KV
group into the query-length axis: grouped-query attention then reads every cached key once,
where transformers' masked SDPA path would first copy K/V for every query head, and each row
reads only its own positions (`decode_attention`).

Prefill fills chosen cache rows with one chunk of their prompts at a time (`Prefill`): the
chunk's keys are written at [start, start + chunk) and its queries attend causally to the
row's keys [0, start + chunk), so a long prompt never needs more than one chunk of activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lorapop.engine import decode_attention

NAME = "lorapop_static_kv"


def kv_shape(model: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of the model's cache."""
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_token(model: Any) -> int:
    """Bytes one token's keys and values take in the cache, over all layers."""
    layers, kv_heads, head_dim = kv_shape(model)
    dtype = next(model.parameters()).dtype
    return 2 * layers * kv_heads * head_dim * dtype.itemsize


@dataclass
class Prefill:
    """Cache rows `rows` [R] being filled with tokens at positions [start, start + chunk)."""

    rows: torch.Tensor
    start: int


class StaticKV:
    """Keys and values of every layer for a fixed batch size and length.

    One tensor per layer ([batch, kv_heads, length, head_dim]), so that under torch.compile
    the in-place cache write mutates a whole graph input rather than a view of a shared one.
    `pos` [batch] is each row's cache index for the next decoded token; decode runs over the
    first `rows` rows (the decoder moves the last running rows there) and attends over
    the first `width` positions (every running row's must lie below it; a row past it does
    not run, and its key may not be written), of which `decode_attention` reads only each
    row's own. While `prefill` is set, forwards fill those rows instead of decoding.
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
        kernel: decode_attention.Kernel = "auto",
    ) -> None:
        shape = (batch, kv_heads, length, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.rows = batch  # decode runs over the first `rows` cache rows
        self.length = length
        self.width = length  # decode attends over positions [0, width)
        self.prefill: Prefill | None = None
        self.kernel = kernel  # decode attention: "auto" (the kernel where it applies) or "sdpa"

    @property
    def nbytes(self) -> int:
        return sum(2 * k.numel() * k.element_size() for k in self.k)

    def copy_rows(self, dst: list[int], src: list[int], width: int) -> None:
        """Rows `dst` get rows `src`'s keys and values at positions [0, width)."""
        d = torch.tensor(dst, device=self.pos.device)
        s = torch.tensor(src, device=self.pos.device)
        for cache in (*self.k, *self.v):
            cache[d, :, :width] = cache[s, :, :width]

    def regrid(self, batch: int, length: int, rows: list[int], width: int) -> None:
        """Re-size to `batch` rows of `length` positions, new row j holding old row `rows[j]`'s
        positions [0, width) and position. One layer at a time, each old layer freed as its
        new one is filled: the peak is the old cache and one new layer, not both caches."""
        src = torch.tensor(rows, dtype=torch.long, device=self.pos.device)
        n = len(rows)
        for cache in (self.k, self.v):
            for i, old in enumerate(cache):
                new = old.new_zeros(batch, old.shape[1], length, old.shape[3])
                new[:n, :, :width] = old[src, :, :width]
                cache[i] = new
            del old
        pos = self.pos.new_zeros(batch)
        pos[:n] = self.pos[src]
        self.pos, self.rows, self.length, self.width = pos, batch, length, length


_active: StaticKV | None = None


def _prefill_attention(
    kv: StaticKV, i: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling
) -> torch.Tensor:
    pf = kv.prefill
    assert pf is not None
    s, q_len = pf.start, query.shape[2]
    kv.k[i][pf.rows, :, s : s + q_len] = key
    kv.v[i][pf.rows, :, s : s + q_len] = value
    if s == 0:  # the whole context is this chunk: plain causal attention (flash on CUDA)
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
    groups = query.shape[1] // key.shape[1]
    k = kv.k[i][pf.rows, :, : s + q_len].repeat_interleave(groups, dim=1)
    v = kv.v[i][pf.rows, :, : s + q_len].repeat_interleave(groups, dim=1)
    mask = causal_lower_right(q_len, s + q_len)  # query j sees keys up to s + j
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)


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
    if kv.prefill is not None:  # the model's own mask is ignored: causality is all we need
        out = _prefill_attention(kv, i, query, key, value, scaling)
        return out.transpose(1, 2).contiguous(), None
    # decode: one query token per row, written at the row's own position
    k, v, pos = kv.k[i][: kv.rows], kv.v[i][: kv.rows], kv.pos[: kv.rows]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # the decoder passes the reference's mask, made once a step, where the kernel does not run
    return decode_attention.attend(query, k, v, pos, scale, kv.kernel, attention_mask,
                                   new=(key, value), width=kv.width), None


AttentionInterface.register(NAME, _attention)


def activate(kv: StaticKV | None) -> None:
    """The cache the attention function reads (None: plain SDPA); set by `patches.static_kv`,
    which also routes the model's attention here."""
    global _active
    _active = kv
