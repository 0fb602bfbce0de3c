"""UPGrad's and DualProj's projections on low-rank Gramians, solved in the rank's dimension
(``balancers/_low_rank.py``), against scipy's NNLS on the rows and the optimality
conditions on the rows: rows in a random low-dimensional span (norms spanning ``1e-3 …
1e3``, some zero) and per-sample-like rows (``[B, T]`` objectives, each sample's ``T`` rows
parallel: a ``[B·T, B·T]`` Gramian of rank ``B``); the same kinds with their Gramian
multiplied in float32 (low rank up to its rounding: near duplicates, norms ``1e-6 … 1e6``,
an ill-conditioned per-sample Gramian under the parallel blocks), against scipy on the
rounded rows to the bound of the rounding cut."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import _cone, _low_rank
from gradbalance.balancers._active_set import SCHUR_RTOL_PER_ROW
from gradbalance.balancers._solvers import project_dual_cone, trace_normalized
from support.balancers import nnls_dual_cone
from support.many_kinds import KIND_NAMES, assert_same_update, kind_rows

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")  # K ≤ 100: one thread is faster


def _span_rows(k: int, r: int, seed: int) -> Tensor:
    """``[K, P]`` rows in a random ``r``-dimensional span, norms ``1e-3 … 1e3``, a few zero."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(k, r, generator=gen, dtype=F64) @ torch.randn(r, 3 * k, generator=gen,
                                                                  dtype=F64)
    g *= torch.logspace(-3, 3, k, dtype=F64)[torch.randperm(k, generator=gen)][:, None]
    g[torch.randperm(k, generator=gen)[: k // 8]] = 0.0
    return g


def _per_sample_rows(b: int, t: int, seed: int) -> Tensor:
    """``[B·T, P]``: sample ``i``'s ``T`` task gradients ``sᵢₜ uᵢ`` (parallel or opposed)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(b, 4 * b * t, generator=gen, dtype=F64)
    s = torch.randn(b, t, generator=gen, dtype=F64)
    return (s[:, :, None] * u[:, None, :]).reshape(b * t, -1)


def _check_against_scipy(g: Tensor, seed: int) -> None:
    """UPGrad's K bounds ``pᵢeᵢ`` and DualProj's ``p`` (random positive ``p``): the update
    ``Jᵀv`` scipy's (cosine ≥ 0.999999, norm within 1e-6), ``v ≥ u``, in the dual cone: to
    ``1e-9`` of ``‖gₖ‖ Σ uᵢ‖gᵢ‖`` on the dense route, to the ``√(4·eps·K)`` by which the
    low-rank route's factor moves a row where it ran (docs/balancers.md, "Solvers": copies
    closer than that are one direction to it; K = 52, copies 2e-8 apart: −2.5e-9)."""
    k = g.shape[0]
    pref = torch.rand(k, generator=torch.Generator().manual_seed(seed), dtype=F64) + 0.1
    u = torch.cat([torch.diag(pref), pref[None]])
    gram, trace = trace_normalized(g @ g.T)
    with pytest.MonkeyPatch.context() as mp:
        routed = _routed_ranks(mp)
        v = project_dual_cone(gram, u)
    floor = (4 * torch.finfo(F64).eps * k) ** 0.5 if routed else 1e-9
    unit = g / trace.sqrt()
    norms = g.norm(dim=1)
    for i in range(u.shape[0]):
        x = v[i] @ g
        assert_same_update(x, nnls_dual_cone(unit, u[i]) * trace.sqrt(), g)
        assert bool((v[i] >= u[i] * (1 - 1e-12)).all())
        size = float((u[i] * norms).sum())
        assert float((g @ x / (norms * size).clamp_min(1e-300)).min()) >= -floor


def _routed_ranks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ranks :func:`~._low_rank.low_rank_box` is called with, recorded."""
    seen: list[int] = []
    solve = _low_rank.low_rank_box

    def spy(factor: Tensor, *args: object) -> tuple[Tensor, Tensor]:
        seen.append(factor.shape[1])
        return solve(factor, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_low_rank, "low_rank_box", spy)
    return seen


@settings(max_examples=20, deadline=None)
@given(st.integers(19, 64), st.integers(1, 8), st.integers(0, 2**16))
def test_span_rows_take_the_rank_and_match_scipy(k: int, r: int, seed: int) -> None:
    """Rows of rank ``r ≤ n/8`` (``n`` non-zero rows) are solved in ``r`` dimensions, with
    scipy's updates."""
    r = max(1, min(r, (k - k // 8) // 8))
    with pytest.MonkeyPatch.context() as mp:
        seen = _routed_ranks(mp)
        _check_against_scipy(_span_rows(k, r, seed), seed)
    assert seen and seen[0] == r


@settings(max_examples=12, deadline=None)
@given(st.integers(2, 8), st.integers(8, 12), st.integers(0, 2**16))
def test_per_sample_rows_take_the_rank_and_match_scipy(b: int, t: int, seed: int) -> None:
    """``[B, T]`` objectives with parallel rows per sample: rank ``B``, scipy's updates."""
    with pytest.MonkeyPatch.context() as mp:
        seen = _routed_ranks(mp)
        _check_against_scipy(_per_sample_rows(b, t, seed), seed)
    assert seen == [b]


def _near_duplicate_rows(k: int, r: int, log_delta: float, seed: int) -> Tensor:
    """``K/2`` rows of rank ``r`` in a half-space (a positive leading coefficient: a
    non-trivial update) and their copies moved by ``10^log_delta`` of their norm, norms
    ``1e-2 … 1e2``: the cut-off ``4·eps·K`` falls between the copies or above them."""
    gen = torch.Generator().manual_seed(seed)
    coef = torch.randn(k // 2, r, generator=gen, dtype=F64)
    coef[:, 0] = coef[:, 0].abs() + 1.0
    base = coef @ torch.randn(r, 3 * k, generator=gen, dtype=F64)
    noise = torch.randn(k // 2, 3 * k, generator=gen, dtype=F64) / (3 * k) ** 0.5
    g = torch.cat([base, base + 10**log_delta * base.norm(dim=1, keepdim=True) * noise])
    return g * torch.logspace(-2, 2, k, dtype=F64)[torch.randperm(k, generator=gen)][:, None]


@settings(max_examples=10, deadline=None)
@given(st.integers(10, 32), st.integers(1, 3), st.floats(-8.0, -6.0), st.integers(0, 2**16))
def test_near_duplicates_around_the_cut_match_scipy(half: int, r: int, log_delta: float,
                                                     seed: int) -> None:
    """Copies closer than the cut-off (routed at rank ``r``) or farther (dense): scipy's
    updates either way."""
    _check_against_scipy(_near_duplicate_rows(2 * half, r, log_delta, seed), seed)


@settings(max_examples=20, deadline=None)
@given(st.integers(16, 48), st.integers(1, 12), st.integers(0, 2**16))
def test_pivoted_cholesky_reveals_the_rank(k: int, r: int, seed: int) -> None:
    """Rank ``r`` by construction: ``r`` columns, the residual positive semi-definite with
    its diagonal within ``τ Qᵢᵢ``; None when ``r`` exceeds the allowed rank."""
    g = _span_rows(k, r, seed)
    q = g @ g.T
    factor = _low_rank.pivoted_cholesky(q, k)
    assert factor is not None
    # r columns above the rounding of the longest row; more only at it: the stop is relative
    # to each row's own diagonal, and a row 1e6 shorter than the longest keeps a residual of
    # the longest's rounding (K = 17, r = 11, seed 234: a 12th column of norm² 5e-16 against
    # a largest diagonal of 6e8)
    above = factor.norm(dim=0).square() > 64 * torch.finfo(F64).eps * k * float(q.diagonal().max())
    assert int(above.sum()) == r and bool(above[:r].all())
    resid = q - factor @ factor.T
    scale = float(torch.diagonal(q).max())
    assert float(torch.linalg.eigvalsh(resid).min()) >= -1e-12 * k * scale
    assert bool((torch.diagonal(resid) <= SCHUR_RTOL_PER_ROW * k * torch.diagonal(q)
                 + 1e-12 * scale).all())
    assert _low_rank.pivoted_cholesky(q, r - 1) is None


def test_open_problems_fall_back_to_the_dense_solve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Problems the low-rank route leaves open are solved densely: scipy's updates still."""
    def none_done(factor: Tensor, lower: Tensor, *args: object) -> tuple[Tensor, Tensor]:
        done = torch.zeros(lower.shape[0], dtype=torch.bool)
        done[0] = True
        out = lower.clone()
        out[0] = _low_rank_box(factor, lower[:1], *args)[0][0]  # type: ignore[arg-type]
        return out, done

    _low_rank_box = _low_rank.low_rank_box
    monkeypatch.setattr(_low_rank, "low_rank_box", none_done)
    assert _cone.low_rank_projection is _low_rank.low_rank_projection
    _check_against_scipy(_span_rows(32, 3, 5), 5)


# -- low rank up to rounding: a Gramian multiplied in float32 ------------------------------
def _rounded(g: Tensor) -> tuple[Tensor, Tensor]:
    """``(rows, gram)``: the rows rounded to float32 (as float64, the references' input) and
    their Gramian by :func:`~gradbalance.gramian.compute_gramian` (multiplied in float32:
    rounded near ``10⁻⁷`` of its entries, far above the exact cut-off)."""
    from gradbalance.gramian import compute_gramian

    rows32 = g.to(torch.float32)
    return rows32.to(F64), compute_gramian(rows32)


def _half_space_rows(k: int, r: int, seed: int) -> Tensor:
    """``[K, P]`` rows of rank ``r`` with a positive leading coefficient (a non-trivial
    update), adjacent pairs ``1e-6`` apart, norms ``1e-6 … 1e6``, a few zero."""
    gen = torch.Generator().manual_seed(seed)
    coef = torch.randn(k, r, generator=gen, dtype=F64)
    coef[:, 0] = coef[:, 0].abs() + 0.5
    g = coef @ torch.randn(r, 3 * k, generator=gen, dtype=F64)
    g[1::2] = g[0:k - 1:2] * (1 + 1e-6 * torch.randn(k // 2, 3 * k, generator=gen, dtype=F64))
    g *= torch.logspace(-6, 6, k, dtype=F64)[torch.randperm(k, generator=gen)][:, None]
    g[torch.randperm(k, generator=gen)[: k // 8]] = 0.0
    return g


def _ill_per_sample_rows(b: int, t: int, seed: int) -> Tensor:
    """``[B·T, P]``: sample ``i``'s ``T`` rows ``sᵢₜ hᵢ`` (parallel, norms ``0.1 … 10``, a
    third of them opposed) over per-sample gradients ``hᵢ`` whose ``[B, B]`` Gramian has
    condition number ``1e12``."""
    gen = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(b, b, generator=gen, dtype=F64))[0]
    span = torch.linalg.qr(torch.randn(4 * b * t, b, generator=gen, dtype=F64))[0]
    h = (basis * torch.logspace(0, -6, b, dtype=F64)) @ span.T
    s = torch.rand(b, t, generator=gen, dtype=F64) * torch.logspace(-1, 1, t, dtype=F64)
    s = torch.where(torch.rand(b, t, generator=gen) < 1 / 3, -s, s)
    return (s[:, :, None] * h[:, None, :]).reshape(b * t, -1)


def _scipy_unit(rows: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """``(x*, s*)``: ``Jᵀu`` projected onto ``{x : Jx ≥ 0}`` by scipy's NNLS over the unit
    rows ``ĝₖ`` (``x* = Jᵀu + Σ yₖ ĝₖ``), and its weights on them, ``s* = D u + y``."""
    from scipy.optimize import nnls

    norms = rows.norm(dim=1)
    live = norms > 0
    unit = torch.zeros_like(rows)
    unit[live] = rows[live] / norms[live, None]
    a = rows.T @ u
    y, _ = nnls(unit[live].T.numpy(), -a.numpy(), maxiter=10_000)
    s = norms * u
    s[live] += torch.from_numpy(y)
    return s @ unit, s


def _check_rounded(g: Tensor, seed: int, strict: bool) -> list[int]:
    """UPGrad's and DualProj's problems on the float32-rounded Gramian of ``g`` against
    scipy's on the rounded rows: ``‖x − x*‖² ≤ 3ε(‖s‖² + ‖s*‖²)`` (``_low_rank``'s bound,
    ``ε = ‖C − C*‖₂`` the cosine matrix's rounding, ``s`` the weights on the unit rows; plus
    ``1e-8 Σ|s|`` for the solvers' own tolerance), and with ``strict`` the same update
    (:func:`assert_same_update`); the ranks the low-rank route took."""
    rows, gram = _rounded(g)
    k = rows.shape[0]
    pref = torch.rand(k, generator=torch.Generator().manual_seed(seed), dtype=F64) + 0.1
    u = torch.cat([torch.diag(pref), pref[None]])
    with pytest.MonkeyPatch.context() as mp:
        seen = _routed_ranks(mp)
        v = project_dual_cone(trace_normalized(gram)[0], u)
    norms, exact = torch.diagonal(gram).sqrt(), rows.norm(dim=1)
    live = (norms > 0) & (exact > 0)
    cos = gram[live][:, live] / torch.outer(norms[live], norms[live])
    cos_exact = rows[live] @ rows[live].T / torch.outer(exact[live], exact[live])
    eps = float(torch.linalg.matrix_norm(cos - cos_exact, ord=2))
    for i in range(u.shape[0]):
        x = v[i] @ rows
        ref, s_ref = _scipy_unit(rows, u[i])
        s = v[i] * exact
        bound = (3 * eps * float(s @ s + s_ref @ s_ref)) ** 0.5 + 1e-8 * float(s.abs().sum())
        assert float((x - ref).norm()) <= bound
        assert bool((v[i] >= u[i] * (1 - 1e-12)).all())
        if strict:
            assert_same_update(x, ref, rows)
    return seen


@settings(max_examples=12, deadline=None)
@given(st.integers(24, 64), st.integers(1, 4), st.integers(0, 2**16))
def test_rounded_low_rank_takes_its_rank_and_matches_scipy(k: int, r: int, seed: int) -> None:
    """Rank ``r`` rows with near duplicates, norms ``1e-6 … 1e6`` and zero rows, their
    Gramian multiplied in float32: the pivots stop at the gate, the eigen-factor cut at the
    rounding has rank ``r`` (the copies ``1e-6`` apart are below the rounding), and the
    updates are scipy's on the rounded rows to the rounding's bound (the rank within an
    eighth of the non-zero rows, whose cosine matrix the route reads: K = 24 has 21). Not the
    same update to 1e-6: pairs 1e-6 apart are one direction to the float32 Gramian, whose
    split between them the bound, ``√ε``, leaves open (K = 46, seed 1: 4.5e-4 of the update
    off scipy's, a tenth of the bound)."""
    r = min(r, (k - k // 8) // 8)
    g = _half_space_rows(k, r, seed)
    assert _check_rounded(g, seed, strict=False) == _expected_route(g, r, seed)


def _expected_route(g: Tensor, r: int, seed: int) -> list[int]:
    """``[r]``, or no route where fewer than two of :func:`_check_rounded`'s problems lie
    outside the dual cone: a problem ``u`` whose ``uG ≥ 0`` is its own projection (the KKT
    point ``v = u``), and one problem alone takes the dense solve below
    ``ONE_PROBLEM_MIN_SIZE`` tasks (a Gramian without a negative entry has none outside)."""
    gram = _rounded(g)[1]
    k = gram.shape[0]
    pref = torch.rand(k, generator=torch.Generator().manual_seed(seed), dtype=F64) + 0.1
    u = torch.cat([torch.diag(pref), pref[None]])
    outside = int(((u @ gram) < 0).any(dim=1).sum())
    return [r] if outside >= 2 else []


@settings(max_examples=8, deadline=None)
@given(st.integers(2, 8), st.integers(2, 9), st.integers(0, 2**16))
def test_parallel_per_sample_blocks_match_scipy(b: int, t: int, seed: int) -> None:
    """``[B, T]`` objectives from one output: each sample's ``T`` rows parallel or opposed,
    over an ill-conditioned per-sample Gramian, multiplied in float32: scipy's updates to the
    bound of the rounding (opposed rows cancel: no relative test), routed in at most ``B``
    dimensions where the route applies."""
    seen = _check_rounded(_ill_per_sample_rows(b, t, seed), seed, strict=False)
    assert all(r <= b for r in seen)
    assert seen or t < 8 or b * t < _low_rank.LOW_RANK_MIN_SIZE  # rank ≤ B ≤ K/8: routed


def test_rounding_cut_is_the_larger_of_the_two() -> None:
    """The cut-off of :func:`~._boxqp.rounding_cut`, by hand: ``4·eps·n·λ_max`` where the
    matrix is positive semi-definite, ``rounding · |λ_min|`` where that is larger."""
    from gradbalance.balancers._boxqp import RANK_RTOL_PER_ROW, rounding_cut

    lam = torch.tensor([-1e-7, 0.0, 1e-9, 2.0], dtype=F64)
    assert rounding_cut(lam, 4, 2.0) == 2e-7
    assert rounding_cut(lam, 4, 0.0) == RANK_RTOL_PER_ROW * 4 * 2.0
    assert rounding_cut(lam.abs(), 4, 2.0) == RANK_RTOL_PER_ROW * 4 * 2.0


@settings(max_examples=15, deadline=None)
@given(st.integers(16, 48), st.sampled_from(KIND_NAMES), st.integers(0, 2**16))
def test_every_kind_rounded_to_float32_within_the_bound(k: int, kind: str, seed: int) -> None:
    """Every kind of the many-task check (``support.many_kinds``) with its Gramian multiplied
    in float32, whichever route it takes: scipy's updates on the rounded rows to the bound
    of the rounding."""
    _check_rounded(kind_rows(kind, k, 2 * k + 3, seed), seed, strict=False)


def test_rank_above_an_eighth_from_128_tasks_takes_its_rank() -> None:
    """K = 160 (140 non-zero rows), rank 24 (above ``K/8``, within ``K/4``) rounded to float32:
    routed at its rank from ``LOW_RANK_WIDE_SIZE`` tasks on, with scipy's updates."""
    g = _half_space_rows(160, 24, 3)
    assert _check_rounded(g, 3, strict=True) == _expected_route(g, 24, 3) == [24]
