"""Row-to-slot routing and the batched LoRA kernels.

A `Routing` is computed once per batch (by `AdapterBank.set_slot_ids_`) and read by every
banked layer, so layers do no index arithmetic of their own. Nothing here synchronises with
the host: shapes depend only on the batch size and the number of slots, never on the ids, so a
decode step that reads a routing can be captured in a CUDA graph.

Three kernels compute the LoRA delta `scaling * B[s] @ A[s] @ x` for every row at once:

- ``grouped``: rows sorted by slot, then `grouped_mm` over the slot groups. Each adapter is
  read once and every FLOP is useful; the kernel for training on CUDA.
- ``gather``: each row gathers its own A and B (`index_select`) and one `bmm` does the rest.
  Works on every device and dtype; its cost grows with rows x adapter size.
- ``dense``: every row through every slot's A (one matmul), masked to its own slot, then a
  `bmm` with all B's. N times the LoRA FLOPs but no sort or gather; meant for decoding, where
  a step reads every adapter anyway and FLOPs are free.

`DecodeCache` serves one-token rows without grad (decoding): a compute-dtype copy of the bank
laid out for two plain GEMMs per projection, `h = x @ A_all^T` ([B, N*r], masked to each row's
slot) and `out + h @ B_all` (one addmm), where projections that read the same input (q/k/v,
gate/up) share one A GEMM, and the LoRA scaling is folded into the cached B, so the mask is
0/1 and with one slot there is none. That is 11-15 small kernels per layer (4 shrinks, their
masks, 7 expands) instead of ~50, and no cast of the fp32 master weights on every step; under
torch.compile (`fuse_add`) q/k/v and gate/up each get their deltas from one GEMM, and the adds
fuse into the kernels that read the outputs. At decode sizes each of these kernels costs a
launch (5-10 us on an H100/H200) more than its bytes, so fewer kernels is what counts. On
CUDA in bf16/fp16 the shrink and the expand run as `decode_kernel`'s two Triton kernels
instead, each row through its own slot's A and B only and one expand per merged output; the
GEMMs above are their reference and their fallback. Where the projections' weights hold the
cache's A in extra rows (`engine.merged.reserve_lora_rows`), their decode GEMM has computed
every slot's h already and no shrink runs on either path.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lorapop.lora import decode_kernel

KERNELS = ("grouped", "gather", "dense")


def _grouped_mm_fn():
    """The grouped matmul of this torch build: public in 2.13, private before."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


GROUPED_MM = _grouped_mm_fn()


