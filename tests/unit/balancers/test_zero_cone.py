"""The low-rank route's zero dual cone (``balancers/_zero_cone.py``): rows whose conic hull is
their whole span give every projection zero, certified by an interior null vector; against
scipy's NNLS on the projection's dual and the KKT conditions, with tolerances from the
problem's own scale (``Σ vⱼ ‖gⱼ‖``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import _boxqp, _low_rank, _zero_cone
from gradbalance.balancers._solvers import project_dual_cone, trace_normalized
from support.balancers import nnls_dual_cone
from support.many_kinds import assert_same_update

F64 = torch.float64
EPS = torch.finfo(F64).eps


pytestmark = pytest.mark.usefixtures("one_thread")  # K ≤ 100: one thread is faster


def _spanning_factor(k: int, r: int, seed: int) -> Tensor:
    """``[K, r]`` rows whose conic hull is ``ℝʳ`` by construction: ``K − r − 1`` random rows,
    ``r`` more and minus their positive combination with the others (so ``Σ cⱼLⱼ = 0``
    with every ``cⱼ > 0``); norms ``1e-3 … 1e3``, rows shuffled."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(k - 1, r, generator=gen, dtype=F64)
    weights = torch.rand(k - 1, generator=gen, dtype=F64) + 0.1
    rows = torch.cat([rows, -(weights @ rows)[None]])
    rows *= torch.logspace(-3, 3, k, dtype=F64)[torch.randperm(k, generator=gen)][:, None]
    return rows[torch.randperm(k, generator=gen)]


def _bounds(k: int, seed: int) -> Tensor:
    """UPGrad's ``K`` bounds ``pᵢeᵢ`` and DualProj's ``p`` (random positive ``p``)."""
    pref = torch.rand(k, generator=torch.Generator().manual_seed(seed), dtype=F64) + 0.1
    return torch.cat([torch.diag(pref), pref[None]])


def _assert_all_certified(factor: Tensor, lower: Tensor,
                          found: tuple[Tensor, Tensor] | None) -> None:
    """A certificate was found, finished every problem, and meets :func:`_assert_kkt`."""
    assert found is not None
    v, done = found
    assert bool(done.all())
    _assert_kkt(factor, lower, v)


def _half_space_factor(k: int, r: int, seed: int) -> Tensor:
    """``[K, r]`` Gaussian rows moved into the open half-space ``Lⱼ·e₀ > 0``."""
    factor = torch.randn(k, r, generator=torch.Generator().manual_seed(seed), dtype=F64)
    factor[:, 0] = factor[:, 0].abs() + 0.1
    return factor


def _assert_kkt(factor: Tensor, lower: Tensor, v: Tensor) -> None:
    """``v ≥ lower``, ``x = Lᵀv`` in the dual cone and complementary, each to ``64·eps·K``
    times the problem's scale ``Σ vⱼ ‖Lⱼ‖`` (the rounding of ``Lᵀv``); and scipy's NNLS
    on the same problem leaves a residual as small (the projection is zero)."""
    k = factor.shape[0]
    norms = factor.norm(dim=1)
    for i in range(lower.shape[0]):
        x = v[i] @ factor
        scale = float(v[i].abs() @ norms)
        slack = 64 * EPS * k * scale
        assert bool((v[i] >= lower[i]).all())
        assert float(x.norm()) <= slack
        assert float((factor @ x).min()) >= -slack * float(norms.max())
        assert float(((v[i] - lower[i]) * (factor @ x)).abs().max()) <= slack * scale
        ref = nnls_dual_cone(factor, lower[i])
        assert float(ref.norm()) <= 1e-8 * float(lower[i] @ norms)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 16), st.integers(0, 48), st.integers(0, 2**16))
def test_spanning_factor_gives_zero_projections(r: int, extra: int, seed: int) -> None:
    """A factor whose rows positively span ``ℝʳ`` (``K = 2r + 2 … 64``, norms ``1e-3 …
    1e3``): every problem done (certified, or by Lawson–Hanson where the alternating
    projections find no ``c``), with scipy's (zero) projection and the KKT conditions."""
    k = min(64, 2 * r + 2 + extra)
    factor = _spanning_factor(k, r, seed)
    lower = _bounds(k, seed)
    v, done = _low_rank.low_rank_box(factor, lower, 1e-12, 3 * r + 10)
    assert bool(done.all())
    _assert_kkt(factor, lower, v)


