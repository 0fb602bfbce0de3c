"""MGDA: two-task closed form, TorchJD 0.18 and scipy agreement, normalisations."""

from __future__ import annotations

import pytest
import torch
import torchjd.aggregation as tjd
from hypothesis import given, settings

from gradbalance.balancers import MGDA
from gradbalance.balancers._solvers import min_norm_simplex
from support.balancers import matrices, random_matrix, scipy_min_norm


@settings(max_examples=40, deadline=None)
@given(matrices(min_k=2, max_k=2))
def test_two_task_closed_form(g) -> None:
    # γ = clip(((g2 − g1)·g2) / ‖g1 − g2‖², 0, 1), update γ g1 + (1 − γ) g2 (Sener et al.).
    g1, g2 = g[0], g[1]
    diff = float((g1 - g2) @ (g1 - g2))
    gamma = 0.5 if diff == 0 else min(max(float((g2 - g1) @ g2) / diff, 0.0), 1.0)
    expected = gamma * g1 + (1 - gamma) * g2
    torch.testing.assert_close(MGDA()(g), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("k", "p", "seed"), [(3, 7, 0), (5, 30, 1), (6, 40, 2), (6, 3, 3)])
def test_agrees_with_torchjd_and_scipy(k: int, p: int, seed: int) -> None:
    g = random_matrix(seed, k, p)
    ours = MGDA()(g)
    # TorchJD runs Frank-Wolfe (Sener et al.'s Algorithm 2); run it to near convergence.
    expected = tjd.MGDA(epsilon=1e-12, max_iters=50_000)(g)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-8)
    assert abs(float(ours @ ours) - scipy_min_norm(g)) <= 1e-8 * float((g * g).sum())


def test_pareto_stationary_gives_zero() -> None:
    g = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -2.0]], dtype=torch.float64)
    out = MGDA()(g)
    torch.testing.assert_close(out, torch.zeros(2, dtype=torch.float64), rtol=0, atol=1e-12)


def test_normalizations() -> None:
    g = random_matrix(4, 3, 5)
    losses = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64)
    norms = g.norm(dim=1)
    for normalization, div in [("l2", norms), ("loss", losses), ("loss+", losses * norms)]:
        n = g / div[:, None]
        alpha = min_norm_simplex((n @ n.T) / (n @ n.T).trace())
        normed = MGDA(normalization=normalization).combine(g, losses)  # type: ignore[arg-type]
        raw = MGDA(normalization=normalization, apply_to="raw").combine(g, losses)  # type: ignore[arg-type]
        torch.testing.assert_close(normed.vector, alpha @ n, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(raw.vector, alpha @ g, rtol=1e-9, atol=1e-12)
        # The normalised update never conflicts with a task.
        assert float((g @ normed.vector).min()) >= -1e-10


def test_loss_normalization_needs_losses() -> None:
    g = random_matrix(0, 3, 4)
    assert MGDA(normalization="loss").needs_losses and not MGDA().needs_losses
    with pytest.raises(ValueError, match="losses"):
        MGDA(normalization="loss+")(g)
    with pytest.raises(ValueError, match="> 0"):
        MGDA(normalization="loss")(g, torch.tensor([1.0, 0.0, 2.0]))
    with pytest.raises(ValueError, match="normalization"):
        MGDA(normalization="l1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="apply_to"):
        MGDA(apply_to="both")  # type: ignore[arg-type]
