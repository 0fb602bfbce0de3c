"""MGDA, PCD, CAGrad and DualProj on singular float32 Gramians through the rounding lift,
K = 64 … 96.

Rows of which some tasks are sums of others (``d`` of them, the Gramian of rank ``K − d``)
multiplied in float32 give a Gramian whose rounding leaves ``d`` eigenvalues near zero, the
most negative one below it. MGDA's min-norm point is then solved on the lifted cosine matrix
(:func:`~gradbalance.balancers._min_norm_dual.lifted_min_norm`) where at most
``SINGLE_LIFT_MAX_NULLITY`` of its eigenvalues are rounding, and DualProj's single
projection takes the lift (:func:`~gradbalance.balancers._boxqp._lifted`) as UPGrad's do.
Each answer is checked against an independent solver on the float64 rows: MGDA's min-norm
point by scipy's NNLS in Lawson & Hanson's least-distance form, DualProj's projection by
scipy's NNLS over the unit rows (:mod:`support.cone_reference`); the same update (cosine
≥ 0.999999, norm within 1e-6). PCD's answer moves by about 1e-5 with the float32 rounding
itself (by either route), so its lifted answer is checked as PCD's exact answer on the
lifted Gramian ``G' = D(C + εI)D``: scipy's least-distance program on the rows of a
Cholesky factor of ``G'``; CAGrad's dual weights likewise by the optimality conditions of
its dual on ``G'`` and SLSQP's value of its primal on those rows. Where the lift does not
apply (a large rounding null space, a
zero row, float64 rows whose rounding is at float64's resolution, a positive definite
Gramian; for PCD also constraints that ``G`` itself cannot meet) it is refused and the
least-squares route gives the answer.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import UPGrad, _boxqp, _min_norm_dual, _pcd, _solvers
from gradbalance.balancers._boxqp import CHOLESKY_MAX_COND, cosine_spectrum
from gradbalance.balancers._boxqp import _lifted as lifted
from gradbalance.balancers._dualproj import dualproj_weights
from gradbalance.balancers._solvers import cagrad_dual, min_norm_simplex, trace_normalized
from gradbalance.functional import pcd_weights
from support.balancers import scipy_cagrad_value, scipy_pcd
from support.cone_reference import scipy_projection
from support.many_kinds import assert_same_update

F64 = torch.float64


def summed_rows(k: int, dependent: int, seed: int, spread: float = 0.0) -> Tensor:
    """``[K, 4K]`` float32 conflicting rows, the last ``dependent`` the sums of two others,
    each row scaled by one of ``logspace(−spread, spread, K)`` (shuffled) before the sums."""
    gen = torch.Generator().manual_seed(seed)
    p = 4 * k
    g = torch.randn(k, 1, generator=gen) * torch.randn(p, generator=gen)
    g = g + 0.5 * torch.randn(k, p, generator=gen)
    scales = torch.logspace(-spread, spread, k)[torch.randperm(k, generator=gen)]
    g = g * scales[:, None]
    pairs = torch.randint(0, k - dependent, (dependent, 2), generator=gen)
    g[k - dependent:] = g[pairs[:, 0]] + g[pairs[:, 1]]
    return g


def float32_gram(g: Tensor) -> Tensor:
    """The trace-normalised float64 copy of the float32 product ``g gᵀ`` (its rounding)."""
    return trace_normalized((g @ g.T).double())[0]


def scipy_min_norm_point(g: Tensor) -> Tensor:
    """MGDA's min-norm point ``Jᵀw`` of the rows ``g`` (float64) by scipy's NNLS:
    ``u = argmin_{u ≥ 0} ‖[Jᵀ/s; 1ᵀ] u − e‖`` has ``w = u/Σu`` (Lawson & Hanson 1974,
    Ch. 23; ``s`` the largest row norm)."""
    from scipy.optimize import nnls

    scale = float(g.norm(dim=1).max())
    a = torch.cat([g.T / scale, torch.ones(1, g.shape[0], dtype=F64)])
    b = torch.zeros(a.shape[0], dtype=F64)
    b[-1] = 1.0
    u, _ = nnls(a.numpy(), b.numpy(), maxiter=10_000)
    w = torch.from_numpy(u)
    return g.T @ (w / w.sum())


def spy_lift(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each call of :func:`lifted_min_norm` from MGDA's solver lifted (appended)."""
    taken: list[bool] = []

    def spy(spectrum, tol):  # type: ignore[no-untyped-def]
        out = _min_norm_dual.lifted_min_norm(spectrum, tol)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(_solvers, "lifted_min_norm", spy)
    return taken


