"""The decode cache's shrink GEMM as one Triton kernel: h = x @ A^T, masked to each row's slot.

Decoding runs `h = x @ A_all^T` per projection group with M = batch rows, few columns
(G*N*r = 32..768) and a long K (3584, 18944 at 7B): cuBLAS covers that with a handful of
CTAs, and the slot mask was a second launch. Here K is split over enough CTAs to fill the
chip; each CTA writes its fp32 partial tile to a workspace and bumps an atomic counter, and
the last CTA of each output tile sums the partials, zeroes the columns of other slots and
writes h. The counters are reset by that CTA, so no zeroing launch is needed and a CUDA graph
can replay the kernel. Optional: without Triton (CPU builds) `available()` is False and the
decode cache uses mm + mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None

BM_MAX, BK, MAX_SPLIT, TARGET_CTAS = 64, 64, 16, 128


def available(x: Tensor) -> bool:
    """Whether the fused kernel can serve this input (CUDA, half precision, Triton present)."""
    return triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


if triton is not None:

    @triton.jit
    def _shrink_kernel(
        x_ptr,
        a_ptr,
        ids_ptr,
        h_ptr,
        ws_ptr,
        cnt_ptr,
        M,
        C,
        K,
        stride_x,
        stride_a,
        stride_h,
        K_CHUNK: tl.constexpr,
        RANK: tl.constexpr,
        SLOTS: tl.constexpr,
        MASK: tl.constexpr,
        SPLIT: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BLOCK_K)
        k_lo = pid_k * K_CHUNK
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K_CHUNK, BLOCK_K):
            kk = k_lo + k + rk
            xt = tl.load(
                x_ptr + rm[:, None] * stride_x + kk[None, :],
                mask=(rm[:, None] < M) & (kk[None, :] < K),
                other=0.0,
            )
            at = tl.load(
                a_ptr + rn[None, :] * stride_a + kk[:, None],
                mask=(rn[None, :] < C) & (kk[:, None] < K),
                other=0.0,
            )
            acc += tl.dot(xt, at)
        h_ptrs = h_ptr + rm[:, None] * stride_h + rn[None, :]
        h_mask = (rm[:, None] < M) & (rn[None, :] < C)
        if SPLIT == 1:
            if MASK:
                ids = tl.load(ids_ptr + rm, mask=rm < M, other=-1)
                own = ids[:, None] == ((rn // RANK) % SLOTS)[None, :]
                acc = tl.where(own, acc, 0.0)
            tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=h_mask)
        else:
            tile = pid_m * tl.num_programs(1) + pid_n
            local = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
            ws = ws_ptr + tile * (SPLIT * BM * BN) + local
            tl.store(ws + pid_k * (BM * BN), acc)
            tl.debug_barrier()  # every thread's partial is written before the release below
            count = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if count == SPLIT - 1:  # last CTA of this tile: reduce, mask, store, reset
                total = tl.zeros((BM, BN), dtype=tl.float32)
                for s in tl.static_range(SPLIT):
                    total += tl.load(ws + s * (BM * BN), cache_modifier=".cg")
                if MASK:
                    ids = tl.load(ids_ptr + rm, mask=rm < M, other=-1)
                    own = ids[:, None] == ((rn // RANK) % SLOTS)[None, :]
                    total = tl.where(own, total, 0.0)
                tl.store(h_ptrs, total.to(h_ptr.dtype.element_ty), mask=h_mask)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


def plan(rows: int, cols: int, width: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, split, k_chunk, tiles) for an [rows, width] x [width, cols] shrink."""
    bm = min(BM_MAX, max(16, 1 << (rows - 1).bit_length()))
    bn = 32 if cols <= 256 else 64
    tiles = -(-rows // bm) * -(-cols // bn)
    split = max(1, min(MAX_SPLIT, TARGET_CTAS // tiles, width // (4 * BK)))
    per_cta = -(-width // split)
    k_chunk = -(-per_cta // BK) * BK
    split = -(-width // k_chunk)
    return bm, bn, split, k_chunk, tiles


def counters(rows: int, cols: int, width: int, device: torch.device) -> Tensor:
    """Zeroed int32 counters for one (rows, cols, width) shape; the kernel leaves them zeroed."""
    return torch.zeros(plan(rows, cols, width)[4], dtype=torch.int32, device=device)


def shrink(x: Tensor, a: Tensor, ids: Tensor, rank: int, slots: int, cnt: Tensor) -> Tensor:
    """h [M, C] = x [M, K] @ a[C, K]^T, column c kept only where (c // rank) % slots == ids[m].

    `slots == 1` skips the mask. `cnt` comes from `counters` for this shape and must not be
    shared with a launch that may run concurrently.
    """
    rows, width = x.shape
    cols = a.shape[0]
    if x.stride(1) != 1 or a.stride(1) != 1:
        raise ValueError("shrink needs row-major x and A")
    bm, bn, split, k_chunk, tiles = plan(rows, cols, width)
    h = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    ws = torch.empty(
        tiles * split * bm * bn if split > 1 else 1, dtype=torch.float32, device=x.device
    )
    grid = (-(-rows // bm), -(-cols // bn), split)
    _shrink_kernel[grid](
        x,
        a,
        ids,
        h,
        ws,
        cnt,
        rows,
        cols,
        width,
        x.stride(0),
        a.stride(0),
        h.stride(0),
        K_CHUNK=k_chunk,
        RANK=rank,
        SLOTS=slots,
        MASK=slots > 1,
        SPLIT=split,
        BM=bm,
        BN=bn,
        BLOCK_K=BK,
        num_warps=4,
        num_stages=3,
    )
    return h
