"""Uncertainty Weighting: the σ = 1 weights and learned variances against known noise."""

from __future__ import annotations

import pytest
import torch

from gradbalance.weighting import UncertaintyWeighting


def test_weights_at_unit_sigma() -> None:
    w = UncertaintyWeighting(2, task_types=["regression", "classification"])
    torch.testing.assert_close(w.weights, torch.tensor([0.5, 1.0]))
    # L/(2σ²) + log σ and L/σ² + log σ at σ = 1
    torch.testing.assert_close(w(torch.tensor([2.0, 3.0])), torch.tensor([1.0, 3.0]))
    assert list(w.parameters()) == [w.log_vars]


@pytest.mark.parametrize(("task_type", "factor"), [("regression", 1.0), ("classification", 2.0)])
def test_learned_variance_minimises_the_objective(task_type: str, factor: float) -> None:
    # fixed losses: d/ds (c e^{-s} L + s/2) = 0  =>  σ² = e^s = 2cL
    losses = torch.tensor([0.1, 1.0, 30.0])
    w = UncertaintyWeighting(3, task_types=task_type)
    opt = torch.optim.SGD(w.parameters(), lr=1.0)  # the curvature at the optimum is 1/2
    for _ in range(200):
        opt.zero_grad()
        w(losses).sum().backward()
        opt.step()
        w.update()
    torch.testing.assert_close(w.variances, factor * losses, rtol=1e-4, atol=0)


def test_variances_approach_the_known_noise_variances() -> None:
    g = torch.Generator().manual_seed(0)
    n, d = 4000, 4
    noise_var = torch.tensor([0.25, 1.0, 4.0])
    x = torch.randn(n, d, generator=g)
    coef = torch.randn(d, 3, generator=g)
    y = x @ coef + torch.randn(n, 3, generator=g) * noise_var.sqrt()
    torch.manual_seed(0)
    model = torch.nn.Linear(d, 3)
    w = UncertaintyWeighting(3)
    opt = torch.optim.Adam([*model.parameters(), *w.parameters()], lr=0.05)
    for _ in range(300):
        losses = ((model(x) - y) ** 2).mean(0)
        opt.zero_grad()
        w(losses).sum().backward()
        opt.step()
        w.update()
    # optimum σ² = E[L]: the least-squares residual variance, and near the true noise
    xb = torch.cat([x, torch.ones(n, 1)], 1)
    resid = y - xb @ torch.linalg.lstsq(xb, y).solution
    torch.testing.assert_close(w.variances, (resid ** 2).mean(0), rtol=0.03, atol=0)
    torch.testing.assert_close(w.variances, noise_var, rtol=0.08, atol=0)
