"""N LoRA adapter slots on one frozen Hugging Face causal LM.

Every target `nn.Linear` keeps its frozen base weight and gets a forward hook that adds the
LoRA delta of each row's slot, so the model's module tree and state dict stay untouched.
All adapter weights live in ONE flat tensor `weights` [N, P] (P: parameters of one slot);
each layer's `A` [N, r, in] and `B` [N, out, r] are views of it, and their gradients are
views of one flat `grads` [N, P]. A slot is then one row: copy, reset and optimizer updates
are a few whole-tensor ops instead of a loop over layers or slots.

Initialisation follows PEFT (A kaiming-uniform with a=sqrt(5), B zeros), so a fresh slot is
the identity, and the delta is `alpha / r * B @ A @ dropout(x)`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from lorapop.engine.transfer import host_to_device
from lorapop.lora import decode_kernel
from lorapop.lora.routing import (
    KERNELS,
    DecodeCache,
    GemmShrink,
    Routing,
    add_delta_by_runs,
    add_delta_frozen_linear,
    grouped_supported,
    lora_delta,
    slot_runs,
)

DEFAULT_TARGETS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

SlotState = dict[str, dict[str, Tensor]]
DECODE_KERNELS = (*KERNELS, "fused")
#: False: prefills cast each slot's factors as other forwards do (`prefill_weights` a no-op; a
#: switch for before/after measurements)
PREFILL_FROM_CACHE = True
# Projections of one parent module that read the same input: their decode LoRA shares one GEMM.
SHARED_INPUT: tuple[frozenset[str], ...] = (
    frozenset({"q_proj", "k_proj", "v_proj"}),
    frozenset({"gate_proj", "up_proj"}),
)

# Parameters are strided views of the flat storage, so autograd notes once that their grads
# are not dense; accumulation into the bound grad views is still in place and correct.
warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout")


@dataclass
class _Target:
    """One banked linear: its name in the model, its views into the flat storage."""

    name: str
    module: nn.Linear
    a: nn.Parameter  # [N, r, in]
    b: nn.Parameter  # [N, out, r]
    a_slice: slice  # columns of the flat storage holding A
    b_slice: slice
    handle: torch.utils.hooks.RemovableHandle | None = None


@dataclass
class _HeldCopy:
    """The bank's weights in a compute dtype, and each target's A and B views of them."""

    dtype: torch.dtype
    flat: Tensor  # [N, P]
    views: dict[str, tuple[Tensor, Tensor]]
    stamp: int  # the bank's weights stamp when copied


class _HeldCast(torch.autograd.Function):
    """`master.to(copy.dtype)` read from `copy`, a cast made earlier: the same values, and the
    same gradient to `master` (the incoming one cast to master's dtype, as a cast's backward)."""

    @staticmethod
    def forward(ctx, master: Tensor, copy: Tensor) -> Tensor:  # type: ignore[override]
        ctx.dtype = master.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad.to(ctx.dtype), None


class _SlotView(torch.autograd.Function):
    """`source[s]`, a view of one slot of `master` (itself, detached, or its held copy), whose
    gradient is added straight into `grad_row` (master's gradient of slot s): one kernel,
    where indexing the whole [N, ...] parameter makes autograd write a zero gradient for every
    other slot, then cast and accumulate all N. `master` gets no gradient through autograd."""

    @staticmethod
    def forward(ctx, master: Tensor, source: Tensor, s: int, grad_row: Tensor  # type: ignore[override]
                ) -> Tensor:
        ctx.grad_row = grad_row
        return source[s]

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        ctx.grad_row.add_(grad)
        return None, None, None, None


class AdapterBank:
    """N LoRA slots attached to `model`; `route(slot_ids)` picks each row's slot.

    The base model is frozen. Create the bank after moving the model to its device; the bank
    allocates its weights on the device of the base weights.

    Kernels: ``kernel`` is used for multi-token rows (prefill, training) and
    ``decode_kernel`` for one-token rows. "auto" picks, for multi-token rows, "grouped" when
    the rows are in slot order and this torch build runs grouped_mm for the compute dtype,
    else "gather" (row permutations cost more than per-row weight gathers); for one-token
    rows "fused" without grad (a cached compute-dtype copy of the bank, 3 GEMM-sized kernels
    per projection, q/k/v and gate/up sharing their A GEMM) and "dense" with grad.
    Measurements in docs/performance.md.

    The "fused" cache is refreshed when `weights` changed since it was built, detected by
    the tensor's version counter (every in-place write through `weights`, its views or the
    per-layer parameters counts; writes through `.data` do not: call `invalidate_caches()`).
    It costs 2 bytes (bf16) per adapter parameter; `clear_caches()` frees it (but its A,
    where the projections' weights hold it: `keep_decode_a`).

    Inside `held_copy(dtype)` (the update phase) multi-token forwards read A and B from one
    copy of the bank in the compute dtype instead of casting every module's weights in every
    forward (and holding those casts until the backward); the gradients reach the master
    weights exactly as through a cast.
    """

    def __init__(
        self,
        model: nn.Module,
        n_slots: int,
        rank: int = 16,
        alpha: float = 32.0,
        dropout: float = 0.0,
        target_modules: Sequence[str] = DEFAULT_TARGETS,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        kernel: str = "auto",
        decode_kernel: str = "auto",
    ) -> None:
        if n_slots < 1 or rank < 1:
            raise ValueError(f"AdapterBank needs n_slots >= 1 and rank >= 1, got {n_slots}, {rank}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if kernel != "auto" and kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; expected 'auto' or one of {KERNELS}")
        if decode_kernel != "auto" and decode_kernel not in DECODE_KERNELS:
            raise ValueError(
                f"unknown decode kernel {decode_kernel!r}; expected 'auto' or one of "
                f"{DECODE_KERNELS}"
            )
        if getattr(model, "_lorapop_bank", None) is not None:
            raise ValueError("this model already has an AdapterBank; call bank.detach() first")
        suffixes = tuple(target_modules)
        found = [
            (name, mod)
            for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in suffixes
        ]
        if not found:
            raise ValueError(f"no nn.Linear in the model matches target_modules {list(suffixes)}")
        devices = {mod.weight.device for _, mod in found}
        if len(devices) != 1:
            raise ValueError(f"AdapterBank needs all target modules on one device, got {devices}")
        for p in model.parameters():
            p.requires_grad_(False)

        self.model = model
        self.n_slots = n_slots
        self.rank = rank
        self.alpha = float(alpha)
        self.scaling = self.alpha / rank
        self.dropout = dropout
        self.target_modules = suffixes
        self.dtype = dtype
        self.device = devices.pop()
        self.kernel = kernel
        self.decode_kernel = decode_kernel

        sizes = [(rank * m.in_features, m.out_features * rank) for _, m in found]
        self.slot_numel = sum(a + b for a, b in sizes)
        self.weights = torch.zeros(n_slots, self.slot_numel, dtype=dtype, device=self.device)
        self.grads = torch.zeros_like(self.weights)
        self.targets: dict[str, _Target] = {}
        col = 0
        for (name, mod), (na, nb) in zip(found, sizes, strict=True):
            a_sl, b_sl = slice(col, col + na), slice(col + na, col + na + nb)
            col += na + nb
            a = nn.Parameter(self.weights[:, a_sl].view(n_slots, rank, mod.in_features))
            b = nn.Parameter(self.weights[:, b_sl].view(n_slots, mod.out_features, rank))
            self.targets[name] = _Target(name, mod, a, b, a_sl, b_sl)
        self.bind_grads_()

        self._grouped_ok: dict[torch.dtype, bool] = {}
        for dt in {dtype, torch.bfloat16, next(iter(found))[1].weight.dtype}:
            # grouped_mm needs 16-byte aligned strides: rows of rank r must span 16 bytes
            aligned = (rank * torch.empty((), dtype=dt).element_size()) % 16 == 0
            self._grouped_ok[dt] = aligned and grouped_supported(self.device, dt)
        self._routings: dict[int, Routing] = {}
        self._active: Routing | None = None
        self._version = 0
        self._grad_routing: Routing | None = None
        self._grad_version = -1
        self._disabled = False
        self._caches: dict[torch.dtype, DecodeCache] = {}
        self._stale = 0  # bumped by invalidate_caches(): part of the cache stamp
        self._held: _HeldCopy | None = None
        self._prefill_cache: DecodeCache | None = None  # inside `prefill_weights`
        self._gemm_shrinks: dict[tuple[str, ...], GemmShrink] = {}  # `keep_decode_a`
        # a prefill's token routing (`_token_routing`): ((routing version, tokens), perm, ends)
        self._tokens_routed: tuple[tuple[int, int], Tensor, Tensor] | None = None
        self._iota = torch.arange(0)

        for i in range(n_slots):
            self.reset_slot(i, seed + i)
        for t in self.targets.values():
            t.handle = t.module.register_forward_hook(self._hook(t))
            t.module._lorapop_bank = self  # (`fused_swiglu`: the MLP finds its bank)
        self._by_module = {t.module: t for t in self.targets.values()}
        model._lorapop_bank = self  # type: ignore[assignment]

    # ------------------------------------------------------------------ routing
    @contextmanager
    def route(self, slot_ids: Sequence[int] | Tensor) -> Iterator[None]:
        """Route row b of every forward inside the block to slot `slot_ids[b]`.

        Validates the ids on the host: ids on the device are read back (the host waits for
        the GPU), ids on the host are not (their copy is queued). The previous routing is
        restored on exit. For CUDA-graph decoding use `set_slot_ids_` instead.
        """
        ids = torch.as_tensor(slot_ids, dtype=torch.long).reshape(-1)
        host = ids.cpu()
        if host.numel() == 0:
            raise ValueError("route() needs at least one slot id")
        lo, hi = int(host.min()), int(host.max())
        if lo < 0 or hi >= self.n_slots:
            raise ValueError(f"slot ids must lie in [0, {self.n_slots}), got range [{lo}, {hi}]")
        is_sorted = bool((host[1:] >= host[:-1]).all())
        prev = self._active
        saved = None if prev is None else (prev.ids.clone(), prev.is_sorted, prev.runs)
        self.set_slot_ids_(host_to_device(ids, self.device), is_sorted=is_sorted,
                           runs=slot_runs(host) if is_sorted else None)
        try:
            yield
        finally:
            if saved is None:
                self._active = None
                self._version += 1
            else:
                self.set_slot_ids_(*saved)

    def set_slot_ids_(self, slot_ids: Tensor, is_sorted: bool = False,
                      runs: list[tuple[int, int, int]] | None = None) -> None:
        """Set the routing in place, without host synchronisation or validation.

        Index buffers persist per batch size, so a CUDA graph captured after this call reads
        whatever a later call with the same batch size writes. `is_sorted=True` promises the
        ids are non-decreasing (the grouped kernel then skips its row gathers).
        """
        batch = slot_ids.numel()
        routing = self._routings.get(batch)
        if routing is None:
            routing = Routing.empty(batch, self.n_slots, self.device)
            self._routings[batch] = routing
        routing.fill_(slot_ids.reshape(-1), is_sorted, runs)
        self._active = routing
        self._version += 1

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Run the base model alone (no adapter on any row) inside the block."""
        prev, self._disabled = self._disabled, True
        try:
            yield
        finally:
            self._disabled = prev

    def _routing(self) -> Routing:
        """The routing for this forward.

        Under non-reentrant gradient checkpointing the forward is recomputed during
        backward, possibly after `route` exited or re-routed another batch. Grad-enabled
        forwards therefore snapshot the routing, and recomputation (a forward running inside
        a backward pass) reads that snapshot.
        """
        if torch.is_grad_enabled():
            if torch._C._current_graph_task_id() != -1:
                if self._grad_routing is None:
                    raise RuntimeError("AdapterBank: recomputation without a routed forward")
                return self._grad_routing
            if self._active is None:
                raise RuntimeError(_NO_ROUTE)
            if self._grad_version != self._version:
                self._grad_routing = self._active.clone()
                self._grad_version = self._version
            return self._grad_routing  # type: ignore[return-value]
        if self._active is None:
            raise RuntimeError(_NO_ROUTE)
        return self._active

    def _hook(self, target: _Target):
        def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
            if self._disabled:
                return output
            routing = self._routing()
            x = args[0]
            dropout = self.dropout > 0 and module.training
            if dropout:
                x = nn.functional.dropout(x, self.dropout, training=True)
            dev = x.device.type
            dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
            grad = torch.is_grad_enabled() and any(
                t.requires_grad for t in (output, x, target.a, target.b))
            path = self._path(module, x, output, routing, dt, dropout, grad)
            if path == "decode_cache":
                # while torch.compile traces, version counters can't be read (the decoder
                # refreshes before each batch); sharing h between q/k/v (gate/up) is a
                # side effect on the cache that dynamo replays, so it stays on; compiled,
                # each group's deltas come from one GEMM and the adds fuse downstream
                tracing = torch.compiler.is_compiling()
                cache = self.decode_cache(dt, check=not tracing)
                return cache.add_delta(target.name, x, output, routing, True, tracing)
            if path == "one_slot":
                s = routing.runs[0][0]  # type: ignore[index]
                return add_delta_frozen_linear(output, x, module.weight,
                                               *self._slot_weights(target, dt, s), self.scaling)
            if path == "runs":
                cache = self._prefill_cache
                if cache is not None and not grad and cache.dtype == dt:  # B holds the scaling
                    if (routing.is_sorted and x.dim() == 3 and x.is_contiguous()
                            and output.is_contiguous()
                            and cache.add_delta_tokens(target.name, x, output,
                                                       *self._token_routing(routing, x))):
                        return output
                    weights, scaling = partial(cache.slot_weights, target.name), 1.0
                else:
                    weights, scaling = partial(self._slot_weights, target, dt), self.scaling
                return add_delta_by_runs(output, x.to(dt), weights, routing.runs,  # type: ignore[arg-type]
                                         scaling, grad)
            a, b = self._compute_weights(target, dt)
            delta = lora_delta(x.to(dt), a, b, routing, path, self.scaling)
            return output + delta.to(output.dtype)

        return hook

    def fused_swiglu(self, gate_proj: nn.Module, up_proj: nn.Module, x: Tensor,
                     act: Callable[[Tensor, Tensor], Tensor]) -> Tensor | None:
        """act(gate_proj(x), up_proj(x)), both with their LoRA terms, as the SwiGLU
        epilogue of the gate/up expand (`DecodeCache.swiglu`), for the forwards whose hooks
        take the decode cache's kernels: decode steps, and prefills in slot order inside
        `prefill_weights`. `act` is the SwiGLU the caller runs otherwise, here only if the
        kernel fails after the projections ran. None where this does not apply (nothing is
        computed: the caller runs its MLP as usual)."""
        tg, tu = self._by_module.get(gate_proj), self._by_module.get(up_proj)
        routing = self._active
        if (not decode_kernel.SWIGLU or tg is None or tu is None or self._disabled
                or routing is None or torch.is_grad_enabled() or x.dim() != 3
                or x.shape[0] != routing.ids.numel() or torch.compiler.is_compiling()
                or torch.is_autocast_enabled(x.device.type)
                or (self.dropout > 0 and gate_proj.training)
                or not (_only_hook(tg) and _only_hook(tu))):
            return None
        if x.shape[1] == 1:
            if self.decode_kernel not in ("auto", "fused"):
                return None
            cache, perm, ends = self.decode_cache(x.dtype), routing.perm, routing.ends
            bm = decode_kernel.BM
        else:
            cache = self._prefill_cache
            if (cache is None or cache.dtype != x.dtype or self.kernel not in ("auto", "fused")
                    or routing.runs is None or not routing.is_sorted or not x.is_contiguous()):
                return None
            (perm, ends), bm = self._token_routing(routing, x), decode_kernel.BM_TOKENS
        # the projections without their hooks: their terms are the kernel's
        gate, up = gate_proj.forward(x), up_proj.forward(x)
        out = cache.swiglu(tg.name, tu.name, x, gate, up, perm, ends, bm)
        if out is None:
            out = act(self._hook(tg)(gate_proj, (x,), gate), self._hook(tu)(up_proj, (x,), up))
        return out

    def _token_routing(self, routing: Routing, x: Tensor) -> tuple[Tensor, Tensor]:
        """(perm, ends) over the tokens of x [B, T, in] whose rows are in slot order: the
        identity, and each slot's end in tokens; made once per routing and T (a forward's
        every projection reads them)."""
        tokens = x.shape[1]
        key = (self._version, tokens)
        held = self._tokens_routed
        if held is None or held[0] != key:
            n = x.shape[0] * tokens
            if self._iota.numel() < n or self._iota.device != x.device:
                self._iota = torch.arange(max(n, 2 * self._iota.numel()), device=x.device)
            held = (key, self._iota[:n], routing.ends * tokens)
            self._tokens_routed = held
        return held[1], held[2]

    def _path(self, module: nn.Module, x: Tensor, output: Tensor, routing: Routing,
              dt: torch.dtype, dropout: bool, grad: bool) -> str:
        """The one place that picks how a projection adds its LoRA term. The batched kernels
        ("grouped", "gather", "dense": `lora_delta`) are the reference and serve any batch;
        the others are faster where they apply, and tests/lora/test_bank.py compares each
        with "gather" (set `kernel`/`decode_kernel` to a batched kernel to force it).

        - "decode_cache": one token a row, no grad, no dropout: the decode cache's kernels
          (a compute-dtype copy of the bank; q/k/v and gate/up share their A GEMM).
        - "one_slot": every row of one slot under grad, through a frozen plain linear, all in
          the compute dtype, no dropout: the input's gradient is formed as one tensor, base
          and LoRA (`add_delta_frozen_linear`), not two summed.
        - "runs": several tokens a row, rows in runs of one slot that the host knows (routed
          by `route` in slot order), output in the compute dtype, one run if under grad: the
          add goes into the expand GEMM (`add_delta_by_runs`), no delta tensor. Several runs
          under grad would make autograd copy the output's whole gradient for each. Inside
          `prefill_weights` the weights come from the decode cache (no casts), and rows in
          slot order take its kernels over their tokens (`DecodeCache.add_delta_tokens`).
        - otherwise the batched kernel asked for; with "auto", "dense" for one token a row,
          "grouped" for rows in slot order where this torch runs grouped_mm for the dtype,
          else "gather" (row permutations cost more than per-row weight gathers)."""
        one_token = x.dim() >= 2 and x.shape[-2] == 1
        kernel = self.decode_kernel if one_token else self.kernel
        if kernel not in ("auto", "fused"):
            return kernel
        if one_token:
            fits = x.dim() == 3 and not torch.is_grad_enabled() and not dropout
            return "decode_cache" if fits else "dense"
        runs = routing.runs
        if runs is not None and output.dtype == dt:
            if (grad and len(runs) == 1 and runs[0][2] == x.shape[0] and not dropout
                    and type(module) is nn.Linear and not module.weight.requires_grad
                    and module.weight.device == x.device
                    and x.dtype == module.weight.dtype == dt):
                return "one_slot"
            if not grad or len(runs) == 1:
                return "runs"
        return "grouped" if routing.is_sorted and self._grouped_ok.get(dt, False) else "gather"

    def _compute_weights(self, target: _Target, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """A and B of every slot in `dtype`: views of the held copy if there is one in that
        dtype (refreshed if the weights changed), else casts."""
        held = self._held_views(target, dtype)
        if held is None:
            return target.a.to(dtype), target.b.to(dtype)
        return _HeldCast.apply(target.a, held[0]), _HeldCast.apply(target.b, held[1])

    def _slot_weights(self, target: _Target, dtype: torch.dtype, s: int) -> tuple[Tensor, Tensor]:
        """Slot s's A and B in `dtype`, from the held copy where there is one. Under grad their
        gradients go straight into row s of `grads` (`_SlotView`)."""
        held = self._held_views(target, dtype)
        if not torch.is_grad_enabled():
            return (target.a[s].to(dtype), target.b[s].to(dtype)) if held is None else \
                (held[0][s], held[1][s])
        out = []
        for i, (p, sl) in enumerate(((target.a, target.a_slice), (target.b, target.b_slice))):
            if held is None and p.dtype != dtype:
                out.append(p[s].to(dtype))  # a cast per forward, as `_compute_weights`
                continue
            source = p.detach() if held is None else held[i]
            out.append(_SlotView.apply(p, source, s, self.grads[s, sl].view(p.shape[1:])))
        return out[0], out[1]

    def _held_views(self, target: _Target, dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
        """The target's A and B in the held copy, if there is one in `dtype` (refreshed first
        if the weights changed since it was made)."""
        held = self._held
        if held is None or held.dtype != dtype:
            return None
        if held.stamp != self._stamp():
            with torch.no_grad():
                held.flat.copy_(self.weights)
            held.stamp = self._stamp()
        return held.views[target.name]

    @contextmanager
    def held_copy(self, dtype: torch.dtype) -> Iterator[None]:
        """Hold a `dtype` copy of the bank for the forwards (and backwards) inside the block;
        freed on exit. A no-op for the bank's own dtype (there is nothing to cast)."""
        if dtype == self.dtype or self._held is not None:
            yield
            return
        flat = self.weights.detach().to(dtype)
        views = {n: (flat[:, t.a_slice].view(t.a.shape), flat[:, t.b_slice].view(t.b.shape))
                 for n, t in self.targets.items()}
        self._held = _HeldCopy(dtype, flat, views, self._stamp())
        try:
            yield
        finally:
            self._held = None

    # ------------------------------------------------------------------ decode cache
    def decode_cache(self, dtype: torch.dtype, check: bool = True) -> DecodeCache:
        """The "fused" decode kernel's copy of the bank in `dtype`, refreshed if stale.

        `check=False` skips the staleness test (used while torch.compile traces, which
        cannot read version counters; the decoder refreshes before each batch).
        """
        cache = self._caches.get(dtype)
        if cache is None:
            groups = self._shared_input_groups()
            cache = DecodeCache(groups, dtype, self.scaling,
                                [self._gemm_shrinks.get(tuple(n for n, _, _ in g)) for g in groups])
            self._caches[dtype] = cache
            check = True
        if check and cache.stamp != self._stamp():
            cache.refresh_(self._stamp())
        return cache

    @contextmanager
    def prefill_weights(self, dtype: torch.dtype) -> Iterator[None]:
        """Forwards of several tokens a row without grad inside the block (a decoder's
        prefills) take slot weights from the decode cache in `dtype`, made fresh here: no
        cast of each slot's factors per projection and run, and the weights the decode steps
        use. Without the decode cache path (`decode_kernel` set to a batched kernel), a no-op."""
        if not PREFILL_FROM_CACHE or self.decode_kernel not in ("auto", "fused"):
            yield
            return
        self._prefill_cache = self.decode_cache(dtype)
        try:
            yield
        finally:
            self._prefill_cache = None

    def sync_caches(self) -> None:
        """Refresh every existing decode cache whose weights changed (no-op otherwise)."""
        for dtype in list(self._caches):
            self.decode_cache(dtype)

    def invalidate_caches(self) -> None:
        """Mark the decode caches stale (needed only after writes through `.data`)."""
        self._stale += 1

    def clear_caches(self) -> None:
        """Free the decode caches (rebuilt on the next decode forward); projections that held
        a cache's A stop computing it."""
        for cache in self._caches.values():
            cache.release()
        self._caches.clear()

    def _stamp(self) -> int:
        return self.weights._version * 1_000_003 + self._stale

    def keep_decode_a(self, names: Sequence[str], shrink: GemmShrink) -> None:
        """Decode caches keep the A of the projections `names` (in the order of the shrink's
        rows; the group `_shared_input_groups` makes of them) in `shrink`'s rows, and take
        the h their GEMM computes there instead of running a shrink."""
        self._gemm_shrinks[tuple(names)] = shrink
        self.clear_caches()  # a cache made before binds on its next build

    def _shared_input_groups(self) -> list[list[tuple[str, Tensor, Tensor]]]:
        """Targets grouped by shared input: same parent module, one SHARED_INPUT set."""
        groups: dict[tuple[str, int, int], list[tuple[str, Tensor, Tensor]]] = {}
        for name, t in self.targets.items():
            parent, _, leaf = name.rpartition(".")
            kind = next((i for i, s in enumerate(SHARED_INPUT) if leaf in s), -1)
            key = (parent, kind, t.module.in_features) if kind >= 0 else (name, -1, 0)
            groups.setdefault(key, []).append((name, t.a.detach(), t.b.detach()))  # type: ignore[arg-type]
        # members by name: the order `engine.merged` lays a group's outputs out in, so the
        # decode kernels add every member's term into the merged output at once
        return [sorted(g, key=lambda m: m[0]) for g in groups.values()]

    # ------------------------------------------------------------------ slots
    @property
    def module_names(self) -> list[str]:
        return list(self.targets)

    def parameters_of_bank(self) -> list[nn.Parameter]:
        """Per-layer A and B parameters (views of `weights`; their grads view `grads`)."""
        return [p for t in self.targets.values() for p in (t.a, t.b)]

    def bind_grads_(self) -> None:
        """Make every parameter's .grad a view of `grads` (autograd accumulates in place)."""
        for t in self.targets.values():
            for p, sl in ((t.a, t.a_slice), (t.b, t.b_slice)):
                view = self.grads[:, sl].view(p.shape)
                g = p.grad
                if g is not None and g.data_ptr() != view.data_ptr():
                    view.copy_(g)
                elif g is None:
                    view.zero_()
                p.grad = view

    def zero_grad(self) -> None:
        self.grads.zero_()
        self.bind_grads_()

    def _check_slot(self, i: int) -> None:
        if not 0 <= i < self.n_slots:
            raise IndexError(f"slot {i} out of range [0, {self.n_slots})")

    def slot_state(self, i: int) -> SlotState:
        """Copies of slot i's weights: {module_name: {"A": [r, in], "B": [out, r]}}."""
        self._check_slot(i)
        return {
            n: {"A": t.a[i].detach().clone(), "B": t.b[i].detach().clone()}
            for n, t in self.targets.items()
        }

    @torch.no_grad()
    def load_slot(self, i: int, state: SlotState) -> None:
        """Write a slot state (same modules and shapes as `slot_state`) into slot i."""
        self._check_slot(i)
        missing = set(self.targets) - set(state)
        extra = set(state) - set(self.targets)
        if missing or extra:
            raise ValueError(
                f"slot state does not match the bank: missing {sorted(missing)[:3]}, "
                f"unexpected {sorted(extra)[:3]}"
            )
        for n, t in self.targets.items():
            for key, p in (("A", t.a), ("B", t.b)):
                src = state[n][key]
                if tuple(src.shape) != tuple(p.shape[1:]):
                    raise ValueError(
                        f"{n}.{key}: expected shape {tuple(p.shape[1:])}, got {tuple(src.shape)}"
                    )
                p[i].copy_(src)

    @torch.no_grad()
    def copy_slot(self, src: int, dst: int) -> None:
        self._check_slot(src)
        self._check_slot(dst)
        self.weights[dst].copy_(self.weights[src])

    @contextmanager
    def swapped(self, i: int, weights: Tensor) -> Iterator[None]:
        """Slot i holds `weights` (a `weights[i]`-shaped row) inside the block and its own,
        bit for bit, after it; no optimizer or gradient state is touched."""
        self._check_slot(i)
        row = self.weights[i]
        own = row.detach().clone()
        with torch.no_grad():
            row.copy_(weights.to(row.device))
        self.invalidate_caches()
        try:
            yield
        finally:
            with torch.no_grad():
                row.copy_(own)
            self.invalidate_caches()

    @torch.no_grad()
    def reset_slot(self, i: int, seed: int = 0) -> None:
        """Fresh PEFT-style init of slot i (identity), reproducible on any device."""
        self._check_slot(i)
        gen = torch.Generator().manual_seed(seed)
        for t in self.targets.values():
            a = torch.empty(t.a.shape[1:], dtype=torch.float32)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            t.a[i].copy_(a)
            t.b[i].zero_()

    def state_dict(self) -> dict:
        """Weights and shape metadata, for checkpoints."""
        return {
            "weights": self.weights.detach().clone(),
            "n_slots": self.n_slots,
            "rank": self.rank,
            "alpha": self.alpha,
            "modules": self.module_names,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if state.get("modules") != self.module_names or state.get("rank") != self.rank:
            raise ValueError("bank checkpoint does not match this bank's modules or rank")
        if tuple(state["weights"].shape) != tuple(self.weights.shape):
            raise ValueError(
                f"bank checkpoint has weights {tuple(state['weights'].shape)}, "
                f"expected {tuple(self.weights.shape)}"
            )
        self.weights.copy_(state["weights"])

    def detach(self) -> None:
        """Remove the hooks: the model is the plain base model again."""
        self.clear_caches()
        for t in self.targets.values():
            if t.handle is not None:
                t.handle.remove()
                t.handle = None
            if getattr(t.module, "_lorapop_bank", None) is self:
                t.module._lorapop_bank = None
        if getattr(self.model, "_lorapop_bank", None) is self:
            self.model._lorapop_bank = None  # type: ignore[assignment]


def _only_hook(t: _Target) -> bool:
    """Whether the bank's hook is the only one `t`'s module runs (calling its `forward`
    directly then skips nothing but the bank's term)."""
    m = t.module
    return (t.handle is not None and list(m._forward_hooks) == [t.handle.id]
            and not m._forward_pre_hooks and not nn.modules.module._global_forward_hooks
            and not nn.modules.module._global_forward_pre_hooks)


_NO_ROUTE = "AdapterBank: no routing set; wrap the forward in `with bank.route(slot_ids):`"
