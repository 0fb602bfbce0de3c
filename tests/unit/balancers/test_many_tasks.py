"""The many-task fast paths against slow exact references, up to K = 64.

UPGrad's batched projections pivot with conjugate-gradient solves (forced here from K = 2 on)
and are checked against the factorisation path and against the optimality conditions of
each projection; PCGrad's and GradVac's blocked passes (every block size, sparse and dense
refreshes) against a loop over the rows and a loop over the pairs on the Gramian;
TrimmedMean's ``topk`` path against the sort; PCD past 16 tasks against its KKT conditions.
Inputs: conflicting random rows, rank-deficient Gramians (``K ≫`` rank), near-duplicate
tasks, row norms spanning 1e-6 … 1e6, and all three at once (rank 8). Tolerance: the same
update, cosine ≥ 0.999999 and norm within 1e-6 relative, where the update is not below
``1e-9 Σₖ‖gₖ‖`` (a cancelling update is fixed by a Gramian only to its rounding,
``docs/balancers.md``); below that, a difference under ``1e-8 Σₖ‖gₖ‖``.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import (
    PCD,
    DualProj,
    GradDrop,
    GradVac,
    PCGrad,
    TrimmedMean,
    UPGrad,
    _boxqp,
    _pairwise,
)
from gradbalance.balancers._gradvac import gradvac_coefficients, gradvac_orders
from gradbalance.balancers._pcgrad import pcgrad_coefficients, pcgrad_orders
from gradbalance.balancers._solvers import trace_normalized
from gradbalance.balancers._trimmed_mean import trimmed_mean_update
from gradbalance.balancers._upgrad import upgrad_weights
from support.many_kinds import (
    assert_same_update,
    check_gradvac_pass,
    check_pcgrad_pass,
    gradvac_loop,
    pass_settings,
    pcgrad_loop,
)

F64 = torch.float64
KINDS = ["conflicting", "rank_deficient", "near_duplicates", "wide_norms", "rank8_mixed"]


def rows(kind: str, k: int, p: int, seed: int) -> Tensor:
    """``[K, P]`` float64 task gradients of one adversarial kind."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(p, generator=gen, dtype=F64)
    g = torch.randn(k, 1, generator=gen, dtype=F64) * shared
    g = g + 0.5 * torch.randn(k, p, generator=gen, dtype=F64)
    if kind == "rank_deficient":  # rank ≤ 3 whatever K
        g = torch.randn(k, 3, generator=gen, dtype=F64) @ torch.randn(3, p, generator=gen,
                                                                        dtype=F64)
    elif kind == "near_duplicates":  # pairs of tasks 1e-9 apart
        g[1::2] = g[0:k - 1:2] + 1e-9 * torch.randn(k // 2, p, generator=gen, dtype=F64)
    elif kind == "wide_norms":
        g = g * torch.logspace(-6, 6, k, dtype=F64)[torch.randperm(k, generator=gen)][:, None]
    elif kind == "rank8_mixed":  # all three at once: rank ≤ 8, near duplicates, wide norms
        g = torch.randn(k, 8, generator=gen, dtype=F64) @ torch.randn(8, p, generator=gen,
                                                                        dtype=F64)
        g[1::2] = g[0:k - 1:2] + 1e-9 * torch.randn(k // 2, p, generator=gen, dtype=F64)
        g = g * torch.logspace(-6, 6, k, dtype=F64)[torch.randperm(k, generator=gen)][:, None]
    return g


CASES = st.tuples(st.integers(2, 64), st.sampled_from(KINDS), st.integers(0, 2**16))


# -- UPGrad / DualProj ------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(CASES)
def test_upgrad_cg_pivoting_matches_factorisations(case: tuple[int, str, int]) -> None:
    k, kind, seed = case
    g = rows(kind, k, 2 * k + 3, seed)
    gram = g @ g.T
    slow = upgrad_weights(gram) @ g
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "CG_MIN_SIZE", 2)
        fast = upgrad_weights(gram) @ g
    assert_same_update(fast, slow, g)


@settings(max_examples=20, deadline=None)
@given(CASES)
def test_upgrad_projections_meet_their_optimality_conditions(case: tuple[int, str, int]) -> None:
    """Each ``vᵢ = argmin_{v ≥ eᵢ/K} vᵀGv`` (the definition), the conjugate-gradient
    pivoting forced: feasible, ``Gvᵢ ≥ 0`` and ``(vᵢ − eᵢ/K)ᵀ G vᵢ = 0`` to rounding of the
    trace-normalised Gramian, plus on the free set the tight solves' residual (at most
    ``CG_RTOL_MAX`` times ``‖(Gu)_F‖``, :func:`~._boxqp.tight_residuals`)."""
    k, kind, seed = case
    g = rows(kind, k, 2 * k + 3, seed)
    gram, _ = trace_normalized(g @ g.T)
    u = torch.eye(k, dtype=F64) / k
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "CG_MIN_SIZE", 2)
        v = _boxqp.solve_box_qp_batched(gram, torch.zeros_like(u), u)
    gv, y = v @ gram, v - u
    scale = float(v.abs().max())
    assert bool((y >= -1e-12).all())
    solves = 1.01 * _boxqp.CG_RTOL_MAX * torch.linalg.vector_norm(
        (u @ gram) * (y > 1e-12 * scale), dim=1)
    assert bool((gv >= -(1e-9 * scale + solves[:, None])).all())
    gap = (y * gv).sum(dim=1).abs()
    assert bool((gap <= 1e-9 * scale + torch.linalg.vector_norm(y, dim=1) * solves).all())


