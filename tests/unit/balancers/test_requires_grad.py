"""A matrix that requires grad is read as its values by every balancer (docs/balancers.md).

DB-MTL, ExcessMTL and MoCo raised torch's ``out=`` autograd error on such a matrix, and
FairGrad, MoDo, Nash-MTL, PCD and SDMGrad returned weights carrying a graph through their
solvers. The reference is the same balancer on a plain copy of the rows: two steps each,
the updates, weights and states equal bit for bit, none of them holding a graph.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import gradbalance
from support.balancers import build_balancer, random_matrix

NAMES = sorted(gradbalance.BALANCERS)


def _tensors(value: object) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


@pytest.mark.parametrize("name", NAMES)
def test_rows_that_require_grad_are_read_as_values(name: str) -> None:
    k = 4
    plain, tracked = build_balancer(name, k, seed=3), build_balancer(name, k, seed=3)
    losses = torch.tensor([1.0, 0.5, 2.0, 0.75], dtype=torch.float64)
    for seed in (0, 1):
        rows = random_matrix(seed, k, 6)
        leaf = rows.clone().requires_grad_()
        expected = plain.combine(rows, losses if plain.needs_losses else None)
        got = tracked.combine(leaf, losses if tracked.needs_losses else None)
        assert torch.equal(got.vector, expected.vector)
        assert not got.vector.requires_grad
        if expected.weights is not None:
            assert got.weights is not None and torch.equal(got.weights, expected.weights)
            assert not got.weights.requires_grad
    state = _tensors(tracked.state_dict())
    assert not any(t.requires_grad for t in state)
    assert all(torch.equal(a, b) for a, b in zip(state, _tensors(plain.state_dict()),
                                                  strict=True))


@pytest.mark.parametrize("name", [n for n in NAMES if gradbalance.BALANCERS[n].from_gramian])
def test_gramian_that_requires_grad_is_read_as_values(name: str) -> None:
    rows = random_matrix(5, 3, 4)
    gram = rows @ rows.T
    losses = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    plain, tracked = build_balancer(name, 3, seed=1), build_balancer(name, 3, seed=1)
    arg = losses if plain.needs_losses else None
    expected = plain.compute_weights(gram, arg)
    got = tracked.compute_weights(gram.clone().requires_grad_(), arg)
    assert torch.equal(got, expected) and not got.requires_grad
