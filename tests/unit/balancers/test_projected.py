"""The accelerated projected-gradient start of the box pivoting (``_projected.py``): FISTA's
point against scipy's NNLS on the same problem, the scaled start's point against the
unscaled FISTA's, and UPGrad's update with and without the start (the pivoting decides
either way)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradbalance.balancers import _boxqp, _projected
from gradbalance.balancers._solvers import trace_normalized
from gradbalance.balancers._upgrad import upgrad_weights
from support.balancers import outlying
from support.many_kinds import assert_same_update

F64 = torch.float64


@settings(max_examples=12, deadline=None)
@given(st.integers(3, 40), st.integers(0, 2**16))
def test_fista_reaches_the_nnls_solution(k: int, seed: int) -> None:
    """``min ½ yᵀQy + shiftᵀy``, ``y ≥ 0`` with ``Q = JJᵀ`` of random rows (``P = 4K``: a
    condition number below 10): after 300 steps ``y`` is scipy's NNLS solution of
    ``min ‖Jᵀ(y + l)‖``, ``y ≥ 0`` (``shift = Q l``), ``free`` where it is positive and
    ``yq = yQ``."""
    gen = torch.Generator().manual_seed(seed)
    j = torch.randn(k, 4 * k, generator=gen, dtype=F64)
    q = j @ j.T
    lower = torch.randn(3, k, generator=gen, dtype=F64)
    shift = lower @ q
    lam = torch.linalg.eigvalsh(q)
    from scipy.optimize import nnls

    refs = [torch.from_numpy(nnls(j.T.numpy(), -(j.T @ lower[i]).numpy(), maxiter=10_000)[0])
            for i in range(3)]
    for bottom in (0.0, float(lam[0])):  # FISTA's tₖ, the strongly convex momentum
        free, y, yq = _projected.fista(q, shift, float(lam[-1]), steps=300, bottom=bottom)
        for i, ref_t in enumerate(refs):
            assert torch.allclose(y[i], ref_t, atol=1e-7 * (float(ref_t.abs().max()) + 1.0))
        assert torch.allclose(yq, y @ q)
        assert torch.equal(free, y > 0)


@pytest.mark.parametrize(("k", "seed", "shared", "spread"),
                         [(64, 0, 0.0, 0.0), (96, 1, 0.0, 1.4), (80, 2, 0.3, 0.0),
                          (72, 3, 2.0, 0.0), (70, 4, 2.0, 1.4)])
def test_upgrad_is_the_same_with_and_without_the_start(k: int, seed: int, shared: float,
                                                       spread: float) -> None:
    """UPGrad's update (K ≥ 64: the conjugate-gradient pivoting) with the projected start
    forced on every Gramian, with it forced off, and as chosen: the same update, on rows
    with no shared direction (the start's case) and with one (a start far from the
    optimum: the pivoting still reaches it), norms equal or spread over ``10^±spread``
    (the start's diagonal scaling; below 1e3 the Gramian is solved as given)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(k, 4 * k, generator=gen, dtype=F64)
    g = g + shared * torch.randn(k, 1, generator=gen, dtype=F64) * torch.randn(
        4 * k, generator=gen, dtype=F64)
    g = g * torch.logspace(-spread, spread, k, dtype=F64)[torch.randperm(k, generator=gen), None]
    gram = g @ g.T
    chosen = upgrad_weights(gram) @ g
    for forced in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_projected, "PROJECTED_MAX_KAPPA", 1e30 if forced else 0.0)
            assert_same_update(upgrad_weights(gram) @ g, chosen, g)
    q, _ = trace_normalized(gram)
    assert q.shape[0] >= _boxqp.CG_MIN_SIZE