@dataclass
class Routing:
    """Per-batch index tensors shared by all banked layers (persistent, updated in place)."""

    ids: Tensor  # [B] long: slot of each row
    perm: Tensor  # [B] long: rows in slot order (stable)
    inv: Tensor  # [B] long: inverse of perm
    ends: Tensor  # [N] int32: exclusive end of each slot's group among the sorted rows
    mask: Tensor  # [N, B] float32: mask[s, b] = 1 when row b uses slot s
    is_sorted: bool  # rows already in slot order: the grouped kernel skips its gathers (T > 1)
    # (slot, first row, end row) of each run of one slot, where the host knows them (rows in
    # slot order, routed by `AdapterBank.route`); None otherwise (e.g. CUDA-graph decoding)
    runs: list[tuple[int, int, int]] | None = None
    _ends_by_len: dict[int, Tensor] = field(default_factory=dict)
    _masks: dict[tuple[int, torch.dtype, float], Tensor] = field(default_factory=dict)
    _cols: dict[tuple[int, int, torch.dtype], Tensor] = field(default_factory=dict)

    @classmethod
    def empty(cls, batch: int, n_slots: int, device: torch.device) -> Routing:
        long = dict(dtype=torch.long, device=device)
        return cls(
            ids=torch.zeros(batch, **long),
            perm=torch.zeros(batch, **long),
            inv=torch.zeros(batch, **long),
            ends=torch.zeros(n_slots, dtype=torch.int32, device=device),
            mask=torch.zeros(n_slots, batch, dtype=torch.float32, device=device),
            is_sorted=False,
        )

    @torch.no_grad()
    def fill_(self, ids: Tensor, is_sorted: bool,
              runs: list[tuple[int, int, int]] | None = None) -> None:
        """Recompute every index tensor in place from `ids` (no host synchronisation);
        `runs`: the host's view of the same ids, if it has one."""
        n_slots = self.ends.numel()
        self.ids.copy_(ids)
        sorted_ids, perm = torch.sort(self.ids, stable=True)
        self.perm.copy_(perm)
        self.inv.scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
        slots = torch.arange(n_slots, device=ids.device, dtype=sorted_ids.dtype)
        self.ends.copy_(torch.searchsorted(sorted_ids, slots, right=True))
        self.mask.copy_(slots[:, None] == self.ids[None, :])
        self.is_sorted = is_sorted
        self.runs = runs
        for tokens, ends in self._ends_by_len.items():
            torch.mul(self.ends, tokens, out=ends)
        for key, mask in self._masks.items():
            mask.copy_(self._token_mask(*key))
        for key, cols in self._cols.items():
            cols.copy_(self._col_mask(*key))

    def ends_for(self, tokens_per_row: int) -> Tensor:
        """Group ends in tokens when every row holds `tokens_per_row` tokens (cached)."""
        ends = self._ends_by_len.get(tokens_per_row)
        if ends is None:
            ends = self.ends * tokens_per_row
            self._ends_by_len[tokens_per_row] = ends
        return ends

    def token_mask(self, tokens: int, dtype: torch.dtype, scale: float) -> Tensor:
        """[N, B*tokens, 1] = scale where the token's row uses the slot, else 0 (cached)."""
        key = (tokens, dtype, scale)
        mask = self._masks.get(key)
        if mask is None:
            mask = self._token_mask(*key)
            self._masks[key] = mask
        return mask

    def _token_mask(self, tokens: int, dtype: torch.dtype, scale: float) -> Tensor:
        n, rows = self.mask.shape
        full = (self.mask * scale).to(dtype)[:, :, None].expand(n, rows, tokens)
        return full.reshape(n, rows * tokens, 1)

    def col_mask(self, rank: int, tiles: int, dtype: torch.dtype) -> Tensor:
        """[B, tiles*N*rank] = 1 on the row's own slot's rank columns, else 0 (cached).

        Columns are ordered (tile, slot, rank), matching `DecodeCache`'s rows of A.
        """
        key = (rank, tiles, dtype)
        cols = self._cols.get(key)
        if cols is None:
            cols = self._col_mask(*key).clone()  # own memory: refilled in place by fill_
            self._cols[key] = cols
        return cols

    def _col_mask(self, rank: int, tiles: int, dtype: torch.dtype) -> Tensor:
        n, rows = self.mask.shape
        per_row = self.mask.t().to(dtype)[:, None, :, None]
        return per_row.expand(rows, tiles, n, rank).reshape(rows, tiles * n * rank)

    def clone(self) -> Routing:
        return Routing(
            ids=self.ids.clone(),
            perm=self.perm.clone(),
            inv=self.inv.clone(),
            ends=self.ends.clone(),
            mask=self.mask.clone(),
            is_sorted=self.is_sorted,
            runs=self.runs,
        )


def slot_runs(ids: Tensor) -> list[tuple[int, int, int]]:
    """(slot, first row, end row) of each run of equal ids in host tensor `ids`."""
    slots, counts = torch.unique_consecutive(ids, return_counts=True)
    ends = counts.cumsum(0)
    return list(zip(slots.tolist(), (ends - counts).tolist(), ends.tolist(), strict=True))


def add_delta_by_runs(
    out: Tensor, x: Tensor, weights: Callable[[int], tuple[Tensor, Tensor]],
    runs: list[tuple[int, int, int]], scaling: float, grad: bool,
) -> Tensor | None:
    """out + scaling * B[s] @ A[s] @ x for multi-token rows x [B, T, in] that come in `runs`
    of one slot, with the add in the expand GEMM (addmm): the delta, a full-width tensor per
    projection, is never written and read back; without grad it goes into `out` (the module's
    fresh output) in place, as an out-of-place addmm would first copy `out` whole.
    `weights(s)`: slot s's A [r, in] and B [out, r] in x's dtype; `grad`: whether this forward
    is differentiated. None where this does not apply: several runs under grad (an in-place
    add into slices of `out` would make autograd copy the whole gradient of `out` for each),
    or `out` not in the compute dtype.
    """
    if runs[-1][2] != x.shape[0]:
        raise ValueError(f"AdapterBank: batch has {x.shape[0]} rows but the routing has "
                         f"{runs[-1][2]} slot ids")
    if out.dtype != x.dtype or (grad and len(runs) > 1):
        return None
    x2, out2 = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
    if len(runs) == 1:
        a, b = weights(runs[0][0])
        if grad:
            return torch.addmm(out2, x2 @ a.t(), b.t(), alpha=scaling).view(out.shape)
        return out2.addmm_(x2 @ a.t(), b.t(), alpha=scaling).view(out.shape)
    tokens = x2.shape[0] // x.shape[0]
    for s, first, end in runs:
        rows = slice(first * tokens, end * tokens)
        a, b = weights(s)
        out2[rows].addmm_(x2[rows] @ a.t(), b.t(), alpha=scaling)
    return out2.view(out.shape)


