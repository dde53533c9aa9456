"""Data parallelism across the processes that `torchrun` starts: one rank per GPU (or CPU process).

Every rank holds the frozen base and the whole adapter bank. A step's rows (proposals,
answers, update rollouts) are split across ranks by expected tokens (`shard`), each rank works
on its part, and `sharded` gathers the results back into the global order so every rank holds
the same records. Bank gradients are summed over ranks (`all_reduce_sum`), so every rank takes
the same optimizer step; `check_same` compares cheap fingerprints (`fingerprint`) and fails
loudly if the ranks drifted apart.

Without torchrun (no WORLD_SIZE in the environment, or WORLD_SIZE=1) the process is rank 0
of 1 and every collective here is a no-op, so `lorapop train` alone stays a plain process.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

R = TypeVar("R")
# Ranks wait for each other at every gather: a slow phase on one rank (a long verification,
# rank 0 writing a checkpoint) must not time the others out, a hung rank still fails the run.
TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class World:
    """This process's place among the ranks of a run."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0 writes checkpoints, metrics and the console."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


SINGLE = World()


class DivergenceError(RuntimeError):
    """The ranks' copies of state that must be identical differ."""


def init(device: str) -> World:
    """Join the process group that torchrun describes in the environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR/PORT); a process not started by torchrun is rank 0 of 1.

    NCCL when the model runs on CUDA (each rank on GPU LOCAL_RANK), gloo on CPU. `device` is
    the config's `model.device` ("auto", "cpu" or "cuda").
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return SINGLE
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), local)
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        if local >= torch.cuda.device_count():
            raise RuntimeError(
                f"rank {rank}: LOCAL_RANK {local} but only {torch.cuda.device_count()} GPUs are "
                "visible; use --nproc-per-node <= the GPUs of a node"
            )
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=TIMEOUT, device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)
    return World(rank, size, local)


def close(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def shard(
    costs: Sequence[float], n: int, together: Sequence[Hashable] | None = None
) -> list[list[int]]:
    """Row indices split into `n` parts of near-equal total cost, each part in ascending order.

    Longest first, each row to the least-loaded part (then the one with fewer rows, then the
    lowest rank): deterministic, so every rank computes the same split without talking.
    Rows with equal `together` labels (e.g. copies of one prompt, which share a prefill) go to
    one part as a unit, cut into pieces of at most a half part's cost when larger.
    """
    if n < 1:
        raise ValueError(f"need at least one part, got {n}")
    units: dict[Hashable, list[int]] = {}
    for i in range(len(costs)):
        units.setdefault(i if together is None else ("unit", together[i]), []).append(i)
    cap = sum(float(c) for c in costs) / (2 * n)
    pieces: list[tuple[float, list[int]]] = []  # (cost, rows)
    for rows in units.values():
        cost, piece = 0.0, []
        for i in rows:
            if piece and cost + costs[i] > cap:
                pieces.append((cost, piece))
                cost, piece = 0.0, []
            cost, piece = cost + float(costs[i]), [*piece, i]
        pieces.append((cost, piece))
    heap = [(0.0, 0, r) for r in range(n)]
    parts: list[list[int]] = [[] for _ in range(n)]
    for cost, piece in sorted(pieces, key=lambda p: (-p[0], p[1][0])):
        load, count, r = heapq.heappop(heap)
        parts[r].extend(piece)
        heapq.heappush(heap, (load + cost, count + len(piece), r))
    return [sorted(p) for p in parts]


def all_gather(obj: Any, world: World) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if not world.distributed:
        return [obj]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any, world: World, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank."""
    if not world.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def sharded(
    costs: Sequence[float],
    fn: Callable[[list[int]], Sequence[R]],
    world: World,
    together: Sequence[Hashable] | None = None,
) -> list[R]:
    """`fn` over this rank's share of the rows, every rank's results in global row order.

    `fn(indices)` gets the global indices of its rows (ascending) and returns one result per
    index. Results must be picklable; every rank receives all of them. `together`: as `shard`.
    """
    parts = shard(costs, world.size, together)
    mine = parts[world.rank]
    done = list(fn(mine)) if mine else []
    if len(done) != len(mine):
        raise ValueError(f"sharded: {len(mine)} rows gave {len(done)} results")
    out: list[Any] = [None] * len(costs)
    for part, results in zip(parts, all_gather(done, world), strict=True):
        for i, r in zip(part, results, strict=True):
            out[i] = r
    return out


def all_reduce_sum(tensor: Tensor, world: World) -> None:
    """Sum `tensor` over ranks, in place (every rank gets the same bytes)."""
    if world.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


def broadcast_tensor(tensor: Tensor, world: World, src: int = 0) -> None:
    """Overwrite `tensor` on every rank with rank `src`'s, in place."""
    if world.distributed:
        dist.broadcast(tensor, src=src)


def fingerprint(tensors: Iterable[Tensor]) -> list[int]:
    """One integer per tensor: the sum of its elements' bit patterns.

    Integer sums do not depend on the order of summation, so equal tensors give equal
    fingerprints on any device; a difference in any element changes them (barring an exact
    cancellation). Costs one read of the tensors and one host synchronisation.
    """
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    sums = [t.detach().contiguous().view(ints[t.element_size()]).sum(dtype=torch.int64)
            for t in tensors]
    return [int(x) for x in torch.stack([s.cpu() for s in sums]).tolist()] if sums else []


def check_same(state: dict[str, Any], world: World, where: str) -> None:
    """Raise DivergenceError on every rank if any rank's `state` (name -> picklable value,
    e.g. fingerprints) differs from rank 0's, naming the entries and ranks that differ."""
    if not world.distributed:
        return
    states = all_gather(state, world)
    bad = {k: [r for r, s in enumerate(states) if s.get(k) != states[0].get(k)] for k in state}
    bad = {k: ranks for k, ranks in bad.items() if ranks}
    if bad:
        what = "; ".join(f"{k} on ranks {ranks}" for k, ranks in bad.items())
        raise DivergenceError(
            f"ranks diverged {where}: {what} differ from rank 0. The run cannot continue; "
            "resume from the last checkpoint (and report this: ranks must stay identical)"
        )


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()