@settings(max_examples=20, deadline=None)
@given(st.integers(64, 96), st.sampled_from([1, 4, 16]), st.sampled_from([0.0, 2.0]),
       st.integers(0, 2**31 - 1))
def test_mgda_lifted_matches_the_exact_min_norm_point(k: int, dependent: int, spread: float,
                                                      seed: int) -> None:
    """Plain and wide-norm rows (the cosine route) with ``d ≤ K/4`` dependent tasks: the
    lift is taken wherever the float32 rounding made the Gramian indefinite, and MGDA's
    update is scipy's on the float64 rows."""
    with pytest.MonkeyPatch.context() as mp:
        taken = spy_lift(mp)
        g = summed_rows(k, dependent, seed, spread)
        gram = float32_gram(g)
        w = min_norm_simplex(gram)
    g64 = g.double()
    assert_same_update(w @ g64, scipy_min_norm_point(g64), g64)
    assert abs(float(w.sum()) - 1.0) <= 1e-12 and bool((w >= 0).all())
    lam = torch.linalg.eigvalsh(cosine_spectrum(gram).cosine)
    low, high = float(lam[0]), float(lam[-1])
    # rounding visible (not at float64's resolution: λ_max/|λ_min| within the limit): lifted
    assert taken == ([True] if low < 0.0 and high < CHOLESKY_MAX_COND * -low / 3 else
                     taken[:1])


def test_dependent_float32_rows_take_the_lift() -> None:
    """Conflicting rows with ``K/16`` dependent tasks at K = 64, five seeds: the float32
    rounding makes each Gramian indefinite and MGDA takes the lift every time."""
    with pytest.MonkeyPatch.context() as mp:
        taken = spy_lift(mp)
        for seed in range(5):
            min_norm_simplex(float32_gram(summed_rows(64, 4, seed)))
    assert taken == [True] * 5


def test_the_lift_is_refused_where_it_does_not_apply() -> None:
    """No lift: rows in a span of rank K/2 (half the eigenvalues rounding), a zero row,
    float64 rows exactly dependent (a lift at float64's rounding: condition number above
    ``CHOLESKY_MAX_COND``), a positive definite Gramian. MGDA's answer is scipy's in each."""
    gen = torch.Generator().manual_seed(3)
    half = torch.randn(64, 32, generator=gen) @ torch.randn(32, 256, generator=gen)
    zero = summed_rows(64, 4, 5)
    zero[7] = 0.0
    exact = summed_rows(64, 4, 6).double()
    definite = torch.randn(64, 256, generator=gen)
    for rows, gram in ((half, float32_gram(half)), (zero, float32_gram(zero)),
                       (exact, trace_normalized(exact @ exact.T)[0]),
                       (definite, float32_gram(definite))):
        spectrum = cosine_spectrum(gram)
        assert _min_norm_dual.lifted_min_norm(spectrum, 1e-12) is None
        g64 = rows.double()
        assert_same_update(min_norm_simplex(gram) @ g64, scipy_min_norm_point(g64), g64)
    assert float(cosine_spectrum(float32_gram(half)).lam[0]) < 0.0  # refused by its nullity


