"""FairGrad: the defining equation, closed forms, and agreement with TorchJD's FairGrad."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchjd.aggregation import FairGradWeighting

from gradbalance.balancers import FairGrad
from gradbalance.functional import fairgrad_weights


def _gram(seed: int, k: int = 4, p: int = 30) -> torch.Tensor:
    g = torch.randn(k, p, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return g @ g.T


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0, 5.0])
def test_solves_the_fairness_equation_and_matches_torchjd(alpha: float) -> None:
    a = _gram(int(alpha * 10))
    w = fairgrad_weights(a, alpha)
    assert bool((w > 0).all())
    torch.testing.assert_close(a @ w, w.pow(-1.0 / alpha), rtol=1e-8, atol=0)
    # TorchJD solves the same system with scipy's least_squares (tolerance ~1e-8).
    torch.testing.assert_close(w, FairGradWeighting(alpha)(a), rtol=1e-6, atol=0)


def test_orthogonal_gradients_closed_form() -> None:
    # A = diag(d): d_k w_k = w_k^{-1/α} -> w_k = d_k^{-α/(1+α)}; α = 1: w_k = 1/‖g_k‖.
    d = torch.tensor([1.0, 4.0, 25.0], dtype=torch.float64)
    for alpha in (1.0, 3.0):
        torch.testing.assert_close(fairgrad_weights(torch.diag(d), alpha),
                                   d.pow(-alpha / (1 + alpha)))


def test_alpha_zero_is_uniform_and_scaling_law() -> None:
    a = _gram(1)
    torch.testing.assert_close(fairgrad_weights(a, 0.0), torch.full((4,), 0.25,
                                                                   dtype=torch.float64))
    # A -> s²A scales w by s^{-2α/(1+α)}, so the update scales by s^{(1-α)/(1+α)}.
    s, alpha = 10.0, 2.0
    torch.testing.assert_close(fairgrad_weights(s * s * a, alpha),
                               fairgrad_weights(a, alpha) * s ** (-2 * alpha / (1 + alpha)))


def test_zero_row_gets_zero_weight() -> None:
    a = _gram(2)
    a[1, :] = 0
    a[:, 1] = 0
    w = fairgrad_weights(a, 1.0)
    assert float(w[1]) == 0.0
    rest = [0, 2, 3]
    torch.testing.assert_close(w[rest], fairgrad_weights(a[rest][:, rest], 1.0))


def test_invalid_alpha() -> None:
    with pytest.raises(ValueError, match="Invalid alpha: -1"):
        FairGrad(alpha=-1.0)


@settings(max_examples=200, deadline=None)
@given(k=st.integers(2, 8), p=st.integers(1, 12), alpha=st.floats(0.2, 8.0),
       seed=st.integers(0, 10_000), span=st.floats(0.0, 4.0))
def test_defining_equation_on_random_gramians(k: int, p: int, alpha: float, seed: int,
                                              span: float) -> None:
    """Any K ≤ P rows (so a solution exists), norms spanning up to 1e±4: ``w > 0``, finite,
    and either ``(G Gᵀ) w = w^{-1/α}`` to 1e-6 per task or a warning that says the weights are
    approximate (docs/balancers.md: Newton warns where its residual stays above 1e-6)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(k, max(p, k), generator=gen, dtype=torch.float64)
    g = g * torch.logspace(-span, span, k, dtype=torch.float64)[:, None]
    a = g @ g.T
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        w = fairgrad_weights(a, alpha)
    assert bool((w > 0).all()) and bool(torch.isfinite(w).all())
    residual = (w.pow(1.0 / alpha) * (a @ w) - 1).abs().max().item()
    warned = any(issubclass(c.category, RuntimeWarning) for c in caught)
    assert warned or residual <= 1e-6, f"residual {residual:.2e} above 1e-6 without a warning"


def test_no_solution_warns_and_stays_finite() -> None:
    # Opposite rows: (1, 1) combines them to zero, so no w > 0 solves the system.
    g = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="no exact solution exists"):
        w = fairgrad_weights(g @ g.T, 2.0)
    assert bool(torch.isfinite(w).all()) and bool((w > 0).all())
