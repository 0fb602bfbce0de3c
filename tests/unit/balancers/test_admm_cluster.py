"""Box problems on a Gramian whose small eigenvalues form a cluster (``balancers/_admm.py``,
``balancers/_boxqp.py``'s ``_pivot_admm``): rows in a span of low rank plus noise. The
cluster's test against hand-built spectra, the route against scipy's NNLS (an independent
solver of each projection), and the common Gramians kept off it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import DualProj, UPGrad, _admm, _boxqp
from gradbalance.balancers._upgrad import upgrad_weights
from support.balancers import nnls_dual_cone
from support.many_kinds import assert_same_update

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")  # K ≤ 96: one thread is faster


def _with_spectrum(lam: list[float], seed: int = 0) -> Tensor:
    """``V diag(λ) Vᵀ`` with a random orthogonal ``V``."""
    k = len(lam)
    gen = torch.Generator().manual_seed(seed)
    v = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=F64)).Q
    return (v * torch.tensor(lam, dtype=F64)) @ v.T


def _floors(lam: list[float]) -> tuple[float | None, float | None]:
    """:func:`~._admm.cluster_floor` from the eigenvalues and from the inverse."""
    q = _with_spectrum(lam)
    ascending = torch.tensor(sorted(lam), dtype=F64)
    return (_admm.cluster_floor(q, eigenvalues=ascending),
            _admm.cluster_floor(q, inverse=torch.cholesky_inverse(torch.linalg.cholesky(q))))


@pytest.mark.parametrize(("small", "value", "found"), [
    (8, 1e-6, True),  # 8 of 64 at 1e-6: λ_min Σ 1/λ = 8 + 56e-6 ≥ 64/8
    (7, 1e-6, False),  # 7 + 57e-6 < 8: a few small eigenvalues, not a cluster
    (32, 1e-6, True),
    (2, 1e-8, False),  # a Gaussian mixing's few small ones
    (32, 2e-3, False),  # a cluster, but 2e-3 of the mean (≈ 1) is not small
    (32, 5e-4, True),
])
def test_cluster_against_hand_counts(small: int, value: float, found: bool) -> None:
    """K = 64: ``small`` eigenvalues at ``value``, the others at 1; a cluster where the count
    ``λ_min Σ 1/λᵢ = small + (64 − small)·value`` reaches ``K/8 = 8`` and ``value`` is at most
    ``1e-3`` of the mean eigenvalue ``(small·value + 64 − small)/64``. Both ways of finding it
    agree, the floor within 1e-6 of ``value`` (the power steps on ``Q⁻¹``: the cluster
    dominates by a factor ``1/value``)."""
    lam = [value] * small + [1.0] * (64 - small)
    mean = sum(lam) / 64
    assert (small + (64 - small) * value >= 8 and value <= 1e-3 * mean) is found
    for floor in _floors(lam):
        if found:
            assert floor is not None and abs(floor - value) <= 1e-6 * value
        else:
            assert floor is None


def _noisy_rows(k: int, rank: int, noise: float, seed: int, p: int = 1500) -> Tensor:
    """``[K, P]`` rows in a random span of ``rank`` plus Gaussian noise ``noise`` of their size."""
    gen = torch.Generator().manual_seed(seed)
    basis = torch.randn(k, rank, generator=gen, dtype=F64) @ torch.randn(
        rank, p, generator=gen, dtype=F64) / rank**0.5
    return basis + noise * torch.randn(k, p, generator=gen, dtype=F64)


def _watched_route(rows: Tensor) -> tuple[Tensor, list[tuple[int, int]]]:
    """UPGrad's update of ``rows`` and, per call of ``_pivot_admm`` that took the route, how
    many problems it had and finished."""
    calls: list[tuple[int, int]] = []
    route = _boxqp._pivot_admm

    def spy(*args: object) -> tuple[Tensor, Tensor] | None:
        got = route(*args)  # type: ignore[arg-type]
        if got is not None:
            calls.append((got[1].numel(), int(got[1].sum())))
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "_pivot_admm", spy)
        update = UPGrad()(rows)
    return update, calls


def _reference(rows: Tensor) -> Tensor:
    """UPGrad's update from scipy's NNLS, one projection at a time (``pᵢ = 1/K``)."""
    k = rows.shape[0]
    eye = torch.eye(k, dtype=F64) / k
    return sum((nnls_dual_cone(rows, eye[i]) for i in range(k)), torch.zeros(rows.shape[1],
                                                                           dtype=F64))


@settings(max_examples=10, deadline=None)
@given(st.integers(64, 96), st.sampled_from([(1, 2, 1e-2), (1, 4, 1e-3), (3, 8, 1e-2)]),
       st.integers(0, 2**16))
def test_noisy_low_rank_rows_take_the_route_and_match_scipy(
        k: int, shape: tuple[int, int, float], seed: int) -> None:
    """Rows of rank ``K/2``, ``K/4`` or ``3K/8`` plus noise 1e-2 or 1e-3: the route is taken
    (the cluster found), the factorised pivoting from ADMM's free sets finishes at least
    7/8 of the projections, and the update equals the sum of scipy's projections."""
    numerator, denominator, noise = shape
    rows = _noisy_rows(k, max(2, numerator * k // denominator), noise, seed)
    update, calls = _watched_route(rows)
    problems, finished = calls[0]
    assert problems == k and finished >= 7 * k // 8
    # a later call only on the problems the first left open (K = 68, seed 146: one, whose own
    # call finished none; the solver after the route did)
    assert sum(later for later, _ in calls[1:]) <= k - finished
    assert_same_update(update, _reference(rows), rows)


@pytest.mark.parametrize("seed", [0, 1])
def test_admm_free_sets_are_the_optimal_ones(seed: int) -> None:
    """K = 64, rank 32 plus noise 1e-2: ADMM's free sets equal the optimal ones (scipy's NNLS
    support ``{x > 1e-9 max x}``) for at least 7/8 of the projections, and differ from them
    by at most 4 indices in all."""
    rows = _noisy_rows(64, 32, 1e-2, seed)
    gram = rows @ rows.T
    d = torch.diagonal(gram).sqrt()
    q = gram / torch.outer(d, d) / 64  # the cosine matrix, trace 1, as the dual-cone route's
    lower = torch.eye(64, dtype=F64) / 64
    floor = _admm.cluster_floor(q, torch.cholesky_inverse(torch.linalg.cholesky(q)))
    assert floor is not None
    free = _admm.admm_free_sets(q, lower, _admm.first_rho(q, floor))
    from scipy.optimize import nnls

    a = (rows / d[:, None]).T.numpy()
    wrong = []
    for i in range(64):
        x = torch.from_numpy(nnls(a, -a[:, i] / 64, maxiter=10_000)[0])
        optimal = x > 1e-9 * float(x.max())
        wrong.append(int((free[i] ^ optimal).sum()))
    assert sum(w == 0 for w in wrong) >= 56
    assert sum(wrong) <= 4


@pytest.mark.parametrize("kind", ["randn", "square_mixing"])
def test_common_gramians_stay_off_the_route(kind: str) -> None:
    """Gaussian rows (condition number near 3) and a Gaussian mixing of them (a few small
    eigenvalues, condition number near ``K²``) have no cluster: the route's test is ``O(K)``
    on the trace of ``Q⁻¹`` and ADMM never runs."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(96, 1500, generator=gen, dtype=F64)
    if kind == "square_mixing":
        rows = torch.randn(96, 96, generator=gen, dtype=F64) @ rows / 96**0.5
    ran = [0]
    free_sets = _admm.admm_free_sets

    def spy(*args: Tensor | float) -> Tensor:
        ran[0] += 1
        return free_sets(*args)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "admm_free_sets", spy)
        update = UPGrad()(rows)
    assert ran[0] == 0
    assert_same_update(update, _reference(rows), rows)


def _span_rows(k: int, rank: int, seed: int) -> Tensor:
    """``[K, 3K]`` float64 rows in a random span of ``rank`` dimensions (a singular Gramian)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(k, rank, generator=gen, dtype=F64) @ torch.randn(
        rank, 3 * k, generator=gen, dtype=F64)


def _watched_singular(rows: Tensor, gram: Tensor | None = None,
                      calls: list[tuple[int, int]] | None = None) -> Tensor:
    """UPGrad's update of ``rows`` (from ``gram``, by default their own), ``(problems,
    finished)`` of each ADMM route's call appended to ``calls``."""
    calls = [] if calls is None else calls
    route = _boxqp._pivot_from_admm

    def spy(q: Tensor, lower: Tensor, x: Tensor | None, tol: float,
            rank: int | None = None, floor: float | None = None) -> tuple[Tensor, Tensor]:
        got = route(q, lower, x, tol, rank, floor)
        calls.append((lower.shape[0], int(got[1].sum())))
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "_pivot_from_admm", spy)
        weights = upgrad_weights(rows @ rows.T if gram is None else gram)
    return weights @ rows


@settings(max_examples=8, deadline=None)
@given(st.sampled_from([64, 72, 96]), st.floats(0.55, 0.64), st.integers(0, 2**16))
def test_thin_cone_rows_take_admm_first_and_match_scipy(k: int, fraction: float,
                                                        seed: int) -> None:
    """Rows in a span of rank ``0.55K … 0.64K`` (a singular Gramian, a thin dual cone):
    ADMM's route runs first on all K projections, and the update is scipy's NNLS
    projections summed, whichever route finished each."""
    rows = _span_rows(k, int(fraction * k), seed)
    calls: list[tuple[int, int]] = []
    update = _watched_singular(rows, calls=calls)
    assert calls and calls[0][0] == k
    assert_same_update(update, _reference(rows), rows)


@pytest.mark.parametrize(("k", "rank", "seed"), [(64, 38, 0), (96, 58, 1), (128, 81, 0)])
def test_admm_finishes_thin_cone_projections(k: int, rank: int, seed: int) -> None:
    """Rank 0.6K … 0.64K: ADMM's route itself finishes at least 7/8 of the projections (the
    pivoting's test and the multipliers' on ``Q``), the update scipy's."""
    rows = _span_rows(k, rank, seed)
    calls: list[tuple[int, int]] = []
    update = _watched_singular(rows, calls=calls)
    assert calls[0][0] == k and calls[0][1] >= 7 * k // 8
    assert_same_update(update, _reference(rows), rows)


@pytest.mark.parametrize(("k", "rank", "seed"), [(64, 35, 0)])
def test_steps_that_do_not_settle_leave_the_problems_to_fista(k: int, rank: int,
                                                              seed: int) -> None:
    """Float64 rows of rank just above K/2, their Gramian singular to 1e-17: the optimal
    ``v`` is not unique and ADMM's steps wander on its face (free sets above the rank: no
    factorisation), the route finishes under half the projections and stops after one
    round, FISTA's route runs next, and the update is scipy's."""
    rows = _span_rows(k, rank, seed)
    order: list[str] = []
    fista = _boxqp._pivot_from_fista
    calls: list[tuple[int, int]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "_pivot_from_fista",
                   lambda *a, **kw: order.append("fista") or fista(*a, **kw))
        update = _watched_singular(rows, rows @ rows.T, calls)
    assert calls[0][0] == k and 2 * calls[0][1] < k
    assert order and order[0] == "fista"
    assert_same_update(update, _reference(rows), rows)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_second_round_finishes_what_the_first_leaves(seed: int) -> None:
    """K = 72, rank 41: with the first round stopped at its first look (25 steps, every free
    set still moving), the second round (a third of ``ρ``, until eight looks in a row move
    nothing) brings the route to at least 7/8 of the projections, each summed into scipy's
    update."""
    rows = _span_rows(72, 41, seed)
    calls: list[tuple[int, int]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "ADMM_SETTLED", 1.0)
        update = _watched_singular(rows, calls=calls)
    assert calls[0][0] == 72 and calls[0][1] >= 63
    assert_same_update(update, _reference(rows), rows)


def test_one_problem_does_not_take_admm() -> None:
    """DualProj's single projection on a singular Gramian: no ADMM (its steps would be
    matrix-vector products, its inverse a factorisation of its own), the FISTA route first."""
    from gradbalance.balancers._dualproj import dualproj_weights

    rows = _span_rows(64, 37, 5)
    update_calls: list[int] = []
    route = _boxqp._pivot_from_admm
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "_pivot_from_admm",
                   lambda *a, **kw: update_calls.append(1) or route(*a, **kw))
        update = dualproj_weights(rows @ rows.T) @ rows
    assert not update_calls
    assert_same_update(update, nnls_dual_cone(rows, torch.full((64,), 1 / 64, dtype=F64)), rows)