def _gaussian_factor(k: int, r: int, seed: int) -> Tensor:
    """``[K, r]`` standard normal rows, norms then spread over ``1e-3 … 1e3``."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(k, r, generator=gen, dtype=F64)
    return rows * torch.logspace(-3, 3, k, dtype=F64)[torch.randperm(k, generator=gen)][:, None]


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 8), st.integers(0, 2**16))
def test_random_rows_well_above_the_rank_are_certified(r: int, seed: int) -> None:
    """``K = 8r`` random rows (in no half-space but with probability about ``2^{1−K}
    Σ_{i<r} C(K−1, i)``, Wendel 1962): the certificate is found and every problem is done
    by it, with scipy's (zero) projection and the KKT conditions."""
    k = 8 * r
    factor = _gaussian_factor(k, r, seed)
    lower = _bounds(k, seed)
    _assert_all_certified(factor, lower, _zero_cone.zero_cone_box(factor, lower, 1e-12))


@settings(max_examples=15, deadline=None)
@given(st.integers(2, 16), st.integers(0, 48), st.integers(0, 2**16))
def test_half_space_factor_has_no_certificate(r: int, extra: int, seed: int) -> None:
    """Rows in an open half-space (``Lⱼ·e > 0``): no ``c > 0`` has ``Lᵀc = 0``, the cone is
    not ``{0}`` (scipy's projections are not zero), and no certificate is claimed."""
    k = min(64, 2 * r + 2 + extra)
    factor = _half_space_factor(k, r, seed)
    lower = _bounds(k, seed)
    assert _zero_cone.zero_cone_box(factor, lower, 1e-12) is None
    ref = nnls_dual_cone(factor, lower[-1])
    assert float(ref.norm()) > 1e-3 * float(lower[-1] @ factor.norm(dim=1)) / k


def _watched_projection(gram: Tensor, u: Tensor, certified: Callable[[Tensor, Tensor], bool],
                        **settings: int) -> tuple[Tensor, list[bool]]:
    """``project_dual_cone(gram, u)`` with the zero dual cone's certificate watched: per call,
    whether it finished every problem and ``certified(factor, lower)`` holds; ``settings``:
    ``_low_rank`` constants set for the call."""
    seen: list[bool] = []
    box = _zero_cone.zero_cone_box

    def spy(factor: Tensor, lower: Tensor, tol: float) -> tuple[Tensor, Tensor] | None:
        out = box(factor, lower, tol)
        seen.append(out is not None and bool(out[1].all()) and certified(factor, lower))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_low_rank, "zero_cone_box", spy)
        for name, value in settings.items():
            mp.setattr(_low_rank, name, value)
        v = project_dual_cone(gram, u)
    return v, seen


def _span_rows(k: int, r: int, seed: int) -> Tensor:
    """``[K, P]`` rows ``coef @ basis`` in a random ``r``-dimensional span with coefficients
    of :func:`_gaussian_factor` (norms ``1e-3 … 1e3``), a few zero."""
    gen = torch.Generator().manual_seed(seed + 1)
    n = k - k // 8
    g = torch.zeros(k, 3 * k, dtype=F64)
    live = torch.randperm(k, generator=gen)[:n]
    g[live] = _gaussian_factor(n, r, seed) @ torch.randn(r, 3 * k, generator=gen, dtype=F64)
    return g


