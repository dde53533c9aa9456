"""Evolution operators: shapes, rank, purity, seeds, and the exact identities users rely on."""

from __future__ import annotations

import pytest
import torch

from lorapop.lora import evolve
from lorapop.lora.evolve import INFO, OPERATORS

R = 4
# (out, in) per module kind; two kinds share a shape so batching across modules is exercised
SHAPES = {"self_attn.q_proj": (16, 12), "self_attn.k_proj": (8, 12), "self_attn.o_proj": (12, 16),
          "mlp.up_proj": (20, 12), "mlp.down_proj": (12, 20)}
LAYERS = 4


def make_state(seed: int, rank: int = R, dtype: torch.dtype = torch.float32,
               live: int | None = None, extra: bool = True) -> dict:
    """Random full-rank factors (or rank `live`: the other B columns are zero)."""
    g = torch.Generator().manual_seed(seed)
    names = [f"model.layers.{i}.{k}" for i in range(LAYERS) for k in SHAPES]
    shapes = [SHAPES[n.split(".", 3)[3]] for n in names]
    if extra:  # a module with no layer index
        names.append("lm_head")
        shapes.append((10, 16))
    state = {}
    for n, (o, i) in zip(names, shapes, strict=True):
        b = torch.randn(o, rank, generator=g)
        if live is not None:
            b[:, live:] = 0
        state[n] = {"A": torch.randn(rank, i, generator=g).to(dtype), "B": b.to(dtype)}
    return state


def dw(f: dict) -> torch.Tensor:
    return f["B"].double() @ f["A"].double()


def close_dw(x: dict, y: dict, rtol: float = 1e-4) -> bool:
    return all(
        torch.linalg.matrix_norm(dw(x[n]) - dw(y[n])) <= rtol * torch.linalg.matrix_norm(dw(y[n]))
        for n in y
    )


def rank(w: torch.Tensor) -> int:
    return int(torch.linalg.matrix_rank(w.double(), rtol=1e-5))


def call(name: str, parents: list[dict], seed: int = 0, **kw) -> dict:
    return OPERATORS[name](parents[: INFO[name].n_parents], seed, **kw)


def snapshot(state: dict) -> dict:
    return {n: {k: t.clone() for k, t in f.items()} for n, f in state.items()}


def test_registry_describes_every_operator() -> None:
    assert set(OPERATORS) == set(INFO)
    assert {i.kind for i in INFO.values()} == {"mutation", "crossover", "control"}
    for name, info in INFO.items():
        assert info.n_parents == (2 if info.kind == "crossover" or name == "mean" else 1)