@settings(max_examples=16, deadline=None)
@given(st.integers(5, 30), st.integers(0, 2**16), st.integers(0, 3))
def test_scaled_start_is_the_problem_s_solution(k: int, seed: int, outliers: int) -> None:
    """:func:`~._projected.projected_start` on ``SQS`` with a scaling ``S`` and none, one
    (``c vvᵀ``) or several (``V diag(c) Vᵀ``, the semismooth Newton prox) of its top
    eigenpairs in the prox: after 400 steps ``y``, mapped back, is scipy's NNLS solution of
    the unscaled problem (``min ‖Jᵀ(y + l)‖``, ``y ≥ 0``) and ``yq = yQ``."""
    from scipy.optimize import nnls

    gen = torch.Generator().manual_seed(seed)
    j = torch.randn(k, 4 * k, generator=gen, dtype=F64)
    j *= torch.logspace(-1, 1, k, dtype=F64)[:, None]
    q = j @ j.T
    lower = torch.rand(2, k, generator=gen, dtype=F64)
    scale = torch.diagonal(q).rsqrt()
    scaled = q * scale[:, None] * scale[None, :]
    v: torch.Tensor | None = None
    c: float | torch.Tensor = 0.0
    if outliers:  # the scaled Q's top eigenpairs taken out of the gradient, into the prox
        lam, vec = torch.linalg.eigh(scaled)
        excess = lam[-outliers:] - lam[:-outliers].mean()
        if bool((excess > 0.0).all()):
            v, c = vec[:, -outliers:], excess
            if outliers == 1:
                v, c = v[:, 0], float(excess[0])
    top = _projected.bulk_top(scaled, v, c)
    bulk = scaled
    if v is not None:
        vm = v if v.dim() == 2 else v[:, None]
        bulk = scaled - (vm * torch.as_tensor(c, dtype=F64).reshape(-1)) @ vm.T
    bottom = float(torch.linalg.eigvalsh(bulk)[0]) if seed % 2 else 0.0  # either momentum
    start = _projected.Plan(scale, top, v, c, bottom)
    free, y, yq = _projected.projected_start(q, lower @ q, start, steps=400)
    assert torch.equal(free, y > 0)
    for i in range(2):
        ref, _ = nnls(j.T.numpy(), -(j.T @ lower[i]).numpy(), maxiter=10_000)
        ref_t = torch.from_numpy(ref)
        assert torch.allclose(y[i], ref_t, atol=1e-6 * (float(ref_t.abs().max()) + 1.0))
    assert torch.allclose(yq, y @ q, rtol=1e-9, atol=1e-9 * float(yq.abs().max()))


@settings(max_examples=10, deadline=None)
@given(st.integers(3, 60), st.integers(0, 2**16))
def test_bulk_bottom_is_the_smallest_eigenvalue_from_above(k: int, seed: int) -> None:
    """``λ_min(SBS)`` from the power steps on ``S⁻¹B⁻¹S⁻¹``: at least the eigenvalue (a
    Rayleigh quotient of the inverse is below its top), and near it on random rows'
    Gramians (``P = 4K``: within 1.37× on 300 seeds; 4× asserted)."""
    gen = torch.Generator().manual_seed(seed)
    j = torch.randn(k, 4 * k, generator=gen, dtype=F64)
    j *= torch.logspace(-1, 1, k, dtype=F64)[torch.randperm(k, generator=gen), None]
    b = j @ j.T
    scale = torch.diagonal(b).rsqrt()
    true = float(torch.linalg.eigvalsh(b * scale[:, None] * scale[None, :])[0])
    bottom = _projected._bulk_bottom(torch.linalg.inv(b), scale.reciprocal())
    assert true * (1 - 1e-9) <= bottom <= 4.0 * true


def _shared_direction_rows(k: int, p: int, seed: int, shared: int = 1) -> torch.Tensor:
    """``Σⱼ aᵢⱼ sⱼ + nᵢ/2`` (``shared`` directions, each shared to different degrees with
    conflicting signs, as tasks in clusters)."""
    gen = torch.Generator().manual_seed(seed)
    directions = torch.randn(shared, p, generator=gen, dtype=F64)
    return (torch.randn(k, shared, generator=gen, dtype=F64) @ directions
            + 0.5 * torch.randn(k, p, generator=gen, dtype=F64))


