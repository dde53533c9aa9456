"""LoRA weight-space evolution operators: pure functions of slot states and a seed.

A state is ``{module_name: {"A": Tensor[r, in], "B": Tensor[out, r]}}``; the adapter adds
``scaling * B @ A`` to the module. Parents come from one bank and share ``scaling``, so the
operators work on the product ``dW = B @ A`` alone. Call them as
``OPERATORS[name](parents, seed, **options)``; ``parents[0]`` is the fitter parent.

Why dW space. A factorisation is defined only up to an invertible r x r matrix
(``B A = (B M)(M^-1 A)``), and adapters trained from different seeds have unrelated factors,
so averaging or swapping entries of A and B across parents mixes arbitrary bases. Every
operator that combines parents or edits directions works on dW through its exact SVD and
writes the child in the balanced form ``B' = U sqrt(S)``, ``A' = sqrt(S) V^T``. Only module
selection (whole modules are copied) and the two noise mutations (a local perturbation of
the parent's own factors) touch factors directly.

Exact low-rank SVD. A sum of rank-r products ``sum_i B_i A_i = B A`` (B = [B_1 .. B_k],
A = [A_1; ..; A_k]) has rank <= kr. With ``B = Q_b R_b`` and ``A^T = Q_a R_a``,
``B A = Q_b (R_b R_a^T) Q_a^T``: the SVD of the small kr x kr core is the exact SVD of B A,
and its leading r components are the best rank-r approximation (Eckart-Young). Nothing is
orthogonalised on the big tensors: from the kr x kr Gram matrices (float64)
``A A^T = R_a^T R_a`` comes from an eigendecomposition, and the core's right singular
vectors and squared singular values from ``eigh(C^T C) = eigh(R_a B^T B R_a^T)``. That is two
small float64 eigh's per module on the CPU (cheaper there than cuSOLVER's per-matrix calls)
and batched matmuls on the device; exact rank deficiency (a parent crossed with itself, a
fresh adapter with B = 0) is handled by thresholding eigenvalues, with no Cholesky failure.
Directions with a singular value below ``RTOL`` of the largest count as zero.
(A QR-of-both-factors route gave the same result 2-4x slower on an H200; docs/performance.md.)
Modules of equal shapes are stacked and processed as one batch.

Dormant directions. A component with zero singular value would get a zero row in A and a
zero column in B, and such a direction never gets a gradient again. The child's B column is
zero there (dW unchanged) and its A row is drawn as PEFT initialises LoRA A
(kaiming-uniform), so the direction stays trainable, as in a fresh adapter.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

State = dict[str, dict[str, Tensor]]
Kind = Literal["mutation", "crossover", "control"]

RTOL = 1e-6  # singular values below RTOL * largest (per module) count as zero

_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True)
class OpInfo:
    """What an operator is, for the replacement policy and for reports."""

    kind: Kind
    n_parents: int
    random: bool  # whether the child's dW depends on the seed
    summary: str


# --------------------------------------------------------------------------- plumbing


class _Rng:
    """Per-call generators: one on the tensors' device, one on the CPU for discrete choices."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        # float64 where the device has it (not MPS): the dW algebra loses nothing then.
        self.dtype = torch.float64 if device.type in ("cpu", "cuda") else torch.float32
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.cpu = torch.Generator().manual_seed(seed ^ 0x5DEECE66D)

    def randn(self, *shape: int) -> Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=self.dtype)

    def rand(self, *shape: int) -> Tensor:
        return torch.rand(shape, generator=self.gen, device=self.device, dtype=self.dtype)


