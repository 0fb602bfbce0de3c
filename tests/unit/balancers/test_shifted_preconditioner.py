"""UPGrad's projections on Gramians with small or zero eigenvalues, K = 64 … 96.

A Gramian of rank below K (rows ``C B`` with ``C`` ``[K, r]``, ``r = K − d``: a task gradient
that is a combination of others) is not positive definite; one of full rank whose mixing
``C`` has singular values spanning 1e-3 … 1 (condition number 1e6) is, but below the
``1e-3 · tr Q / K`` gate of :func:`~._precond.preconditioner_inverse`. Both take the
conjugate-gradient pivoting preconditioned through ``(Q + δI)⁻¹`` (the first via
``_pivot_singular``, which must finish problems itself, the second on the positive definite
path). Every projection is checked against scipy's NNLS on the rows (an independent solver;
the same update: cosine ≥ 0.999999, norm within 1e-6 relative) and against its KKT conditions
on the rows. The gate itself: the shifted inverse against ``torch.linalg.inv`` of ``Q + δI``,
and ``Q⁻¹`` kept where the smallest eigenvalue is above the gate.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import _boxqp, _precond
from gradbalance.balancers._solvers import trace_normalized
from support.balancers import nnls_dual_cone
from support.cone_reference import assert_kkt
from support.many_kinds import assert_same_update

F64 = torch.float64


def mixed_rows(k: int, rank: int, seed: int, spread: float = 0.0) -> Tensor:
    """``[K, P]`` float64 rows ``C B`` (``P = 4K``): ``C`` ``[K, rank]`` with singular values
    ``logspace(0, −spread)`` and random singular vectors, ``B`` Gaussian."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(k, rank, generator=gen, dtype=F64))
    v, _ = torch.linalg.qr(torch.randn(rank, rank, generator=gen, dtype=F64))
    mixing = u * torch.logspace(0.0, -spread, rank, dtype=F64) @ v.T
    return mixing @ torch.randn(rank, 4 * k, generator=gen, dtype=F64)


def check_projections(g: Tensor, gram: Tensor, v: Tensor, u: Tensor) -> None:
    for i in range(u.shape[0]):
        assert_same_update(g.T @ v[i], nnls_dual_cone(g, u[i]), g)
    assert_kkt(gram, u, v)


@settings(max_examples=8, deadline=None)
@given(k=st.integers(64, 96), deficit=st.sampled_from([1, 2, 8, 12]),
       seed=st.integers(0, 2**16))
def test_singular_gramians_are_pivoted_with_the_shifted_preconditioner(
        k: int, deficit: int, seed: int) -> None:
    g = mixed_rows(k, k - deficit, seed)
    gram, _ = trace_normalized(g @ g.T)
    u = torch.eye(k, dtype=F64) / k
    finished: list[int] = []
    original = _boxqp._pivot_singular

    def spy(q: Tensor, lower: Tensor, x: Tensor, tol: float) -> tuple[Tensor, Tensor] | None:
        out = original(q, lower, x, tol)
        finished.append(-1 if out is None else int(out[1].sum()))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "_pivot_singular", spy)
        v = _boxqp.solve_box_qp_batched(gram, torch.zeros_like(u), u)
    assert len(finished) == 1 and finished[0] > 0  # it ran and finished problems itself
    check_projections(g, gram, v, u)


@settings(max_examples=6, deadline=None)
@given(k=st.integers(64, 96), seed=st.integers(0, 2**16))
def test_badly_conditioned_gramians_take_the_shifted_preconditioner(k: int, seed: int) -> None:
    g = mixed_rows(k, k, seed, spread=3.0)
    gram, _ = trace_normalized(g @ g.T)
    lam = torch.linalg.eigvalsh(gram)
    mean = float(lam.mean())
    assert float(lam[0]) < _precond.SHIFT_BELOW * mean and float(lam[-1] / lam[0]) < 1e10
    h = torch.linalg.inv(gram)
    base = _precond.preconditioner_inverse(gram, h)
    expected = torch.linalg.inv(gram + _precond.SHIFT * mean * torch.eye(k, dtype=F64))
    assert base is not h
    assert float((base - expected).abs().max()) <= 1e-10 * float(expected.abs().max())
    u = torch.eye(k, dtype=F64) / k
    check_projections(g, gram, _boxqp.solve_box_qp_batched(gram, torch.zeros_like(u), u), u)


def test_a_well_conditioned_gramian_keeps_its_inverse() -> None:
    g = mixed_rows(64, 64, 0, spread=1.0)  # condition number 1e2: smallest eigenvalue 0.03 μ
    gram, _ = trace_normalized(g @ g.T)
    lam = torch.linalg.eigvalsh(gram)
    assert float(lam[0]) > 10 * _precond.SHIFT_BELOW * float(lam.mean())
    h = torch.linalg.inv(gram)
    assert _precond.preconditioner_inverse(gram, h) is h