def _cosine_and_deflation(rows: torch.Tensor,
                          m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trace-normalised cosine matrix of ``rows`` and its ``m`` top eigenpairs as the
    preconditioner deflates them (``V``, ``c = λⱼ − μ``)."""
    gram = rows @ rows.T
    d = torch.diagonal(gram).sqrt()
    q = gram / torch.outer(d, d) / rows.shape[0]
    lam, vec = torch.linalg.eigh(q)
    mean = float(lam[:-m].mean())
    return q, vec[:, -m:], lam[-m:] - mean


@settings(max_examples=12, deadline=None)
@given(st.integers(12, 96), st.integers(0, 2**16), st.floats(0.0, 1.0), st.integers(1, 3))
def test_scaled_outliers_are_the_scaled_matrix_s_top_eigenpairs(k: int, seed: int,
                                                               spread: float, m: int) -> None:
    """:func:`~._projected._scaled_outliers` on the cosine matrix of rows sharing ``m``
    directions (``S`` the bulk's scaling, far from a multiple of the identity): ``U`` spans
    the top ``m`` eigenvectors of ``SQS`` (eigh), ``c̃ⱼ = λⱼ − μ`` with ``μ`` the mean of
    the other eigenvalues, and ``SQS − U diag(c̃) Uᵀ`` is positive semi-definite with top
    eigenvalue ``max(λ_{m+1}, μ)`` (the bulk's, no part of an outlier left behind)."""
    rows = _shared_direction_rows(k, 8 * k, seed, m)
    rows *= torch.logspace(-spread, spread, k, dtype=F64)[:, None]
    q, v, c = _cosine_and_deflation(rows, m)
    scale = (torch.diagonal(q) - (v * v) @ c).rsqrt()
    found = _projected._scaled_outliers(q, scale, v * scale[:, None], c)
    assert found is not None
    u, weight = found
    u = u[:, None] if u.dim() == 1 else u
    weight_t = torch.as_tensor(weight, dtype=F64).reshape(-1)
    scaled = q * scale[:, None] * scale[None, :]
    lam_s, vec_s = torch.linalg.eigh(scaled)
    top = vec_s[:, -m:]
    assert float(torch.linalg.matrix_norm(top.T @ u, 2)) >= 1 - 1e-9  # the same subspace
    assert float(torch.linalg.svdvals(top.T @ u).min()) >= 1 - 1e-6
    mu = float(lam_s[:-m].mean())
    torch.testing.assert_close(weight_t.sort().values, (lam_s[-m:] - mu).sort().values,
                               rtol=1e-7, atol=0.0)
    rest = torch.linalg.eigvalsh(scaled - (u * weight_t) @ u.T)
    assert float(rest[0]) >= -1e-12 * float(lam_s[-1])
    assert float(rest[-1]) == pytest.approx(max(float(lam_s[-m - 1]), mu), rel=1e-6)


@pytest.mark.parametrize(("k", "seed", "shared"), [(128, 0, 1), (192, 1, 1), (160, 2, 2),
                                                   (192, 3, 3)])
def test_start_on_the_cosine_matrix_is_near_the_optimal_free_sets(k: int, seed: int,
                                                                  shared: int) -> None:
    """UPGrad's problems on the cosine matrix of rows sharing one to three directions to
    different degrees (``P = 8K``), as the pivoting plans them (:func:`~._projected.plan`
    with the deflated preconditioner: the shared directions' eigenvalues, those before the
    spectrum's gap, deflated, not the top of the bulk below them): a plan is made, and
    FISTA's steps leave at most 0.2 % of the indices off the optimal free sets (scipy's NNLS
    per problem, independently). With ``Q``'s own eigenvector scaled in place of ``SQS``'s
    (the previous plan) 0.6 % were off at these sizes for one direction (``λ₁`` of the
    gradient part 3.7 against 1.7), a quarter at K = 1,024; with two or more there was no
    plan (the pivoting started from the all-free side, about 50 indices per problem off)."""
    from scipy.optimize import nnls

    from gradbalance.balancers._precond import deflated

    rows = _shared_direction_rows(k, 8 * k, seed, shared)
    gram = rows @ rows.T
    d = torch.diagonal(gram).sqrt()
    q = gram / torch.outer(d, d) / k
    lower = torch.eye(k, dtype=F64)
    pre = deflated(q, torch.linalg.inv(q))
    assert pre.v is not None and pre.v.shape[1] == outlying(q) == shared
    start = _projected.plan(q, pre)
    assert start is not None
    free, _, _ = _projected.projected_start(q.float(), (lower @ q).float(), start)
    unit = (rows / d[:, None]).numpy()
    off = 0
    for i in range(k):  # v = eᵢ + y, y ≥ 0 minimising ‖Jᵀv‖: y solves the NNLS below
        ref, _ = nnls(unit.T, -unit[i], maxiter=10_000)
        off += int((free[i] ^ torch.from_numpy(ref > 1e-9 * max(ref.max(), 1.0))).sum())
    assert off <= 0.002 * k * k


@pytest.mark.parametrize(("k", "seed", "shared"), [(72, 0, 2), (90, 1, 3), (100, 2, 4)])
def test_upgrad_is_the_same_with_the_start_on_several_directions(k: int, seed: int,
                                                                 shared: int) -> None:
    """UPGrad's update on rows sharing two to four directions (the plan's several outliers
    in the prox), norms spread over ``10^±1.4`` (the cosine matrix): the same with the start
    forced off and as chosen, and equal to scipy's NNLS projections summed."""
    from support.balancers import nnls_dual_cone

    rows = _shared_direction_rows(k, 4 * k, seed, shared)
    gen = torch.Generator().manual_seed(seed + 7)
    rows *= torch.logspace(-1.4, 1.4, k, dtype=F64)[torch.randperm(k, generator=gen), None]
    gram = rows @ rows.T
    chosen = upgrad_weights(gram) @ rows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_projected, "PROJECTED_MAX_KAPPA", 0.0)
        assert_same_update(upgrad_weights(gram) @ rows, chosen, rows)
    eye = torch.eye(k, dtype=F64)
    reference = torch.stack([nnls_dual_cone(rows, eye[i]) for i in range(k)]).mean(dim=0)
    assert_same_update(chosen, reference, rows)


def test_several_outliers_leave_a_non_finite_row_to_itself() -> None:
    """A row of ``shift`` that is not finite (a float32 overflow upstream) does not stop the
    prox's batched Newton solves (``solve_ex``: no raise) nor move the other rows."""
    gen = torch.Generator().manual_seed(5)
    j = torch.randn(20, 80, generator=gen, dtype=F64)
    q = j @ j.T
    lam, vec = torch.linalg.eigh(q)
    v, c = vec[:, -2:], lam[-2:] - lam[:-2].mean()
    top = _projected.bulk_top(q, v, c)
    shift = torch.randn(4, 20, generator=gen, dtype=F64) @ q
    clean = _projected.fista(q, shift, top, v, c, steps=30)
    shift[0, 3] = float("nan")
    dirty = _projected.fista(q, shift, top, v, c, steps=30)
    for a, b in zip(clean, dirty, strict=True):
        torch.testing.assert_close(b[1:], a[1:], rtol=1e-12, atol=1e-12)
    assert not bool(torch.isfinite(dirty[1][0]).all())


@pytest.mark.parametrize(("top", "bottom", "steps"),
                         [(1.4, 0.66, 8), (2.5, 1.0, 8), (10.0, 1.0, 16), (34.0, 1.0, 30),
                          (1000.0, 1.0, 32), (5.0, 0.0, 8)])
def test_start_steps_grow_as_the_root_of_the_condition_number(top: float, bottom: float,
                                                               steps: int) -> None:
    """FISTA's steps: eight up to ``κ = top/bottom = 2.5`` (or ``bottom`` unknown), then
    ``⌈8 √(κ/2.5)⌉`` (``κ = 10``: 16; ``κ = 34``: ``⌈29.5⌉``), at most 32 — by hand from
    the rule, FISTA's ``√κ`` rate."""
    plan = _projected.Plan(torch.ones(3, dtype=F64), top, bottom=bottom)
    assert _projected.start_steps(plan) == steps
