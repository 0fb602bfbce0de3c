"""UPGrad on rows in a span of rank a little above K/2 (a thin dual cone): the dense pivoting
from a long FISTA start (``_boxqp._pivot_from_fista``; a batch's ADMM route before it turned
off) against scipy's NNLS per projection, what it certifies and what it leaves to the paths
after it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradbalance.balancers import _boxqp
from gradbalance.balancers._solvers import trace_normalized
from gradbalance.balancers._upgrad import upgrad_weights
from support.balancers import nnls_dual_cone
from support.many_kinds import assert_same_update

F64 = torch.float64


def _span_rows(k: int, rank: int, seed: int, spread: float = 0.0) -> torch.Tensor:
    """``[K, 3K]`` float64 rows in a random span of ``rank`` dimensions, norms spread over
    ``10^±spread``."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(k, rank, generator=gen, dtype=F64) @ torch.randn(
        rank, 3 * k, generator=gen, dtype=F64)
    scales = torch.logspace(-spread, spread, k, dtype=F64)[torch.randperm(k, generator=gen)]
    return rows * scales[:, None]


def _reference(rows: torch.Tensor) -> torch.Tensor:
    """UPGrad's update from scipy's NNLS, one projection per task, summed (the mean's)."""
    k = rows.shape[0]
    eye = torch.eye(k, dtype=F64)
    return torch.stack([nnls_dual_cone(rows, eye[i]) for i in range(k)]).mean(dim=0)


