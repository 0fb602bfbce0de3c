"""The mixed-precision free-set solves (float32 steps on a float64 residual) against dense
float64 solves of each free block, and UPGrad through them against scipy's NNLS."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradbalance.balancers import _boxqp, _mixed
from gradbalance.balancers._projected import Plan
from support.balancers import classifier_rows
from support.cone_reference import assert_kkt, scipy_projection
from support.many_kinds import assert_same_update


def _spd(k: int, seed: int, outlier: float = 0.0) -> torch.Tensor:
    """A positive definite ``[K, K]`` float64 matrix: rows of ``P = 4K`` columns' Gramian,
    divided by ``P``, plus ``outlier`` times a shared direction's rank one."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(k, 4 * k, generator=gen, dtype=torch.float64)
    shared = torch.randn(k, generator=gen, dtype=torch.float64)
    return rows @ rows.T / (4 * k) + outlier * torch.outer(shared, shared) / k


def _free_block_solution(q: torch.Tensor, rhs: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """``Q_FF⁻¹ rhs_F`` per row by a dense float64 solve, zero off ``F``."""
    out = torch.zeros_like(rhs)
    for i in range(rhs.shape[0]):
        idx = torch.nonzero(free[i]).flatten()
        if idx.numel():
            out[i, idx] = torch.linalg.solve(q[idx][:, idx], rhs[i, idx])
    return out


@settings(max_examples=25, deadline=None)
@given(k=st.integers(2, 40), m=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_preconditioner_is_the_woodbury_inverse_on_each_free_set(k: int, m: int,
                                                                 seed: int) -> None:
    """``M⁻¹r = S(I + U_F diag(c) U_Fᵀ)⁻¹Sr`` on ``F``, zero off it: against the dense inverse
    of ``I + U_F diag(c) U_Fᵀ`` restricted to each free set."""
    gen = torch.Generator().manual_seed(seed)
    m = min(m, k - 1)
    scale = torch.rand(k, generator=gen) + 0.5
    v = torch.linalg.qr(torch.randn(k, m, generator=gen)).Q if m else None
    c = torch.rand(m, generator=gen) * 10 + 0.1 if m else None
    pre = _mixed.ScaledPreconditioner(scale, v, c)
    free = torch.rand(5, k, generator=gen) < 0.6
    f = free.float()
    r = torch.randn(5, k, generator=gen) * f
    z = pre.apply(r.clone(), f, pre.setup(f))
    for i in range(5):
        idx = torch.nonzero(free[i]).flatten()
        inner = torch.eye(idx.numel(), dtype=torch.float64)
        if v is not None and c is not None:
            vf = v[idx].double()
            inner = inner + vf @ torch.diag(c.double()) @ vf.T
        s = scale[idx].double()
        expected = s * torch.linalg.solve(inner, s * r[i, idx].double())
        assert torch.allclose(z[i, idx].double(), expected, rtol=1e-4, atol=1e-5)
        assert bool((z[i, ~free[i]] == 0).all())


@settings(max_examples=20, deadline=None)
@given(k=st.integers(3, 48), seed=st.integers(0, 2**16), outlier=st.sampled_from([0.0, 50.0]))
def test_rounds_reach_the_dense_solution(k: int, seed: int, outlier: float) -> None:
    """From a start ``1e-3`` off, rounds (each from the last one's ``y`` and exact ``yQ``) meet a
    ``1e-9`` relative target within four, each one not converged shrinking the residual at
    least tenfold; ``yQ`` is the float64 product of ``y``, and ``y`` the dense float64
    solution of each block within its condition number."""
    q = _spd(k, seed, outlier)
    gen = torch.Generator().manual_seed(seed + 1)
    free = torch.rand(6, k, generator=gen) < 0.5
    free[:, 0] = True
    rhs = torch.randn(6, k, generator=gen, dtype=torch.float64)
    exact = _free_block_solution(q, rhs, free)
    y = exact * (1 + 1e-3 * torch.randn(6, k, generator=gen, dtype=torch.float64))
    yq = y @ q
    pre = _mixed.ScaledPreconditioner(torch.diagonal(q).rsqrt().float(), None, None)
    size = torch.linalg.vector_norm(rhs * free, dim=1)
    last = torch.linalg.vector_norm((rhs - yq) * free, dim=1)
    for _ in range(4):
        out = _mixed.mixed_free_solve(q, q.float(), pre, -rhs, free, y, yq, 1e-9 * size)
        y, yq = out.y, out.yq
        residual = torch.linalg.vector_norm((rhs - y @ q) * free, dim=1)
        assert bool((out.converged == (residual <= 1e-9 * size)).all())
        assert bool((out.converged | (residual <= 0.1 * last)).all())
        last = residual
        if bool(out.converged.all()):
            break
    assert bool(out.converged.all())
    assert torch.allclose(yq, y @ q, rtol=0, atol=1e-12 * float(q.abs().max() * y.abs().max()))
    cond = float(torch.linalg.cond(q))
    assert torch.allclose(y, exact, rtol=0, atol=1e-8 * cond * float(exact.abs().max()))
    assert bool((y[~free] == 0).all())


def test_a_round_float32_cannot_resolve_is_reported_stalled() -> None:
    """A block whose condition number is near ``1/eps₃₂`` (float32's rounding of ``Q`` as large
    as the correction): the round is stalled, not reported converged."""
    k = 12
    gen = torch.Generator().manual_seed(3)
    basis = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64)).Q
    q = basis @ torch.diag(torch.logspace(-9, 0, k, dtype=torch.float64)) @ basis.T
    free = torch.ones(1, k, dtype=torch.bool)
    rhs = torch.randn(1, k, generator=gen, dtype=torch.float64)
    y0 = torch.zeros(1, k, dtype=torch.float64)
    pre = _mixed.ScaledPreconditioner(torch.diagonal(q).rsqrt().float(), None, None)
    out = _mixed.mixed_free_solve(q, q.float(), pre, -rhs, free, y0, y0.clone(),
                                  1e-12 * torch.linalg.vector_norm(rhs, dim=1))
    assert not bool(out.converged.any())
    assert bool(out.stalled.all())