@settings(max_examples=20, deadline=None)
@given(st.integers(24, 64), st.integers(2, 8), st.integers(0, 2**16))
def test_routed_spanning_rows_match_scipy(k: int, r: int, seed: int) -> None:
    """UPGrad's and DualProj's problems on rows whose conic hull is their span, rank ``r ≤
    n/8`` (``n`` non-zero rows): routed in ``r`` dimensions, every problem certified, the
    updates scipy's on the rows (zero) and ``v ≥ u``."""
    n = k - k // 8
    r = max(2, min(r, n // 8))
    g = _span_rows(k, r, seed)
    u = _bounds(k, seed)
    gram, trace = trace_normalized(g @ g.T)
    v, seen = _watched_projection(gram, u, lambda factor, lower: factor.shape[1] == r)
    assert seen == [True]
    unit = g / trace.sqrt()
    for i in range(u.shape[0]):
        assert_same_update(v[i] @ g, nnls_dual_cone(unit, u[i]) * trace.sqrt(), g)
        assert bool((v[i] >= u[i] * (1 - 1e-12)).all())


def test_equal_rows_are_not_certified() -> None:
    """``K`` equal rows of rank 1 (a half-line cone): the null space's projection of ``1`` is
    rounding, no positive null vector is claimed and no problem is certified."""
    factor = torch.full((40, 1), 0.1581, dtype=F64)
    found = _zero_cone.zero_cone_box(factor, _bounds(40, 0), 1e-12)
    assert found is None or not bool(found[1].any())
    rows, done = _low_rank.low_rank_box(factor, _bounds(40, 0), 1e-12, 13)
    assert bool(done.all())
    assert float((rows @ factor).norm()) > 0.0


@settings(max_examples=15, deadline=None)
@given(st.integers(24, 64), st.integers(2, 8), st.integers(0, 2**16))
def test_one_problem_on_spanning_rows_matches_scipy(k: int, r: int, seed: int) -> None:
    """DualProj's one problem on rows whose conic hull is their span (routed from 16 tasks
    here; by default from ``ONE_PROBLEM_MIN_SIZE``): certified in ``r`` dimensions,
    scipy's (zero) update and ``v ≥ p``."""
    n = k - k // 8
    r = max(2, min(r, n // 8))
    g = _span_rows(k, r, seed)
    p = _bounds(k, seed)[-1]
    gram, trace = trace_normalized(g @ g.T)
    v, seen = _watched_projection(gram, p, lambda factor, lower: lower.shape[0] == 1,
                                  ONE_PROBLEM_MIN_SIZE=16)
    assert seen == [True]
    assert_same_update(v @ g, nnls_dual_cone(g / trace.sqrt(), p) * trace.sqrt(), g)
    assert bool((v >= p * (1 - 1e-12)).all())


@pytest.mark.parametrize(("r", "seed"), [(2, 0), (8, 1)])
def test_one_problem_above_512_tasks_is_certified_at_a_low_rank(r: int, seed: int) -> None:
    """Above 512 tasks DualProj's one problem takes the certificate at every rank, low ones
    included (it used to go to the dense solve there): rows in a span of rank 2 or 8 at
    K = 600, ``v ≥ p`` and an update at most 1e-9 of the mean's (the projection is zero),
    with the certificate seen."""
    k = 600
    g = _span_rows(k, r, seed)
    p = torch.full((k,), 1.0 / k, dtype=F64)
    gram, _ = trace_normalized(g @ g.T)
    v, seen = _watched_projection(gram, p, lambda factor, lower: True)
    assert seen == [True]
    assert bool((v >= p * (1 - 1e-12)).all())
    assert float((v @ g).norm()) <= 1e-9 * float((p @ g).norm())


def test_pivots_stop_early_only_out_of_reach() -> None:
    """The pivots' early stop is a cost decision: the identity at K = 256 (rank 256, largest
    rank 64) is given up at 16 pivots; rows of rank 60 (one row in ten scaled by ``1e3``)
    and of rank 64 still reach their rank."""
    calls: list[int] = []
    reach = _low_rank._out_of_reach

    def spy(mass: dict[int, float], r: int, max_rank: int) -> bool:
        out = reach(mass, r, max_rank)
        if out:
            calls.append(r)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_low_rank, "_out_of_reach", spy)
        assert _low_rank.low_rank_factor(torch.eye(256, dtype=F64), 64) is None
        assert calls == [16]
        for rank in (60, 64):
            g = _gaussian_factor(256, rank, rank) @ torch.randn(rank, 300, dtype=F64)
            g[::10] *= 1e3
            found = _low_rank.low_rank_factor(g @ g.T, 64)
            assert found is not None and found[0].shape[1] == rank


def _watched_dense(gram: Tensor, u: Tensor) -> tuple[Tensor, list[tuple[int, bool]]]:
    """``project_dual_cone(gram, u)`` with the dense path's certificate watched: per call, the
    factor's rank and whether it finished every problem."""
    seen: list[tuple[int, bool]] = []
    box = _boxqp.zero_cone_box

    def spy(factor: Tensor, lower: Tensor, tol: float, rounds: int,
            exact: _zero_cone.LeastSquares | None = None,
            basis: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
        out = box(factor, lower, tol, rounds, exact, basis)
        seen.append((factor.shape[1], out is not None and bool(out[1].all())))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "zero_cone_box", spy)
        v = project_dual_cone(gram, u)
    return v, seen


@settings(max_examples=12, deadline=None)
@given(st.integers(64, 112), st.floats(0.3, 0.42), st.integers(0, 2**16))
def test_dense_rows_of_rank_up_to_half_are_certified(k: int, fraction: float,
                                                     seed: int) -> None:
    """Rows in a span of rank ``r`` between ``K/4`` and ``K/2`` whose conic hull is the span
    (:func:`_spanning_factor` times a random basis, norms ``1e-3 … 1e3``): the low-rank
    route declines (rank above ``K/4``), the dense path's eigen-factor has rank ``r`` and
    its certificate finishes every problem of UPGrad and DualProj; the updates are
    scipy's on the rows (zero) and ``v ≥ u``."""
    r = int(fraction * k)
    gen = torch.Generator().manual_seed(seed)
    g = _spanning_factor(k, r, seed) @ torch.randn(r, 3 * k, generator=gen, dtype=F64)
    u = _bounds(k, seed)
    gram, trace = trace_normalized(g @ g.T)
    v, seen = _watched_dense(gram, u)
    assert seen == [(r, True)]
    unit = g / trace.sqrt()
    for i in range(u.shape[0]):
        assert_same_update(v[i] @ g, nnls_dual_cone(unit, u[i]) * trace.sqrt(), g)
        assert bool((v[i] >= u[i] * (1 - 1e-12)).all())


@settings(max_examples=4, deadline=None)
@given(st.integers(64, 80), st.integers(0, 2**16))
def test_dense_rows_in_a_half_space_go_on_to_the_dense_solve(k: int, seed: int) -> None:
    """Rows of rank ``K/3`` in an open half-space (the cone is not ``{0}``): no certificate
    is claimed, the dense solve answers, and every update is scipy's on the rows."""
    r = k // 3
    gen = torch.Generator().manual_seed(seed)
    coef = torch.randn(k, r, generator=gen, dtype=F64)
    coef[:, 0] = coef[:, 0].abs() + 0.1
    g = coef @ torch.randn(r, 3 * k, generator=gen, dtype=F64)
    u = _bounds(k, seed)[-3:]
    gram, trace = trace_normalized(g @ g.T)
    v, seen = _watched_dense(gram, u)
    assert [done for _, done in seen] == [False]
    unit = g / trace.sqrt()
    for i in range(u.shape[0]):
        ref = nnls_dual_cone(unit, u[i]) * trace.sqrt()
        assert float(ref.norm()) > 0.0
        assert_same_update(v[i] @ g, ref, g)


@settings(max_examples=6, deadline=None)
@given(st.integers(64, 96), st.integers(0, 2**16))
def test_exact_search_alone_finds_the_certificate(k: int, seed: int) -> None:
    """Rows whose conic hull is their span with ``K/r`` near 2 (``r = K/2 − 1``, one row
    minus a positive combination of all the others): with no alternating projection the
    exact search (one NNLS) still finds ``c ≥ 1`` with ``Lᵀc = 0`` to the rounding, and the
    certificate passes the stop; with neither, none is claimed."""
    r = k // 2 - 1
    factor = _spanning_factor(k, r, seed)
    lower = _bounds(k, seed)
    assert _zero_cone.interior_null(factor, 0) is None
    c = _zero_cone.interior_null(factor, 0, _boxqp._nnls_point)
    assert c is not None
    assert float(c.min()) == pytest.approx(1.0)
    scale = float(c @ factor.norm(dim=1))
    assert float((c @ factor).norm()) <= 1e3 * EPS * k * scale
    _assert_all_certified(factor, lower, _zero_cone.zero_cone_box(factor, lower, 1e-12, 0,
                                                                  _boxqp._nnls_point))


@settings(max_examples=6, deadline=None)
@given(st.integers(2, 16), st.integers(0, 48), st.integers(0, 2**16))
def test_exact_search_claims_nothing_in_a_half_space(r: int, extra: int, seed: int) -> None:
    """Rows in an open half-space: the exact search's least ``‖Lᵀc‖`` over ``c ≥ 1`` is not
    zero, its projection on the null space is not positive, and no certificate is claimed."""
    k = min(64, 2 * r + 2 + extra)
    factor = _half_space_factor(k, r, seed)
    assert _zero_cone.interior_null(factor, 0, _boxqp._nnls_point) is None
    assert _zero_cone.zero_cone_box(factor, _bounds(k, seed), 1e-12, 0,
                                    _boxqp._nnls_point) is None


@pytest.mark.parametrize("seed", [1, 5])
def test_dense_rows_at_half_the_tasks_are_certified(seed: int) -> None:
    """K = 128 Gaussian rows of rank 64 (``K/r = 2``: their conic hull is their span with
    probability ½, Wendel 1962) for seeds where it is and 1,024 alternating projections find
    no ``c``: the dense path's exact search certifies every problem of UPGrad, and each
    update is scipy's (zero)."""
    k, r = 128, 64
    gen = torch.Generator().manual_seed(seed)
    factor = torch.randn(k, r, generator=gen, dtype=F64)
    assert _zero_cone.interior_null(factor, _zero_cone.DENSE_NULL_ROUNDS) is None
    g = factor @ torch.randn(r, 3 * k, generator=gen, dtype=F64)
    u = torch.eye(k, dtype=F64) / k
    gram, trace = trace_normalized(g @ g.T)
    v, seen = _watched_dense(gram, u)
    assert seen == [(r, True)]
    unit = g / trace.sqrt()
    for i in range(0, k, 16):
        ref = nnls_dual_cone(unit, u[i]) * trace.sqrt()
        assert float(ref.norm()) <= 1e-9 * float(g.norm(dim=1).sum())
        assert_same_update(v[i] @ g, ref, g)


@pytest.mark.parametrize(("k", "r", "p", "seed", "dtype"), [
    (200, 112, 100, 0, torch.float32), (300, 168, 150, 1, torch.float32),
    (65, 24, 3000, 0, torch.float64)])
def test_a_certificate_moved_inward_keeps_the_update_near_zero(
        k: int, r: int, p: int, seed: int, dtype: torch.dtype) -> None:
    # Rows whose conic hull only just covers their span (P = K/2 in float32; rank 3K/8 of
    # float32-made rows in float64): every exact projection is zero to about 1e-7 of the
    # rows' mean norm, certified below by scipy's NNLS (a c ≥ 1 with Jᵀc = 0). The first
    # positive null vector's entries spread over 1e7 (a certificate 8e8 times its problem)
    # and UPGrad's update on the rows was 0.3–28 times their mean norm (float32), 9e-4
    # (float64); with the rounds after it, 2e-6 … 6e-5.
    from scipy.optimize import nnls

    from gradbalance.balancers import DualProj, UPGrad

    gen = torch.Generator().manual_seed(seed)
    rows = (torch.randn(k, r, generator=gen) @ torch.randn(r, p, generator=gen)).to(dtype)
    g = rows.double()
    mean_norm = float(g.norm(dim=1).mean())
    unit = (g / g.norm(dim=1, keepdim=True)).numpy()
    y, _ = nnls(unit.T, -unit.sum(axis=0), maxiter=10_000)  # c = 1 + y, Ĵᵀc ≈ 0
    assert float(torch.from_numpy(unit.T @ (1.0 + y)).norm()) <= 1e-7 * (1.0 + y).sum()
    bound = 1e-4 if dtype == torch.float32 else 1e-5
    assert float(UPGrad()(rows).double().norm()) <= bound * mean_norm
    assert float(DualProj()(rows).double().norm()) <= bound * mean_norm


def test_a_null_vector_positive_by_a_hair_is_no_certificate() -> None:
    # 512 sparse float32 rows (2 % of 200 coordinates, rank 200, eigenvalues well apart from
    # zero): the exact search found a null vector whose least entry was 1e-8 of its largest
    # in the float32 Gramian's rounding. Certified, DualProj's weights reached 1e5 and its
    # update 1.3e4 times the mean's size, where the exact projection (scipy's NNLS on the
    # rows in float64) is 0.14 of it; the certificate needs CERTIFICATE_MIN_RATIO now.
    from gradbalance.balancers import DualProj

    k, p = 512, 200
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(k, p, generator=gen) * (torch.rand(k, p, generator=gen) < 0.02)
    g = rows.double()
    ref = nnls_dual_cone(g, torch.full((k,), 1.0 / k, dtype=F64))
    got = DualProj()(rows).double()
    assert float(ref.norm()) > 0.1 * float(g.mean(dim=0).norm())  # a non-zero projection
    assert_same_update(got, ref, g)
