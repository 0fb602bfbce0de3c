"""Nash-MTL: the bargaining equations, closed form, scipy, warm-start state, failures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradbalance import NonFiniteGradientError, SolverError
from gradbalance.balancers import NashMTL
from support.balancers import random_matrix


def test_orthogonal_closed_form() -> None:
    # G = diag(9, 1): α = (1/3, 1), g = g1/‖g1‖ + g2/‖g2‖.
    g = torch.tensor([[3.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    result = NashMTL().combine(g)
    torch.testing.assert_close(result.weights, torch.tensor([1 / 3, 1.0], dtype=torch.float64))
    torch.testing.assert_close(result.vector, torch.tensor([1.0, 1.0], dtype=torch.float64))


@pytest.mark.parametrize(("k", "p", "seed"), [(2, 4, 0), (3, 7, 1), (5, 12, 2)])
def test_bargaining_equations_and_scipy(k: int, p: int, seed: int) -> None:
    """α solves αᵢ (G α)ᵢ = 1 and agrees with scipy's root of the same equations.

    Both answers are judged by their residuals, never by scipy's ``success`` flag (which
    depends on its version's stopping rule at machine precision): for the residual map
    r(α) = α ⊙ Gα − 1 with Jacobian J = diag(Gα) + diag(α) G, two points with residuals r₁, r₂
    lie within ‖J⁻¹‖ (‖r₁‖ + ‖r₂‖) of each other to first order.
    """
    from scipy.optimize import root

    g = random_matrix(seed, k, p, conflict=False)
    result = NashMTL().combine(g)
    alpha = result.weights.numpy()
    assert float(alpha.min()) > 0
    gram = (g @ g.T).numpy()

    def residual(a: np.ndarray) -> float:
        return float(np.linalg.norm(a * (gram @ a) - 1))

    assert residual(alpha) <= 1e-9
    sol = root(lambda x: gram @ np.exp(x) - np.exp(-x), np.zeros(k))
    reference = np.exp(sol.x)
    assert residual(reference) <= 1e-8, "scipy's root is not a solution: not a library failure"
    jac = np.diag(gram @ alpha) + np.diag(alpha) @ gram
    bound = np.linalg.norm(np.linalg.inv(jac), 2) * (residual(alpha) + residual(reference))
    assert np.linalg.norm(alpha - reference) <= 2 * bound + 1e-12 * np.linalg.norm(alpha)


def test_frobenius_normalization() -> None:
    g = random_matrix(3, 3, 6, conflict=False)
    paper = NashMTL().combine(g).weights
    frob = NashMTL(normalization="frobenius").combine(g).weights
    # α(G/n) = √n α(G), n = ‖G‖_F.
    norm = torch.linalg.matrix_norm(g @ g.T)
    torch.testing.assert_close(frob, paper * norm.sqrt(), rtol=1e-9, atol=1e-12)


def test_state_resume_reuse_and_failures() -> None:
    mats = [random_matrix(i, 3, 6, conflict=False) for i in range(5)]
    a = NashMTL(update_weights_every=2)
    outs = [a.combine(m).weights for m in mats[:2]]
    # Second call reuses α of the first (rescaled to the current Gramian's trace).
    t0, t1 = (mats[0] @ mats[0].T).trace(), (mats[1] @ mats[1].T).trace()
    torch.testing.assert_close(outs[1], outs[0] * (t0 / t1).sqrt(), rtol=1e-12, atol=0)
    saved = a.state_dict()
    bad = mats[2].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError):
        a(bad)
    opposite = torch.tensor([[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 1.0, 0.0]],
                            dtype=torch.float64)
    fresh = NashMTL(no_solution="raise")
    with pytest.raises(SolverError):
        fresh(torch.cat([opposite, torch.zeros(3, 3, dtype=torch.float64)], dim=1))
    assert fresh.alpha is None and int(fresh.step) == 0
    assert int(a.state_dict()["step"]) == int(saved["step"])
    tail = [a(m) for m in mats[2:]]
    b = NashMTL(update_weights_every=2)
    b.load_state_dict(saved)
    for m, expected in zip(mats[2:], tail):
        assert torch.equal(b(m), expected)


def test_zero_row_gets_zero_weight() -> None:
    g = random_matrix(4, 3, 6, conflict=False)
    g[1] = 0
    w = NashMTL().combine(g).weights
    assert float(w[1]) == 0.0
    sub = NashMTL().combine(g[[0, 2]]).weights
    torch.testing.assert_close(w[[0, 2]], sub, rtol=1e-9, atol=0)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="normalization"):
        NashMTL(normalization="l2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="update_weights_every"):
        NashMTL(update_weights_every=0)


def test_warm_start_far_from_the_solution_converges() -> None:
    """Regression: a warm start from an earlier step used to stall the line search near the
    optimum (float64 cannot resolve the objective's decrease there) and raise SolverError."""
    from gradbalance.balancers._solvers import nash_bargaining

    gram = torch.tensor([[0.5125, -0.0288], [-0.0288, 0.4875]], dtype=torch.float64)
    warm = torch.tensor([1.28043123407253123, 1.45618567424858281], dtype=torch.float64)
    alpha = nash_bargaining(gram, warm)
    # The defining equation of the bargaining solution: αᵢ (G α)ᵢ = 1 for every task.
    torch.testing.assert_close(alpha * (gram @ alpha), torch.ones(2, dtype=torch.float64),
                               rtol=0, atol=1e-9)


def test_row_norms_spanning_twelve_orders_are_solved() -> None:
    """Row norms 1e-6 … 1e6 (K ≤ P, so a solution exists): α solves αᵢ (G α)ᵢ = 1 although
    its entries span orders of magnitude (the divergence test is relative to the start)."""
    gen = torch.Generator().manual_seed(6)
    g = torch.randn(8, 12, generator=gen, dtype=torch.float64)
    g = g * torch.logspace(-6, 6, 8, dtype=torch.float64)[:, None]
    alpha = NashMTL().combine(g).weights
    gram = g @ g.T
    torch.testing.assert_close(alpha * (gram @ alpha), torch.ones(8, dtype=torch.float64),
                               rtol=0, atol=1e-9)


def test_no_solution_takes_the_ridge_in_closed_form() -> None:
    """``g₁ = −g₂ = e₁``, ``g₃ = e₂``: no α > 0 solves ``(Gα)ᵢ = 1/αᵢ``. By default Nash-MTL
    warns and solves ``((G + εI) α)ᵢ = 1/αᵢ`` with ``ε = 1e-6 tr G = 3e-6``, whose solution is,
    by hand, ``α₁ = α₂ = 1/√ε`` (``εα₁² = 1``) and ``α₃ = 1/√(1 + ε)``; the update is ``α₃e₂``.
    ``no_solution="raise"`` raises instead, with nothing moved."""
    g = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    eps = 3e-6
    with pytest.warns(RuntimeWarning, match="no solution.*no_solution=\"raise\""):
        result = NashMTL().combine(g)
    expected = torch.tensor([eps**-0.5, eps**-0.5, (1 + eps) ** -0.5], dtype=torch.float64)
    torch.testing.assert_close(result.weights, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(result.vector, torch.tensor([0.0, (1 + eps) ** -0.5],
                                                           dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)
    strict = NashMTL(no_solution="raise")
    with pytest.raises(SolverError, match="no solution"):
        strict.combine(g)
    assert strict.alpha is None and int(strict.step) == 0
    with pytest.raises(ValueError, match="no_solution"):
        NashMTL(no_solution="skip")  # type: ignore[arg-type]


def test_the_ridge_from_a_warm_start_is_the_same_closed_form() -> None:
    """The hand-derived ridge of the test above, reached again from the previous call's
    weights (the balancer's warm start: the ridge solve starts there too), and from a warm
    start far from it; each to the ridge's residual ``1e-6``."""
    g = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    eps = 3e-6
    expected = torch.tensor([eps**-0.5, eps**-0.5, (1 + eps) ** -0.5], dtype=torch.float64)
    balancer = NashMTL()
    with pytest.warns(RuntimeWarning, match="no solution"):
        balancer.combine(g)
        again = balancer.combine(g)
    torch.testing.assert_close(again.weights, expected, rtol=1e-6, atol=0)
    from gradbalance.balancers._solvers import nash_bargaining

    gram = (g @ g.T) / 3.0  # trace 1: ε = 1e-6
    far = torch.tensor([5.0, 0.01, 40.0], dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="no solution"):
        alpha = nash_bargaining(gram, far)
    ridge = gram + 1e-6 * torch.eye(3, dtype=torch.float64)
    assert float((alpha * (ridge @ alpha) - 1.0).abs().max()) <= 1e-6
    # by hand: εα₁² = 1 (α₁ = α₂), α₃²(1/3 + ε) = 1
    torch.testing.assert_close(alpha, torch.tensor([1e3, 1e3, (1 / 3 + 1e-6) ** -0.5],
                                                   dtype=torch.float64), rtol=1e-6, atol=0)
