"""Lawson–Hanson on an updated QR factorisation (``balancers/_qr_update.py``).

The updated factorisation against one computed from scratch (``torch.linalg.lstsq`` and
``qr`` on the same columns) after every addition and removal; the NNLS against scipy's
``nnls`` and its own KKT conditions, relative to the problem's scale, on random,
rank-deficient, duplicate-column and wide-scale inputs; MGDA's least-squares route on a
Gramian with the spectrum of a per-sample Gramian (docs/per_sample.md) against its KKT
conditions; PCD on rank-deficient rows with near-duplicate pairs against its KKT conditions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import _boxqp
from gradbalance.balancers._boxqp import nnls
from gradbalance.balancers._qr_update import ColumnQR
from gradbalance.functional import pcd_weights

F64 = torch.float64
EPS = torch.finfo(F64).eps
KINDS = ("random", "low_rank", "duplicates", "wide_scale")


def matrix(kind: str, m: int, n: int, seed: int) -> tuple[Tensor, Tensor]:
    """``A`` ``[m, n]`` of one kind and ``b`` ``[m]`` (float64)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, n, generator=gen, dtype=F64)
    if kind == "low_rank":  # rank ≤ 3
        r = min(3, m, n)
        a = torch.randn(m, r, generator=gen, dtype=F64) @ torch.randn(r, n, generator=gen,
                                                                       dtype=F64)
    elif kind == "duplicates":  # each column twice, the copy 1e-9 apart or exact
        half = a[:, : (n + 1) // 2]
        copies = half + 1e-9 * torch.randn(half.shape, generator=gen, dtype=F64)
        copies[:, ::2] = half[:, ::2]
        a = torch.cat([half, copies], dim=1)[:, :n]
    elif kind == "wide_scale":  # column norms 1e-6 … 1e6
        a = a * torch.logspace(-6, 6, n, dtype=F64)[torch.randperm(n, generator=gen)]
    return a, torch.randn(m, generator=gen, dtype=F64) * float(a.norm() / max(m, 1) ** 0.5)


def _from_scratch(a: Tensor, b: Tensor, cols: list[int]) -> tuple[Tensor, Tensor, float]:
    """Least-squares solution, distances of every column to the span and residual norm,
    from a factorisation of ``A[:, cols]`` computed anew."""
    sub = a[:, cols]
    z = torch.linalg.lstsq(sub, b[:, None], driver="gelsd").solution[:, 0]
    q = torch.linalg.qr(sub).Q
    off = (a - q @ (q.T @ a)).norm(dim=0)
    return z, off, float((sub @ z - b).norm())


def assert_matches_from_scratch(qr: ColumnQR, a: Tensor, b: Tensor) -> None:
    """``qr``'s least-squares fit, residual norm and distances of the columns to its span
    against :func:`_from_scratch`: to ``1e-7`` of ``‖b‖`` (the fit; ``1e-9`` the residual)
    plus the rounding either carries on the column set, ``m n eps κ ‖b‖`` (``κ`` its
    condition number: with column norms 1e-6 … 1e6 a set far from dependent, each column
    ``1e-6`` of its norm off the others' span, still reaches ``κ = 1e12``, where the fit ``A z``
    cancels ``‖A‖‖z‖ ≈ κ‖b‖`` down to ``‖b‖``); the distances to ``1e-9`` of the longest
    column."""
    z, off, res = _from_scratch(a, b, qr.cols)
    sub = a[:, qr.cols]
    scale = float(b.norm()) + 1e-300
    rounding = sub.shape[0] * sub.shape[1] * EPS * float(torch.linalg.cond(sub))
    torch.testing.assert_close(sub @ qr.solve(), sub @ z, rtol=0,
                               atol=(1e-7 + rounding) * scale)  # the fit: z is as sensitive
    assert qr.residual_norm() == pytest.approx(res, rel=1e-7, abs=(1e-9 + rounding) * scale)
    torch.testing.assert_close(qr.off_norms(), off, rtol=0,
                               atol=1e-9 * float(a.norm(dim=0).max()))


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(KINDS), st.integers(2, 16), st.integers(2, 24),
       st.integers(0, 2**31 - 1), st.lists(st.integers(0, 10**6), min_size=1, max_size=16))
def test_updated_factorisation_matches_from_scratch(kind: str, m: int, n: int, seed: int,
                                                    moves: list[int]) -> None:
    # Each move adds a column far enough from the span (distance above 1e-6 of its norm:
    # the set stays of full rank, its conditioning in the tolerances) or drops one.
    a, b = matrix(kind, m, n, seed)
    qr = ColumnQR(a, b)
    norms = a.norm(dim=0)
    for move in moves:
        far = (qr.off_norms() > 1e-6 * norms).tolist()
        outside = [j for j in range(n) if far[j] and j not in qr.cols]
        if qr.cols and (move % 3 == 0 or not outside):
            qr.drop(qr.cols[move % qr.size])
        elif outside:
            qr.add(outside[move % len(outside)])
        if qr.cols:
            assert_matches_from_scratch(qr, a, b)


