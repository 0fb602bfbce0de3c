"""Box problems on a Gramian whose small eigenvalues form a cluster (``balancers/_admm.py``,
``balancers/_boxqp.py``'s ``_pivot_admm``): rows in a span of low rank plus noise. The
cluster's test against hand-built spectra, the route against scipy's NNLS (an independent
solver of each projection), and the common Gramians kept off it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import UPGrad, _admm, _boxqp
from support.balancers import nnls_dual_cone
from support.many_kinds import assert_same_update

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")  # K ≤ 96: one thread is faster


def _with_spectrum(lam: list[float], seed: int = 0) -> Tensor:
    """``V diag(λ) Vᵀ`` with a random orthogonal ``V``."""
    k = len(lam)
    gen = torch.Generator().manual_seed(seed)
    v = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=F64)).Q
    return (v * torch.tensor(lam, dtype=F64)) @ v.T


def _floors(lam: list[float]) -> tuple[float | None, float | None]:
    """:func:`~._admm.cluster_floor` from the eigenvalues and from the inverse."""
    q = _with_spectrum(lam)
    ascending = torch.tensor(sorted(lam), dtype=F64)
    return (_admm.cluster_floor(q, eigenvalues=ascending),
            _admm.cluster_floor(q, inverse=torch.cholesky_inverse(torch.linalg.cholesky(q))))


@pytest.mark.parametrize(("small", "value", "found"), [
    (8, 1e-6, True),  # 8 of 64 at 1e-6: λ_min Σ 1/λ = 8 + 56e-6 ≥ 64/8
    (7, 1e-6, False),  # 7 + 57e-6 < 8: a few small eigenvalues, not a cluster
    (32, 1e-6, True),
    (2, 1e-8, False),  # a Gaussian mixing's few small ones
    (32, 2e-3, False),  # a cluster, but 2e-3 of the mean (≈ 1) is not small
    (32, 5e-4, True),
])
def test_cluster_against_hand_counts(small: int, value: float, found: bool) -> None:
    """K = 64: ``small`` eigenvalues at ``value``, the others at 1; a cluster where the count
    ``λ_min Σ 1/λᵢ = small + (64 − small)·value`` reaches ``K/8 = 8`` and ``value`` is at most
    ``1e-3`` of the mean eigenvalue ``(small·value + 64 − small)/64``. Both ways of finding it
    agree, the floor within 1e-6 of ``value`` (the power steps on ``Q⁻¹``: the cluster
    dominates by a factor ``1/value``)."""
    lam = [value] * small + [1.0] * (64 - small)
    mean = sum(lam) / 64
    assert (small + (64 - small) * value >= 8 and value <= 1e-3 * mean) is found
    for floor in _floors(lam):
        if found:
            assert floor is not None and abs(floor - value) <= 1e-6 * value
        else:
            assert floor is None


def _noisy_rows(k: int, rank: int, noise: float, seed: int, p: int = 1500) -> Tensor:
    """``[K, P]`` rows in a random span of ``rank`` plus Gaussian noise ``noise`` of their size."""
    gen = torch.Generator().manual_seed(seed)
    basis = torch.randn(k, rank, generator=gen, dtype=F64) @ torch.randn(
        rank, p, generator=gen, dtype=F64) / rank**0.5
    return basis + noise * torch.randn(k, p, generator=gen, dtype=F64)


def _watched_route(rows: Tensor) -> tuple[Tensor, list[tuple[int, int]]]:
    """UPGrad's update of ``rows`` and, per call of ``_pivot_admm`` that took the route, how
    many problems it had and finished."""
    calls: list[tuple[int, int]] = []
    route = _boxqp._pivot_admm

    def spy(*args: object) -> tuple[Tensor, Tensor] | None:
        got = route(*args)  # type: ignore[arg-type]
        if got is not None:
            calls.append((got[1].numel(), int(got[1].sum())))
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "_pivot_admm", spy)
        update = UPGrad()(rows)
    return update, calls


def _reference(rows: Tensor) -> Tensor:
    """UPGrad's update from scipy's NNLS, one projection at a time (``pᵢ = 1/K``)."""
    k = rows.shape[0]
    eye = torch.eye(k, dtype=F64) / k
    return sum((nnls_dual_cone(rows, eye[i]) for i in range(k)), torch.zeros(rows.shape[1],
                                                                           dtype=F64))


@settings(max_examples=10, deadline=None)
@given(st.integers(64, 96), st.sampled_from([(1, 2, 1e-2), (1, 4, 1e-3), (3, 8, 1e-2)]),
       st.integers(0, 2**16))
def test_noisy_low_rank_rows_take_the_route_and_match_scipy(
        k: int, shape: tuple[int, int, float], seed: int) -> None:
    """Rows of rank ``K/2``, ``K/4`` or ``3K/8`` plus noise 1e-2 or 1e-3: the route is taken
    (the cluster found), the factorised pivoting from ADMM's free sets finishes at least
    7/8 of the projections, and the update equals the sum of scipy's projections."""
    numerator, denominator, noise = shape
    rows = _noisy_rows(k, max(2, numerator * k // denominator), noise, seed)
    update, calls = _watched_route(rows)
    assert len(calls) == 1
    problems, finished = calls[0]
    assert problems == k and finished >= 7 * k // 8
    assert_same_update(update, _reference(rows), rows)


@pytest.mark.parametrize("seed", [0, 1])
def test_admm_free_sets_are_the_optimal_ones(seed: int) -> None:
    """K = 64, rank 32 plus noise 1e-2: ADMM's free sets equal the optimal ones (scipy's NNLS
    support ``{x > 1e-9 max x}``) for at least 7/8 of the projections, and differ from them
    by at most 4 indices in all."""
    rows = _noisy_rows(64, 32, 1e-2, seed)
    gram = rows @ rows.T
    d = torch.diagonal(gram).sqrt()
    q = gram / torch.outer(d, d) / 64  # the cosine matrix, trace 1, as the dual-cone route's
    lower = torch.eye(64, dtype=F64) / 64
    floor = _admm.cluster_floor(q, torch.cholesky_inverse(torch.linalg.cholesky(q)))
    assert floor is not None
    free = _admm.admm_free_sets(q, lower, floor)
    from scipy.optimize import nnls

    a = (rows / d[:, None]).T.numpy()
    wrong = []
    for i in range(64):
        x = torch.from_numpy(nnls(a, -a[:, i] / 64, maxiter=10_000)[0])
        optimal = x > 1e-9 * float(x.max())
        wrong.append(int((free[i] ^ optimal).sum()))
    assert sum(w == 0 for w in wrong) >= 56
    assert sum(wrong) <= 4


@pytest.mark.parametrize("kind", ["randn", "square_mixing"])
def test_common_gramians_stay_off_the_route(kind: str) -> None:
    """Gaussian rows (condition number near 3) and a Gaussian mixing of them (a few small
    eigenvalues, condition number near ``K²``) have no cluster: the route's test is ``O(K)``
    on the trace of ``Q⁻¹`` and ADMM never runs."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(96, 1500, generator=gen, dtype=F64)
    if kind == "square_mixing":
        rows = torch.randn(96, 96, generator=gen, dtype=F64) @ rows / 96**0.5
    ran = [0]
    free_sets = _admm.admm_free_sets

    def spy(*args: Tensor | float) -> Tensor:
        ran[0] += 1
        return free_sets(*args)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "admm_free_sets", spy)
        update = UPGrad()(rows)
    assert ran[0] == 0
    assert_same_update(update, _reference(rows), rows)