class _FrozenLinearLora(torch.autograd.Function):
    """`out + scaling * (x @ A^T) @ B^T` where `out = x @ W^T (+ bias)` came from a frozen
    linear (detached: this node owns x's gradient). The backward forms x's gradient as
    `g @ W` and adds the LoRA's `(g @ B) @ A` into it (addmm_). Through autograd the two
    were full-width tensors summed by a separate add: 10 adds a layer, 2.9% of a 7B student
    micro-batch; this path made the update ~1% faster on an H200.

    The LoRA term goes into `out` in place (the frozen linear's fresh output, which nothing
    else reads): an out-of-place addmm first copies its `out` whole, a full-width tensor per
    projection (13 ms of device-to-device copies in a 592 ms student micro-batch at 7B)."""

    @staticmethod
    def forward(ctx, out: Tensor, x: Tensor, weight: Tensor, a: Tensor, b: Tensor,  # type: ignore[override]
                scaling: float) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ a.t()
        ctx.save_for_backward(x2, weight, a, b, h)
        ctx.scaling, ctx.x_shape = scaling, x.shape
        out.view(-1, out.shape[-1]).addmm_(h, b.t(), alpha=scaling)  # (a linear's: contiguous)
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        x2, weight, a, b, h = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gh = (g @ b).mul_(ctx.scaling)  # [tokens, r]
        need = ctx.needs_input_grad
        gx = (g @ weight).addmm_(gh, a).view(ctx.x_shape) if need[1] else None
        ga = gh.t() @ x2 if need[3] else None
        gb = (g.t() @ h).mul_(ctx.scaling) if need[4] else None
        return None, gx, None, ga, gb, None


def add_delta_frozen_linear(out: Tensor, x: Tensor, weight: Tensor, a: Tensor, b: Tensor,
                            scaling: float) -> Tensor:
    """`out + scaling * B @ A @ x` for rows of one slot, `out = x @ weight^T (+ bias)` the
    output of a frozen plain linear, `a` [r, in] and `b` [out, r] in x's dtype: as
    `add_delta_by_runs` with one run, and x's two input gradients formed as one (see
    `_FrozenLinearLora`)."""
    return _FrozenLinearLora.apply(out.detach(), x, weight, a, b, scaling)


def lora_delta(
    x: Tensor, a: Tensor, b: Tensor, routing: Routing, kernel: str, scaling: float = 1.0
) -> Tensor:
    """scaling * B[s] @ A[s] @ x for x [B, ..., in], a [N, r, in], b [N, out, r].

    All three tensors must already be in the compute dtype. Returns [B, ..., out]. The
    scaling is applied to the rank-r intermediate, the smallest tensor on the path.
    """
    rows = x.shape[0]
    if rows != routing.ids.numel():
        raise ValueError(
            f"AdapterBank: batch has {rows} rows but the routing has {routing.ids.numel()} slot ids"
        )
    x3 = x.reshape(rows, -1, x.shape[-1])
    if kernel == "grouped":
        y = _grouped(x3, a, b, routing, scaling)
    elif kernel == "gather":
        y = _gather(x3, a, b, routing, scaling)
    elif kernel == "dense":
        y = _dense(x3, a, b, routing, scaling)
    else:
        raise ValueError(f"unknown LoRA kernel {kernel!r}; expected one of {KERNELS}")
    return y.reshape(*x.shape[:-1], b.shape[1])