@pytest.mark.parametrize("name", sorted(OPERATORS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_child_keeps_keys_shapes_dtype_rank_and_parents(name: str, dtype: torch.dtype) -> None:
    parents = [make_state(1, dtype=dtype), make_state(2, dtype=dtype)]
    before = [snapshot(p) for p in parents]
    child = call(name, parents, seed=3)
    assert list(child) == list(parents[0])
    for n, f in child.items():
        for k in ("A", "B"):
            assert f[k].shape == parents[0][n][k].shape
            assert f[k].dtype == dtype and f[k].device == parents[0][n][k].device
            assert torch.isfinite(f[k]).all()
            assert f[k].data_ptr() not in (p[n][k].data_ptr() for p in parents)
        assert rank(dw(f)) <= R
    for p, b in zip(parents, before, strict=True):
        for n in p:
            assert torch.equal(p[n]["A"], b[n]["A"]) and torch.equal(p[n]["B"], b[n]["B"])


@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_reproducible_under_seed_and_random_ops_vary(name: str) -> None:
    parents = [make_state(1), make_state(2)]
    a, b = call(name, parents, seed=7), call(name, parents, seed=7)
    for n in a:
        assert torch.equal(a[n]["A"], b[n]["A"]) and torch.equal(a[n]["B"], b[n]["B"])
    c = call(name, parents, seed=8)
    differs = any(not torch.allclose(dw(a[n]), dw(c[n])) for n in a)
    assert differs == INFO[name].random


@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_parents_that_require_grad_give_a_detached_child(name: str) -> None:
    parents = [make_state(1), make_state(2)]
    for p in parents:
        for f in p.values():
            f["A"].requires_grad_(True)
    child = call(name, parents)
    assert not any(t.requires_grad for f in child.values() for t in f.values())


def test_copy_is_exact() -> None:
    parent = make_state(1)
    child = evolve.copy([parent], 0)
    for n in parent:
        assert torch.equal(child[n]["A"], parent[n]["A"]) and torch.equal(child[n]["B"], parent[n]["B"])


@pytest.mark.parametrize("name,kw", [
    ("mean", {}), ("dare", {"p": 0.0}), ("layer_select", {}), ("layer_select", {"unit": "module"}),
    ("subspace_mix", {}), ("subspace_mix", {"k": 1}), ("extrapolate", {"lam": 0.7}),
])
def test_crossover_with_itself_returns_the_parent(name: str, kw: dict) -> None:
    parent = make_state(1)
    assert close_dw(OPERATORS[name]([parent, parent], 5, **kw), parent)


def test_dare_without_drop_is_the_mean() -> None:
    parents = [make_state(1), make_state(2)]
    assert close_dw(evolve.dare(parents, 3, p=0.0), evolve.mean(parents, 3))


def test_mean_and_extrapolate_are_exact_when_the_sum_fits_rank_r() -> None:
    p1, p2 = make_state(1, live=R // 2), make_state(2, live=R // 2)
    want_mean = {n: {"B": (dw(p1[n]) + dw(p2[n])) / 2, "A": torch.eye(p1[n]["A"].shape[1])}
                 for n in p1}
    want_ext = {n: {"B": 1.5 * dw(p1[n]) - 0.5 * dw(p2[n]), "A": torch.eye(p1[n]["A"].shape[1])}
                for n in p1}
    assert close_dw(evolve.mean([p1, p2], 0), want_mean)
    assert close_dw(evolve.extrapolate([p1, p2], 0, lam=0.5), want_ext)


def test_mean_is_the_best_rank_r_approximation() -> None:
    p1, p2 = make_state(1), make_state(2)
    child = evolve.mean([p1, p2], 0)
    for n in p1:
        u, s, vh = torch.linalg.svd((dw(p1[n]) + dw(p2[n])) / 2)
        best = (u[:, :R] * s[:R]) @ vh[:R]
        assert torch.allclose(dw(child[n]), best, rtol=1e-4, atol=1e-4)


def test_subspace_mix_takes_leading_k_of_fitter_and_rest_of_other() -> None:
    p1, p2 = make_state(1), make_state(2)
    child = evolve.subspace_mix([p1, p2], 0, k=1)
    for n in p1:
        u1, s1, v1 = torch.linalg.svd(dw(p1[n]))
        u2, s2, v2 = torch.linalg.svd(dw(p2[n]))
        want = (u1[:, :1] * s1[:1]) @ v1[:1] + (u2[:, 1:R] * s2[1:R]) @ v2[1:R]
        assert torch.allclose(dw(child[n]), want, rtol=1e-4, atol=1e-4)


def test_spectral_without_noise_keeps_dw() -> None:
    parent = make_state(1)
    assert close_dw(evolve.spectral([parent], 4, sigma=0.0, angle=0.0), parent)


def test_spectral_rotation_keeps_singular_values_and_scaling_keeps_subspaces() -> None:
    parent = make_state(1)
    rotated = evolve.spectral([parent], 4, sigma=0.0, angle=0.1)
    scaled = evolve.spectral([parent], 4, sigma=0.3, angle=0.0)
    for n in parent:
        w, wr, ws = dw(parent[n]), dw(rotated[n]), dw(scaled[n])
        s = torch.linalg.svdvals(w)[:R]
        assert torch.allclose(torch.linalg.svdvals(wr)[:R], s, rtol=1e-4)
        assert not torch.allclose(wr, w, rtol=1e-3)
        u, _, vh = torch.linalg.svd(w)
        proj_u, proj_v = u[:, :R] @ u[:, :R].T, vh[:R].T @ vh[:R]
        assert torch.allclose(proj_u @ ws @ proj_v, ws, atol=1e-4 * ws.norm())
        assert not torch.allclose(torch.linalg.svdvals(ws)[:R], s, rtol=1e-2)


@pytest.mark.parametrize("n", [1, 2])
def test_mask_drops_exactly_n_directions_and_keeps_them_trainable(n: int) -> None:
    parent = make_state(1)
    child = evolve.mask([parent], 9, n=n)
    for name in parent:
        w, wc = dw(parent[name]), dw(child[name])
        assert rank(wc) == R - n
        kept = torch.linalg.svdvals(wc)[: R - n]
        s = torch.linalg.svdvals(w)[:R]
        assert all(torch.isclose(s, v, rtol=1e-4).any() for v in kept)  # a subset of the parent's
        assert (child[name]["B"].abs().sum(0) == 0).sum() == n  # switched off in B ...
        assert rank(child[name]["A"]) == R  # ... while A keeps a fresh, trainable row


def test_fresh_adapter_with_zero_b_stays_zero_but_trainable() -> None:
    parent = make_state(1, live=0)  # B = 0, as PEFT initialises
    child = evolve.spectral([parent], 2)
    for f in child.values():
        assert torch.count_nonzero(f["B"]) == 0 and rank(f["A"]) == R


def test_layer_noise_touches_only_the_chosen_layers() -> None:
    parent = make_state(1, extra=False)
    child = evolve.layer_noise([parent], 3, p=0.5)
    changed = {n.split(".")[2] for n in parent if not torch.equal(child[n]["A"], parent[n]["A"])}
    assert len(changed) == LAYERS // 2
    for n in parent:  # every module of a chosen layer changes, in both factors
        hit = n.split(".")[2] in changed
        assert hit == (not torch.equal(child[n]["B"], parent[n]["B"]))


def test_noise_is_scaled_to_each_tensor() -> None:
    parent = make_state(1)
    for f in parent.values():
        f["B"] *= 1e-3  # B small as after little training: its noise must be small too
    child = evolve.noise([parent], 3, scale=0.1)
    for k in ("A", "B"):
        rel = torch.stack([(child[n][k] - f[k]).norm() / f[k].norm() for n, f in parent.items()])
        assert 0.07 < rel.mean() < 0.13


def test_layer_select_copies_whole_layers_from_either_parent() -> None:
    p1, p2 = make_state(1), make_state(2)
    child = evolve.layer_select([p1, p2], 11)
    source = {}
    for n, f in child.items():
        src = 0 if torch.equal(f["A"], p1[n]["A"]) else 1
        assert torch.equal(f["A"], (p1, p2)[src][n]["A"]) and torch.equal(f["B"], (p1, p2)[src][n]["B"])
        source.setdefault(evolve._layer(n), set()).add(src)
    assert all(len(s) == 1 for s in source.values())
    assert {s.pop() for s in source.values()} == {0, 1}
    only_first = evolve.layer_select([p1, p2], 11, p=1.0)
    assert all(torch.equal(only_first[n]["A"], p1[n]["A"]) for n in p1)


def test_dare_is_unbiased_when_the_mean_fits_rank_r() -> None:
    p1, p2 = make_state(1, live=R // 2, extra=False), make_state(2, live=R // 2, extra=False)
    name = "model.layers.0.mlp.up_proj"
    p1, p2 = {name: p1[name]}, {name: p2[name]}
    avg = sum(dw(evolve.dare([p1, p2], s, p=0.3)[name]) for s in range(200)) / 200
    want = (dw(p1[name]) + dw(p2[name])) / 2
    assert (avg - want).norm() < 0.15 * want.norm()


def test_low_rank_svd_matches_the_dense_svd() -> None:
    g = torch.Generator().manual_seed(0)
    b, a = torch.randn(3, 12, 4, generator=g), torch.randn(3, 4, 10, generator=g)
    b[2, :, 3] = 0  # one rank-deficient module
    u, s, vh = evolve._svd(b, a, 4)
    dense = torch.linalg.svdvals(b @ a)[:, :4]
    assert torch.allclose(s, dense * (dense > 1e-5), atol=1e-4)
    assert torch.allclose(u @ torch.diag_embed(s) @ vh, b @ a, atol=1e-4)
    assert s[2, 3] == 0 and torch.all(u[2, :, 3] == 0) and torch.all(vh[2, 3] == 0)


@pytest.mark.parametrize("call_bad,msg", [
    (lambda p: evolve.mean([p], 0), "expected 2 parent"),
    (lambda p: evolve.mean([p, {"x": p["lm_head"]}], 0), "different module names"),
    (lambda p: evolve.copy([{"x": {"A": torch.ones(2, 3), "B": torch.ones(3, 3)}}], 0), "expected A"),
    (lambda p: evolve.dare([p, p], 0, p=1.0), "p must be"),
    (lambda p: evolve.mask([p], 0, n=-1), "n must be"),
    (lambda p: evolve.subspace_mix([p, p], 0, k=R + 1), "k must be"),
])
def test_bad_input_is_a_one_line_error(call_bad, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        call_bad(make_state(1))


def test_non_finite_parent_is_a_clear_error():
    parent = {"model.layers.0.mlp.up_proj": {"A": torch.randn(4, 16), "B": torch.randn(24, 4)}}
    parent["model.layers.0.mlp.up_proj"]["B"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        evolve.OPERATORS["spectral"]([parent], seed=0)
