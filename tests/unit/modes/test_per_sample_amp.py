"""``batch_dim=0`` under a ``GradScaler``: the matrix route's scaled ``.grad``; a non-finite
step is skipped by the scaler with the balancer's state untouched."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, GradVac


def _model() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Linear(8, 1)


def _grads(params: list[Tensor]) -> Tensor:
    return torch.cat([p.grad.flatten() for p in params if p.grad is not None])


def test_scaled_step_equals_matrix_route() -> None:
    trunk, head = _model()
    params = [*trunk.parameters(), *head.parameters()]
    x, y = torch.randn(6, 4), torch.randn(6)
    got = []
    for per_sample in (True, False):
        for p in params:
            p.grad = None
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        kwargs = {"modules": trunk, "batch_dim": 0} if per_sample else {}
        buf = TaskGradBuffer(trunk.parameters(), head.parameters(), **kwargs)  # type: ignore[arg-type]
        buf.backward((head(trunk(x))[:, 0] - y) ** 2, scaler)
        stats = buf.apply_(MGDA(), scaler)
        assert not stats.found_inf and stats.loss_scale == 2.0**10
        got.append((_grads(params), stats.weights))
    (g1, w1), (g2, w2) = got
    assert torch.allclose(w1, w2, rtol=1e-4, atol=1e-6)
    assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-5 * g2.abs().max())
    assert g2.abs().max() > 100  # the .grad is scaled (s = 1024), as scaler.scale(loss)


def test_non_finite_step_is_skipped_and_balancer_kept() -> None:
    trunk, head = _model()
    params = [*trunk.parameters(), *head.parameters()]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    balancer = GradVac()
    buf = TaskGradBuffer(trunk.parameters(), head.parameters(), modules=trunk, batch_dim=0)
    x = torch.randn(5, 4)
    x[2, 0] = float("inf")  # one sample overflows
    buf.backward(head(trunk(x))[:, 0] ** 2, scaler)
    balancer.compute_weights(torch.eye(5, dtype=torch.float64))  # some state to keep
    twin = copy.deepcopy(balancer)  # the same state, never sees the skipped step
    stats = buf.apply_(balancer, scaler)
    assert stats.found_inf and stats.weights is None
    assert all(not bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)
    probe = torch.tensor([[2.0, -1.0], [-1.0, 1.0]], dtype=torch.float64)
    probe = torch.block_diag(probe, probe, torch.ones(1, 1, dtype=torch.float64))
    assert torch.equal(balancer.compute_weights(probe), twin.compute_weights(probe))
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # the step was skipped
    assert scaler.get_scale() < 2.0**10