@pytest.mark.parametrize(("k", "seed"), [(64, 0), (96, 1), (128, 2)])
def test_one_problem_left_open_takes_admm_before_the_active_set(k: int, seed: int) -> None:
    """DualProj's single projection on rows of rank K/2 plus noise 1e-2 with its pivoting
    made to fail: ADMM's route finishes it (the active set never runs), and the update is
    scipy's NNLS projection of the mean."""
    from gradbalance.balancers._dualproj import dualproj_weights

    rows = _noisy_rows(k, k // 2, 1e-2, seed)
    finished: list[bool] = []
    route = _boxqp._finish_single_admm

    def spy(q: Tensor, lower: Tensor, out: Tensor, done: Tensor, tol: float,
            inverse: Tensor | None) -> None:
        route(q, lower, out, done, tol, inverse)
        finished.append(bool(done.all()))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "_pivot_single", lambda *a, **kw: None)
        mp.setattr(_boxqp, "_finish_single_admm", spy)
        mp.setattr(_boxqp, "box_active_set", lambda *a, **kw: pytest.fail("active set ran"))
        update = dualproj_weights(rows @ rows.T) @ rows
    assert finished == [True]
    assert_same_update(update, nnls_dual_cone(rows, torch.full((k,), 1 / k, dtype=F64)), rows)


