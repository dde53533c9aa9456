"""Decode attention over each row's own cached positions: one query token a row.

A decode step's rows have every length up to the cap. The reference path (`reference`,
SDPA with a per-row mask) reads every row's cache up to the batch's attention width, the
masked positions too, through SDPA's memory-efficient kernel (the additive mask rules out
flash). The Triton kernel (`_split_kernel`) reads only positions [0, length) of each row:
the cost of a step is the tokens its rows hold, not rows x width. One program per (row, KV
head, split) holds that head's query group (grouped-query attention reads each key once) and
runs an online softmax over its share of the row; when rows x KV heads are too few to fill
the GPU (a phase's tail), each row is split along its length into parts that a second kernel
combines (flash-decoding, `_combine_kernel`). `attend` picks the kernels where they apply
(CUDA, bf16/fp16, Triton importable, not under torch.compile) and the reference elsewhere;
tests/engine/test_decode_attention.py compares the two.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from lorapop.kernels import built, failed

Kernel = Literal["auto", "sdpa"]
# the split kernel's launch (read at each call: `benchmarks/decode_attention.py --tune` times
# other values at the paper's shapes)
BLOCK_N = 64  # cached positions per inner step
NUM_WARPS, NUM_STAGES = 4, 3
WAVES = 2  # a row is split until its programs fill the multiprocessors this many times over
MIN_SPLIT = 512  # a split reads at least this many positions


def row_mask(pos: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [B, 1, 1, width] of rows over positions [0, pos[b]]: 0 there, -inf
    beyond (the form SDPA takes without a conversion)."""
    ok = torch.arange(width, device=pos.device) <= pos.view(-1, 1)
    mask = torch.zeros(ok.shape, dtype=dtype, device=pos.device).masked_fill_(~ok, -math.inf)
    return mask.view(-1, 1, 1, width)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, 1, D] against k, v [B, Hkv, W, D], row b over positions [0, pos[b]]:
    out [B, H, 1, D]. The query heads of each KV group fold into the query axis, so SDPA
    reads each cached key once. `mask`: `row_mask(pos, W, q.dtype)` made once for a step's
    layers by the caller (made here if None)."""
    b, heads, q_len, d = q.shape
    kv_heads, width = k.shape[1], k.shape[2]
    if mask is None:
        mask = row_mask(pos, width, q.dtype)
    folded = q.reshape(b, kv_heads, heads // kv_heads * q_len, d)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, heads, q_len, d)


#: why the kernel failed to build or run on this machine (the reference runs from then on)
failure: str | None = None
#: False: `attend` scatters the step's key and value before the kernel runs (a switch for
#: before/after measurements of the kernel's own write)
WRITE_IN_KERNEL = True


def applies(device: torch.device, dtype: torch.dtype, head_dim: int,
            kernel: Kernel = "auto") -> bool:
    """Whether `attend` runs the Triton kernel on such queries (outside torch.compile)."""
    return (kernel == "auto" and device.type == "cuda" and 16 <= head_dim <= 256
            and dtype in (torch.bfloat16, torch.float16) and failure is None
            and _triton() is not None)


def usable(q: torch.Tensor, kernel: Kernel = "auto") -> bool:
    """Whether `attend` runs the Triton kernel for this query."""
    return (applies(q.device, q.dtype, q.shape[-1], kernel)
            and not torch.compiler.is_compiling())


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    kernel: Kernel = "auto",
    mask: torch.Tensor | None = None,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """One decode step's attention: q [B, H, 1, D] (any strides), the cache k, v [B, Hkv, L,
    D] with the last dim contiguous, row b over positions [0, pos[b]], every running row's
    below `width` (default L: the reference reads that many). `new`: the step's key and value
    [B, Hkv, 1, D], written into k, v at pos[b] here: by the kernel itself where it runs (two
    scatter kernels a layer fewer), for the rows below `width` (the others do not run), else
    scattered for every row; without `new` they are already there. Returns out
    [B, 1, H, D] contiguous (the layout the output projection reads). `kernel="sdpa"` forces
    the reference (`mask`: its mask, see `reference`). A kernel that fails to compile or
    launch here (an older GPU, a Triton without a feature it needs) warns once and leaves the
    reference in its place for the rest of the process: generation is slower, not stopped."""
    global failure
    if usable(q, kernel):
        if new is not None and not WRITE_IN_KERNEL:
            write(k, v, pos, *new)
            new = None
        try:
            return _triton_attend(q, k, v, pos, scale, new, width)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - any compiler or launch failure: the reference
            failure = failed(e, "decode attention kernel", "using SDPA")
    if new is not None:
        write(k, v, pos, *new)
    if width is not None and width < k.shape[2]:  # a view: only the last dim is contiguous
        k, v = k[:, :, :width], v[:, :, :width]
    return reference(q, k, v, pos, scale, mask).transpose(1, 2).contiguous()


def write(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, key: torch.Tensor,
          value: torch.Tensor) -> None:
    """The step's key and value [B, Hkv, 1, D] into the cache k, v [B, Hkv, W, D] at each
    row's position."""
    at = pos.view(-1, 1, 1, 1).expand(-1, k.shape[1], 1, k.shape[3])
    k.scatter_(2, at, key)
    v.scatter_(2, at, value)