def dependent_float32_rows(k: int, seed: int) -> Tensor:
    """``[K, P]`` float32 conflicting rows, the last ``K/16`` the sums of two others."""
    gen = torch.Generator().manual_seed(seed)
    p = 4 * k
    g = torch.randn(k, 1, generator=gen) * torch.randn(p, generator=gen)
    g = g + 0.5 * torch.randn(k, p, generator=gen)
    extra = k // 16
    pairs = torch.randint(0, k - extra, (extra, 2), generator=gen)
    g[k - extra:] = g[pairs[:, 0]] + g[pairs[:, 1]]
    return g


def scipy_weights(q: Tensor, lower: Tensor) -> Tensor:
    """``argmin_{v ≥ lower} vᵀQv`` by scipy's NNLS on a factor of ``Q`` (an independent
    solver): ``v = lower + μ``, ``min ‖Lᵀ(lower + μ)‖``, ``μ ≥ 0``."""
    from scipy.optimize import nnls

    lam, vec = torch.linalg.eigh(q)
    factor = vec * lam.clamp_min(0.0).sqrt()
    mu, _ = nnls(factor.T.numpy(), -(factor.T @ lower).numpy(), maxiter=10_000)
    return lower + torch.from_numpy(mu)


@pytest.mark.parametrize(("k", "seed"), [(64, 0), (80, 1), (96, 2), (96, 3)])
def test_a_float32_gramian_of_dependent_rows_is_lifted_within_its_rounding(
        k: int, seed: int) -> None:
    """The float32 Gramian of rows with K/16 dependent ones has a negative eigenvalue: the
    batch is solved on ``Q + 2|λ_min| I``, and the update is within the low-rank route's
    bound of the rows' exact (float64) Gramian's: ``‖Jᵀ(v − v*)‖² ≤ 3ε(‖v‖² + ‖v*‖²)``,
    ``ε = ‖Q − Q*‖₂`` (docs/balancers.md), ``v*`` from scipy's NNLS on the exact Gramian."""
    g32 = dependent_float32_rows(k, seed)
    g64 = g32.double()
    exact = g64 @ g64.T
    scale = float(torch.trace(exact)) / k
    q = (g32 @ g32.T).double() / scale
    q = (q + q.T) / 2
    q_star = exact / scale
    lam = torch.linalg.eigvalsh(q)
    assert float(lam[0]) < 0.0  # the rounding shows
    lifts: list[bool] = []
    original = _boxqp._lifted

    def spy(q_: Tensor, lift: float | None) -> Tensor | None:
        out = original(q_, lift)
        lifts.append(out is not None)
        return out

    lower = torch.eye(k, dtype=F64) / k
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "_lifted", spy)
        v = _boxqp.solve_box_qp_batched(q, torch.zeros_like(lower), lower)
    assert lifts[:1] == [True]
    eps = float(torch.linalg.matrix_norm(q - q_star, ord=2))
    for i in range(k):
        v_star = scipy_weights(q_star, lower[i])
        d = v[i] - v_star
        gap = float(d @ q_star @ d)
        assert gap <= 3 * eps * float(v[i] @ v[i] + v_star @ v_star) + 1e-12 * float(
            v_star @ q_star @ v_star)
        assert bool((v[i] >= lower[i] - 1e-12).all())


def test_the_lift_is_refused_where_the_rounding_null_space_is_large() -> None:
    """Rows in a span of rank K/2 (float32): half the eigenvalues are rounding, more than
    ``LIFT_MAX_NULLITY``; no lift (lifted, the conjugate gradients would resolve each)."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(64, 32, generator=gen) @ torch.randn(32, 256, generator=gen)
    q = (g @ g.T).double()
    q = (q + q.T) / 2 / float(torch.trace(q)) * 64
    well, definite, lift = _boxqp._spectrum(q)[:3]
    lam = torch.linalg.eigvalsh(q)
    assert float(lam[0]) < 0.0 and not well and not definite
    assert lift is None
    # and with a single dependent row the lift is twice the most negative eigenvalue
    g2 = dependent_float32_rows(64, 5)
    q2 = (g2 @ g2.T).double()
    q2 = (q2 + q2.T) / 2 / float(torch.trace(q2)) * 64
    low = float(torch.linalg.eigvalsh(q2)[0])
    assert low < 0.0
    assert _boxqp._spectrum(q2).lift == pytest.approx(2 * -low, rel=1e-12)
