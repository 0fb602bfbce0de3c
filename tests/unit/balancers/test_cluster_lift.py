"""Rows in a span of low rank plus noise near a float32 Gramian's rounding
(``balancers/_admm.py``'s ``eigen_cluster_floor``, ``balancers/_boxqp.py``'s
``cluster_lift``): the small eigenvalues the rounding spread still make a cluster, and a
rounding null space too large for the plain lift is lifted where the noise's eigenvalues
above it outnumber it. The rules against hand-built spectra; the routes against scipy's
NNLS on the problem each one solves (an independent solver of each projection)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from gradbalance.balancers import _admm, _boxqp
from gradbalance.balancers._upgrad import upgrad_weights
from gradbalance.gramian import compute_gramian
from support.many_kinds import assert_same_update

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("spread", "found"), [
    ([1e-9, 1e-8, 1e-7, 1e-6, 1e-6, 1e-6, 1e-6, 1e-6], True),  # 8 of 64 below 1e-3·mean
    ([1e-9, 1e-8, 1e-7, 1e-6, 1e-6, 1e-6, 1e-6], False),  # 7: fewer than K/8
    ([1e-9, 1e-8, 1e-7, 1e-6, 1e-6, 1e-6, 1e-6, 2e-3], False),  # the 8th above 1e-3·mean
])
def test_spread_cluster_against_hand_counts(spread: list[float], found: bool) -> None:
    """K = 64, the eigenvalues ``spread`` and the others at 1 (mean ≈ 0.9): the count
    ``λ_min Σ 1/λᵢ`` is below ``K/8 = 8`` (about 1.0), so only the spread rule can find a
    cluster: where the 8th smallest eigenvalue is at most ``1e-3`` of the mean, with
    ``λ_min`` as its floor."""
    lam = torch.tensor(sorted(spread + [1.0] * (64 - len(spread))), dtype=F64)
    mean = float(lam.mean())
    assert float((lam[0] / lam).sum()) < 8  # the count alone: no cluster
    assert (float(lam[7]) <= 1e-3 * mean) is found
    floor = _admm.eigen_cluster_floor(lam)
    assert floor == (spread[0] if found else None)


def _lift(lam: list[float]) -> float | None:
    """:func:`~._boxqp.cluster_lift` of the eigenvalues ``lam``."""
    ascending = torch.tensor(sorted(lam), dtype=F64)
    return _boxqp.cluster_lift(ascending, float(ascending[0]), float(ascending[-1]))


def test_cluster_lift_against_hand_spectra() -> None:
    """K = 64, eigenvalues of a signal at ``1/n`` each, rounding in ``±1e-9`` and noise at
    ``5e-9``: the lift is ``2·|λ_min| = 2e-9`` where the noise above it outnumbers the
    eigenvalues at or below it (16 signal, 8 rounding, 40 noise), or where the signal is at
    most ``K/4`` (8 signal, 40 rounding, 16 noise: low rank plus noise at the rounding); none
    for a signal above ``K/4`` over a null space that is mostly the rounding's (24 signal and
    40 rounding: rows in an exact span; 24 signal, 32 rounding, 8 noise)."""
    rounding = [-1e-9, -5e-10, 0.0, 1e-10, 2e-10, 5e-10, 8e-10, 1e-9]

    def spectrum(signal: int, rounds: int, noise: int) -> list[float]:
        return [1 / signal] * signal + rounding * rounds + [5e-9] * noise

    for lifted in (_lift(spectrum(16, 1, 40)), _lift(spectrum(8, 5, 16))):
        assert lifted is not None and abs(lifted - 2e-9) <= 1e-15
    assert _lift(spectrum(24, 5, 0)) is None
    assert _lift(spectrum(24, 4, 8)) is None


def _rows(k: int, p: int, rank: int, noise: float, seed: int) -> Tensor:
    """``[K, P]`` float32 rows in a random span of ``rank`` plus Gaussian noise ``noise``."""
    gen = torch.Generator().manual_seed(seed)
    basis = torch.randn(k, rank, generator=gen) @ torch.randn(rank, p, generator=gen)
    return (basis / rank**0.5 + noise * torch.randn(k, p, generator=gen)).float()


def _scipy_weights(q: Tensor) -> Tensor:
    """UPGrad's weights ``Σᵢ vᵢ``, ``vᵢ = argmin_{v ≥ eᵢ/K} vᵀQv``, from scipy's NNLS on the
    Cholesky factor of ``Q`` (``v = eᵢ/K + x``, ``x ≥ 0``: ``min ‖Lᵀx + Lᵀeᵢ/K‖``)."""
    from scipy.optimize import nnls

    k = q.shape[0]
    low = torch.linalg.cholesky(q).T.numpy()
    total = torch.zeros(k, dtype=F64)
    for i in range(k):
        x, _ = nnls(low, -low[:, i] / k, maxiter=10_000)
        total += torch.from_numpy(x)
    return total + 1.0 / k


def _classified_once(rows: Tensor, field: str) -> tuple[Tensor, Tensor, _boxqp._Spectrum]:
    """UPGrad's weights on the Gramian of ``rows`` (float64) and the one ``(Q, spectrum)``
    that ``_spectrum`` classified with ``field`` set (the trace-normalised Gramian: its
    problems' answers are the Gramian's)."""
    seen: list[tuple[Tensor, _boxqp._Spectrum]] = []
    spectrum = _boxqp._spectrum

    def spy(q: Tensor, vectors: bool = False) -> _boxqp._Spectrum:
        got = spectrum(q, vectors)
        seen.append((q.clone(), got))
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "_spectrum", spy)
        weights = upgrad_weights(compute_gramian(rows).double())
    found = [(q, got) for q, got in seen if getattr(got, field) is not None]
    assert len(found) == 1
    return weights, *found[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_near_the_rounding_are_lifted_and_match_scipy(seed: int) -> None:
    """K = 64, float32 rows of rank 8 plus noise 7e-4 (P = 8,000): the float32 Gramian's
    noise eigenvalues sit a few times above its rounding, a fifth of them at or below
    twice ``|λ_min|``. The batch is lifted by that amount (``cluster_lift``, not the plain
    lift), and UPGrad's update equals the sum of scipy's projections on ``Q + lift·I``
    (cos ≥ 0.999999, norms within 1e-6); the lift is ``2·|λ_min(Q)|``."""
    rows = _rows(64, 8000, 8, 7e-4, seed)
    weights, q, spectrum = _classified_once(rows, "lift")
    lam = torch.linalg.eigvalsh(q)
    assert _boxqp.rounding_lift(lam) is None  # too large a null space for the plain lift
    lift = spectrum.lift
    assert lift is not None and lift == pytest.approx(-2.0 * float(lam[0]), rel=1e-9)
    reference = _scipy_weights(q + lift * torch.eye(q.shape[0], dtype=F64))
    rows64 = rows.double()
    assert_same_update(weights @ rows64, reference @ rows64, rows64)


@pytest.mark.parametrize(("k", "p", "rank", "seed"), [(96, 8000, 8, 0), (96, 20000, 16, 1)])
def test_a_spread_cluster_takes_admm_and_matches_scipy(k: int, p: int, rank: int,
                                                       seed: int) -> None:
    """Float32 rows of rank 8 or 16 plus noise 1e-3: a positive definite Gramian whose noise
    eigenvalues the rounding spread over a decade and more (the count ``λ_min Σ 1/λᵢ`` below
    ``K/8``), found a cluster by the spread rule; UPGrad's update equals the sum of scipy's
    projections on that Gramian."""
    rows = _rows(k, p, rank, 1e-3, seed)
    weights, q, _ = _classified_once(rows, "floor")
    lam = torch.linalg.eigvalsh(q)
    assert float(lam[0]) > 0.0 and float((lam[0] / lam).sum()) < k / 8  # not by the count
    rows64 = rows.double()
    assert_same_update(weights @ rows64, _scipy_weights(q) @ rows64, rows64)
