"""The decode cache's LoRA terms as two Triton kernels that read only each row's own adapter.

`DecodeCache`'s plain path runs every row through every slot's A (one GEMM over the
[G x N x r, in] stack), masks the result to the row's own slot and adds `h @ B_all` over all
N slots' B: at a decode step's few hundred rows each of those small GEMMs, their split-K
reductions and the masks cost a launch and a ramp more than its bytes (~2.2 ms of a 16 ms 7B
step at 176 rows, ~1.7 of 7.5 at 8 rows on an H200: `docs/performance.md`). Here the rows are
taken in slot order (`Routing.perm`, `Routing.ends`, kept on the device, so a captured step
follows the routing): each program holds up to `BM` rows of one slot and reads only that
slot's A or B.

- `shrink`: h = x @ A[slot]^T for every member of a group that reads one input (q/k/v,
  gate/up), each row's own slot only; the input dimension is split over programs and the parts
  kept in float32 ([splits, rows, members x r]).
- `expand`: out += h @ B[slot] for one member, in place: the parts are summed in order and
  rounded to the compute dtype (as the plain path's h is), and the product is added to the base
  output in float32 and rounded once (as `addmm_` does). It also reads h as a projection's
  GEMM gives it (`all_slots`: every slot's columns, the compute dtype, `engine.merged`), where
  no shrink runs. `expand_group` does every member of a
  group at once into the group's merged output (`engine.merged`), one launch for q/k/v.
- `expand_swiglu`: the gate/up group's expand with the MLP's silu(gate) * up as its
  epilogue (`AdapterBank.fused_swiglu`): gate and up are read once, and only the activation
  is written.

`usable` says where they run (CUDA, bf16/fp16, Triton importable, outside torch.compile);
a kernel that fails to build or launch warns once and leaves the plain path in its place.
tests/lora/test_decode_cache.py compares the two on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from lorapop.kernels import built, failed

BM = 16  # rows of one slot per program (the least tl.dot takes)
#: rows per program for a prefill's tokens: each program reads its slot's A whole, so a
#: prefill's thousands of tokens in tiles of `BM` would read it thousands of times
BM_TOKENS = 64
BK = 256  # input features per inner step of the shrink
BN = 128  # output features per expand program
#: tiles of `BM` rows of one slot per `expand_swiglu` program at a decode step, which reads
#: its slot's two B blocks once for all of them: read per tile, as `expand` reads B, they
#: moved more bytes than gate, up and the activation together (at 7B on an H200: 384-row
#: steps 6% slower at 1 tile than at 8 or 16)
SWIGLU_TILES = 8
MIN_SPLIT = 1024  # input features each shrink program reads at least
MAX_SPLITS = 16
T = TypeVar("T")

#: False runs the plain path (a switch for before/after measurements)
ENABLED = True
#: False runs the gate/up expand and the SwiGLU as kernels of their own (`expand_swiglu`
#: off: a switch for before/after measurements)
SWIGLU = True
#: why the kernels failed to build or run on this machine (the plain path runs from then on)
failure: str | None = None


def usable(x: Tensor, out: Tensor) -> bool:
    """Whether `DecodeCache` adds the LoRA terms of input `x` [rows, in] into `out`
    [rows, out] (last dim contiguous) with the kernels."""
    return (ENABLED and failure is None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and out.dtype == x.dtype and out.stride(-1) == 1 and x.stride(-1) == 1
            and not torch.compiler.is_compiling() and _kernels() is not None)


def splits_for(width: int) -> int:
    """Parts the shrink's input dimension is cut into: at least `MIN_SPLIT` features each, at
    most `MAX_SPLITS` (a tail's few rows still fill the GPU; the expand sums the parts)."""
    return max(1, min(MAX_SPLITS, width // MIN_SPLIT))


def shrink(x: Tensor, a: Tensor, n_slots: int, rank: int, perm: Tensor, ends: Tensor,
           bm: int = BM) -> Tensor | None:
    """h [splits, rows, members x rank] (float32 parts) of x [rows, in] through the group's
    A [members x n_slots x rank, in] (rows: member, slot, rank), each row through its own
    slot's only, `bm` rows a program; None if the kernel failed here (it warns once)."""
    rows, width = x.shape
    members = a.shape[0] // (n_slots * rank)
    splits = splits_for(width)
    per_split = -(-width // splits)
    per_split = -(-per_split // BK) * BK
    h = torch.empty(splits, rows, members * rank, dtype=torch.float32, device=x.device)
    grid = (-(-rows // bm) + n_slots, members, splits)
    return _launch(lambda: _kernels()[0][grid](
        x, a, perm, ends, h, rows, width, x.stride(0), per_split,
        N=n_slots, R=rank, BR=_block(rank), BM=bm, BK=BK, num_warps=4), h)


def expand(h: Tensor, member: int, b: Tensor, out: Tensor, perm: Tensor, ends: Tensor,
           n_slots: int, rank: int, bm: int = BM, all_slots: bool = False) -> bool:
    """out [rows, out] += h's `member` columns @ b [n_slots x rank, out] (rows: slot, rank;
    any row stride), each row through its own slot's B, in place, `bm` rows a program (as
    the shrink's); False if the kernel failed here (it warns once; `out` is then untouched).
    `all_slots`: h is [1, rows, members x n_slots x rank] (any row stride, the compute
    dtype), every slot's columns as a GEMM over the decode cache's A gives them, rather than
    the shrink's parts."""
    return _expand(h, b, out, perm, ends, n_slots, rank, member, None, 0, 0, bm, all_slots)


def expand_group(h: Tensor, b: Tensor, out: Tensor, perm: Tensor, ends: Tensor,
                 n_slots: int, rank: int, col_member: Tensor, all_slots: bool = False) -> bool:
    """Every member's term at once into the group's output out [rows, sum of outs] (members'
    columns side by side, any row stride): b is the group's B, block-diagonal [members x
    n_slots x rank, sum of outs] or stacked [members, n_slots x rank, out]; `col_member`
    [column blocks of `BN`] int32 names each block's member (no block spans two). As
    `expand` otherwise."""
    if b.dim() == 2:  # column n of member m: row m x N x r + s x r + j, column n
        member_stride, member_cols = b.stride(0) * n_slots * rank, 0
    else:  # stacked: member m's own [N x r, out] block, column n - m x out
        member_stride, member_cols = b.stride(0), b.shape[2]
    return _expand(h, b, out, perm, ends, n_slots, rank, 0, col_member, member_stride,
                   member_cols, BM, all_slots)


def _expand(h: Tensor, b: Tensor, out: Tensor, perm: Tensor, ends: Tensor, n_slots: int,
            rank: int, member: int, col_member: Tensor | None, member_stride: int,
            member_cols: int, bm: int, all_slots: bool) -> bool:
    splits, rows, _ = h.shape
    cols = out.shape[1]
    # h's columns of (member m, slot s): m x member_width + s x slot_width
    member_width, slot_width = (n_slots * rank, rank) if all_slots else (rank, 0)
    grid = (-(-rows // bm) + n_slots, -(-cols // BN))
    return _launch(lambda: _kernels()[1][grid](
        h, b, out, perm, ends, h if col_member is None else col_member, cols,
        h.stride(0), h.stride(1), member * member_width, member_width, slot_width, splits,
        b.stride(-2), out.stride(0), member_stride, member_cols,
        N=n_slots, R=rank, BR=_block(rank), BM=bm, BN=BN,
        MAPPED=col_member is not None, num_warps=4), True) is not None


def expand_swiglu(h: Tensor, b: Tensor, gate: Tensor, up: Tensor, act: Tensor, perm: Tensor,
                  ends: Tensor, n_slots: int, rank: int, members: tuple[int, int], bm: int,
                  all_slots: bool = False) -> bool:
    """act [rows, I] = silu(gate + its LoRA term) * (up + its LoRA term), each row through its
    own slot's B: the gate/up group's expand with the SwiGLU as its epilogue. Where the
    expand adds into the merged output and the SwiGLU pass reads it back, this reads gate and
    up once and writes only act: at 7B the gate/up output is ~76% of the bytes every expand
    of a layer moves. Each term is added in float32 and rounded as `expand` rounds it, then
    silu(g) * u is computed in float32 and rounded once, as the compiled SwiGLU pass
    (`engine.fused._silu_mul`) does. h as `expand`'s (the group's parts, or `all_slots`); b
    the group's stacked B [members, n_slots x rank, I]; `members` gate's and up's index in
    the group; gate and up any row stride. False if the kernel failed here (it warns once;
    `act` is then unwritten)."""
    splits, rows, _ = h.shape
    cols = act.shape[1]
    member_width, slot_width = (n_slots * rank, rank) if all_slots else (rank, 0)
    tiles = SWIGLU_TILES if bm == BM else 1  # (a prefill's tiles hold `BM_TOKENS` already)
    grid = (-(-rows // (bm * tiles)) + n_slots, -(-cols // BN))
    return _launch(lambda: _kernels()[2][grid](
        h, b[members[0]], b[members[1]], gate, up, act, perm, ends, cols,
        h.stride(0), h.stride(1), members[0] * member_width, members[1] * member_width,
        slot_width, splits, b.stride(-2), gate.stride(0), up.stride(0), act.stride(0),
        N=n_slots, R=rank, BR=_block(rank), BM=bm, TILES=tiles, BN=BN, num_warps=4),
        True) is not None


def _block(rank: int) -> int:
    return max(16, 1 << (rank - 1).bit_length())


def _launch(run: Callable[[], object], result: T) -> T | None:
    global failure
    try:
        run()
        return result
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - any compiler or launch failure: the plain path
        failure = failed(e, "LoRA decode kernels", "using GEMMs", stacklevel=3)
        return None


_kernels = built(lambda: _build())  # (shrink, expand, swiglu), or None without Triton


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def _tile(Ends, t, N: tl.constexpr, BM: tl.constexpr):
        """Program t's slot and rows [first, end) among the rows in slot order: each slot's
        rows are cut into tiles of BM, the slots' tiles one after another (-1: no tile)."""
        slot = -1
        first = 0
        end = 0
        base = 0
        lo = 0
        for s in tl.static_range(N):
            hi = tl.load(Ends + s)
            tiles = (hi - lo + BM - 1) // BM
            hit = (t >= base) & (t < base + tiles)
            slot = tl.where(hit, s, slot)
            first = tl.where(hit, lo + (t - base) * BM, first)
            end = tl.where(hit, hi, end)
            base += tiles
            lo = hi
        return slot, first, end

    @triton.jit
    def _shrink_kernel(X, A, Perm, Ends, H, rows_total, width, sx, per_split,
                       N: tl.constexpr, R: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr,
                       BK: tl.constexpr):
        slot, first, end = _tile(Ends, tl.program_id(0), N, BM)
        member = tl.program_id(1)
        part = tl.program_id(2)
        if slot >= 0:
            m = first + tl.arange(0, BM)
            mmask = m < end
            rows = tl.load(Perm + m, mask=mmask, other=0)
            j = tl.arange(0, BR)
            jmask = j < R
            arow = ((member * N + slot) * R + j).to(tl.int64)
            acc = tl.zeros([BM, BR], tl.float32)
            start = part * per_split
            stop = tl.minimum(start + per_split, width)
            for k0 in range(start, stop, BK):
                k = k0 + tl.arange(0, BK)
                kmask = k < stop
                xt = tl.load(X + rows[:, None] * sx + k[None, :],
                             mask=mmask[:, None] & kmask[None, :], other=0.0)
                at = tl.load(A + arow[:, None] * width + k[None, :],
                             mask=jmask[:, None] & kmask[None, :], other=0.0)
                acc += tl.dot(xt, tl.trans(at))
            cols = tl.num_programs(1) * R
            at_h = H + (part * rows_total + rows[:, None]).to(tl.int64) * cols + member * R
            tl.store(at_h + j[None, :], acc, mask=mmask[:, None] & jmask[None, :])

    @triton.jit
    def _expand_kernel(H, B, Out, Perm, Ends, ColMember, cols, sh_part, sh_row, h_first,
                       h_member, h_slot, splits, sb, so, sm, cm, N: tl.constexpr,
                       R: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       MAPPED: tl.constexpr):
        slot, first, end = _tile(Ends, tl.program_id(0), N, BM)
        if slot >= 0:
            member = tl.load(ColMember + tl.program_id(1)) if MAPPED else 0
            m = first + tl.arange(0, BM)
            mmask = m < end
            rows = tl.load(Perm + m, mask=mmask, other=0)
            j = tl.arange(0, BR)
            jmask = j < R
            hmask = mmask[:, None] & jmask[None, :]
            at_h = H + rows[:, None].to(tl.int64) * sh_row + h_first + member * h_member \
                + slot * h_slot + j[None, :]
            h = tl.zeros([BM, BR], tl.float32)
            for p in range(0, splits):  # the parts in order: the same sum at every run
                h += tl.load(at_h + p * sh_part, mask=hmask, other=0.0).to(tl.float32)
            n = tl.program_id(1) * BN + tl.arange(0, BN)
            nmask = n < cols
            at_b = B + member * sm + (slot * R + j)[:, None].to(tl.int64) * sb \
                + (n - member * cm)[None, :]
            bt = tl.load(at_b, mask=jmask[:, None] & nmask[None, :], other=0.0)
            delta = tl.dot(h.to(bt.dtype), bt)
            omask = mmask[:, None] & nmask[None, :]
            at = Out + rows[:, None].to(tl.int64) * so + n[None, :]
            base = tl.load(at, mask=omask, other=0.0)
            tl.store(at, (base.to(tl.float32) + delta).to(Out.dtype.element_ty), mask=omask)

    @triton.jit
    def _swiglu_kernel(H, BG, BU, G, U, Act, Perm, Ends, cols, sh_part, sh_row, h_gate, h_up,
                       h_slot, splits, sb, sg, su, sa, N: tl.constexpr, R: tl.constexpr,
                       BR: tl.constexpr, BM: tl.constexpr, TILES: tl.constexpr,
                       BN: tl.constexpr):
        slot, first, end = _tile(Ends, tl.program_id(0), N, BM * TILES)
        if slot >= 0:
            j = tl.arange(0, BR)
            jmask = j < R
            n = tl.program_id(1) * BN + tl.arange(0, BN)
            nmask = n < cols
            bmask = jmask[:, None] & nmask[None, :]
            at_b = (slot * R + j)[:, None].to(tl.int64) * sb + n[None, :]
            bg = tl.load(BG + at_b, mask=bmask, other=0.0)
            bu = tl.load(BU + at_b, mask=bmask, other=0.0)
            dtype = Act.dtype.element_ty
            for t0 in range(first, tl.minimum(end, first + BM * TILES), BM):
                m = t0 + tl.arange(0, BM)
                mmask = m < end
                rows = tl.load(Perm + m, mask=mmask, other=0).to(tl.int64)
                hmask = mmask[:, None] & jmask[None, :]
                at_h = H + rows[:, None] * sh_row + slot * h_slot + j[None, :]
                hg = tl.zeros([BM, BR], tl.float32)
                hu = tl.zeros([BM, BR], tl.float32)
                for p in range(0, splits):  # the parts in order, as the expand sums them
                    hg += tl.load(at_h + p * sh_part + h_gate, mask=hmask, other=0.0
                                  ).to(tl.float32)
                    hu += tl.load(at_h + p * sh_part + h_up, mask=hmask, other=0.0
                                  ).to(tl.float32)
                dg = tl.dot(hg.to(bg.dtype), bg)
                du = tl.dot(hu.to(bu.dtype), bu)
                omask = mmask[:, None] & nmask[None, :]
                g = tl.load(G + rows[:, None] * sg + n[None, :], mask=omask, other=0.0)
                u = tl.load(U + rows[:, None] * su + n[None, :], mask=omask, other=0.0)
                g = (g.to(tl.float32) + dg).to(dtype).to(tl.float32)  # the expand's rounding
                u = (u.to(tl.float32) + du).to(dtype).to(tl.float32)
                a = g * tl.sigmoid(g) * u
                tl.store(Act + rows[:, None] * sa + n[None, :], a.to(dtype), mask=omask)

    return _shrink_kernel, _expand_kernel, _swiglu_kernel
