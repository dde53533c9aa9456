"""Attention over prompt-shared packs [prompt, c1, ..., ck] with SDPA's fused kernels.

A pack is one sequence of the update's forward: a prompt once, then every completion of that
prompt (a student's answers to one task). Each completion must see the prompt and its own
earlier tokens only. A dense [W, W] mask says so but rules out the fused kernels (and their
grouped-query path), and most of its square is masked. Here a pack's attention is computed
piecewise instead: the prompt's queries causally over the prompt (`is_causal`), and the
completions' queries, batched and right-padded to the longest of their bucket, over [prompt
keys; own keys] under a bottom-right-aligned causal mask (`causal_lower_right`), which SDPA
runs with FlashAttention on CUDA. Completions are bucketed by length (`buckets`) so that the
padded queries and gathered keys, which the backward keeps, stay within `PAD_SLACK` of the
real ones: one answer at the cap among short ones, padded together, kept ~4x their tokens and
ran a 7B update out of memory on an 80 GB card. Keys and values are gathered per head group, never repeated per
query head. Right padding is exact: query j of a completion sees keys up to prompt + j, so no
real query ever sees a padding key, and padding outputs are written to a scratch row that is
dropped (selecting the real ones first cost an atomic index_add_ over them in the backward:
~1% of a 7B student micro-batch).

The layout travels as the `pack_layout` keyword of the model call: transformers hands extra
keywords to the attention function, and its activation checkpointing replays them, so the
recomputed forward attends exactly as the first one. The attention function is registered
under `NAME` and installed on the model once (`patches.use_pack_attention`); every forward without a layout
(rows that share nothing, other callers) runs transformers' own SDPA path, with its own masks
except inside `maskless` (the update's forwards: causal rows need none).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lorapop.engine.transfer import host_to_device

NAME = "lorapop_packs"


#: Padded completion tokens of one attention call stay within this factor of the real ones
PAD_SLACK = 1.25


@dataclass
class _Bucket:
    """Completions of similar length, right-padded to the longest (C tokens): one SDPA call."""

    queries: torch.Tensor  # [R, C] flat positions (padding repeats the last token)
    keys: torch.Tensor  # [R, prompt + C] flat positions of each one's keys


@dataclass
class _Group:
    """Packs of one prompt length: their prompts take one SDPA call, their completions one
    per bucket."""

    rows: torch.Tensor  # [G] sequences (batch rows) of these packs
    prompt: int  # prompt tokens, the same for every pack of the group
    buckets: list[_Bucket]  # empty when every completion is empty


def buckets(lengths: Sequence[int], slack: float = PAD_SLACK) -> list[list[int]]:
    """Indices of `lengths` (> 0) in groups, longest first, each padded to its longest within
    `slack` x its real tokens: len(g) * max <= slack * sum."""
    out: list[list[int]] = []
    top = real = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if out and (len(out[-1]) + 1) * top <= slack * (real + n):
            out[-1].append(i)
            real += n
        else:
            out.append([i])
            top = real = n
    return out


@dataclass
class PackLayout:
    """Where each pack's prompt and completions lie in a [N, W] batch of pack sequences."""

    sequences: int
    width: int
    groups: list[_Group]
    # flat position of every output, in the order the groups yield them; padding outputs go
    # to the scratch position [N * width], one past the batch
    written: torch.Tensor

    @classmethod
    def build(cls, prompts: Sequence[int], completions: Sequence[Sequence[int]], width: int,
              device: torch.device) -> PackLayout:
        """Layout of packs whose sequence s is [prompt of `prompts[s]` tokens, completions of
        `completions[s]` tokens in order, right padding to `width`]."""
        def put(x: torch.Tensor) -> torch.Tensor:
            return host_to_device(x, device)

        by_prompt: dict[int, list[int]] = {}
        for s, p in enumerate(prompts):
            by_prompt.setdefault(int(p), []).append(s)
        groups, written = [], []
        scratch = len(prompts) * width
        for p, rows in by_prompt.items():
            written.append((torch.tensor(rows)[:, None] * width + torch.arange(p)).flatten())
            comps = [(s, s * width + start, n) for s in rows
                     for start, n in _spans(p, completions[s]) if n > 0]
            parts = []
            for b in buckets([n for *_, n in comps]):
                lens = torch.tensor([comps[i][2] for i in b])
                j = torch.arange(int(lens.max()))
                last = torch.minimum(j, lens[:, None] - 1)  # padding repeats the last token
                queries = torch.tensor([comps[i][1] for i in b])[:, None] + last
                prompt_keys = torch.tensor([comps[i][0] * width for i in b])[:, None] \
                    + torch.arange(p)
                written.append(torch.where(j < lens[:, None], queries, scratch).flatten())
                parts.append(_Bucket(put(queries), put(torch.cat([prompt_keys, queries], 1))))
            groups.append(_Group(put(torch.tensor(rows)), p, parts))
        return cls(len(prompts), width, groups, put(torch.cat(written)))


