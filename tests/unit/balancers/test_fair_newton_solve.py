"""The Newton step of Nash-MTL's and FairGrad's solve (``balancers/_solvers.py``'s
``_newton_solve``): from 512 tasks on the CPU a blocked Cholesky factorisation of the
Hessian ``G + diag(p w^{-p-1})``, an LU solve where it does not factorise and below. Checked
against LAPACK's LU solve and against the defining equations ``(Gw)ᵢ = wᵢ^{-p}``."""

from __future__ import annotations

import pytest
import torch

from gradbalance.balancers import _solvers

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def _spd(k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(k, k + 40, generator=gen, dtype=F64)
    return a @ a.T / k


@pytest.mark.parametrize("k", [511, 512, 700])
def test_the_step_is_lapack_s_solve(k: int) -> None:
    """Either side of ``BLOCKED_MIN_SIZE``: the solve of ``(G + diag(d)) s = grad`` equals
    ``torch.linalg.solve`` to ``1e-10`` relative (the Hessian's condition number near 1e3
    times float64's rounding)."""
    h = _spd(k, k)
    diagonal = torch.rand(k, generator=torch.Generator().manual_seed(2), dtype=F64)
    grad = torch.randn(k, generator=torch.Generator().manual_seed(1), dtype=F64)
    step, info = _solvers._newton_solve(h, diagonal, grad)
    h = h + torch.diag(diagonal)
    assert int(info) == 0
    expected = torch.linalg.solve(h, grad)
    assert float((step - expected).norm()) <= 1e-10 * float(expected.norm())


def test_a_matrix_that_does_not_factorise_takes_the_lu_solve() -> None:
    """A symmetric indefinite matrix of order 600 (one eigenvalue −1): the Cholesky
    factorisation fails and the LU solve answers, equal to ``torch.linalg.solve``."""
    h = _spd(600, 3)
    v = torch.nn.functional.normalize(torch.randn(600, dtype=F64), dim=0)
    h = h - (float(v @ h @ v) + 1.0) * torch.outer(v, v)
    assert int(torch.linalg.cholesky_ex(h).info) != 0
    grad = torch.randn(600, generator=torch.Generator().manual_seed(2), dtype=F64)
    step, info = _solvers._newton_solve(h, torch.zeros(600, dtype=F64), grad)
    expected = torch.linalg.solve(h, grad)
    assert int(info) == 0
    assert float((step - expected).norm()) <= 1e-9 * float(expected.norm())


@pytest.mark.parametrize("p", [1.0, 0.5])
def test_newton_at_512_tasks_meets_the_defining_equations(p: float) -> None:
    """K = 512 conflicting rows (a shared direction plus noise): ``fair_newton`` on the
    Cholesky path ends with ``max |wᵢ^p (Gw)ᵢ − 1|`` within ``1e-10`` (the tolerance), the
    residual recomputed here from ``G`` and ``w`` alone."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(1, 900, generator=gen, dtype=F64) + torch.randn(512, 900, generator=gen,
                                                                        dtype=F64)
    gram = rows @ rows.T
    gram = gram / torch.diagonal(gram).max()
    w, residual, _ = _solvers.fair_newton(gram, p)
    assert bool((w > 0).all())
    recomputed = float((w.pow(p) * (gram @ w) - 1.0).abs().max())
    assert recomputed <= 1e-10 and residual <= 1e-10
