"""UPGrad's conjugate-gradient pivoting: the float32 start and the float64 solves, K ≤ 48.

``pcg_free`` (float64 and float32): each free block's residual recomputed in float64 from the
returned ``y``; the whole path (the float32 pivoting of ``rough_free_sets``, then the float64
pivoting from it) against scipy's NNLS on the rows, projection by projection, and against the
same path from a wrong start (K ≤ 24; the float32 phase is only a start: the float64 pivoting
decides). Inputs: conflicting rows (condition numbers up to about 1e3), rows whose norms
span 1e-2 … 1e2 (1e8 … 4e9, below the path's limit of 1e10), and few coordinates
(``P = K + 3``: up to about 2e5), all on the conjugate-gradient path (``CG_MIN_SIZE`` forced
to 2). Tolerance: the same update (cosine ≥ 0.999999, norm within
1e-6 relative). Rows sharing one to three directions (as many outlying eigenvalues, deflated
together), K ≤ 64: every projection against its KKT conditions, four per case against scipy's
NNLS. The all-free start ``−lower`` against the closed form from ``−Q⁻¹ shift``, and the
bounds' product from rows of ``Q`` against the product.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import _boxqp, _pcg, _precond
from gradbalance.balancers._solvers import trace_normalized
from support.balancers import nnls_dual_cone
from support.cone_reference import assert_kkt
from unit.balancers.test_many_tasks import assert_same_update

F64 = torch.float64
KINDS = ["conflicting", "wide_norms", "few_coordinates"]


def well_posed_rows(kind: str, k: int, seed: int) -> Tensor:
    """``[K, P]`` rows with a positive definite Gramian (the pivoting's domain)."""
    gen = torch.Generator().manual_seed(seed)
    p = k + 3 if kind == "few_coordinates" else 4 * k + 8
    g = torch.randn(k, 1, generator=gen, dtype=F64) * torch.randn(p, generator=gen, dtype=F64)
    g = g + 0.5 * torch.randn(k, p, generator=gen, dtype=F64)
    if kind == "wide_norms":
        g = g * torch.logspace(-2, 2, k, dtype=F64)[torch.randperm(k, generator=gen), None]
    return g


def cg_projections(gram: Tensor, u: Tensor) -> Tensor:
    """Every projection ``argmin_{v ≥ uᵢ} vᵀGv`` on the conjugate-gradient path."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "CG_MIN_SIZE", 2)
        return _boxqp.solve_box_qp_batched(gram, torch.zeros_like(u), u)


CASES = st.tuples(st.integers(3, 48), st.sampled_from(KINDS), st.integers(0, 2**16))


@settings(max_examples=15, deadline=None)
@given(st.integers(2, 48), st.sampled_from([torch.float64, torch.float32]),
       st.integers(0, 2**16))
def test_pcg_free_solves_every_free_block(k: int, dtype: torch.dtype, seed: int) -> None:
    """Each row: ``y`` zero off ``F``, ``Q_FF y_F = rhs_F`` (checked in float64 against the
    returned ``y``) to the relative tolerance asked for where converged (float64: every
    row), ``yQ`` (carried along the steps) the product of the returned ``y``."""
    gen = torch.Generator().manual_seed(seed)
    rows = well_posed_rows("conflicting", k, seed)
    gram, _ = trace_normalized(rows @ rows.T)
    h = torch.cholesky_inverse(torch.linalg.cholesky(gram))
    free = torch.rand(k, k, generator=gen) < 0.6
    rhs = torch.randn(k, k, generator=gen, dtype=F64) / k
    start = torch.randn(k, k, generator=gen, dtype=F64) / k  # a warm start, partly off F
    rtol = 1e-10 if dtype == torch.float64 else 1e-4
    q = gram.to(dtype)
    y, converged, yq = _pcg.pcg_free(q, h.to(dtype), rhs.to(dtype), free, start.to(dtype),
                                     start.to(dtype) @ q, torch.full((k,), rtol, dtype=dtype))
    y64, f = y.to(F64), free.to(F64)
    assert bool((y64[~free] == 0).all())
    size = torch.linalg.vector_norm(rhs * f, dim=1)
    residual = torch.linalg.vector_norm((rhs - y64 @ gram) * f, dim=1)
    # The recursive residual meets rtol; the true one within rounding of the products.
    slack = 10 * k * torch.finfo(dtype).eps * torch.linalg.vector_norm(y64, dim=1)
    assert bool((residual <= rtol * size + slack)[converged].all())
    assert dtype == torch.float32 or bool(converged.all())
    drift = torch.linalg.vector_norm(yq.to(F64) - y64 @ gram, dim=1)
    assert bool((drift <= size * 1e-2 * rtol ** 0.5 + slack).all())


@settings(max_examples=8, deadline=None)
@given(CASES)
def test_float32_start_then_float64_matches_scipy_nnls(case: tuple[int, str, int]) -> None:
    """UPGrad's projections on the conjugate-gradient path against scipy's NNLS on the rows
    (an independent solver), four of them per case."""
    k, kind, seed = case
    g = well_posed_rows(kind, k, seed)
    gram, _ = trace_normalized(g @ g.T)
    u = torch.eye(k, dtype=F64) / k
    v = cg_projections(gram, u)
    for i in sorted({0, k // 3, 2 * k // 3, k - 1}):
        assert_same_update(g.T @ v[i], nnls_dual_cone(g, u[i]), g)


@settings(max_examples=6, deadline=None)
@given(st.tuples(st.integers(3, 24), st.sampled_from(KINDS), st.integers(0, 2**16)))
def test_the_float32_phase_is_only_a_start(case: tuple[int, str, int]) -> None:
    """A wrong guess (every index free, random positive ``y``) in place of the float32
    pivoting gives the same projections: the float64 pivoting decides."""
    k, kind, seed = case
    g = well_posed_rows(kind, k, seed)
    gram, _ = trace_normalized(g @ g.T)
    u = torch.eye(k, dtype=F64) / k
    expected = cg_projections(gram, u)

    def wrong(q: Tensor, h: Tensor, shift: Tensor, free0: Tensor,
              *_: object) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return torch.ones_like(free0), torch.rand(free0.shape, generator=gen, dtype=F64) / k

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "rough_free_sets", wrong)
        got = cg_projections(gram, u)
    assert_same_update(got.sum(dim=0) @ g, expected.sum(dim=0) @ g, g)


def test_rough_free_sets_keeps_the_start_where_float32_is_not_finite() -> None:
    """A problem whose float32 solve is not finite (an overflowing or NaN ``shift``) keeps
    its given free set and ``y = 0``; another gets the optimum (here ``Q = I``:
    ``y = max(−shift, 0)``), one that overflows a finite guess."""
    k = 6
    q = torch.eye(k, dtype=F64)
    shift = torch.tensor([[-1.0, 2.0, -3.0, 0.5, -0.25, 1.0], [float("nan")] * k,
                          [1e300] * k], dtype=F64)
    free0 = torch.zeros(3, k, dtype=torch.bool)
    free0[1:, 1] = True
    free, y = _pcg.rough_free_sets(q, q, shift, free0)
    assert free[0].tolist() == [True, False, True, False, True, False]
    assert torch.allclose(y[0], (-shift[0]).clamp_min(0.0), rtol=1e-6)
    assert free[1].tolist() == free0[1].tolist()
    assert bool((y[1:] == 0).all()) and bool(torch.isfinite(y).all())


@settings(max_examples=12, deadline=None)
@given(st.integers(2, 32), st.integers(0, 2**16))
def test_opposite_start_solves_the_free_block_without_one_index(k: int, seed: int) -> None:
    """UPGrad's shifts (``p_i Q_i``): ``y`` zero at ``i`` and ``Q_FF y_F = −shift_F`` on the
    other indices (checked against a direct solve of that block), the free set where
    ``y > 0``, ``yQ`` its product; a row with a given free set keeps it (and ``y = 0``)."""
    gram, _ = trace_normalized((g := well_posed_rows("conflicting", k, seed)) @ g.T)
    h = torch.cholesky_inverse(torch.linalg.cholesky(gram))
    p = torch.rand(k, generator=torch.Generator().manual_seed(seed), dtype=F64) + 0.5
    shift = p[:, None] * gram
    free0 = torch.zeros(k, k, dtype=torch.bool)
    free0[0, -1] = True  # row 0: a warm start
    free, y, yq = _pcg.opposite_start(h, shift, free0)
    assert free[0].tolist() == free0[0].tolist() and bool((y[0] == 0).all())
    for i in range(1, k):
        rest = [j for j in range(k) if j != i]
        expected = torch.linalg.solve(gram[rest][:, rest], -shift[i, rest])
        assert float(y[i, i]) == 0.0
        scale = float(expected.abs().max())
        assert torch.allclose(y[i, rest], expected, rtol=1e-8, atol=1e-10 * scale)
        assert free[i].tolist() == (y[i] > 0).tolist()
    assert torch.allclose(yq[1:], y[1:] @ gram, atol=1e-12)


@settings(max_examples=10, deadline=None)
@given(st.integers(2, 48), st.integers(0, 2**16))
def test_opposite_start_from_the_known_all_free_point(k: int, seed: int) -> None:
    """UPGrad's bounds (``c = 0``): the all-free point ``−lower`` given instead of ``−Q⁻¹
    shift`` (one product fewer) gives the start of the same closed form, every row cold."""
    gram, _ = trace_normalized((g := well_posed_rows("conflicting", k, seed)) @ g.T)
    h = torch.cholesky_inverse(torch.linalg.cholesky(gram))
    lower = torch.diag(torch.rand(k, generator=torch.Generator().manual_seed(seed),
                                  dtype=F64) + 0.5)
    free0 = torch.zeros(k, k, dtype=torch.bool)
    free, y, yq = _pcg.opposite_start(h, lower @ gram, free0, -lower)
    for i in range(k):
        rest = [j for j in range(k) if j != i]
        expected = torch.linalg.solve(gram[rest][:, rest], -(lower @ gram)[i, rest])
        scale = float(expected.abs().max()) if rest else 1.0
        assert float(y[i, i]) == 0.0
        assert torch.allclose(y[i, rest], expected, rtol=1e-8, atol=1e-10 * scale)
        assert free[i].tolist() == (y[i] > 0).tolist()
    assert torch.allclose(yq, y @ gram, atol=1e-12)


@pytest.mark.parametrize("per_row", [1, 40])
def test_sparse_product_either_way_is_the_product(per_row: int) -> None:
    """``a Q`` from the rows of ``Q`` of ``a``'s few non-zero entries (UPGrad's bounds: one
    per row, each entry the product's own, bit for bit), or one product (many)."""
    gen = torch.Generator().manual_seed(per_row)
    k = 512  # one per row: within SPARSE_FRACTION; 40: not
    q = torch.randn(k, k, generator=gen, dtype=F64)
    a = torch.zeros(k, k, dtype=F64)
    cols = torch.rand(k, k, generator=gen).argsort(dim=1)[:, :per_row]
    a.scatter_(1, cols, torch.randn(k, per_row, generator=gen, dtype=F64))
    got = _precond.sparse_product(a, q)
    assert torch.allclose(got, a @ q, atol=1e-12)
    diag = torch.diag(torch.randn(k, generator=gen, dtype=F64))
    assert torch.equal(_precond.sparse_product(diag[:3], q), diag[:3] @ q)


@pytest.mark.parametrize(("k", "dropped"), [(64, 1), (512, 1), (512, 40)])
def test_restricted_product_either_way_is_the_product(k: int, dropped: int) -> None:
    """``(y ∘ f) Q`` from ``y Q``, by a sparse product of the dropped entries (few, ``Q``
    wide) or one product (many, or ``Q`` narrow)."""
    gen = torch.Generator().manual_seed(dropped)
    q = torch.randn(k, k, generator=gen, dtype=F64)
    y = torch.randn(3, k, generator=gen, dtype=F64)
    f = torch.ones(3, k, dtype=F64)
    f[:, :dropped] = 0.0
    got = _pcg.restricted_product(q, y, y @ q, f)
    assert torch.allclose(got, (y * f) @ q, atol=1e-12)


def test_float64_solves_with_a_float32_preconditioner_converge() -> None:
    """``pcg_free`` in float64 with ``h`` in float32 (the float64 pivoting's solves): every
    row to ``1e-11`` (the tight tolerance), residual recomputed from ``y``."""
    k = 48
    gram, _ = trace_normalized((g := well_posed_rows("wide_norms", k, 5)) @ g.T)
    h32 = torch.cholesky_inverse(torch.linalg.cholesky(gram)).float()
    gen = torch.Generator().manual_seed(5)
    free = torch.rand(k, k, generator=gen) < 0.5
    rhs = torch.randn(k, k, generator=gen, dtype=F64)
    zero = torch.zeros(k, k, dtype=F64)
    y, converged, _ = _pcg.pcg_free(gram, h32, rhs, free, zero, zero,
                                    torch.full((k,), 1e-11, dtype=F64))
    f = free.to(F64)
    residual = torch.linalg.vector_norm((rhs - y @ gram) * f, dim=1)
    assert bool(converged.all())
    assert bool((residual <= 2e-11 * torch.linalg.vector_norm(rhs * f, dim=1)).all())


def shared_rows(k: int, directions: int, seed: int) -> Tensor:
    """``[k, 4k + 8]`` rows ``Σⱼ wⱼ aᵢⱼ sⱼ + nᵢ/2`` (``w = 1, 0.7, 0.4``): one outlying eigenvalue
    of the Gramian per shared direction ``sⱼ``, each deflated from the preconditioner."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.tensor([1.0, 0.7, 0.4], dtype=F64)[:directions]
    a = torch.randn(k, directions, generator=gen, dtype=F64) * weights
    s = torch.randn(directions, 4 * k + 8, generator=gen, dtype=F64)
    return a @ s + 0.5 * torch.randn(k, 4 * k + 8, generator=gen, dtype=F64)


@settings(max_examples=8, deadline=None)
@given(st.integers(8, 64), st.integers(1, 3), st.integers(0, 2**16))
def test_several_shared_directions_match_scipy_nnls_and_kkt(k: int, directions: int,
                                                           seed: int) -> None:
    """Rows sharing 1–3 directions (as many outlying eigenvalues, deflated together by one
    ``m × m`` Woodbury solve per free set): every projection meets its KKT conditions, four
    per case equal scipy's NNLS on the rows."""
    g = shared_rows(k, directions, seed)
    gram, _ = trace_normalized(g @ g.T)
    u = torch.eye(k, dtype=F64) / k
    seen = []

    def spy(q: Tensor, h: Tensor) -> _precond.Preconditioner:
        seen.append(pre := _precond.deflated(q, h))
        return pre

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "deflated", spy)
        v = cg_projections(gram, u)
    assert seen and seen[0].v is not None
    assert_kkt(gram, u, v)
    for i in sorted({0, k // 3, 2 * k // 3, k - 1}):
        assert_same_update(g.T @ v[i], nnls_dual_cone(g, u[i]), g)


@settings(max_examples=10, deadline=None)
@given(CASES)
def test_tight_solves_meet_their_error_bound(case: tuple[int, str, int]) -> None:
    """The tight solves' residual (:func:`~._boxqp.tight_residuals`) bounds each projection's
    error in ``Q``'s norm, ``‖Jᵀ(v − v*)‖``, by ``max(CG_ERROR, CG_RTOL_MIN·b)`` times its
    bound's, ``‖Jᵀu‖``, against scipy's NNLS on the rows (an independent solver, to ``1e-10``
    of it); ``b = √(‖Q‖_∞‖Q⁻¹‖_∞)`` is at least ``√κ`` (eigenvalues), and each target is
    ``CG_ERROR ‖u‖_Q √λ_min`` or less (``λ_min`` from the eigenvalues)."""
    k, kind, seed = case
    g = well_posed_rows(kind, k, seed)
    gram, _ = trace_normalized(g @ g.T)
    u = torch.eye(k, dtype=F64) / k
    h = torch.linalg.inv(gram)
    lam = torch.linalg.eigvalsh(gram)
    bound = float(gram.abs().sum(dim=1).amax() * h.abs().sum(dim=1).amax()) ** 0.5
    assert bound >= float(lam[-1] / lam[0]) ** 0.5 * (1 - 1e-9)
    targets = _boxqp.tight_residuals(h, u, u @ gram)
    sizes = torch.einsum("bi,ij,bj->b", u, gram, u).sqrt()
    assert bool((targets <= _boxqp.CG_ERROR * sizes * lam[0].sqrt() * (1 + 1e-9)).all())
    allowed = max(_boxqp.CG_ERROR, _boxqp.CG_RTOL_MIN * bound) + 1e-10
    v = cg_projections(gram, u)
    for i in range(k):
        size = float(torch.linalg.vector_norm(g.T @ u[i]))
        err = float(torch.linalg.vector_norm(g.T @ v[i] - nnls_dual_cone(g, u[i])))
        assert err <= 1.01 * allowed * size