def test_the_pilot_tries_three_rhos_on_sixteen_spread_problems() -> None:
    """:func:`~._admm.pilot_rho` on 64 problems from ``ρ``: the candidates ``ρ, 3ρ, 9ρ``, each on
    the problems 0, 4, 8, …, 63 (``linspace(0, 63, 16)`` rounded), the answer the candidate
    whose steps settled first (the smaller on a tie)."""
    rows = _noisy_rows(64, 32, 1e-2, 4)
    gram = rows @ rows.T
    d = torch.diagonal(gram).sqrt()
    q = gram / torch.outer(d, d) / 64
    lower = torch.eye(64, dtype=F64) / 64
    seen: list[tuple[float, list[int], int]] = []
    steps = _admm._admm_steps

    def spy(q_: Tensor, low: Tensor, rho: float, *rest: float) -> tuple[Tensor, int]:
        got = steps(q_, low, rho, *rest)  # type: ignore[arg-type]
        seen.append((rho, torch.nonzero(low > 0)[:, 1].tolist(), got[1]))
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_admm, "_admm_steps", spy)
        chosen = _admm.pilot_rho(q, lower, 1e-6)
    expected_rows = [round(i * 63 / 15) for i in range(16)]
    assert [r for r, _, _ in seen] == pytest.approx([1e-6, 3e-6, 9e-6])
    assert all(at == expected_rows for _, at, _ in seen)
    fewest = min(n for _, _, n in seen)
    assert chosen == next(r for r, _, n in seen if n == fewest)