@settings(max_examples=12, deadline=None)
@given(st.integers(64, 96), st.sampled_from([4, 8]), st.integers(0, 2**31 - 1))
def test_dualproj_single_projection_through_the_lift(k: int, dependent: int,
                                                     seed: int) -> None:
    """DualProj's one projection of the mean on rows with dependent tasks (float32
    Gramian): scipy's projection of the float64 rows' mean."""
    g = summed_rows(k, dependent, seed)
    lifts: list[bool] = []

    def spy(q: Tensor, lift: float | None) -> Tensor | None:
        out = lifted(q, lift)
        lifts.append(out is not None)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "_lifted", spy)
        w = dualproj_weights((g @ g.T).double())
    assert lifts[:1] == [True] or float(torch.linalg.eigvalsh(float32_gram(g))[0]) >= 0.0
    g64 = g.double()
    u = torch.full((k,), 1.0 / k, dtype=F64)
    assert_same_update(w @ g64, scipy_projection(g64, u), g64)
    assert bool((w >= u * (1 - 1e-12)).all())


TAU = 0.02


def lifted_rows(gram: Tensor) -> Tensor:
    """Rows of the lifted Gramian ``G' = D(C + εI)D`` (``ε``: the single dual QPs' lift of
    ``G``'s cosine matrix ``C``): its Cholesky factor, ``G' = LLᵀ``."""
    spectrum = cosine_spectrum(gram)
    lift = _min_norm_dual.single_lift(spectrum.lam)
    assert lift is not None
    d = spectrum.norms
    lifted = (spectrum.cosine + lift * torch.eye(d.shape[0], dtype=F64)) * torch.outer(d, d)
    return torch.linalg.cholesky(lifted)


@settings(max_examples=15, deadline=None)
@given(st.integers(64, 96), st.sampled_from([1, 4, 16]), st.integers(0, 2**31 - 1))
def test_pcd_lifted_is_the_exact_answer_on_the_lifted_gramian(k: int, dependent: int,
                                                             seed: int) -> None:
    """PCD on the float32 Gramian of rows with ``d ≤ K/4`` dependent tasks: where the lift
    is taken, ``d = g₁ + Σ μⱼgⱼ`` on the rows of ``G'`` is scipy's answer there, and every
    constraint holds on ``G`` itself to ``HOLD_RTOL``; where it is refused, the least-distance
    program's answer; where ``G`` is certified well conditioned, the update of that
    program's weights."""
    g = summed_rows(k, dependent, seed)
    gram = (g @ g.T).double()
    taus = torch.full((k - 1,), TAU, dtype=F64)
    taken: list[bool] = []

    def spy(*args):  # type: ignore[no-untyped-def]
        out = lifted_weights(*args)
        taken.append(out is not None)
        return out

    lifted_weights = _pcd._lifted_weights
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_pcd, "_lifted_weights", spy)
        mult = pcd_weights(gram, taus)
    if taken == [True]:
        rows = lifted_rows(gram)
        assert_same_update(mult @ rows, scipy_pcd(rows, TAU), rows)
    elif taken == [False]:
        assert_least_distance_route(gram, taus)
    else:  # certified well conditioned, no lift tried: the box QP's answer, the program's
        # update (the weights differ along the rounding's near-null directions: 3e-6 apart
        # under MKL's reproducible COMPATIBLE kernels at K = 64, one dependent task)
        rows = g.double()
        program = torch.cat([mult[:1], _pcd._ldp_weights(gram, taus)])
        assert_same_update(mult @ rows, program @ rows, rows)


def assert_least_distance_route(gram: Tensor, taus: Tensor) -> None:
    """PCD's weights on ``gram`` are the least-distance program's (``_ldp_weights`` on the
    shared eigen-decomposition, the answer returned as it is), and within 1e-4 of the
    program on its own decomposition: on the float32 Gramians of dependent rows the two
    decompositions' weights differ by rounding the problem amplifies (up to 3.2e-6 under
    MKL's reproducible ``COMPATIBLE`` kernels at K = 81, 2.4e-6 on torch 2.6 on an
    ill-posed instance)."""
    answers: list[Tensor] = []
    ldp_weights = _pcd._ldp_weights

    def spy(*args: object) -> Tensor:
        answers.append(ldp_weights(*args))  # type: ignore[arg-type]
        return answers[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_pcd, "_ldp_weights", spy)
        mult = pcd_weights(gram, taus)
    assert len(answers) == 1 and torch.equal(mult[1:], answers[0])
    torch.testing.assert_close(mult[1:], ldp_weights(gram, taus), rtol=1e-4, atol=0.0)


