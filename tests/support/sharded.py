"""Sharded trunks simulated in one process: column splits, a thread group whose ``reduce`` is a
barrier-synchronised sum, and the two-rank gloo worker that checks the same with real
collectives."""

from __future__ import annotations

import datetime
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradbalance.balancers import Balancer, GradDrop, PCGrad, Shard, dim0_runs

Runs = tuple[tuple[int, int], ...]

BARRIER_TIMEOUT_S = 60.0  # a rank that never reaches the barrier fails the test, not hangs it


def fsdp_splits(shapes: Sequence[Sequence[int]], world: int) -> list[Runs]:
    """Each rank's runs when every parameter is split on dim 0 (FSDP2)."""
    return [dim0_runs(shapes, r, world) for r in range(world)]


def random_splits(total: int, world: int, gen: torch.Generator) -> list[Runs]:
    """``[0, total)`` cut at random points into pieces, each given to a random rank, each
    rank's pieces in a random order (ranks may get nothing)."""
    cuts = sorted({int(c) for c in torch.randint(0, total + 1, (world + 2,), generator=gen)})
    edges = sorted({0, total, *cuts})
    owner: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for lo, hi in itertools.pairwise(edges):
        owner[int(torch.randint(0, world, (), generator=gen))].append((lo, hi - lo))
    out = []
    for pieces in owner:
        perm = torch.randperm(len(pieces), generator=gen).tolist()
        out.append(tuple(pieces[i] for i in perm))
    return out


def columns(runs: Runs) -> Tensor:
    """The global column indices of a rank's local columns, in local order."""
    parts = [torch.arange(s, s + n) for s, n in runs]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def gather(parts: Sequence[Tensor], splits: Sequence[Runs], total: int) -> Tensor:
    """The full ``[..., total]`` tensor from every rank's local columns (last dim)."""
    out = torch.full((*parts[0].shape[:-1], total), float("nan"), dtype=parts[0].dtype)
    for part, runs in zip(parts, splits, strict=True):
        out[..., columns(runs)] = part
    return out


class ThreadGroup:
    """``world`` threads, each a rank; :meth:`reduce` sums a tensor over them in rank order
    (the same sum on every rank, as an all-reduce)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=BARRIER_TIMEOUT_S)
        self.calls = 0

    def reduce(self, rank: int, value: Tensor) -> Tensor:
        self.slots[rank] = value.clone()
        self.barrier.wait()
        parts = [s for s in self.slots if s is not None]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        if rank == 0:
            self.calls += 1
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return total

    def shard(self, rank: int, runs: Runs, total: int) -> Shard:
        return Shard(runs, total, lambda value: self.reduce(rank, value))

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(rank)`` on every rank at once; the results (or the exception raised) by rank.

        A rank that raised never reaches the barrier again: once every rank still running
        waits there, the barrier is broken (``BrokenBarrierError`` in those ranks) instead of
        waiting for the timeout.
        """
        results: list[Any] = [None] * self.world

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # returned to the test
                results[rank] = exc

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 2 * BARRIER_TIMEOUT_S
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            alive = sum(t.is_alive() for t in threads)
            if alive < self.world and self.barrier.n_waiting == alive:
                self.barrier.abort()
            time.sleep(0.001)
        assert not any(t.is_alive() for t in threads), "a simulated rank hung"
        return results


# -- two real ranks (gloo) ----------------------------------------------------------------

GLOO_SHAPES = [(6, 5), (7,), (3, 2, 2), (1,)]
GLOO_STEPS = 3


def gloo_matrices(k: int = 3) -> list[Tensor]:
    """The full ``[K, P]`` matrices of every step (the same on every rank)."""
    p = sum(torch.Size(s).numel() for s in GLOO_SHAPES)
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(k, p, generator=gen) for _ in range(GLOO_STEPS)]


def gloo_balancers() -> dict[str, Balancer]:
    return {"graddrop": GradDrop(generator=torch.Generator().manual_seed(5)),
            "pcgrad": PCGrad(generator=torch.Generator().manual_seed(5))}


def _all_reduce(value: Tensor) -> Tensor:
    out = value.clone()
    dist.all_reduce(out)
    return out


def gloo_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Each balancer, :data:`GLOO_STEPS` steps on this rank's FSDP2 columns, ``reduce`` an
    ``all_reduce``; saves the local updates, weights and final state."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    matrices = gloo_matrices()
    runs = dim0_runs(GLOO_SHAPES, rank, world)
    shard = Shard(runs, matrices[0].shape[1], _all_reduce)
    idx = columns(runs)
    results: dict[str, Any] = {"runs": runs}
    for name, balancer in gloo_balancers().items():
        steps = [balancer.combine_sharded(g[:, idx], shard) for g in matrices]
        results[name] = {"vectors": [c.vector for c in steps],
                         "weights": [c.weights for c in steps],
                         "state": balancer.state_dict()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # torch 2.6's gloo can hang in destroy while the other rank is still busy
    dist.destroy_process_group()