def _assert_nnls_optimal(a: Tensor, b: Tensor, x: Tensor) -> None:
    """KKT of ``min ‖Ax − b‖``, ``x ≥ 0``, relative to the scale: ``x ≥ 0``, ``w = Aᵀr ≤ 0``
    and ``xⱼwⱼ = 0``, ``wⱼ`` against ``‖Aⱼ‖‖b‖``; and the residual no larger than scipy's."""
    from scipy.optimize import nnls as scipy_nnls

    assert float(x.min()) >= 0.0
    r = b - a @ x
    scale = a.norm(dim=0) * float(b.norm()) + 1e-300
    w = (a.T @ r) / scale
    assert float(w.max()) <= 1e-8
    assert float((w * (x > 0)).abs().max()) <= 1e-8
    ref, _ = scipy_nnls(a.numpy(), b.numpy(), maxiter=100 * a.shape[1])
    expected = float(np.linalg.norm(a.numpy() @ ref - b.numpy()))
    assert float(r.norm()) <= expected * (1 + 1e-9) + 1e-12 * float(b.norm())


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(KINDS), st.integers(1, 40), st.integers(1, 64),
       st.integers(0, 2**31 - 1))
def test_nnls_is_optimal_on_degenerate_inputs(kind: str, m: int, n: int, seed: int) -> None:
    a, b = matrix(kind, m, n, seed)
    result = nnls(a, b)
    _assert_nnls_optimal(a, b, result.x)
    assert result.fallback_steps == 0 and result.additions <= 3 * n + 10


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(KINDS), st.integers(2, 30), st.integers(2, 48),
       st.integers(0, 2**31 - 1), st.lists(st.booleans(), min_size=48, max_size=48))
def test_nnls_warm_start_from_any_guess(kind: str, m: int, n: int, seed: int,
                                        guess: list[bool]) -> None:
    # A guessed passive set, dependent columns and non-positive solves included, changes the
    # path only: the same optimum.
    a, b = matrix(kind, m, n, seed)
    _assert_nnls_optimal(a, b, nnls(a, b, guess[:n]).x)


def per_sample_like(k: int, seed: int) -> Tensor:
    """A ``[K, K]`` Gramian with the spectrum of the transformer's per-sample Gramian at
    B = 256 (eigenvalues 5e-12 … 22, most of them small), random eigenvectors."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=F64)).Q
    lam = torch.logspace(-11.3, 0.0, k, dtype=F64) ** 2 * 22.0
    return (q * lam) @ q.T


@pytest.mark.parametrize("seed", range(2))
def test_mgda_least_squares_route_on_a_per_sample_spectrum(seed: int) -> None:
    # MGDA's KKT conditions on the Gramian itself: (Gw)ₖ ≥ wᵀGw everywhere, equal on the
    # support, to float64 rounding of the trace-normalised problem.
    gram = per_sample_like(40, seed)
    unit = gram / gram.trace()
    zeros = torch.zeros(1, 40, dtype=F64)
    done = torch.zeros(1, dtype=torch.bool)
    w = _boxqp._solve_factored(unit, zeros, zeros, True, None, zeros.clone(), done, 1e-12)[0]
    assert float(w.min()) >= 0.0 and float(w.sum()) == pytest.approx(1.0, abs=1e-12)
    gw = unit @ w
    value = float(w @ gw)
    assert float(gw.min()) >= value - 1e-12
    assert float((gw - value)[w > 0].abs().max()) <= 1e-12


@pytest.mark.parametrize("seed", range(3))
def test_pcd_on_rank_deficient_near_duplicate_rows(seed: int) -> None:
    # Rows in a rank-4 span, adjacent pairs 1e-6 apart, norms 1e-3 … 1e3 (K = 64), τ = 0
    # (d = 0 is feasible): PCD's least-distance route; its KKT conditions on the Gramian
    # (μ ≥ 0, every constraint met, equality where μ > 0), relative to the Gramian's trace.
    gen = torch.Generator().manual_seed(seed)
    k = 64
    g = torch.randn(k, 4, generator=gen, dtype=F64) @ torch.randn(4, 200, generator=gen,
                                                                  dtype=F64)
    g[1::2] = g[::2] + 1e-6 * torch.randn(k // 2, 200, generator=gen, dtype=F64)
    g = g * torch.logspace(-3, 3, k, dtype=F64)[torch.randperm(k, generator=gen)][:, None]
    gram = g @ g.T
    taus = torch.zeros(k - 1, dtype=F64)
    weights = pcd_weights(gram, taus)
    mu = weights[1:]
    slack = (gram @ weights)[1:] - taus * torch.diagonal(gram)[1:]
    tol = 1e-9 * float(gram.trace()) * max(1.0, float(weights.abs().sum()))
    assert bool(mu.any())
    assert float(mu.min()) >= 0.0
    assert float(slack.min()) >= -tol
    assert float((slack.abs() * (mu > 0)).max()) <= tol
