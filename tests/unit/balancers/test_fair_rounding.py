"""Nash-MTL's and FairGrad's Newton solve stops at the residual's rounding.

On rows of rank ``K/4`` plus noise of 1e-3 or 1e-4 of their size (full rank: a solution
exists), the weights reach about 1e4–1e6 and the residual ``max |wᵢ^p (Gw)ᵢ − 1|`` levels
off near 1e-9, above the default ``tol = 1e-10`` but below its float64 rounding
``√K eps max wᵢ^p (|G|w)ᵢ``; the solve used to take its 100 steps there and Nash-MTL then
reported no solution and answered the ridge's bargaining instead. The answers are checked
against the methods' defining equations on the rows' own Gramian.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tests.unit.balancers.test_fair_no_solution import Steps
from tests.unit.balancers.test_shrinking_block import _low_rank_noise

from gradbalance.balancers import FairGrad, NashMTL, _solvers


def _residual(rows: torch.Tensor, w: torch.Tensor, p: float) -> torch.Tensor:
    """``max |wᵢ^p (Gw)ᵢ − 1|`` on the rows' own Gramian."""
    return (w.pow(p) * ((rows @ rows.T) @ w) - 1.0).abs().max()


def _allowed(rows: torch.Tensor, w: torch.Tensor, p: float) -> float:
    """1e-6, or float64's rounding of ``Gw`` there, ``8 √K eps max wᵢ^p (|G|w)ᵢ``, where
    larger (weights up to 1e6 at noise 1e-4)."""
    gram = rows @ rows.T
    k = rows.shape[0]
    rounding = float((w.pow(p) * (gram.abs() @ w)).max()) * k**0.5 * torch.finfo(
        torch.float64).eps
    return max(1e-6, 8 * rounding)


CASES = [(64, 16, 1e-3, 0), (64, 16, 1e-4, 1), (96, 24, 1e-3, 0), (128, 32, 1e-3, 1)]


@pytest.mark.parametrize(("k", "rank", "noise", "seed"), CASES)
def test_nash_mtl_solves_full_rank_rows_near_cancelling(k: int, rank: int, noise: float,
                                                        seed: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """No warning, ``αᵢ (Gα)ᵢ = 1`` on ``G = rows rowsᵀ`` (:func:`_allowed`), well before
    the cap of 100 steps."""
    rows = _low_rank_noise(k, rank, noise, seed)
    steps = Steps(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alpha = NashMTL().combine(rows).weights
    assert alpha is not None
    assert float(_residual(rows, alpha, 1.0)) <= _allowed(rows, alpha, 1.0)
    assert steps.count <= 40


@pytest.mark.parametrize("alpha", [0.5, 2.0])
@pytest.mark.parametrize(("k", "rank", "noise", "seed"),
                         [case for case in CASES if case[2] == 1e-3])
def test_fairgrad_solves_full_rank_rows_near_cancelling(k: int, rank: int, noise: float,
                                                        seed: int, alpha: float,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """No warning, ``wᵢ^{1/α} (Gw)ᵢ = 1`` on ``G = rows rowsᵀ`` (:func:`_allowed`), well
    before the cap of 100 steps (noise 1e-3: at 1e-4 and ``α = 1/2`` the residual's rounding
    passes ``FAIR_ROUNDING_MAX`` and FairGrad warns, as it should)."""
    rows = _low_rank_noise(k, rank, noise, seed)
    steps = Steps(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = FairGrad(alpha=alpha).combine(rows).weights
    assert w is not None
    assert float(_residual(rows, w, 1.0 / alpha)) <= _allowed(rows, w, 1.0 / alpha)
    assert steps.count <= 40


def test_the_rounding_bounds_a_residual_that_cannot_fall() -> None:
    """At the stop on such rows the residual is above ``tol`` and at most its rounding, and
    the rounding is float64's: ``√K eps max wᵢ^p (|G|w)ᵢ`` recomputed here."""
    rows = _low_rank_noise(128, 32, 1e-3, 1)
    gram, _ = _solvers.trace_normalized(rows @ rows.T)
    w, residual, rounding = _solvers.fair_newton(gram, 1.0)
    expected = 128**0.5 * torch.finfo(torch.float64).eps * float(
        (w * (gram.abs() @ w)).max())
    assert rounding == pytest.approx(expected, rel=1e-9)
    assert 1e-10 < residual <= rounding
