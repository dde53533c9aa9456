"""DecodeCache: the one-token decode path equals the plain LoRA formula for any slot count."""

from __future__ import annotations

import pytest
import torch

from lorapop.lora.routing import DecodeCache, Routing

RANK, SCALING = 4, 1.5  # scaling folded into the cached B; not 1 so a lost factor shows


def _groups(n: int, gen: torch.Generator) -> list[list[tuple[str, torch.Tensor, torch.Tensor]]]:
    """q/k/v (unequal outs: block-diagonal B), gate/up (equal outs: stacked B), o alone."""

    def ab(width: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(n, RANK, width, generator=gen, dtype=torch.float64).float()
        return a, torch.randn(n, out, RANK, generator=gen, dtype=torch.float64).float()

    return [
        [("q", *ab(12, 12)), ("k", *ab(12, 4)), ("v", *ab(12, 4))],
        [("gate", *ab(12, 20)), ("up", *ab(12, 20))],
        [("o", *ab(12, 12))],
    ]


def _reference(
    a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """SCALING * B[s] @ A[s] @ x per row, in float64."""
    a64, b64 = a.double()[ids], b.double()[ids]  # [B, r, in], [B, out, r]
    h = torch.einsum("bri,bi->br", a64, x.double()[:, 0])
    return SCALING * torch.einsum("bor,br->bo", b64, h)[:, None]


@pytest.mark.parametrize("n_slots", [1, 3])
@pytest.mark.parametrize("fuse_add", [False, True])
def test_add_delta_equals_the_lora_formula(n_slots: int, fuse_add: bool):
    gen = torch.Generator().manual_seed(n_slots)
    groups = _groups(n_slots, gen)
    cache = DecodeCache(groups, torch.float32, SCALING)
    cache.refresh_(0)
    rows = 7
    routing = Routing.empty(rows, n_slots, torch.device("cpu"))
    for ids in (torch.randint(0, n_slots, (rows,), generator=gen), torch.arange(rows) % n_slots):
        routing.fill_(ids, False)  # a second routing refills the cached masks in place
        for group in groups:
            x = torch.randn(rows, 1, group[0][1].shape[2], generator=gen)
            for name, a, b in group:  # members in order, one shared x: h (and d) reused
                out = torch.randn(rows, 1, b.shape[1], generator=gen)
                want = out.double() + _reference(a, b, x, ids)
                y = cache.add_delta(name, x, out, routing, True, fuse_add)
                torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
                # eager: added into the base output in place (no copy of it first)
                assert fuse_add or y.data_ptr() == out.data_ptr()
        assert all(m.group.x is None for m in cache.members.values())  # nothing held over


def test_refresh_follows_new_weights_and_keeps_buffers():
    gen = torch.Generator().manual_seed(0)
    groups = _groups(2, gen)
    cache = DecodeCache(groups, torch.float32, SCALING)
    cache.refresh_(0)
    ptrs = [m.b.data_ptr() for m in cache.members.values()]
    a, b = groups[0][1][1], groups[0][1][2]  # k's A and B (a block of the block-diagonal B)
    a.mul_(-2.0)
    b.add_(1.0)
    cache.refresh_(1)
    assert [m.b.data_ptr() for m in cache.members.values()] == ptrs  # graphs stay valid
    routing = Routing.empty(3, 2, torch.device("cpu"))
    ids = torch.tensor([1, 0, 1])
    routing.fill_(ids, False)
    x = torch.randn(3, 1, 12, generator=gen)
    out = torch.zeros(3, 1, 4)
    y = cache.add_delta("k", x, out, routing, False)  # unshared: k's own A rows only
    torch.testing.assert_close(y.double(), _reference(a, b, x, ids), rtol=1e-5, atol=1e-5)
    q_block = cache.members["q"].b  # the off-diagonal blocks stay zero
    assert q_block.shape == (2 * RANK, 12)
    big = cache.members["q"].group.b
    assert torch.count_nonzero(big[: 2 * RANK, 12:]) == 0
