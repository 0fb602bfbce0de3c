"""Micro-batches: accumulate-then-balance equals the full batch for every balancer; the other
order (balance each, average) matches the tutorial's two_orders."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from gradbalance import (
    BALANCERS,
    Balancer,
    Combination,
    TaskGradBuffer,
    balanced_backward,
    task_gradients,
)
from gradbalance.balancers import Mean, Sum
from gradbalance_lab.microbatch import BalanceEach, two_orders
from support.helpers import assert_close_lists, build, grads_of, losses_of
from support.loop import make_balancer

K, M = 3, 4


class UnitRows(Balancer):
    """Test-local nonlinear balancer: the sum of the normalised rows."""

    name = ""

    def _combine_matrix(self, matrix: Tensor, losses: Tensor | None) -> Combination:
        return Combination((matrix / matrix.norm(dim=1, keepdim=True)).sum(0))


@pytest.mark.parametrize("name", sorted(BALANCERS))
def test_accumulate_then_balance_equals_full_batch(name: str) -> None:
    torch.manual_seed(0)
    full_model, x, y = build("mlp", num_tasks=K, batch=16, dtype=torch.float64)
    balanced_backward(losses_of(full_model, x, y), make_balancer(name, K),
                      shared_params=full_model.shared_parameters(),
                      head_params=full_model.head_parameters())

    torch.manual_seed(0)
    model, x, y = build("mlp", num_tasks=K, batch=16, dtype=torch.float64)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    for xs, ys in zip(x.chunk(M), y.chunk(M)):
        buf.backward(losses_of(model, xs, ys) / M)
    stats = buf.apply_(make_balancer(name, K))
    assert stats.num_backward == M
    assert_close_lists(grads_of(model.shared_parameters()),
                       grads_of(full_model.shared_parameters()), rtol=1e-6, atol=1e-9)
    assert_close_lists(grads_of(model.head_parameters()),
                       grads_of(full_model.head_parameters()), rtol=1e-6, atol=1e-9)


def _parts(model, x, y) -> list[Tensor]:
    return [task_gradients(losses_of(model, xs, ys), model.shared_parameters())
            for xs, ys in zip(x.chunk(M), y.chunk(M))]


def test_two_orders_linear_and_nonlinear() -> None:
    model, x, y = build("mlp", num_tasks=K, batch=16, dtype=torch.float64)
    parts = _parts(model, x, y)
    mean_G = sum(parts) / M
    once, each = two_orders(Sum(), parts)
    torch.testing.assert_close(once, mean_G.sum(0))
    torch.testing.assert_close(each, mean_G.sum(0))  # a linear balancer: both orders agree
    once, each = two_orders(UnitRows(), parts)
    unit = lambda G: (G / G.norm(dim=1, keepdim=True)).sum(0)  # noqa: E731
    torch.testing.assert_close(once, unit(mean_G))
    torch.testing.assert_close(each, sum(unit(G) for G in parts) / M)
    assert not torch.allclose(once, each)  # nonlinear: the orders differ


@pytest.mark.parametrize("balancer", [Mean(), UnitRows()], ids=["mean", "unitrows"])
def test_balance_each_in_step_equals_second_order(balancer: Balancer) -> None:
    ref_model, x, y = build("mlp", num_tasks=K, batch=16, dtype=torch.float64)
    _, expected = two_orders(balancer, _parts(ref_model, x, y))
    losses_of(ref_model, x, y).sum().backward()  # heads: plain full-batch gradient

    model, x, y = build("mlp", num_tasks=K, batch=16, dtype=torch.float64)
    each = BalanceEach(model.shared_parameters(), model.head_parameters(), num_microbatches=M)
    for xs, ys in zip(x.chunk(M), y.chunk(M)):
        stats = each.backward(losses_of(model, xs, ys), balancer)
        assert not stats.found_inf
    trunk = torch.cat([g.reshape(-1) for g in grads_of(model.shared_parameters())])
    torch.testing.assert_close(trunk, expected)
    assert_close_lists(grads_of(model.head_parameters()),
                       grads_of(ref_model.head_parameters()), rtol=1e-6, atol=1e-9)


def test_balance_each_with_scaler() -> None:
    scaler = torch.amp.GradScaler("cpu")
    assert scaler.is_enabled()
    ref_model, x, y = build("mlp", num_tasks=K, batch=8)
    _, expected = two_orders(UnitRows(), _parts(ref_model, x, y))
    model, x, y = build("mlp", num_tasks=K, batch=8)
    each = BalanceEach(model.shared_parameters(), model.head_parameters(), num_microbatches=M)
    for xs, ys in zip(x.chunk(M), y.chunk(M)):
        each.backward(losses_of(model, xs, ys), UnitRows(), scaler=scaler)
    trunk = torch.cat([p.grad.reshape(-1) for p in model.shared_parameters()])
    torch.testing.assert_close(trunk / scaler.get_scale(), expected, rtol=1e-5, atol=1e-7)


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"Invalid num_microbatches: 0"):
        BalanceEach([torch.ones(1, requires_grad=True)], num_microbatches=0)
    with pytest.raises(ValueError, match="parts is empty"):
        two_orders(Sum(), [])
    with pytest.raises(ValueError, match=r"parts\[1\] has shape \(2, 3\)"):
        two_orders(Sum(), [torch.ones(2, 2), torch.ones(2, 3)])