def _spans(prompt: int, lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(start, length) of each completion in a pack sequence."""
    out, start = [], prompt
    for n in lengths:
        out.append((start, int(n)))
        start += int(n)
    return out


def lower_right_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          scale: float | None, dropout: float = 0.0,
                          gqa: bool | None = None) -> torch.Tensor:
    """SDPA with query j of L seeing keys [0, S - L + j] (S >= L keys), GQA without repeating
    K/V where the kernel allows it: FlashAttention on CUDA (torch's lower-right efficient
    kernel takes no GQA, so K/V are repeated there) and the masked math path elsewhere."""
    groups = query.shape[1] // key.shape[1]
    if gqa is None:
        gqa = not query.is_cuda or torch.backends.cuda.can_use_flash_attention(
            torch.backends.cuda.SDPAParams(query, key, value, None, dropout, False, True))
    if groups > 1 and not gqa:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    mask = causal_lower_right(query.shape[2], key.shape[2])
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                          scale=scale, enable_gqa=groups > 1 and gqa)


def attend(layout: PackLayout, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, scaling: float | None, dropout: float = 0.0
                   ) -> torch.Tensor:
    """Attention output [N, W, heads, head_dim] of packs laid out by `layout`, from query
    [N, heads, W, d] and key/value [N, kv_heads, W, d] (the attention interface's layout);
    positions outside every pack give zeros."""
    n, heads, w, d = query.shape
    if (n, w) != (layout.sequences, layout.width):
        raise ValueError(f"pack layout of {layout.sequences} x {layout.width} positions for a "
                         f"batch of {n} x {w}")
    # every piece is cut from the [N * W, heads, d] layout the projections wrote (transformers
    # hands q/k/v over as its transposed view), so their gradients meet there contiguous: cut
    # from query/key/value instead, the prompts' gradients met the completions' in the
    # transposed view (a strided add, ~0.8% of a 7B student micro-batch) and left it as copies
    flat = [x.transpose(1, 2).reshape(n * w, x.shape[1], d) for x in (query, key, value)]
    by_sequence = [x.view(n, w, x.shape[1], d) for x in flat]
    parts = []
    for g in layout.groups:
        q, k, v = (x[:, : g.prompt].transpose(1, 2) for x in by_sequence)
        if g.rows.numel() < n:  # else every sequence, in order
            q, k, v = (x.index_select(0, g.rows) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                             scale=scaling, enable_gqa=heads != key.shape[1])
        parts.append(out.transpose(1, 2).reshape(-1, heads, d))
        for b in g.buckets:
            q = flat[0][b.queries].transpose(1, 2)  # [R, heads, C, d]
            k, v = (x[b.keys].transpose(1, 2) for x in flat[1:])  # [R, kv_heads, prompt + C, d]
            out = lower_right_attention(q, k, v, scaling, dropout)
            parts.append(out.transpose(1, 2).reshape(-1, heads, d))
    out = query.new_zeros(n * w + 1, heads, d).index_copy_(0, layout.written, torch.cat(parts))
    return out[:-1].view(n, w, heads, d)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
               scaling: float | None = None, pack_layout: PackLayout | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    if pack_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    window = kwargs.get("sliding_window")
    if window is not None and pack_layout.width > window:
        raise ValueError(f"a pack of {pack_layout.width} tokens exceeds the sliding window "
                         f"({window})")
    return attend(pack_layout, query, key, value, scaling, dropout), None


#: Set while forwards that need no mask run (`maskless`)
_MASKLESS: ContextVar[bool] = ContextVar("lorapop_maskless", default=False)


@contextmanager
def maskless() -> Iterator[None]:
    """Forwards inside the block build no attention mask: packs attend through their layout,
    and rows whose padding only follows their real tokens attend causally (SDPA's causal
    kernel). With an all-ones padding mask passed (so transformers does not search the
    position ids for packed sequences), their mask step then reads nothing back to the host,
    where it would wait for the GPU to finish everything queued before it."""
    token = _MASKLESS.set(True)
    try:
        yield
    finally:
        _MASKLESS.reset(token)


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """SDPA's masks, or none inside `maskless`."""
    return None if _MASKLESS.get() else sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, _attention)
AttentionMaskInterface.register(NAME, _mask)  # outside `maskless`: exactly SDPA's masks