class _PermuteRows(torch.autograd.Function):
    """x[perm] whose backward is the inverse gather, not index_select's atomic index_add."""

    @staticmethod
    def forward(ctx, x: Tensor, perm: Tensor, inv: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(inv)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (inv,) = ctx.saved_tensors
        return grad.index_select(0, inv), None, None


def _gather(x: Tensor, a: Tensor, b: Tensor, routing: Routing, scaling: float) -> Tensor:
    a_rows = a.index_select(0, routing.ids)  # [B, r, in]
    b_rows = b.index_select(0, routing.ids)  # [B, out, r]
    h = torch.bmm(x, a_rows.transpose(1, 2)) * scaling
    return torch.bmm(h, b_rows.transpose(1, 2))


def _grouped(x: Tensor, a: Tensor, b: Tensor, routing: Routing, scaling: float) -> Tensor:
    if GROUPED_MM is None:
        raise RuntimeError("this torch build has no grouped_mm; use the 'gather' kernel")
    rows, tokens, _ = x.shape
    # One-token rows (decoding) always gather: a CUDA graph captured on a sorted batch must
    # stay right when a later batch of the same size is not. Gathering 1 token/row is cheap.
    skip = routing.is_sorted and tokens > 1
    if not skip:
        x = _PermuteRows.apply(x, routing.perm, routing.inv)
    flat = x.reshape(rows * tokens, x.shape[-1])
    ends = routing.ends_for(tokens)
    h = GROUPED_MM(flat, a.transpose(1, 2), offs=ends) * scaling  # [B*T, r]
    y = GROUPED_MM(h, b.transpose(1, 2), offs=ends).view(rows, tokens, b.shape[1])
    return y if skip else _PermuteRows.apply(y, routing.inv, routing.perm)


def _dense(x: Tensor, a: Tensor, b: Tensor, routing: Routing, scaling: float) -> Tensor:
    rows, tokens, width = x.shape
    h = torch.matmul(x.reshape(1, rows * tokens, width), a.transpose(1, 2))  # [N, B*T, r]
    h = h * routing.token_mask(tokens, h.dtype, scaling)
    y = torch.bmm(h, b.transpose(1, 2)).sum(0)  # [B*T, out]
    return y.view(rows, tokens, b.shape[1])


def tensor_version(x: Tensor) -> int:
    """x's in-place write counter (-1 for an inference tensor, which has none)."""
    return -1 if x.is_inference() else x._version


@dataclass(eq=False)
class GemmShrink:
    """Rows of a frozen projection GEMM's weight that hold a decode cache group's A [members
    x N x r, in], and the h = x @ A^T that the GEMM last computed beside its outputs. The
    projections' owner (`engine.merged`) makes them and registers them with the bank
    (`AdapterBank.keep_decode_a`); a decode cache keeps its A there (`used`) and takes h
    (`take`) instead of running a shrink."""

    rows: Tensor
    used: bool = False  # whether a decode cache keeps its A here (then the GEMM computes h)
    x: Tensor | None = None  # the input of `h`, and its version then
    version: int = -1
    h: Tensor | None = None  # [..., members x N x r]

    def put(self, x: Tensor, h: Tensor) -> None:
        self.x, self.version, self.h = x, tensor_version(x), h

    def take(self, x: Tensor) -> Tensor | None:
        """The h the GEMM computed from this very `x` (unchanged since), once; else None."""
        h = self.h if self.x is x and self.version == tensor_version(x) else None
        if h is not None:
            self.clear()
        return h

    def clear(self) -> None:
        self.x = self.h = None


@dataclass
class _Group:
    """Projections reading one input: their A's and B's stacked, and the last input's h."""

    a: Tensor  # [G*N*r, in]: rows (member, slot, rank)
    b: Tensor  # [G, N*r, out] if all outs are equal, else block-diagonal [G*N*r, sum of outs]
    size: int
    x: Tensor | None = None  # the input whose h (and delta) is held for the other members
    h: Tensor | None = None
    d: Tensor | None = None  # every member's delta from one GEMM (`fuse_add`)
    uses: int = 0
    offsets: list[int] = field(default_factory=list)  # each member's first output column
    # the member of each `decode_kernel.BN` block of output columns (None: a block spans two)
    col_member: Tensor | None = None
    whole: Tensor | None = None  # the group's output [B, sum of outs] the held h went into
    all_slots: bool = False  # the held kernel h has every slot's columns (from `gemm`)
    gemm: GemmShrink | None = None  # the GEMM rows `a` lives in: its h, so no shrink runs


@dataclass
class _Member:
    group: _Group
    index: int  # position in the group: rows/columns [index*N*r, (index+1)*N*r)
    b: Tensor  # [N*r, out]: rows (slot, rank); a view of the group's B
    cols: slice  # this member's columns of the group's delta


class DecodeCache:
    """Compute-dtype copy of the bank for one-token rows without grad (see module docstring).

    `groups` lists, per shared input, the (name, A [N, r, in], B [N, out, r]) of its
    projections; `scaling` (alpha / r) is folded into the cached B. Buffers are allocated
    once and refreshed in place (`refresh_`), so CUDA graphs captured on them stay valid
    after the weights change.
    """

    def __init__(
        self,
        groups: list[list[tuple[str, Tensor, Tensor]]],
        dtype: torch.dtype,
        scaling: float = 1.0,
        gemms: Sequence[GemmShrink | None] | None = None,
    ) -> None:
        """`gemms`: per group, the GEMM rows to hold its A (members in the group's order),
        or None."""
        self.dtype = dtype
        self.scaling = float(scaling)
        self.members: dict[str, _Member] = {}
        self.sources: list[tuple[_Member, Tensor, Tensor]] = []
        for i, group in enumerate(groups):
            n, r, width = group[0][1].shape
            dev = group[0][1].device
            gemm = None if gemms is None else gemms[i]
            if (gemm is not None and gemm.rows.shape == (len(group) * n * r, width)
                    and gemm.rows.dtype == dtype and gemm.rows.device == dev):
                a = gemm.rows
                gemm.used = True
            else:
                a, gemm = torch.empty(len(group) * n * r, width, dtype=dtype, device=dev), None
            outs = [b_src.shape[1] for _, _, b_src in group]
            if len(set(outs)) == 1:
                b_all = torch.empty(len(group), n * r, outs[0], dtype=dtype, device=dev)
            else:  # zeros off the diagonal blocks: one GEMM gives every member's delta
                b_all = torch.zeros(len(group) * n * r, sum(outs), dtype=dtype, device=dev)
            g = _Group(a, b_all, len(group), gemm=gemm)
            g.offsets = [sum(outs[:i]) for i in range(len(outs))]
            if len(group) > 1 and all(o % decode_kernel.BN == 0 for o in outs):
                g.col_member = torch.tensor(
                    [i for i, o in enumerate(outs) for _ in range(o // decode_kernel.BN)],
                    dtype=torch.int32, device=dev)
            off = 0
            for i, (name, a_src, b_src) in enumerate(group):
                out = outs[i]
                if b_all.dim() == 3:
                    b, cols = b_all[i], slice(0, out)
                else:
                    b, cols = (
                        b_all[i * n * r : (i + 1) * n * r, off : off + out],
                        slice(off, off + out),
                    )
                off += out
                self.members[name] = _Member(g, i, b, cols)
                self.sources.append((self.members[name], a_src, b_src))
        self.n_slots, self.rank = n, r
        self.stamp = -1

    def release(self) -> None:
        """The merged projections that hold this cache's A stop computing it (the cache is
        being dropped)."""
        for m in self.members.values():
            if m.group.gemm is not None:
                m.group.gemm.used = False
                m.group.gemm.clear()

    def slot_weights(self, name: str, s: int) -> tuple[Tensor, Tensor]:
        """Slot s's A [r, in] and scaling * B [out, r] of projection `name`: views of the
        cache, for forwards of several tokens a row without grad (a prefill's), which then
        cast nothing and compute with the weights the decode steps use."""
        m, nr, r = self.members[name], self.n_slots * self.rank, self.rank
        first = m.index * nr + s * r
        return m.group.a[first : first + r], m.b[s * r : (s + 1) * r].t()

    @torch.no_grad()
    def refresh_(self, stamp: int) -> None:
        """Copy (and cast) the bank's current A and scaling * B into the cache."""
        nr = self.n_slots * self.rank
        for m, a_src, b_src in self.sources:
            m.group.a[m.index * nr : (m.index + 1) * nr].view(a_src.shape).copy_(a_src)
            b_t = b_src.transpose(1, 2)
            b_t = b_t * self.scaling if self.scaling != 1.0 else b_t  # one rounding to dtype
            m.b.unflatten(0, (b_src.shape[0], self.rank)).copy_(b_t)
            m.group.x = m.group.h = m.group.d = m.group.whole = None
        self.stamp = stamp

    def add_delta(
        self,
        name: str,
        x: Tensor,
        out: Tensor,
        routing: Routing,
        share: bool,
        fuse_add: bool = False,
    ) -> Tensor:
        """out + scaling * B[s] A[s] x for one-token rows x [B, 1, in] (out: the base output).

        `share`: reuse the h that a projection of the same group computed from this very
        `x`. `fuse_add` (under torch.compile): the group's first member computes every
        member's delta in one GEMM (a batched one, or one over the block-diagonal B), and
        each member returns `out + delta`, an add the compiler fuses into what reads `out`;
        otherwise each member adds into `out` in place with its own addmm (eager: the add is
        in the GEMM; `out`, the base projection's fresh output, is not read elsewhere).
        """
        rows = x.shape[0]
        if rows != routing.ids.numel():
            raise ValueError(
                f"AdapterBank: batch has {rows} rows but the routing has "
                f"{routing.ids.numel()} slot ids"
            )
        m = self.members[name]
        g, nr = m.group, self.n_slots * self.rank
        out2 = out.reshape(rows, out.shape[-1])
        if not fuse_add and decode_kernel.usable(x, out2) and self._kernel_add(
                m, x, out2, routing.perm, routing.ends, share):
            return out
        if share and g.x is x and g.h is not None and g.h.dim() == 2:
            h, d = g.h, g.d
            g.uses += 1
            if g.uses == g.size:
                g.x = g.h = g.d = None
        else:
            tiles = g.size if share else 1
            h = self._gemm_h(g, x) if share else None
            if h is None:
                x2 = x.reshape(rows, x.shape[-1]).to(self.dtype)
                h = self.shrink(x2, g.a if share else g.a[m.index * nr : (m.index + 1) * nr],
                                routing, tiles)
            else:  # (a view of the GEMM's output, beside the `out` written below: a copy)
                h = h * routing.col_mask(self.rank, tiles, self.dtype) if self.n_slots > 1 \
                    else h.clone()
            d = self._group_delta(h, g) if fuse_add and share else None
            if share and g.size > 1:
                g.x, g.h, g.d, g.uses = x, h, d, 1
        assert h is not None
        if d is not None:
            dm = d[m.index] if d.dim() == 3 else d[:, m.cols]
            return (out2 + dm.to(out2.dtype)).view(out.shape)
        if share:
            h = h[:, m.index * nr : (m.index + 1) * nr]
        if out2.dtype == self.dtype and not out2.requires_grad:
            # in place: an out-of-place addmm first copies `out` (a merged group's output
            # is a strided column slice) into its result, one kernel per projection
            out2.addmm_(h, m.b)
            return out
        y = out2 + torch.mm(h, m.b).to(out2.dtype)
        return y.view(out.shape)

    def add_delta_tokens(self, name: str, x: Tensor, out: Tensor, perm: Tensor,
                         ends: Tensor) -> bool:
        """out += scaling * B[s] A[s] x in place for rows of several tokens without grad (a
        prefill's) through `decode_kernel`, x [B, T, in] and out [B, T, out] contiguous, its
        B x T tokens in slot order (`perm` the identity over them, `ends` each slot's end in
        tokens); the group's h shared as in `add_delta`. One shrink a group and one expand a
        projection, where one GEMM pair per slot and projection launched 7 x 2 x slots
        kernels a layer (a small prefill waited on the host). False where the kernels do not
        run (nothing added)."""
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        if not decode_kernel.usable(x2, out2):
            return False
        return self._kernel_add(self.members[name], x, out2, perm, ends, True,
                                decode_kernel.BM_TOKENS)

    def _kernel_add(self, m: _Member, x: Tensor, out: Tensor, perm: Tensor, ends: Tensor,
                    share: bool, bm: int = decode_kernel.BM) -> bool:
        """out [rows, out] += the member's LoRA term through `decode_kernel` (each row's own
        slot only; rows: x's rows, or its tokens), the group's h shared as in `add_delta`;
        False if the kernels failed here (nothing added: the caller takes the plain path)."""
        g, nr = m.group, self.n_slots * self.rank
        if share and g.x is x and g.h is not None and g.h.dim() == 3:
            h, whole, all_slots = g.h, g.whole, g.all_slots
            g.uses += 1
            if g.uses == g.size:
                g.x = g.h = g.whole = None
            if whole is not None and _is_columns(out, whole, g.offsets[m.index]):
                return True  # the group's first member added every member's term
        else:
            a = g.a if share else g.a[m.index * nr : (m.index + 1) * nr]
            kernel_h = self._kernel_h(g, x, a, share, perm, ends, bm)
            if kernel_h is None:
                return False
            h, all_slots = kernel_h
            if share and g.size > 1:
                g.x, g.h, g.d, g.uses, g.whole, g.all_slots = x, h, None, 1, None, all_slots
                whole = None if g.col_member is None else _whole_output(
                    out, g.col_member.numel() * decode_kernel.BN, g.offsets[m.index])
                if (whole is not None
                        and decode_kernel.expand_group(h, g.b, whole, perm, ends, self.n_slots,
                                                       self.rank, g.col_member, all_slots)):
                    g.whole = whole
                    return True
        return decode_kernel.expand(h, m.index if share else 0, m.b, out, perm, ends,
                                    self.n_slots, self.rank, bm, all_slots)

    def swiglu(self, gate: str, up: str, x: Tensor, gate_out: Tensor, up_out: Tensor,
               perm: Tensor, ends: Tensor, bm: int) -> Tensor | None:
        """silu(gate_out + gate's term) * (up_out + up's term) for x [..., in] through
        `decode_kernel.expand_swiglu`, its rows (or tokens) in slot order as `_kernel_add`
        takes them, h from the projections' GEMM or one shrink; None where it does not apply
        or the kernels failed (nothing is held: the hooks' path can run as usual)."""
        mg, mu = self.members[gate], self.members[up]
        g = mg.group
        width = gate_out.shape[-1]
        if mu.group is not g or g.b.dim() != 3 or up_out.shape != gate_out.shape:
            return None
        gate2, up2 = gate_out.reshape(-1, width), up_out.reshape(-1, width)
        x2 = x.reshape(-1, x.shape[-1])
        if not (decode_kernel.usable(x2, gate2) and decode_kernel.usable(x2, up2)):
            return None
        kernel_h = self._kernel_h(g, x, g.a, True, perm, ends, bm)
        if kernel_h is None:
            return None
        h, all_slots = kernel_h
        act = torch.empty(gate2.shape, dtype=gate2.dtype, device=gate2.device)
        if not decode_kernel.expand_swiglu(h, g.b, gate2, up2, act, perm, ends, self.n_slots,
                                           self.rank, (mg.index, mu.index), bm, all_slots):
            return None
        return act.view(gate_out.shape)

    def _kernel_h(self, g: _Group, x: Tensor, a: Tensor, share: bool, perm: Tensor,
                  ends: Tensor, bm: int) -> tuple[Tensor, bool] | None:
        """The expand kernels' h for x through `a` (the group's A, or one member's), and
        whether it has every slot's columns: the projections' GEMM's where it computed one
        for the whole group (`share`), else the shrink kernel's parts; None if that failed."""
        h = self._gemm_h(g, x) if share else None
        if h is not None:
            return h[None], True
        h = decode_kernel.shrink(x.reshape(-1, x.shape[-1]), a, self.n_slots, self.rank, perm,
                                 ends, bm)
        return None if h is None else (h, False)

    @staticmethod
    def _gemm_h(g: _Group, x: Tensor) -> Tensor | None:
        """x @ g.a^T [rows, members x N x r] from the members' decode GEMM on this very `x`,
        taken once (the group's other members share it here), or None."""
        h = None if g.gemm is None else g.gemm.take(x)
        return None if h is None else h.reshape(-1, h.shape[-1])

    def _group_delta(self, h: Tensor, g: _Group) -> Tensor:
        """Every member's delta from the group's h: [G, B, out] or [B, sum of outs]."""
        if g.b.dim() == 2:
            return torch.mm(h, g.b)
        if g.size == 1:
            return torch.mm(h, g.b[0])
        return torch.bmm(h.view(h.shape[0], g.size, -1).transpose(0, 1), g.b)

    def shrink(self, x: Tensor, a: Tensor, routing: Routing, tiles: int) -> Tensor:
        """h = x @ a^T [B, tiles*N*r], zero outside each row's own slot's columns.

        One slot: every row uses slot 0, so there is nothing to mask.
        """
        h = torch.mm(x, a.t())
        if self.n_slots > 1:
            h.mul_(routing.col_mask(self.rank, tiles, self.dtype))
        return h


def _whole_output(out: Tensor, width: int, first: int) -> Tensor | None:
    """The [rows, width] output whose columns from `first` on `out` [rows, out] is, where
    `out` is such a column slice (as merged projections hand a group's outputs over: the
    first member called need not be the first in the output; the GEMM's output may hold
    more columns after them: the LoRA rows'), else None."""
    base, cols = out._base, out.stride(0)
    if (base is None or not base.is_contiguous() or cols < width
            or base.numel() != out.shape[0] * cols
            or base.data_ptr() != out.data_ptr() - first * out.element_size()):
        return None
    return base.view(out.shape[0], cols)[:, :width]


def _is_columns(out: Tensor, whole: Tensor, first: int) -> bool:
    """Whether `out` is the columns of `whole` from `first` on."""
    return (out.stride(0) == whole.stride(0) and out.shape[0] == whole.shape[0]
            and out.data_ptr() == whole.data_ptr() + first * whole.element_size())


def grouped_probe(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why grouped_mm can't serve the bank here (None: it runs forward and backward).

    Probed on small tensors with the bank's layouts: A/B as strided views, transposed.
    """
    if GROUPED_MM is None:
        return "this torch build has no grouped_mm"
    with torch.enable_grad():
        return _probe(device, dtype)


def _probe(device: torch.device, dtype: torch.dtype) -> str | None:
    try:
        x = torch.randn(32, 64, device=device, dtype=dtype, requires_grad=True)
        store = torch.randn(2, 3 * 64 * 16, device=device, dtype=dtype)
        w = store[:, 64 * 16 : 2 * 64 * 16].view(2, 16, 64).requires_grad_()  # like bank A
        ends = torch.tensor([8, 32], device=device, dtype=torch.int32)
        y = GROUPED_MM(x, w.transpose(1, 2), offs=ends)
        ref = torch.cat([x[:8] @ w[0].T, x[8:] @ w[1].T])
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:
        return f"forward: {type(err).__name__}: {err}".splitlines()[0][:200]
    tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    if not torch.allclose(y.float(), ref.float(), atol=tol * 8, rtol=tol):
        return "forward: wrong result"
    try:
        (y * 2).sum().backward()
        gx, gw = x.grad, w.grad
        x.grad = w.grad = None
        (ref * 2).sum().backward()
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:
        return f"backward: {type(err).__name__}: {err}".splitlines()[0][:200]
    if gx is None or gw is None:
        return "backward: no gradient"
    ok = torch.allclose(gx.float(), x.grad.float(), atol=tol * 8, rtol=tol)
    ok = ok and torch.allclose(gw.float(), w.grad.float(), atol=tol * 32, rtol=tol)
    if not ok:
        return "backward: wrong gradient"
    if device.type == "cuda" and _waits(device, lambda: GROUPED_MM(x, w.transpose(1, 2), offs=ends)):
        # torch's fallback (dtypes and GPUs without its CUTLASS kernels, e.g. fp32) reads the
        # group ends back on the host: a wait in every LoRA layer; gathering never waits
        return "grouped_mm waits for the GPU here (torch's fallback for this dtype or GPU)"
    return None


def _waits(device: torch.device, fn: Callable[[], object]) -> bool:
    """Whether `fn` makes a synchronising CUDA call (torch's sync debug mode, "error")."""
    torch.cuda.synchronize(device)
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # ("a prototype feature")
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.no_grad():
                fn()
        except RuntimeError as err:
            return "synchroniz" in str(err)
        finally:
            torch.cuda.set_sync_debug_mode(before)
    return False


def grouped_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether grouped_mm runs forward and backward here without waiting for the GPU (probed
    on tiny tensors at each call; the bank calls it once per dtype when it is built)."""
    return grouped_probe(device, dtype) is None
