"""The Newton step of Nash-MTL's and FairGrad's solve (``balancers/_solvers.py``'s
``_newton_solve``): from 512 tasks on the CPU a blocked Cholesky factorisation of the
Hessian ``G + diag(p w^{-p-1})``, an LU solve where it does not factorise and below; from 256
tasks the steps far from the solution in float32 (a failed one redone in float64). Checked
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


def _dtypes(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtypes of the Cholesky factorisations ``_solvers`` runs, recorded."""
    seen: list[torch.dtype] = []
    real = _solvers.cholesky_ex

    def spy(a: torch.Tensor):  # type: ignore[no-untyped-def]
        seen.append(a.dtype)
        return real(a)

    monkeypatch.setattr(_solvers, "cholesky_ex", spy)
    return seen


@pytest.mark.parametrize(("k", "p"), [(300, 1.0), (300, 0.5), (600, 2.0)])
def test_float32_steps_then_float64_meet_the_defining_equations(
        k: int, p: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """From ``FAIR_LOW_PRECISION_MIN_SIZE`` (256) tasks the steps far from the solution are
    factorised in float32, the last ones in float64 (512 tasks and up: Cholesky; below: LU):
    conflicting rows with norms over two decades end within ``1e-10`` of ``(Gw)ᵢ = wᵢ^{-p}``,
    recomputed here from ``G`` and ``w`` alone."""
    gen = torch.Generator().manual_seed(k)
    rows = torch.randn(1, 2 * k, generator=gen, dtype=F64) * torch.randn(k, 1, generator=gen,
                                                                          dtype=F64)
    rows = (rows + torch.randn(k, 2 * k, generator=gen, dtype=F64)) * torch.logspace(
        -1, 1, k, dtype=F64)[:, None]
    gram = rows @ rows.T
    gram = gram / torch.diagonal(gram).max()
    seen = _dtypes(monkeypatch)
    w, residual, _ = _solvers.fair_newton(gram, p)
    assert torch.float32 in seen
    assert bool((w > 0).all())
    recomputed = float((w.pow(p) * (gram @ w) - 1.0).abs().max())
    assert recomputed <= 1e-10 and residual <= 1e-10


def test_a_float32_step_that_fails_is_redone_in_float64() -> None:
    """With ``low`` given: a diagonal beyond float32's range (``1e300``: an infinite float32
    Hessian) and an indefinite matrix (no float32 factorisation) both fall back to the
    float64 solve, equal to ``torch.linalg.solve``."""
    h = _spd(300, 4)
    grad = torch.randn(300, generator=torch.Generator().manual_seed(3), dtype=F64)
    huge = torch.full((300,), 1e300, dtype=F64)
    step, _ = _solvers._newton_solve(h, huge, grad, _solvers._Float32Gram(h.float()))
    expected = torch.linalg.solve(h + torch.diag(huge), grad)
    assert bool(torch.isfinite(step).all())
    assert float((step - expected).norm()) <= 1e-10 * float(expected.norm())
    v = torch.nn.functional.normalize(torch.randn(300, dtype=F64), dim=0)
    indefinite = h - (float(v @ h @ v) + 1.0) * torch.outer(v, v)
    assert int(torch.linalg.cholesky_ex(indefinite.float()).info) != 0
    zeros = torch.zeros(300, dtype=F64)
    low = _solvers._Float32Gram(indefinite.float())
    step, info = _solvers._newton_solve(indefinite, zeros, grad, low)
    assert low.gram is None  # dropped: the later steps go to float64 at once
    expected = torch.linalg.solve(indefinite, grad)
    assert int(info) == 0
    assert float((step - expected).norm()) <= 1e-9 * float(expected.norm())