@pytest.mark.parametrize("kind", KINDS)
def test_upgrad_and_dualproj_at_64_tasks_are_finite_and_conflict_free(kind: str) -> None:
    g = rows(kind, 64, 40, 7)
    eps = torch.finfo(F64).eps
    for balancer in (UPGrad(), DualProj()):
        result = balancer.combine(g)
        assert result.weights is not None
        out, w1 = result.vector, float(result.weights.abs().sum())
        assert bool(torch.isfinite(out).all())
        # No conflict with any task, to the Gramian's rounding: the update is fixed to
        # √(K eps tr G) ‖w‖₁ (docs/balancers.md), so gₖ·out to that times ‖gₖ‖ (margin 4).
        bound = 4 * (64 * eps) ** 0.5 * float(g.norm()) * w1 * g.norm(dim=1)
        assert bool((g @ out >= -bound).all())


# -- PCGrad / GradVac -------------------------------------------------------------------
#: How a pass may run: its block size, and the refresh of ``C G`` forced sparse or dense
#: (``SPARSE_COST`` 0: every refresh sparse; huge: every refresh one dense product).
#: (steps per block, sparse cost, columns per tile of the refreshed dots: 10**6, one tile)
PASSES = st.tuples(st.sampled_from([1, 3, 8, 16, 32]), st.sampled_from([0, 10**9]),
                   st.sampled_from([10**6, 1, 3, 8]))


@settings(max_examples=40, deadline=None)
@given(CASES, PASSES)
def test_pcgrad_blocked_pass_matches_the_loop_over_rows(case: tuple[int, str, int],
                                                         how: tuple[int, int, int]) -> None:
    k, kind, seed = case
    check_pcgrad_pass(rows(kind, k, 2 * k + 3, seed), seed, how)


@pytest.mark.parametrize("cost", [0, 10**9])
def test_pcgrad_sparse_and_dense_refreshes_at_200_tasks(cost: int) -> None:
    """Many blocks of the default size past the sparse threshold's K, against the loop."""
    g = rows("conflicting", 200, 230, 5)
    orders = pcgrad_orders(200, torch.Generator().manual_seed(5))
    with pytest.MonkeyPatch.context() as mp:
        pass_settings(mp, (_pairwise.SPARSE_BLOCK, cost))
        fast = pcgrad_coefficients(g @ g.T, orders).sum(dim=0) @ g
    assert_same_update(fast, pcgrad_loop(g, orders), g)