def test_pcd_takes_the_lift_and_refuses_it_where_g_cannot_meet_the_constraints() -> None:
    """Five seeds of rows with K/16 dependent tasks at K = 64: the lift is taken. Two tasks
    that are minus sums of two others put ``0`` in the secondary rows' conic hull (no ``d``
    meets every constraint on ``G``): the lifted answer misses one on ``G``, is refused, and
    the least-distance program answers."""
    taus = torch.full((63,), TAU, dtype=F64)
    for seed in range(5):
        gram = (lambda g: (g @ g.T).double())(summed_rows(64, 4, seed))
        spectrum = cosine_spectrum(gram)
        assert _pcd._lifted_weights(gram, taus, spectrum) is not None
    g = summed_rows(64, 0, 0)
    g[-2:] = -(g[1:3] + g[3:5])
    gram = (g @ g.T).double()
    spectrum = cosine_spectrum(gram)
    assert _min_norm_dual.single_lift(spectrum.lam) is not None  # the lift itself applies
    assert _pcd._lifted_weights(gram, taus, spectrum) is None
    assert_least_distance_route(gram, taus)  # ill-posed: its answer 5e4 times ‖g₁‖


@settings(max_examples=10, deadline=None)
@given(st.integers(64, 80), st.sampled_from([4, 8, 16]), st.integers(0, 2**31 - 1))
def test_cagrad_lifted_meets_its_dual_on_the_lifted_gramian(k: int, dependent: int,
                                                           seed: int) -> None:
    """CAGrad (``c = 0.4``) on the float32 Gramian of rows with dependent tasks: its root
    search runs on ``G'`` (the lift taken), and its weights meet the optimality conditions of
    ``min_{w∈Δ} wᵀG'1/K + r‖g_w‖`` (``∇F = G'1/K + r G'w/‖g_w‖`` equal on the support, not
    below elsewhere, to 1e-9 of its size), with SLSQP's value of the primal on ``G'``'s rows
    (its tolerance, 1e-5)."""
    c = 0.4
    g = summed_rows(k, dependent, seed)
    gram = float32_gram(g)
    spectrum = cosine_spectrum(gram)
    lifted = _solvers._cagrad_lifted(spectrum)
    if lifted is None:  # no lift without a negative eigenvalue beyond the decomposition's
        # own rounding: the float32 rounding of the few null ones can leave them positive (K =
        # 76, four dependent tasks, seed 0: −2.5e-16, then 5.6e-8 … 2.7e-7)
        assert float(spectrum.lam[0]) > -1e-12 * float(spectrum.lam[-1])
        return
    routes: list[bool] = []

    def spy(*args):  # type: ignore[no-untyped-def]
        out = cagrad_problem(*args)
        routes.append(out[0] is not args[0] and out[1] is None)  # the QPs on G', not on G
        return out

    cagrad_problem = _solvers._cagrad_problem
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_solvers, "_cagrad_problem", spy)
        w = cagrad_dual(gram, c)
    # [] : every task in the support, no QP; not lifted only where G passes as definite
    assert routes in ([], [True]) or _boxqp.is_well_conditioned(gram)
    mean = torch.full((k,), 1.0 / k, dtype=F64)
    lin = lifted @ mean
    r = c * float(mean @ lin) ** 0.5
    norm = float(w @ lifted @ w) ** 0.5
    grad = lin + r * (lifted @ w) / norm
    level = float((grad * w).sum())  # the multiplier of Σw = 1
    size = float(lin.abs().max()) + r * float(torch.diagonal(lifted).max()) ** 0.5
    support = w > 1e-9 * float(w.max())
    assert float((grad[support] - level).abs().max()) <= 1e-9 * size
    assert float((grad - level).min()) >= -1e-9 * size
    rows = torch.linalg.cholesky(lifted)  # G' = LLᵀ: its rows gₖ
    value = float(w @ lin) + r * norm  # the dual's value, min_k gₖ·d* by duality
    expected = scipy_cagrad_value(rows, c)
    assert value == pytest.approx(expected, rel=1e-5, abs=1e-7)