def test_of_plan_takes_one_or_several_outliers() -> None:
    """:meth:`~._mixed.ScaledPreconditioner.of`: a plan's single outlier (``[K]``, a number)
    becomes ``[K, 1]`` and ``[1]``; none stays None."""
    scale = torch.ones(4, dtype=torch.float64)
    one = _mixed.ScaledPreconditioner.of(Plan(scale, 2.0, torch.ones(4) / 2, 3.0))
    assert one.v is not None and one.v.shape == (4, 1) and one.c is not None
    assert one.c.tolist() == [3.0]
    assert _mixed.ScaledPreconditioner.of(Plan(scale, 2.0)).v is None


@pytest.mark.parametrize(("k", "seed", "shared"), [(64, 0, 1.0), (96, 1, 0.0), (128, 2, 2.0)])
def test_upgrad_through_the_mixed_solves_is_scipy_s(k: int, seed: int, shared: float,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """UPGrad from 64 tasks on rows with and without a shared direction: the projected start
    and the mixed-precision solves are taken (counted), every projection meets its KKT
    conditions to the tight solves' residual and eight of them are scipy's NNLS's."""
    gen = torch.Generator().manual_seed(seed)
    p = 4 * k
    g = (shared * torch.randn(k, 1, generator=gen, dtype=torch.float64)
         * torch.randn(p, generator=gen, dtype=torch.float64)
         + torch.randn(k, p, generator=gen, dtype=torch.float64))
    calls = []
    real = _boxqp.mixed_free_solve

    def counted(*args: object, **kwargs: object) -> _mixed.MixedSolve:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_boxqp, "mixed_free_solve", counted)
    gram = g @ g.T
    u = torch.eye(k, dtype=torch.float64) / k
    from gradbalance.balancers._solvers import project_dual_cone
    v = project_dual_cone(gram, u)
    assert calls, "the mixed-precision solves were not taken"
    assert_kkt(gram, u, v)
    for i in range(0, k, k // 8):
        assert_same_update(v[i] @ g, scipy_projection(g, u[i]), g)


@pytest.mark.parametrize("rough", [False, True])
@pytest.mark.parametrize(("k", "seed", "shared"), [(96, 3, 1.5), (128, 4, 0.0)])
def test_bfloat16_products_leave_the_projections_exact(k: int, seed: int, shared: float,
                                                       rough: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """FISTA's first steps and the last float32 steps with their products in bfloat16 (forced
    from 64 tasks, whatever the processor) or none: every projection meets its KKT
    conditions to the tight solves' residual and is scipy's NNLS's; the bfloat16 products
    were taken (counted) exactly where asked."""
    from gradbalance.balancers import _projected

    monkeypatch.setattr(_projected, "ROUGH_MIN_SIZE", 64)
    monkeypatch.setattr(_boxqp, "ROUGH_MIN_SIZE", 64)
    monkeypatch.setattr(_projected, "bfloat16_products", lambda: rough)
    monkeypatch.setattr(_boxqp, "bfloat16_products", lambda: rough)
    taken = []
    real = _mixed.ScaledPreconditioner.bulk

    def counted(self: _mixed.ScaledPreconditioner, q32: torch.Tensor) -> _mixed.Rough:
        taken.append(1)
        return real(self, q32)

    monkeypatch.setattr(_mixed.ScaledPreconditioner, "bulk", counted)
    gen = torch.Generator().manual_seed(seed)
    p = 4 * k
    g = (shared * torch.randn(k, 1, generator=gen, dtype=torch.float64)
         * torch.randn(p, generator=gen, dtype=torch.float64)
         + torch.randn(k, p, generator=gen, dtype=torch.float64))
    gram = g @ g.T
    u = torch.eye(k, dtype=torch.float64) / k
    from gradbalance.balancers._solvers import project_dual_cone
    v = project_dual_cone(gram, u)
    assert bool(taken) == rough
    assert_kkt(gram, u, v)
    for i in range(0, k, k // 8):
        assert_same_update(v[i] @ g, scipy_projection(g, u[i]), g)


@pytest.mark.parametrize(("k", "classes", "width", "seed"), [(112, 6, 80, 3), (128, 10, 40, 1)])
def test_bfloat16_steps_grow_with_fista_s_steps(k: int, classes: int, width: int, seed: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-sample rows of a linear head (FISTA's steps 16 and 32: a bulk of condition number
    near 10 and 40), bfloat16 forced from 64 tasks: every one of FISTA's products but the
    last ``FINE_STEPS`` (counted: the first step has none, the last is float64, two in
    float32) is taken in bfloat16, more than ``ROUGH_STEPS``; every projection meets its
    KKT conditions and is scipy's NNLS's."""
    from gradbalance.balancers import _projected

    monkeypatch.setattr(_projected, "ROUGH_MIN_SIZE", 64)
    monkeypatch.setattr(_boxqp, "ROUGH_MIN_SIZE", 64)
    monkeypatch.setattr(_projected, "bfloat16_products", lambda: True)
    monkeypatch.setattr(_boxqp, "bfloat16_products", lambda: True)
    steps: list[int] = []
    rough: list[int] = []
    real_steps, real_times = _projected.start_steps, _projected._RoughBulk.times

    def counted_steps(start: Plan) -> int:
        steps.append(real_steps(start))
        return steps[-1]

    def counted_times(self: _projected._RoughBulk, z: torch.Tensor) -> torch.Tensor:
        rough.append(1)
        return real_times(self, z)

    monkeypatch.setattr(_projected, "start_steps", counted_steps)
    monkeypatch.setattr(_projected._RoughBulk, "times", counted_times)
    g = classifier_rows(k, classes, width, seed)
    gram = g @ g.T
    u = torch.eye(k, dtype=torch.float64) / k
    from gradbalance.balancers._solvers import project_dual_cone
    v = project_dual_cone(gram, u)
    assert len(steps) == 1 and steps[0] > 2 * _projected.ROUGH_STEPS
    assert len(rough) == steps[0] - _projected.FINE_STEPS > _projected.ROUGH_STEPS
    assert_kkt(gram, u, v)
    for i in range(0, k, k // 8):
        assert_same_update(v[i] @ g, scipy_projection(g, u[i]), g)


@pytest.mark.parametrize("k", [3, 64, 256])
def test_a_transposed_gramian_gives_the_same_weights(k: int) -> None:
    """A column-major Gramian (``G.T`` of a float32 product, converted to float64 with its
    strides) and a column-major float64 one with norms far apart (the cosine scaling's
    route): the contiguous Gramian's weights and projections, nothing raised, the input
    untouched (the in-place symmetrisation took a view of the matrix for its transpose)."""
    from gradbalance.balancers._precond import symmetrized
    from gradbalance.balancers._solvers import project_dual_cone
    from gradbalance.functional import upgrad_weights

    gen = torch.Generator().manual_seed(k)
    g = torch.randn(k, 3 * k + 10, generator=gen, dtype=torch.float64)
    gram32 = (g @ g.T).float()
    before = gram32.clone()
    assert torch.allclose(upgrad_weights(gram32.T), upgrad_weights(gram32.contiguous()),
                          rtol=1e-9, atol=0)
    assert torch.equal(gram32, before)
    wide = g * torch.logspace(-3, 3, k, dtype=torch.float64)[:, None]
    gram = wide @ wide.T
    column_major = gram.T.contiguous().T
    u = torch.eye(k, dtype=torch.float64) / k
    got, want = project_dual_cone(column_major, u), project_dual_cone(gram, u)
    for i in range(0, k, max(1, k // 8)):  # the same projections, to the solves' accuracy
        assert_same_update(got[i] @ wide, want[i] @ wide, wide)
    m = torch.randn(5, 5, generator=gen, dtype=torch.float64).T.contiguous().T
    expected = (m + m.T) / 2
    assert torch.equal(symmetrized(m.clone(memory_format=torch.preserve_format), True),
                       expected)
