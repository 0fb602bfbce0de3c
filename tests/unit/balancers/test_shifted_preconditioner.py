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