def splits_for(rows: int, kv_heads: int, width: int, processors: int) -> int:
    """Parts each row's length is split into: enough programs for about `WAVES` waves over
    the GPU's multiprocessors, each part at least `MIN_SPLIT` positions of the width."""
    want = math.ceil(WAVES * processors / max(1, rows * kv_heads))
    return max(1, min(want, width // MIN_SPLIT))


_triton = built(lambda: _build())  # (split kernel, combine kernel), or None without Triton


def _triton_attend(q, k, v, pos, scale, new=None, width=None):
    kern, combine = _triton()
    if q.stride(-1) != 1:
        q = q.contiguous()
    nk, nv = new if new is not None else (k, v)  # (unread without `new`)
    if nk.stride(-1) != 1 or nv.stride(-1) != 1:
        nk, nv = nk.contiguous(), nv.contiguous()
    b, heads, _, d = q.shape
    kv_heads, width = k.shape[1], width or k.shape[2]
    group = heads // kv_heads
    props = torch.cuda.get_device_properties(q.device)
    splits = splits_for(b, kv_heads, width, props.multi_processor_count)
    split_len = -(-width // splits)
    split_len = -(-split_len // BLOCK_N) * BLOCK_N
    out = torch.empty(b, 1, heads, d, dtype=q.dtype, device=q.device)
    if splits == 1:
        acc = mx = total = out  # unused: the kernel normalises and writes `out`
    else:  # each part's unnormalised output, running max and sum of exponentials
        acc = torch.empty(b, heads, splits, d, dtype=torch.float32, device=q.device)
        mx = torch.empty(b, heads, splits, dtype=torch.float32, device=q.device)
        total = torch.empty(b, heads, splits, dtype=torch.float32, device=q.device)
    kern[(b, kv_heads, splits)](
        q, k, v, pos, out, acc, mx, total, nk, nv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(2),
        nk.stride(0), nk.stride(1), nv.stride(0), nv.stride(1),
        split_len, splits, scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        GROUP=group, BLOCK_G=max(16, triton_next_pow2(group)), D=d,
        BLOCK_D=triton_next_pow2(d), BLOCK_N=BLOCK_N, ONE_PART=splits == 1,
        NEW=new is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if splits > 1:  # one program per (row, head) weighs its parts: one launch, not six
        combine[(b, heads)](acc, mx, total, out, out.stride(0), out.stride(2), splits,
                            D=d, BLOCK_D=triton_next_pow2(d),
                            BLOCK_S=triton_next_pow2(splits), num_warps=1)
    return out


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def _split_kernel(Q, K, V, Pos, Out, Acc, M, L, NewK, NewV,
                      sqb, sqh, skb, skh, skn, svb, svh, svn, sob, soh, snkb, snkh, snvb, snvh,
                      split_len, splits, qk_scale,
                      GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PART: tl.constexpr,
                      NEW: tl.constexpr):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        last = tl.load(Pos + row).to(tl.int32)  # the step's own position
        length = last + 1
        start = part * split_len
        end = tl.minimum(start + split_len, length)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = kvh * GROUP + g
        gmask = g < GROUP
        dmask = d < D
        q = tl.load(Q + row * sqb + heads[:, None] * sqh + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        kbase = K + row.to(tl.int64) * skb + kvh * skh
        vbase = V + row.to(tl.int64) * svb + kvh * svh
        # with NEW the loop stops below the step's position, whose key and value are read
        # and written after it (nothing held in registers through the loop)
        stop = tl.minimum(end, last) if NEW else end
        for n0 in range(start, stop, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < stop
            kt = tl.load(kbase + n[:, None] * skn + d[None, :],
                         mask=nmask[:, None] & dmask[None, :], other=0.0)
            s = tl.dot(q, tl.trans(kt)) * qk_scale  # [BLOCK_G, BLOCK_N], log2 units
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            vt = tl.load(vbase + n[:, None] * svn + d[None, :],
                         mask=nmask[:, None] & dmask[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m = m_new
        if NEW:  # a compile-time branch: without NEW, NewK and NewV are not read
            mine = (start <= last) & (last < end)  # this part holds the step's position
            if mine:  # its key and value into the cache, and one more online-softmax update
                nk = tl.load(NewK + row.to(tl.int64) * snkb + kvh * snkh + d, mask=dmask,
                             other=0.0)
                nv = tl.load(NewV + row.to(tl.int64) * snvb + kvh * snvh + d, mask=dmask,
                             other=0.0)
                tl.store(kbase + last * skn + d, nk, mask=dmask)
                tl.store(vbase + last * svn + d, nv, mask=dmask)
                s_new = tl.sum(q.to(tl.float32) * nk.to(tl.float32)[None, :], 1) * qk_scale
                m_new = tl.maximum(m, s_new)
                alpha = tl.exp2(m - m_new)
                p_new = tl.exp2(s_new - m_new)
                total = total * alpha + p_new
                acc = acc * alpha[:, None] + p_new[:, None] * nv.to(tl.float32)[None, :]
                m = m_new
        omask = gmask[:, None] & dmask[None, :]
        if ONE_PART:
            o = acc / total[:, None]
            tl.store(Out + row * sob + heads[:, None] * soh + d[None, :],
                     o.to(Out.dtype.element_ty), mask=omask)
        else:
            at = (row * (GROUP * tl.num_programs(1)) + heads) * splits + part
            tl.store(Acc + at[:, None] * D + d[None, :], acc, mask=omask)
            tl.store(M + at, m, mask=gmask)
            tl.store(L + at, total, mask=gmask)

    @triton.jit
    def _combine_kernel(Acc, M, L, Out, sob, soh, splits,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        """Out[row, head] from the parts' unnormalised outputs, each weighed by 2^(its max -
        the row's max): parts past a row's end hold max -inf and weigh 0."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        sp = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        smask = sp < splits
        at = (row * tl.num_programs(1) + head) * splits + sp
        m = tl.load(M + at, mask=smask, other=float("-inf"))
        w = tl.exp2(m - tl.max(m, 0))
        w = tl.where(smask, w, 0.0)
        den = tl.sum(tl.load(L + at, mask=smask, other=0.0) * w, 0)
        acc = tl.load(Acc + at[:, None] * D + d[None, :], mask=smask[:, None] & (d < D)[None, :],
                      other=0.0)
        o = tl.sum(acc * w[:, None], 0) / den
        tl.store(Out + row * sob + head * soh + d, o.to(Out.dtype.element_ty), mask=d < D)

    return _split_kernel, _combine_kernel