def test_the_route_with_the_pilot_matches_scipy() -> None:
    """The pilot made to run at K = 96 (rank K/2 plus noise 1e-2): the route still finishes at
    least 7/8 of the projections and the update is scipy's."""
    rows = _noisy_rows(96, 48, 1e-2, 6)
    ran: list[float] = []
    pilot = _boxqp.pilot_rho
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "PILOT_MIN_SIZE", 64)
        mp.setattr(_boxqp, "pilot_rho", lambda *a: ran.append(1.0) or pilot(*a))
        update, calls = _watched_route(rows)
    assert ran == [1.0] and calls[0][1] >= 84
    assert_same_update(update, _reference(rows), rows)


def _dualproj_watched(rows: Tensor) -> tuple[Tensor, int]:
    """DualProj's update of ``rows`` and how often the single pivoting stalled and went to
    Lawson–Hanson on the Cholesky factor (``_boxqp._factored_from``'s ``on_stall``)."""
    stalls = []
    made = _boxqp._factored_from

    def spy(*args: object) -> object:
        finish = made(*args)  # type: ignore[arg-type]

        def counted(free: list[bool]) -> Tensor | None:
            stalls.append(1)
            return finish(free)
        return counted

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "_factored_from", spy)
        update = DualProj()(rows)
    return update, len(stalls)


@pytest.mark.parametrize(("k", "noise", "seed"), [(64, 1e-2, 2), (64, 1e-3, 5), (96, 1e-2, 0)])
def test_dualproj_stalled_pivoting_finishes_on_the_factor(k: int, noise: float,
                                                          seed: int) -> None:
    """Rows of rank K/2 plus noise, where DualProj's single pivoting cycles (the count of
    infeasible indices stale for ``MURTY_AFTER`` iterations; about a third of the seeds at
    K = 64 … 128): Lawson–Hanson on the Cholesky factor finishes the projection, equal to
    scipy's NNLS projection of the mean gradient."""
    rows = _noisy_rows(k, k // 2, noise, seed)
    update, stalls = _dualproj_watched(rows)
    assert stalls == 1
    mean = torch.full((k,), 1.0 / k, dtype=F64)
    assert_same_update(update, nnls_dual_cone(rows, mean), rows)


@settings(max_examples=12, deadline=None)
@given(st.integers(64, 112), st.sampled_from([(1, 2, 1e-2), (1, 2, 1e-3), (3, 8, 1e-2)]),
       st.integers(0, 2**16))
def test_dualproj_on_noisy_low_rank_rows_matches_scipy(k: int, shape: tuple[int, int, float],
                                                       seed: int) -> None:
    """DualProj on rows of rank K/2 or 3K/8 plus noise, stalled or not: scipy's projection."""
    numerator, denominator, noise = shape
    rows = _noisy_rows(k, max(2, numerator * k // denominator), noise, seed)
    update, _ = _dualproj_watched(rows)
    mean = torch.full((k,), 1.0 / k, dtype=F64)
    assert_same_update(update, nnls_dual_cone(rows, mean), rows)
