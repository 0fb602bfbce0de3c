"""Every registered balancer gives the same update bit for bit on a second call with the same
input and seed, whatever memory held before it (freed buffers of integers and NaNs, which
an operation reading uninitialised memory would pick up: ``torch.linalg.lstsq``'s CPU
default ``gelsy`` did, and PCD's update on cancelling rows moved by a third between calls).
A resumed run is bit-identical only if this holds."""

from __future__ import annotations

import warnings

import pytest
import torch

from gradbalance.balancers import BALANCERS
from support.balancers import build_balancer
from support.many_kinds import kind_rows

KINDS = ["mixed", "near_duplicates", "rank8", "span"]


def _rows(kind: str, k: int) -> torch.Tensor:
    """``[K, 3K]`` float32 rows of ``kind`` (``span``: a random span of rank ``9K/16``)."""
    if kind == "span":
        gen = torch.Generator().manual_seed(k)
        r = 9 * k // 16
        return (torch.randn(k, r, generator=gen) @ torch.randn(r, 3 * k, generator=gen))
    return kind_rows(kind, k, 3 * k, k).float()


def _dirty(k: int) -> None:
    """Freed buffers of the sizes a solver's workspaces take, filled with integers and NaNs."""
    for n in (k, k + 1, 2 * k, k * k // 4, k * k):
        torch.full((n,), 7, dtype=torch.int64)
        torch.full((n,), 3, dtype=torch.int32)
        torch.full((n,), float("nan"), dtype=torch.float64)


@pytest.mark.parametrize("name", sorted(BALANCERS))
@pytest.mark.parametrize("k", [20, 72])
def test_a_second_call_repeats_the_first_bit_for_bit(name: str, k: int) -> None:
    """K = 20 (the factorisation paths) and 72 (from 64 tasks: the conjugate-gradient,
    interior-point and lifted paths), on four kinds of rows: the update of a fresh balancer
    with the same seed is the same tensor each time."""
    losses = torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.5
    for kind in KINDS:
        rows = _rows(kind, k)
        updates = []
        for _ in range(2):
            _dirty(k)
            balancer = build_balancer(name, k, seed=0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # approximate solvers say so
                out = balancer.combine(rows, losses if balancer.needs_losses else None)
            updates.append(out.vector)
        assert torch.equal(updates[0], updates[1]), (name, kind)