def test_tiles_only_on_the_cpu() -> None:
    """From ``TILE_FROM`` tasks the CPU pass tiles ``G``; an accelerator keeps one tile."""
    k = _pairwise.TILE_FROM
    assert _pairwise.tile_width(k, torch.device("cpu")) == _pairwise.TILE_COLUMNS
    assert _pairwise.tile_width(k, torch.device("meta")) == k
    assert _pairwise.tile_width(k - 1, torch.device("cpu")) == k - 1


@pytest.mark.parametrize("width", [5, 8, 48])
def test_pcgrad_and_gradvac_with_int32_indices_in_tiles(width: int) -> None:
    """The large-K pass at K = 48 (int32 flat indices and column tiles, full and not, as
    from ``TILE_FROM`` tasks on): PCGrad's and GradVac's passes against their loops."""
    from support.many_kinds import check_gradvac_pass

    g = rows("conflicting", 48, 120, 7)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_pairwise, "SPARSE_FROM", 8)
        check_pcgrad_pass(g, 7, (_pairwise.SPARSE_BLOCK, 0, width))
        check_gradvac_pass(g, 7, 0.5, (_pairwise.SPARSE_BLOCK, 0, width))


def test_pcgrad_block_size_does_not_change_the_coefficients() -> None:
    g = rows("conflicting", 40, 90, 3)
    gram = g @ g.T
    orders = pcgrad_orders(40, torch.Generator().manual_seed(3))
    diag, ar = torch.diagonal(gram), torch.arange(40)

    def visit(t: int, dots: Tensor, out: Tensor) -> Tensor:
        j = orders[:, t]
        return out.copy_(torch.where((dots < 0) & (j != ar), -dots / diag[j], 0.0))

    whole = pcgrad_coefficients(gram, orders)
    for block, cost in itertools.product((1, 7, 16, 40), (0, 10**9)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_pairwise, "SPARSE_COST", cost)
            coef = _pairwise.pairwise_pass(gram, orders, visit, block)
        torch.testing.assert_close(coef, whole, rtol=1e-10, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(CASES, st.floats(0.0, 1.0), PASSES)
def test_gradvac_blocked_pass_matches_the_pair_loop(case: tuple[int, str, int], beta: float,
                                                    how: tuple[int, int, int]) -> None:
    k, kind, seed = case
    check_gradvac_pass(rows(kind, k, 2 * k + 3, seed), seed, beta, how)


@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_gradvac_zero_rows_and_unit_targets_at_40_tasks(eps: float) -> None:
    """Zero gradients and targets of ±1 (the paper step's zero denominators with ``eps = 0``)
    against the pair loop."""
    g = rows("conflicting", 40, 60, 9)
    g[[3, 17]] = 0.0
    gram, _ = trace_normalized(g @ g.T)
    gen = torch.Generator().manual_seed(9)
    orders = gradvac_orders(40, gen)
    targets = torch.rand(40, 40, generator=gen, dtype=F64).round() * 2 - 1
    with pytest.MonkeyPatch.context() as mp:
        pass_settings(mp, (8, 0))
        coef, hat = gradvac_coefficients(gram, orders, targets, 0.3, eps, 0.5)
    ref_coef, ref_hat = gradvac_loop(gram, orders, targets, 0.3, eps, 0.5)
    assert bool(torch.isfinite(coef).all())
    assert_same_update(coef.sum(dim=0) @ g, ref_coef.sum(dim=0) @ g, g)
    torch.testing.assert_close(hat, ref_hat, rtol=1e-6, atol=1e-6)


# -- TrimmedMean, GradDrop, PCD ---------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(st.integers(33, 64), st.integers(0, 10), st.sampled_from(KINDS), st.integers(0, 2**16))
def test_trimmed_mean_topk_path_matches_the_sort(k: int, t: int, kind: str, seed: int) -> None:
    g = rows(kind, k, 50, seed).to(torch.float32)
    g[:, :5] = torch.round(g[:, :5])  # ties
    ordered, _ = torch.sort(g.double(), dim=0)
    expected = ordered[t : k - t].mean(dim=0)
    out = trimmed_mean_update(g, t).double()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6 * float(g.abs().max()))