def _check(parents: Sequence[State], n: int) -> list[State]:
    """Validate parents (count, keys, shapes, device); one-line ValueError otherwise."""
    if len(parents) != n:
        raise ValueError(f"expected {n} parent state(s), got {len(parents)}")
    first = parents[0]
    if not first:
        raise ValueError("parent state has no modules")
    device = None
    for p in parents:
        if p.keys() != first.keys():
            raise ValueError("parent states have different module names")
        for name, f in p.items():
            a, b = (f.get("A"), f.get("B")) if isinstance(f, dict) else (None, None)
            if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
                raise ValueError(f"{name}: expected tensors under 'A' and 'B'")
            if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0]:
                raise ValueError(
                    f"{name}: expected A [r, in] and B [out, r], got "
                    f"{tuple(a.shape)} and {tuple(b.shape)}"
                )
            if a.shape != first[name]["A"].shape or b.shape != first[name]["B"].shape:
                raise ValueError(f"{name}: parents differ in shape")
            device = a.device if device is None else device
            if a.device != device or b.device != device:
                raise ValueError(f"{name}: parents must be on one device")
    return list(parents)


def _groups(state: State) -> list[list[str]]:
    """Module names grouped by equal (out, r, in), in state order."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for name, f in state.items():
        groups.setdefault((*f["B"].shape, f["A"].shape[1]), []).append(name)
    return list(groups.values())


Stacked = Callable[[list[Tensor], list[Tensor], list[str], _Rng], tuple[Tensor, Tensor]]


def _map(parents: list[State], rng: _Rng, fn: Stacked) -> State:
    """Run fn on each group of same-shaped modules, stacked: Bs [m, out, r], As [m, r, in].

    Stacking copies, so the parents are never written; the child is cast back to each
    tensor's dtype.
    """
    child: State = {}
    for names in _groups(parents[0]):
        bs = [torch.stack([p[n]["B"] for n in names]).to(rng.dtype) for p in parents]
        as_ = [torch.stack([p[n]["A"] for n in names]).to(rng.dtype) for p in parents]
        b, a = fn(bs, as_, names, rng)
        for i, n in enumerate(names):
            ref = parents[0][n]
            child[n] = {
                "A": a[i].to(ref["A"].dtype).contiguous(),
                "B": b[i].to(ref["B"].dtype).contiguous(),
            }
    return {n: child[n] for n in parents[0]}


def _layer(name: str) -> int | None:
    """Layer index of a module name ("model.layers.3.mlp.up_proj" -> 3), None if none."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------- exact low-rank SVD


def _on_cpu(*xs: Tensor) -> list[Tensor]:
    return [x.to("cpu", torch.float64) for x in xs]


def _eigh(g: Tensor) -> tuple[Tensor, Tensor]:
    """eigh of symmetric PSD matrices, ascending; LAPACK's eigh can fail to converge on
    matrices with clustered eigenvalues, where the SVD (same factors for PSD) still does."""
    if not torch.isfinite(g).all():
        raise ValueError("evolution operator: a parent adapter has non-finite weights")
    try:
        return torch.linalg.eigh(g)
    except torch.linalg.LinAlgError:
        u, sv, _ = torch.linalg.svd(g)
        return sv.flip(-1), u.flip(-1)


def _half(g: Tensor) -> tuple[Tensor, Tensor]:
    """For a Gram matrix G = X^T X: R with X = Q R, and Y with Q = X Y (0 on X's null space).

    From eigh(G) = P L P^T: R = L^1/2 P^T, Y = P L^-1/2; eigenvalues below RTOL^2 of the
    largest (singular values of X below RTOL) count as zero, so rank deficiency is exact.
    """
    lam, p = _eigh(g)
    keep = (lam > RTOL**2 * lam.amax(-1, keepdim=True)) & (lam > 0)
    root = lam.clamp_min(0).sqrt()
    inv = torch.where(keep, 1 / torch.where(keep, root, 1), 0)
    return (root * keep).unsqueeze(-1) * p.mT, p * inv.unsqueeze(-2)