@settings(max_examples=8, deadline=None)
@given(st.integers(64, 80), st.integers(0, 2**31 - 1))
def test_cagrad_on_near_duplicates_cut_at_the_rounding(k: int, seed: int) -> None:
    """CAGrad (``c = 0.4``) on the float32 Gramian of ``K/4`` near copies of each of four
    directions (``1e-6`` relative noise, far below the float32 rounding): the factor is cut
    at the rounding (four columns), the root search runs on ``LLᵀ``, and the dual's value on
    the float64 rows is SLSQP's optimum of the primal there (its tolerance, 1e-5). The
    collapse of copies (``_min_norm_groups.collapse``, which takes these near copies as four
    rows) is switched off for the route, and its own answer meets the same value."""
    c = 0.4
    gen = torch.Generator().manual_seed(seed)
    dirs = torch.randn(4, 3 * k, generator=gen, dtype=F64)
    rows = dirs[torch.arange(k) % 4] + 1e-6 * torch.randn(k, 3 * k, generator=gen, dtype=F64)
    gram = trace_normalized((rows.float() @ rows.float().T).double())[0]
    used: list[Tensor] = []

    def spy(*args):  # type: ignore[no-untyped-def]
        out = cagrad_problem(*args)
        used.append(out[0])
        return out

    cagrad_problem = _solvers._cagrad_problem
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_solvers, "_cagrad_problem", spy)
        mp.setattr(_solvers, "collapse", lambda *args, **kwargs: None)
        w = cagrad_dual(gram, c)
    assert len(used) == 1 and int(torch.linalg.matrix_rank(used[0])) <= 4
    g = rows @ rows.T
    mean = torch.full((k,), 1.0 / k, dtype=F64)
    lin = g @ mean
    expected = scipy_cagrad_value(rows, c)
    for weights in (w, cagrad_dual(gram, c)):  # the cut route, then the collapse
        value = float(weights @ lin) + c * float(mean @ lin) ** 0.5 * float(
            weights @ g @ weights) ** 0.5
        assert value == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_a_lift_within_the_decompositions_rounding_is_raised_to_it() -> None:
    # λ_min = −1e-17 on λ_max = 1 (K = 100): within float64 eigh's rounding, ~K·eps; twice it
    # would leave the lifted matrix reading a negative eigenvalue again
    lam = torch.cat([torch.tensor([-1e-17], dtype=F64), torch.linspace(0.1, 1.0, 99, dtype=F64)])
    floor = 100 * torch.finfo(F64).eps
    assert _boxqp.rounding_lift(lam) == pytest.approx(2.0 * floor, rel=1e-12, abs=0.0)
    lam[0] = -1e-9  # a rounding above the floor: its own multiple
    assert _boxqp.rounding_lift(lam) == pytest.approx(2e-9, rel=1e-12, abs=0.0)


@pytest.mark.parametrize(("k", "p", "seed"), [(127, 63, 0), (65, 32, 1), (100, 200, 2)])
def test_upgrad_on_float64_copies_returns_each_projection(k: int, p: int, seed: int) -> None:
    # K/2 float32 Gaussian directions each given twice, multiplied in float64 (K = 127,
    # P = 63, seed 0: the lift of a rounding-level λ_min read a negative eigenvalue again,
    # recursing without end)
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(k - k // 2, p, generator=gen)
    g = torch.cat([rows, rows[: k // 2]])[torch.randperm(k, generator=gen)].double()
    u = torch.eye(k, dtype=F64) / k
    expected = torch.stack([scipy_projection(g, u[i]) for i in range(k)]).sum(dim=0)
    assert_same_update(UPGrad()(g), expected, g)