def test_pcd_beyond_sixteen_tasks_meets_its_kkt_conditions() -> None:
    """``min ½‖d − g₁‖²`` s.t. ``gⱼᵀd ≥ τ‖gⱼ‖²``: ``d = g₁ + Σ μⱼ gⱼ``, ``μ ≥ 0``, feasible,
    complementary (on the first step's normalised rows, a multiple of the raw ones)."""
    from gradbalance.balancers._pcd import pcd_weights

    for k in (17, 40, 64):
        g = rows("conflicting", k, 3 * k, k)
        gram = g @ g.T
        taus = torch.full((k - 1,), 0.1, dtype=F64)
        mult = pcd_weights(gram, taus)
        d = mult @ g
        slack = g[1:] @ d - taus * torch.diagonal(gram)[1:]
        scale = float(torch.diagonal(gram).max())
        assert float(mult[0]) == 1.0 and bool((mult[1:] >= 0).all())
        assert float(slack.min()) >= -1e-8 * scale
        assert float((mult[1:] * slack).abs().max()) <= 1e-8 * scale
        assert bool(torch.isfinite(PCD(num_tasks=k)(g)).all())


@pytest.mark.parametrize("kind", KINDS)
def test_pairwise_and_coordinate_balancers_at_64_tasks_are_finite(kind: str) -> None:
    g = rows(kind, 64, 40, 11)
    for balancer in (PCGrad(), GradVac(), TrimmedMean(trim_number=3), GradDrop(), PCD()):
        assert bool(torch.isfinite(balancer(g)).all()), type(balancer).__name__


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 64), st.sampled_from(KINDS), st.integers(0, 2**16), st.booleans())
def test_graddrop_matches_its_masked_sum(k: int, kind: str, seed: int, leak: bool) -> None:
    """The rule as written in the paper: a keep mask per entry, then the (leaky) sum."""
    from gradbalance.balancers._graddrop import graddrop_update

    g = rows(kind, k, 50, seed)
    g[:, :3] = 0.0  # zero columns: purity ½
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(50, generator=gen, dtype=F64)
    lk = torch.rand(k, generator=gen, dtype=F64) if leak else torch.zeros(k, dtype=F64)
    purity = torch.where(g.abs().sum(0) > 0, 0.5 * (1 + g.sum(0) / g.abs().sum(0)), 0.5)
    mask = (((purity > u) & (g > 0)) | ((purity < u) & (g < 0))).to(F64)
    expected = ((lk[:, None] + (1 - lk[:, None]) * mask) * g).sum(dim=0)
    out = graddrop_update(g, u, lk if leak else None)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12 * float(g.abs().sum()))


def test_every_balancer_at_256_tasks_in_a_rank_8_span_is_finite() -> None:
    """K = 256 rows in a rank-8 span, near-duplicate pairs, norms 1e-6 … 1e6 (float32): every
    registered balancer returns a finite update without a solver error, and the projections
    (UPGrad, DualProj) conflict with no task to the Gramian's rounding. Nash-MTL's bargaining
    equation has no solution here (a non-negative combination of the rows vanishes): it warns
    and solves its ridge's equation, as documented."""
    from gradbalance.balancers import BALANCERS, Constant

    g = rows("rank8_mixed", 256, 300, 5).to(torch.float32)
    losses = torch.rand(256, generator=torch.Generator().manual_seed(5)) + 0.5
    for name, cls in BALANCERS.items():
        balancer = Constant(torch.full((256,), 1 / 256)) if name == "constant" else cls()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # FairGrad, Nash-MTL: no solution
            result = balancer.combine(g, losses if balancer.needs_losses else None)
        assert bool(torch.isfinite(result.vector).all()), name
        if name in ("upgrad", "dualproj"):
            assert result.weights is not None
            g64, out = g.double(), result.vector.double()
            w1 = float(result.weights.abs().sum())
            eps = torch.finfo(torch.float32).eps  # the rows' own rounding
            bound = 4 * (256 * eps) ** 0.5 * float(g64.norm()) * w1 * g64.norm(dim=1)
            assert bool((g64 @ out >= -bound).all()), name
