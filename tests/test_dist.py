"""The data-parallel helpers: sharding, and the collectives on two gloo ranks (CPU)."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from lorapop import dist


def test_shard_balances_cost_and_covers_every_row_once():
    costs = [100, 10, 90, 20, 80, 30, 70, 40, 60, 50, 5, 5]
    parts = dist.shard(costs, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(costs)))
    assert all(p == sorted(p) for p in parts)
    loads = [sum(costs[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(costs) / 2
    assert dist.shard(costs, 3) == parts  # every rank computes the same split
    assert dist.shard(costs, 1) == [list(range(len(costs)))]


def test_shard_equal_costs_split_rows_evenly_and_more_ranks_than_rows():
    assert [len(p) for p in dist.shard([7] * 10, 4)] == [3, 3, 2, 2]
    assert dist.shard([1, 2], 4) == [[1], [0], [], []]
    with pytest.raises(ValueError):
        dist.shard([1], 0)


def test_shard_keeps_rows_together_where_balance_allows():
    """The 4 answers of each task land on one rank (they share a prefill there), splitting
    only a group larger than half a rank's share."""
    labels = [t for t in range(12) for _ in range(4)]
    costs = [500 + 40 * t for t in labels]
    parts = dist.shard(costs, 4, together=labels)
    assert sorted(i for p in parts for i in p) == list(range(len(costs)))
    assert all(len({labels[i] for i in p}) * 4 == len(p) for p in parts)
    loads = [sum(costs[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= 4 * max(costs)
    big = dist.shard([1.0] * 16, 2, together=[0] * 16)  # one group: cut into 4-row pieces
    assert [len(p) for p in big] == [8, 8]
    assert dist.shard(costs, 4, together=None) == dist.shard(costs, 4)


def test_one_process_is_a_single_rank(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    world = dist.init("cpu")
    assert world == dist.SINGLE and world.main and not world.distributed
    assert dist.sharded([1, 1, 1], lambda idx: [i * 2 for i in idx], world) == [0, 2, 4]
    t = torch.ones(3)
    dist.all_reduce_sum(t, world)
    assert t.tolist() == [1, 1, 1]
    dist.check_same({"x": 1}, world, "here")


def test_fingerprint_sees_any_element_and_not_the_summation_order():
    w = torch.randn(3, 1000)
    fp = dist.fingerprint(w)  # one value per row
    assert len(fp) == 3 and fp == dist.fingerprint(w.clone()[:, torch.randperm(1000)])
    w2 = w.clone()
    w2[1, 500] = torch.nextafter(w2[1, 500], torch.tensor(float("inf")))  # one ulp
    assert dist.fingerprint(w2)[1] != fp[1] and dist.fingerprint(w2)[0] == fp[0]
    assert dist.fingerprint([w.to(torch.bfloat16), torch.tensor(2.0)])[-1] == 2**30


def _worker(rank: int, size: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = dist.init("cpu")
    try:
        calls = []

        def work(idx):
            calls.append(list(idx))
            return [f"row{i}" for i in idx]

        costs = [5, 1, 4, 2, 3, 3]
        got = {
            "world": (world.rank, world.size, world.main),
            "gather": dist.all_gather(rank * 10, world),
            "broadcast": dist.broadcast({"from": rank}, world),
            "sharded": dist.sharded(costs, work, world),
            "calls": calls,
        }
        t = torch.full((2, 3), float(rank + 1))
        dist.all_reduce_sum(t, world)
        got["sum"] = t.tolist()
        b = torch.full((4,), float(rank))
        dist.broadcast_tensor(b, world)
        got["bcast_tensor"] = b.tolist()
        dist.check_same({"same": [1, 2]}, world, "at step 1")
        try:
            dist.check_same({"same": 1, "weights": [rank]}, world, "at step 2")
            got["diverged"] = None
        except dist.DivergenceError as e:
            got["diverged"] = str(e)
        torch.save(got, f"{out}/rank{rank}.pt")
    finally:
        dist.close(world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_collectives_on_two_gloo_ranks(tmp_path):
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2,
                       start_method="fork")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["world"] == (0, 2, True) and r1["world"] == (1, 2, False)
    for r in (r0, r1):
        assert r["gather"] == [0, 10]
        assert r["broadcast"] == {"from": 0}
        assert r["sharded"] == [f"row{i}" for i in range(6)]
        assert r["sum"] == [[3.0] * 3] * 2
        assert r["bcast_tensor"] == [0.0] * 4
        assert "at step 2: weights on ranks [1]" in r["diverged"]
    parts = dist.shard([5, 1, 4, 2, 3, 3], 2)
    assert r0["calls"] == [parts[0]] and r1["calls"] == [parts[1]]  # each did its share only
