"""The conjugate-gradient preconditioner with ``Q``'s outlying eigenvalue deflated.

``apply`` (Sherman–Morrison on each free set) against the explicit matrix it stands for,
``(Ĥ_FF)⁻¹ + c v_F v_Fᵀ`` built and solved densely in float64; on ``Q = μI + c vvᵀ`` (where
the deflated ``B`` is ``μI``) against ``Q_FF⁻¹`` itself; no deflation without an outlier.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers._precond import deflated
from gradbalance.balancers._solvers import trace_normalized

F64 = torch.float64


def _masks(k: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random free sets ``[k, k]`` (each with at least one index) and residuals zero off them."""
    free = torch.rand(k, k, generator=gen) < 0.5
    free[:, 0] = True
    return free, torch.randn(k, k, generator=gen, dtype=F64) * free


@settings(max_examples=10, deadline=None)
@given(st.integers(8, 32), st.integers(0, 2**16))
def test_apply_is_the_inverse_of_the_deflated_matrix(k: int, seed: int) -> None:
    """Conflicting rows (one eigenvalue far above the rest): ``M⁻¹ r`` from ``u`` equals the
    dense solve with ``M_F = (Ĥ_FF)⁻¹ + c v_F v_Fᵀ``, symmetric positive definite."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(k, 1, generator=gen, dtype=F64) * torch.randn(4 * k, generator=gen,
                                                                      dtype=F64)
    rows = rows + 0.5 * torch.randn(k, 4 * k, generator=gen, dtype=F64)
    q, _ = trace_normalized(rows @ rows.T)
    pre = deflated(q, torch.linalg.inv(q))
    assert pre.v is not None and pre.c > 0
    free, r = _masks(k, gen)
    f = free.to(F64)
    z = pre.apply(r, f, pre.setup(f))
    h, v = pre.h.to(F64), pre.v.to(F64)
    for i in range(k):
        sel = free[i]
        m = torch.linalg.inv(h[sel][:, sel]) + pre.c * torch.outer(v[sel], v[sel])
        expected = torch.linalg.solve(m, r[i, sel])
        assert bool((z[i, ~sel] == 0).all())
        err = torch.linalg.vector_norm(z[i, sel] - expected)
        assert float(err) <= 1e-4 * float(torch.linalg.vector_norm(expected))
        assert float(z[i] @ r[i]) > 0


@settings(max_examples=10, deadline=None)
@given(st.integers(3, 40), st.integers(0, 2**16))
def test_exact_on_a_bulk_of_one_eigenvalue(k: int, seed: int) -> None:
    """``Q = μI + c vvᵀ`` (``c = 50μ``): the deflated preconditioner is ``Q_FF⁻¹`` exactly
    (up to its float32 products), whatever the free set."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(k, generator=gen, dtype=F64)
    v = v / torch.linalg.vector_norm(v)
    q = torch.eye(k, dtype=F64) + 50.0 * torch.outer(v, v)
    pre = deflated(q, torch.linalg.inv(q))
    free, r = _masks(k, gen)
    z = pre.apply(r, free.to(F64), pre.setup(free.to(F64)))
    for i in range(k):
        sel = free[i]
        expected = torch.linalg.solve(q[sel][:, sel], r[i, sel])
        err = torch.linalg.vector_norm(z[i, sel] - expected)
        assert float(err) <= 1e-5 * float(torch.linalg.vector_norm(expected))


def test_no_deflation_without_an_outlier() -> None:
    """Random rows (one Marchenko–Pastur bulk): plain ``(Q⁻¹)_FF``, ``h`` is ``Q⁻¹``."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 1000, generator=gen, dtype=F64)
    q, _ = trace_normalized(rows @ rows.T)
    pre = deflated(q, torch.linalg.inv(q))
    assert pre.v is None and pre.h is pre.inverse