def _svd(b: Tensor, a: Tensor, r: int) -> tuple[Tensor, Tensor, Tensor]:
    """Leading-r SVD of b @ a (b [m, out, k], a [m, k, in]) without forming it.

    Returns U [m, out, r], S [m, r], Vh [m, r, in]; components with S below RTOL of the
    largest are zeroed in all three, so every downstream step sees them as absent.
    """
    dev, dt = b.device, b.dtype
    # core C = R_b R_a^T, C^T C = R_a G_b R_a^T = W S^2 W^T: one eigh instead of an SVD
    gb, ga = _on_cpu(b.mT @ b, a @ a.mT)
    ra, ya = _half(ga)
    lam, w = _eigh(ra @ gb @ ra.mT)
    lam, w = lam.flip(-1), w.flip(-1)
    s = lam.clamp_min(0).sqrt()
    inv = torch.where(s > 0, 1 / torch.where(s > 0, s, 1), 0)
    u = b @ (ra.mT @ w * inv.unsqueeze(-2)).to(dev, dt)  # U = B A V / S, A A^T Y_a = R_a^T
    vh = (ya @ w).to(dev, dt).mT @ a  # V^T = W^T Q_a^T, Q_a = A^T Y_a
    s = s.to(dev, dt)
    u, s, vh = u[..., :r], s[..., :r], vh[..., :r, :]
    if s.shape[-1] < r:  # fewer than r components exist (r above the factors' inner size)
        pad = r - s.shape[-1]
        u = torch.nn.functional.pad(u, (0, pad))
        s = torch.nn.functional.pad(s, (0, pad))
        vh = torch.nn.functional.pad(vh, (0, 0, 0, pad))
    live = ((s > RTOL * s.amax(-1, keepdim=True)) & (s > 0)).to(dt)
    return u * live.unsqueeze(-2), s * live, vh * live.unsqueeze(-1)


def _factors(u: Tensor, s: Tensor, vh: Tensor, rng: _Rng) -> tuple[Tensor, Tensor]:
    """Balanced factors B = U sqrt(S), A = sqrt(S) V^T; dormant rows of A drawn fresh."""
    root = s.clamp_min(0).sqrt()
    b = u * root.unsqueeze(-2)
    a = vh * root.unsqueeze(-1)
    bound = 1 / math.sqrt(a.shape[-1])  # PEFT's kaiming_uniform_(a=sqrt(5)) on [r, in]
    fresh = (rng.rand(*a.shape) * 2 - 1) * bound
    return b, torch.where((s > 0).unsqueeze(-1), a, fresh)