def _spy(mp: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``(problems, finished)`` of every call of the route, recorded; ADMM's route, which a
    batch takes before it (``tests/unit/balancers/test_admm_cluster.py``), turned off: it
    leaves every problem open."""
    mp.setattr(_boxqp, "_pivot_from_admm", lambda q, lower, x, tol, rank=None: (
        lower.clone(), torch.zeros(lower.shape[0], dtype=torch.bool)))
    calls: list[tuple[int, int]] = []
    route = _boxqp._pivot_from_fista

    def spy(q: torch.Tensor, lower: torch.Tensor, x: torch.Tensor, tol: float,
            rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        out = route(q, lower, x, tol, rank)
        calls.append((lower.shape[0], -1 if out is None else int(out[1].sum())))
        return out

    mp.setattr(_boxqp, "_pivot_from_fista", spy)
    return calls


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([64, 72, 96]), st.floats(0.55, 0.64), st.integers(0, 2**16),
       st.sampled_from([0.0, 1.0]))
def test_thin_cone_projections_are_scipy_s(k: int, fraction: float, seed: int,
                                           spread: float) -> None:
    """Rows of rank ``0.55K … 0.64K`` (norms equal or spread over two decades): the route
    runs first, on every problem, and UPGrad's update is scipy's NNLS projections summed
    (cos ≥ 0.999999, norm within 1e-6). The route finishes most problems on most draws, not
    on all (K = 64, rank 36, seed 287: none, the later solvers all; the fixed cases below
    check that it finishes them)."""
    rank = int(fraction * k)
    rows = _span_rows(k, rank, seed, spread)
    with pytest.MonkeyPatch.context() as mp:
        calls = _spy(mp)
        update = upgrad_weights(rows @ rows.T) @ rows
    assert calls and calls[0][0] == k and calls[0][1] >= 0
    assert_same_update(update, _reference(rows), rows)


@pytest.mark.parametrize("seed", [0, 1])
def test_route_finishes_every_problem_of_a_thin_cone(seed: int) -> None:
    """K = 96, rank 54: every one of the 96 projections is certified by the route itself
    (the pivoting's test and the multipliers' on ``Q``), each equal to scipy's."""
    k, rank = 96, 54
    rows = _span_rows(k, rank, seed)
    q, _ = trace_normalized(rows @ rows.T)
    lower = torch.eye(k, dtype=F64) / k
    got = _boxqp._pivot_from_fista(q, lower, lower, 1e-12)
    assert got is not None
    out, done = got
    assert bool(done.all())
    eye = torch.eye(k, dtype=F64)
    for i in range(0, k, 12):  # each projection, not only their sum
        assert_same_update(out[i] @ rows, nnls_dual_cone(rows, eye[i] / k), rows)


@pytest.mark.parametrize(("k", "rank", "forced", "seed"), [(64, 36, True, 3), (64, 33, False, 0)])
def test_problems_the_route_leaves_open_go_on(k: int, rank: int, forced: bool,
                                              seed: int) -> None:
    """With one FISTA step and no pivoting iteration (``forced``: the route certifies
    nothing), or on rows of rank just above K/2 (33 of 64: FISTA's free sets hold more than
    33 indices, singular blocks; the route certifies at most a few), the paths after it
    (the conjugate-gradient pivoting, the batched active set) still give scipy's update."""
    rows = _span_rows(k, rank, seed)
    with pytest.MonkeyPatch.context() as mp:
        if forced:
            mp.setattr(_boxqp, "THIN_STEPS", (1,))
            mp.setattr(_boxqp, "THIN_MAX_PIVOTS", 0)
        calls = _spy(mp)
        update = upgrad_weights(rows @ rows.T) @ rows
    assert calls[0][0] == k and (calls[0][1] == 0 if forced else 0 <= calls[0][1] < k // 8)
    assert_same_update(update, _reference(rows), rows)


def test_above_the_fraction_the_conjugate_gradients_go_first() -> None:
    """Rank ``0.8K``: the conjugate-gradient pivoting runs first, the route only on what it
    leaves open (here nothing or a few), and the update is scipy's."""
    k, rank = 64, 52
    rows = _span_rows(k, rank, 4)
    order: list[str] = []
    fista, singular = _boxqp._pivot_from_fista, _boxqp._pivot_singular
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "_pivot_from_fista",
                   lambda *a, **kw: order.append("fista") or fista(*a, **kw))
        mp.setattr(_boxqp, "_pivot_singular",
                   lambda *a: order.append("cg") or singular(*a))
        update = upgrad_weights(rows @ rows.T) @ rows
    assert order[0] == "cg"
    assert_same_update(update, _reference(rows), rows)


@pytest.mark.parametrize(("k", "rank", "spread", "float32", "seed"),
                         [(80, 48, 6.0, False, 1), (128, 72, 2.0, True, 0)])
def test_wide_norms_and_a_float32_gramian(k: int, rank: int, spread: float, float32: bool,
                                          seed: int) -> None:
    """Norms spread over twelve decades, or a Gramian multiplied in float32 (rounded at 1e-7
    of its entries, its null space at that level): the route runs first, and UPGrad's update
    is scipy's NNLS projections of the float64 rows, summed."""
    rows = _span_rows(k, rank, seed, spread)
    if float32:
        rows = rows.float().double()  # the rows as float32 holds them
        gram = (rows.float() @ rows.float().T).double()
    else:
        gram = rows @ rows.T
    with pytest.MonkeyPatch.context() as mp:
        calls = _spy(mp)
        update = upgrad_weights(gram) @ rows
    assert calls and calls[0][0] == k
    assert_same_update(update, _reference(rows), rows)


@settings(max_examples=8, deadline=None)
@given(st.sampled_from([64, 96, 128]), st.floats(0.53, 0.62), st.integers(0, 2**16),
       st.sampled_from([0.0, 1.0]))
def test_one_problem_takes_its_shorter_start(k: int, fraction: float, seed: int,
                                             spread: float) -> None:
    """DualProj's single projection on rows of rank ``0.53K … 0.62K``: the route runs first
    with ``THIN_SINGLE_STEPS`` (one factorisation per pivoting iteration: a shorter FISTA
    start than a batch's ``THIN_STEPS``), and the update is scipy's NNLS projection of the
    mean (cos ≥ 0.999999, norm within 1e-6), whichever path finished it."""
    from gradbalance.balancers._dualproj import dualproj_weights

    rows = _span_rows(k, int(fraction * k), seed, spread)
    seen: list[int] = []
    fista = _boxqp.projected_start
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "projected_start",
                   lambda q, shift, start, steps=None: seen.append(steps) or fista(
                       q, shift, start, steps))
        calls = _spy(mp)
        update = dualproj_weights(rows @ rows.T) @ rows
    assert calls and calls[0][0] == 1
    assert seen[0] == _boxqp.THIN_SINGLE_STEPS[0] < _boxqp.THIN_STEPS[0]
    assert_same_update(update, nnls_dual_cone(rows, torch.full((k,), 1.0 / k, dtype=F64)), rows)
