"""Objects holding a torch.Generator survive pickling and torch.multiprocessing, stream intact."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from gradbalance import BALANCERS, get_weighting
from gradbalance.clip import PerSampleClip
from support.balancers import build_balancer

GENERATOR_BALANCERS = ("pcgrad", "gradvac", "graddrop", "random")


def _draw(generator: torch.Generator) -> torch.Tensor:
    return torch.rand(5, generator=generator)


@pytest.mark.parametrize("name", GENERATOR_BALANCERS)
def test_balancer_pickle_round_trip_continues_the_stream(name: str) -> None:
    assert name in BALANCERS
    balancer = build_balancer(name, 3, seed=7)
    _draw(balancer.generator)  # advance it: the state, not the seed, must travel
    copy = pickle.loads(pickle.dumps(balancer))
    assert copy.generator is not balancer.generator
    assert torch.equal(_draw(copy.generator), _draw(balancer.generator))


def test_weighting_and_clipper_round_trip() -> None:
    rlw = get_weighting("rlw", num_tasks=3, generator=torch.Generator().manual_seed(2))
    clip = PerSampleClip(1.0, noise_multiplier=1.0, generator=torch.Generator().manual_seed(3))
    for obj in (rlw, clip):
        copy = pickle.loads(pickle.dumps(obj))
        assert torch.equal(_draw(copy.generator), _draw(obj.generator))
        assert vars(copy).keys() == vars(obj).keys()


def _child(rank: int, balancer: object, out: str) -> None:
    torch.save(_draw(balancer.generator), out)  # type: ignore[attr-defined]


def test_balancer_reaches_a_spawned_process(tmp_path: Path) -> None:
    # torch.multiprocessing cannot send a bare torch.Generator ("unable to resize file").
    balancer = build_balancer("pcgrad", 3, seed=11)
    out = tmp_path / "draw.pt"
    mp.spawn(_child, args=(balancer, str(out)), nprocs=1, join=True)
    assert torch.equal(torch.load(out), _draw(balancer.generator))


def _write_into_state(rank: int, balancer: object, out: str) -> None:
    targets = balancer.targets  # type: ignore[attr-defined]
    torch.save(bool(targets.is_shared()), out)
    with torch.no_grad():
        targets.add_(1.0)  # what an in-place state update in a worker does


def test_a_spawned_worker_owns_its_copy_of_the_state(tmp_path: Path) -> None:
    # mp.spawn's pickler moves CPU tensors into shared memory: without a private copy, the
    # worker's in-place update would land in the parent's (and every other worker's) state.
    balancer = build_balancer("gradvac", 3, seed=11)
    balancer(torch.randn(3, 5, generator=torch.Generator().manual_seed(0)))
    before = balancer.targets.clone()
    out = tmp_path / "shared.pt"
    mp.spawn(_write_into_state, args=(balancer, str(out)), nprocs=1, join=True)
    assert torch.load(out) is False  # the worker's copy is private
    assert torch.equal(balancer.targets, before)