def _balanced(b: Tensor, a: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """A parent's own dW in the canonical gauge: U sqrt(S), sqrt(S) V^T (zero if absent)."""
    u, s, vh = _svd(b, a, r)
    root = s.sqrt()
    return u * root.unsqueeze(-2), vh * root.unsqueeze(-1)


def _sum(
    bs: Sequence[Tensor], as_: Sequence[Tensor], r: int, rng: _Rng, weights: Sequence[float]
) -> tuple[Tensor, Tensor]:
    """Best rank-r factors of sum_i w_i B_i A_i, exact through the stacked-factor SVD."""
    b = torch.cat([w * x for w, x in zip(weights, bs, strict=True)], dim=-1)
    a = torch.cat(list(as_), dim=-2)
    return _factors(*_svd(b, a, r), rng)


def _orthonormal(h: Tensor) -> Tensor:
    """Symmetric (Loewdin) orthonormalisation of full-rank columns h [m, n, k]."""
    lam, p = torch.linalg.eigh(*_on_cpu(h.mT @ h))
    w = (p * lam.clamp_min(1e-300).rsqrt().unsqueeze(-2)) @ p.mT
    return h @ w.to(h.device, h.dtype)


def _rotate(u: Tensor, live: Tensor, angle: float, rng: _Rng) -> Tensor:
    """Rotate the live orthonormal columns of u [m, n, r] by about `angle` radians (rms).

    A random skew matrix X on the basis [U, Q] (Q: r random directions orthogonal to U)
    gives the rotation exp(X); its U-U block turns directions within the subspace, its
    Q-U block tilts the subspace itself. Dead columns (live = 0) are left fixed.
    """
    m, n, r = u.shape
    w = 2 * r if n >= 2 * r else r  # room to tilt out of the subspace
    g = rng.randn(m, w, w)
    x = (g - g.mT) * (angle / math.sqrt(2 * w))
    keep = torch.cat([live, torch.ones_like(live)], dim=-1)[..., :w]
    x = x * keep.unsqueeze(-1) * keep.unsqueeze(-2)
    basis = u
    if w == 2 * r:
        h = rng.randn(m, n, r)
        for _ in range(2):  # twice is enough for orthogonality in floating point
            h = h - u @ (u.mT @ h)
        basis = torch.cat([u, _orthonormal(h)], dim=-1)
    return basis @ torch.linalg.matrix_exp(x)[..., :r]


# ----------------------------------------------------------------------------- mutations


@torch.no_grad()
def spectral(
    parents: Sequence[State], seed: int, *, sigma: float = 0.1, angle: float = 0.02
) -> State:
    """Spectral perturbation: singular values times exp(sigma * N(0, 1)), singular
    subspaces rotated by about `angle` radians; rank kept, exact SVD of each module."""
    ps = _check(parents, 1)
    rng = _Rng(ps[0][next(iter(ps[0]))]["A"].device, seed)

    def fn(bs: list[Tensor], as_: list[Tensor], _: list[str], rng: _Rng) -> tuple[Tensor, Tensor]:
        r = bs[0].shape[-1]
        u, s, vh = _svd(bs[0], as_[0], r)
        live = (s > 0).to(s.dtype)
        s = s * torch.exp(sigma * rng.randn(*s.shape))
        if angle:
            u = _rotate(u, live, angle, rng)
            vh = _rotate(vh.mT, live, angle, rng).mT
        return _factors(u, s, vh, rng)

    return _map(ps, rng, fn)


@torch.no_grad()
def layer_noise(
    parents: Sequence[State], seed: int, *, p: float = 0.25, scale: float = 0.1
) -> State:
    """Gaussian noise (std = scale * RMS of each tensor) on A and B of a random subset of
    layers (a fraction p, at least one); modules with no layer index form one more unit."""
    ps = _check(parents, 1)
    _unit_fraction(p)
    rng = _Rng(ps[0][next(iter(ps[0]))]["A"].device, seed)
    units = sorted({_layer(n) for n in ps[0]}, key=lambda x: -1 if x is None else x)
    k = max(1, round(p * len(units)))
    chosen = {units[i] for i in torch.randperm(len(units), generator=rng.cpu)[:k].tolist()}

    def fn(
        bs: list[Tensor], as_: list[Tensor], names: list[str], rng: _Rng
    ) -> tuple[Tensor, Tensor]:
        hit = [i for i, n in enumerate(names) if _layer(n) in chosen]
        if not hit:
            return bs[0], as_[0]
        idx = torch.tensor(hit, device=rng.device)
        b, a = bs[0], as_[0]
        b[idx], a[idx] = _noisy(b[idx], scale, rng), _noisy(a[idx], scale, rng)
        return b, a

    return _map(ps, rng, fn)


@torch.no_grad()
def noise(parents: Sequence[State], seed: int, *, scale: float = 0.05) -> State:
    """Gaussian noise on every A and B, std = scale * RMS of that tensor (a zero B stays 0)."""
    ps = _check(parents, 1)
    rng = _Rng(ps[0][next(iter(ps[0]))]["A"].device, seed)

    def fn(bs: list[Tensor], as_: list[Tensor], _: list[str], rng: _Rng) -> tuple[Tensor, Tensor]:
        return _noisy(bs[0], scale, rng), _noisy(as_[0], scale, rng)

    return _map(ps, rng, fn)


def _noisy(x: Tensor, scale: float, rng: _Rng) -> Tensor:
    """x [m, p, q] plus Gaussian noise with std scale * RMS of each x[i]."""
    rms = x.pow(2).mean(dim=(-2, -1), keepdim=True).sqrt()
    return x + rng.randn(*x.shape) * (scale * rms)


@torch.no_grad()
def mask(parents: Sequence[State], seed: int, *, n: int | None = None) -> State:
    """Component masking: drop n random singular directions of each module (all of its
    nonzero ones if fewer; n=None: r // 8, at least 1); the rank drops by exactly that many."""
    ps = _check(parents, 1)
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = _Rng(ps[0][next(iter(ps[0]))]["A"].device, seed)

    def fn(bs: list[Tensor], as_: list[Tensor], _: list[str], rng: _Rng) -> tuple[Tensor, Tensor]:
        r = bs[0].shape[-1]
        u, s, vh = _svd(bs[0], as_[0], r)
        score = rng.rand(*s.shape) + (s == 0).to(s.dtype)  # live directions go first
        drop = score.argsort(dim=-1)[..., : max(1, r // 8) if n is None else min(n, r)]
        return _factors(u, s.scatter(-1, drop, 0.0), vh, rng)

    return _map(ps, rng, fn)


# ---------------------------------------------------------------------------- crossovers


@torch.no_grad()
def dare(parents: Sequence[State], seed: int, *, p: float = 0.3) -> State:
    """DARE merge: each parent's factors, in its canonical gauge (U sqrt(S), sqrt(S) V^T),
    lose entries with probability p and are rescaled by 1/(1-p); the two dropped products
    are averaged in dW space and re-factored to rank r.

    Why not elementwise DARE on dW: a dropped dW is full rank, so returning to rank r
    needs an SVD of every dense out x in matrix (seconds at 7B). Dropping factor entries
    keeps each parent's dW in expectation (the masks of A and B are independent), needs no
    alignment between parents (each is dropped in its own basis, a function of its dW only),
    and the average of two rank-r products is re-factored exactly.
    """
    ps = _check(parents, 2)
    if not 0 <= p < 1:
        raise ValueError(f"p must be in [0, 1), got {p}")
    rng = _Rng(ps[0][next(iter(ps[0]))]["A"].device, seed)

    def fn(bs: list[Tensor], as_: list[Tensor], _: list[str], rng: _Rng) -> tuple[Tensor, Tensor]:
        r = bs[0].shape[-1]
        dropped_b, dropped_a = [], []
        for b, a in zip(bs, as_, strict=True):
            b, a = _balanced(b, a, r)
            dropped_b.append(b * (rng.rand(*b.shape) >= p) / (1 - p))
            dropped_a.append(a * (rng.rand(*a.shape) >= p) / (1 - p))
        return _sum(dropped_b, dropped_a, r, rng, (0.5, 0.5))

    return _map(ps, rng, fn)


@torch.no_grad()
def layer_select(
    parents: Sequence[State],
    seed: int,
    *,
    p: float = 0.5,
    unit: Literal["layer", "module"] = "layer",
) -> State:
    """Each layer (or module) copied whole from the fitter parent with probability p, else
    from the other. Modules are never split, so no factor alignment is involved."""
    ps = _check(parents, 2)
    _unit_fraction(p)
    if unit not in ("layer", "module"):
        raise ValueError(f"unit must be 'layer' or 'module', got {unit!r}")
    gen = torch.Generator().manual_seed(seed)
    key = _layer if unit == "layer" else (lambda n: n)
    units = list(dict.fromkeys(key(n) for n in ps[0]))
    first = dict(zip(units, (torch.rand(len(units), generator=gen) < p).tolist(), strict=True))
    return {n: {k: t.clone() for k, t in ps[0 if first[key(n)] else 1][n].items()} for n in ps[0]}


@torch.no_grad()
def subspace_mix(parents: Sequence[State], seed: int, *, k: int | None = None) -> State:
    """Leading k singular components of the fitter parent plus components k..r-1 of the
    other, re-factored (rank <= r, exact). k=None draws k in [1, r-1] per module."""
    ps = _check(parents, 2)
    rng = _Rng(ps[0][next(iter(ps[0]))]["A"].device, seed)

    def fn(bs: list[Tensor], as_: list[Tensor], _: list[str], rng: _Rng) -> tuple[Tensor, Tensor]:
        m, _, r = bs[0].shape
        if k is not None and not 0 <= k <= r:
            raise ValueError(f"k must be in [0, {r}], got {k}")
        if k is None:
            kk = torch.randint(1, max(r, 2), (m, 1), generator=rng.gen, device=rng.device)
        else:
            kk = torch.full((m, 1), k, device=rng.device)
        lead = (torch.arange(r, device=rng.device) < kk).to(rng.dtype)  # [m, r]
        u1, s1, v1 = _svd(bs[0], as_[0], r)
        u2, s2, v2 = _svd(bs[1], as_[1], r)
        f1, f2 = (s1 * lead).sqrt(), (s2 * (1 - lead)).sqrt()
        b = [u1 * f1.unsqueeze(-2), u2 * f2.unsqueeze(-2)]
        a = [v1 * f1.unsqueeze(-1), v2 * f2.unsqueeze(-1)]
        return _sum(b, a, r, rng, (1.0, 1.0))

    return _map(ps, rng, fn)


@torch.no_grad()
def extrapolate(parents: Sequence[State], seed: int, *, lam: float = 0.3) -> State:
    """W1 + lam (W1 - W2): a step past the fitter parent, away from the other; the rank-2r
    result is truncated to its best rank-r approximation."""
    ps = _check(parents, 2)
    rng = _Rng(ps[0][next(iter(ps[0]))]["A"].device, seed)

    def fn(bs: list[Tensor], as_: list[Tensor], _: list[str], rng: _Rng) -> tuple[Tensor, Tensor]:
        return _sum(bs, as_, bs[0].shape[-1], rng, (1 + lam, -lam))

    return _map(ps, rng, fn)


# ------------------------------------------------------------------------------ controls


@torch.no_grad()
def copy(parents: Sequence[State], seed: int) -> State:
    """The parent, exactly (fresh tensors)."""
    ps = _check(parents, 1)
    return {n: {k: t.clone() for k, t in f.items()} for n, f in ps[0].items()}


@torch.no_grad()
def mean(parents: Sequence[State], seed: int) -> State:
    """(W1 + W2) / 2, best rank-r approximation. The mean of the factors themselves would
    depend on each parent's arbitrary basis (see the module docstring), so it is not used."""
    ps = _check(parents, 2)
    rng = _Rng(ps[0][next(iter(ps[0]))]["A"].device, seed)

    def fn(bs: list[Tensor], as_: list[Tensor], _: list[str], rng: _Rng) -> tuple[Tensor, Tensor]:
        return _sum(bs, as_, bs[0].shape[-1], rng, (0.5, 0.5))

    return _map(ps, rng, fn)


def _unit_fraction(p: float) -> None:
    if not 0 <= p <= 1:
        raise ValueError(f"p must be in [0, 1], got {p}")


Operator = Callable[..., State]

OPERATORS: dict[str, Operator] = {
    "spectral": spectral,
    "layer_noise": layer_noise,
    "mask": mask,
    "noise": noise,
    "dare": dare,
    "layer_select": layer_select,
    "subspace_mix": subspace_mix,
    "extrapolate": extrapolate,
    "copy": copy,
    "mean": mean,
}

INFO: dict[str, OpInfo] = {
    "spectral": OpInfo("mutation", 1, True, "log-normal singular values, small subspace rotation"),
    "layer_noise": OpInfo(
        "mutation", 1, True, "RMS-scaled Gaussian noise on a random layer subset"
    ),
    "mask": OpInfo("mutation", 1, True, "drop n random singular directions per module"),
    "noise": OpInfo("mutation", 1, True, "RMS-scaled Gaussian noise on every factor"),
    "dare": OpInfo("crossover", 2, True, "drop-and-rescale each parent, mean in dW space"),
    "layer_select": OpInfo("crossover", 2, True, "whole layers (or modules) from either parent"),
    "subspace_mix": OpInfo("crossover", 2, True, "leading k directions of W1, the rest of W2"),
    "extrapolate": OpInfo("crossover", 2, False, "W1 + lam (W1 - W2), rank-r truncated"),
    "copy": OpInfo("control", 1, False, "the parent unchanged"),
    "mean": OpInfo("control", 2, False, "(W1 + W2) / 2, rank-r truncated"),
}
