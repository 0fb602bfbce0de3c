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


@settings(max_examples=10, deadline=None)
@given(st.integers(3, 30), st.integers(0, 2**16), st.booleans())
def test_scaled_start_is_the_problem_s_solution(k: int, seed: int, outlier: bool) -> None:
    """:func:`~._projected.projected_start` on ``SQS`` with a scaling ``S`` and, optionally,
    one outlier ``c vvᵀ`` in the prox: after 400 steps ``y``, mapped back, is scipy's NNLS
    solution of the unscaled problem (``min ‖Jᵀ(y + l)‖``, ``y ≥ 0``) and ``yq = yQ``."""
    from scipy.optimize import nnls

    gen = torch.Generator().manual_seed(seed)
    j = torch.randn(k, 4 * k, generator=gen, dtype=F64)
    j *= torch.logspace(-1, 1, k, dtype=F64)[:, None]
    q = j @ j.T
    lower = torch.rand(2, k, generator=gen, dtype=F64)
    scale = torch.diagonal(q).rsqrt()
    scaled = q * scale[:, None] * scale[None, :]
    v, c = None, 0.0
    if outlier:  # the scaled Q's top eigenpair taken out of the gradient, into the prox
        lam, vec = torch.linalg.eigh(scaled)
        v, c = vec[:, -1], float(lam[-1] - lam[:-1].mean())
        if c <= 0.0:
            v, c = None, 0.0
    top = _projected.bulk_top(scaled, v, c)
    bulk = scaled if v is None else scaled - c * torch.outer(v, v)
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


def _shared_direction_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """``aᵢ s + nᵢ/2`` (one direction shared to different degrees, signs conflicting)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(p, generator=gen, dtype=F64)
    return (torch.randn(k, 1, generator=gen, dtype=F64) * shared
            + 0.5 * torch.randn(k, p, generator=gen, dtype=F64))


@settings(max_examples=10, deadline=None)
@given(st.integers(8, 96), st.integers(0, 2**16), st.floats(0.0, 1.0))
def test_scaled_outlier_is_the_scaled_matrix_s_top_eigenpair(k: int, seed: int,
                                                             spread: float) -> None:
    """:func:`~._projected._scaled_outlier` on the cosine matrix of rows sharing one
    direction (``S`` the bulk's scaling, far from a multiple of the identity): ``u`` is the
    top eigenvector of ``SQS`` (eigh), ``c̃ = λ₁ − μ`` with ``μ`` the mean of the other
    eigenvalues, and ``SQS − c̃uuᵀ`` positive semi-definite with top eigenvalue ``λ₂`` (the
    bulk's, not a part of the outlier left behind)."""
    rows = _shared_direction_rows(k, 8 * k, seed)
    rows *= torch.logspace(-spread, spread, k, dtype=F64)[:, None]
    gram = rows @ rows.T
    d = torch.diagonal(gram).sqrt()
    q = gram / torch.outer(d, d) / k
    lam, vec = torch.linalg.eigh(q)
    v, c = vec[:, -1], float(lam[-1] - lam[:-1].mean())
    scale = (torch.diagonal(q) - c * v * v).rsqrt()
    u, weight = _projected._scaled_outlier(q, scale, v * scale, c)
    scaled = q * scale[:, None] * scale[None, :]
    lam_s, vec_s = torch.linalg.eigh(scaled)
    assert float((u @ vec_s[:, -1]).abs()) >= 1 - 1e-9
    assert weight == pytest.approx(float(lam_s[-1] - lam_s[:-1].mean()), rel=1e-9)
    rest = torch.linalg.eigvalsh(scaled - weight * torch.outer(u, u))
    assert float(rest[0]) >= -1e-12 * float(lam_s[-1])
    assert float(rest[-1]) == pytest.approx(max(float(lam_s[-2]), float(lam_s[:-1].mean())),
                                            rel=1e-6)


@pytest.mark.parametrize(("k", "seed"), [(128, 0), (192, 1)])
def test_start_on_the_cosine_matrix_is_near_the_optimal_free_sets(k: int, seed: int) -> None:
    """UPGrad's problems on the cosine matrix of rows sharing one direction to different
    degrees (``P = 8K``), as the pivoting plans them (:func:`~._projected.plan` with the
    deflated preconditioner): FISTA's ``PROJECTED_STEPS`` steps leave at most 0.2 % of the
    indices off the optimal free sets (scipy's NNLS per problem, independently). With
    ``Q``'s own eigenvector scaled in place of ``SQS``'s (the previous plan) 0.6 % were off
    at these sizes (``λ₁`` of the gradient part 3.7 against 1.7), a quarter at K = 1,024."""
    from scipy.optimize import nnls

    from gradbalance.balancers._precond import deflated

    rows = _shared_direction_rows(k, 8 * k, seed)
    gram = rows @ rows.T
    d = torch.diagonal(gram).sqrt()
    q = gram / torch.outer(d, d) / k
    lower = torch.eye(k, dtype=F64)
    start = _projected.plan(q, deflated(q, torch.linalg.inv(q)))
    assert start is not None
    free, _, _ = _projected.projected_start(q.float(), (lower @ q).float(), start)
    unit = (rows / d[:, None]).numpy()
    off = 0
    for i in range(k):  # v = eᵢ + y, y ≥ 0 minimising ‖Jᵀv‖: y solves the NNLS below
        ref, _ = nnls(unit.T, -unit[i], maxiter=10_000)
        off += int((free[i] ^ torch.from_numpy(ref > 1e-9 * max(ref.max(), 1.0))).sum())
    assert off <= 0.002 * k * k
