"""What the zero dual cone's route spends (``balancers/_zero_cone.py``, ``balancers/_boxqp.py``):
the alternating projections stop once their rate cannot reach a certificate in their budget
(then the exact search decides), and a batch of box problems whose Cholesky factorisation
fails below ``9K/16`` keeps ``Q``'s eigenvectors for the certificate's factor instead of a
second decomposition. The answers are checked against scipy's NNLS and the decisions
against hand-derived cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import _boxqp, _zero_cone
from gradbalance.balancers._solvers import project_dual_cone, trace_normalized
from support.balancers import nnls_dual_cone
from support.many_kinds import assert_same_update

F64 = torch.float64
EPS = torch.finfo(F64).eps

pytestmark = pytest.mark.usefixtures("one_thread")  # K ≤ 128: one thread is faster


@pytest.mark.parametrize(("least", "left", "stops"), [
    ([-0.4, -0.3], 10_000, False),  # two windows: no rate yet
    ([-0.4, -0.2, -0.1], 200, False),  # rate ¼ over two windows: 162 more rounds
    ([-0.4, -0.2, -0.1], 150, True),
    ([-0.3, -0.3, -0.3], 10_000, True),  # no progress: the sets' gap
    ([-0.2, -0.3, -0.25], 10_000, True),  # moving away
    ([-0.5, -0.2, 0.0], 10, False),  # not negative: the caller's positivity test decides
])
def test_out_of_reach_hand_derived(least: list[float], left: int, stops: bool) -> None:
    """The stop against the rule worked by hand: ``needed = 2·32·ln(3e-3/|m|)/ln ρ`` with
    ``ρ`` the ratio of the last least entry to the one two windows before."""
    assert _zero_cone.NULL_WINDOW == 32 and _zero_cone.NULL_NEAR == 3e-3
    if len(least) == 3 and least[-1] < 0 and least[-1] / least[0] < 1:
        needed = 64 * math.log(3e-3 / -least[-1]) / math.log(least[-1] / least[0])
        assert (needed > left) == stops
    assert _zero_cone._out_of_reach(least, left) is stops


def _counted_null(factor: Tensor, rounds: int,
                  exact: _zero_cone.LeastSquares | None = None) -> tuple[Tensor | None, int]:
    """:func:`~._zero_cone.interior_null` and how many projections it tested."""
    calls = [0]
    positive = _zero_cone._positive

    def spy(*args: Tensor) -> tuple[Tensor | None, float]:
        calls[0] += 1
        return positive(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_zero_cone, "_positive", spy)
        found = _zero_cone.interior_null(factor, rounds, exact)
    return found, calls[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rounds_stop_where_no_intersection_exists(seed: int) -> None:
    """Gaussian rows with ``K < 2r`` (K = 96, r = 56): no ``c ≥ 1`` has ``Lᵀc = 0`` (the exact
    search finds none either), and the rounds stop far below their budget of 1,024 (the least
    entry settles at the sets' gap)."""
    factor = torch.randn(96, 56, generator=torch.Generator().manual_seed(seed), dtype=F64)
    found, tested = _counted_null(factor, _zero_cone.DENSE_NULL_ROUNDS, _boxqp._nnls_point)
    assert found is None
    assert tested <= 256


@settings(max_examples=8, deadline=None)
@given(st.integers(64, 128), st.floats(0.25, 0.4), st.integers(0, 2**16))
def test_rounds_that_converge_are_not_stopped(k: int, fraction: float, seed: int) -> None:
    """Gaussian rows well within Wendel's regime (``r ≤ 0.4 K``): the rounds with the stop find
    a certificate wherever 1,024 rounds without it do, in as many rounds; the vector is a
    certificate (``c ≥ 1``, ``‖Lᵀc‖`` at the rounding of ``Σ cⱼ‖Lⱼ‖``)."""
    r = max(2, int(fraction * k))
    factor = torch.randn(k, r, generator=torch.Generator().manual_seed(seed), dtype=F64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_zero_cone, "_out_of_reach", lambda least, left: False)
        plain, plain_tested = _counted_null(factor, _zero_cone.DENSE_NULL_ROUNDS)
    found, tested = _counted_null(factor, _zero_cone.DENSE_NULL_ROUNDS)
    if plain is None:
        return
    assert found is not None and tested == plain_tested
    assert float(found.min()) == pytest.approx(1.0)
    scale = float(found @ factor.norm(dim=1))
    assert float((found @ factor).norm()) <= 1e3 * EPS * k * scale


@pytest.mark.parametrize(("order", "k", "expected"), [
    (0, 128, False),  # factorised: no failure order
    (40, 128, True),
    (72, 128, True),  # (1/2 + 1/16)·128 = 72
    (73, 128, False),  # the leading block of order 72 is positive definite: rank > K/2
    (20, 32, False),  # below CG_MIN_SIZE
])
def test_shares_eigenvectors_by_the_failure_order(order: int, k: int, expected: bool) -> None:
    """The shared decomposition only where the zero cone may follow (box, ``c = 0``, the
    factorisation failed at an order up to ``(½ + 1/16) K``, ``K ≥ 64``)."""
    q = torch.eye(k, dtype=F64)
    c = torch.zeros(2, k, dtype=F64)
    assert _boxqp._shares_eigenvectors(q, c, False, order) is expected
    assert _boxqp._shares_eigenvectors(q, c, True, order) is False  # simplex
    c[0, 0] = 1.0
    assert _boxqp._shares_eigenvectors(q, c, False, order) is False  # c ≠ 0


def test_shares_eigenvectors_only_on_a_balanced_diagonal() -> None:
    """A diagonal spanning more than ``SHARED_EIGEN_MAX_RATIO`` keeps the cosine matrix's
    decomposition (a short row accurate to its own length); within it, ``Q``'s."""
    k = 64
    c = torch.zeros(2, k, dtype=F64)
    diag = torch.ones(k, dtype=F64)
    diag[0] = _boxqp.SHARED_EIGEN_MAX_RATIO
    assert _boxqp._shares_eigenvectors(torch.diag(diag), c, False, 10)
    diag[0] = 1.01 * _boxqp.SHARED_EIGEN_MAX_RATIO
    assert not _boxqp._shares_eigenvectors(torch.diag(diag), c, False, 10)
    diag[0] = 0.0
    assert not _boxqp._shares_eigenvectors(torch.diag(diag), c, False, 10)


def test_top_factor_hand_built() -> None:
    """``V_r Λ_r^{1/2}`` over the leading pairs: on ``diag(0, 1, 4)``, rank 2, the columns
    ``e₂`` and ``2e₃``, whose product is the matrix."""
    q = torch.diag(torch.tensor([0.0, 1.0, 4.0], dtype=F64))
    lam, vec = torch.linalg.eigh(q)
    factor = _boxqp._top_factor(lam, vec, 2)
    assert factor.shape == (3, 2)
    assert torch.allclose(factor @ factor.T, q, atol=1e-15)


def _balanced_coefficients(k: int, r: int, gen: torch.Generator) -> Tensor:
    """``[K, r]`` Gaussian directions with norms ``1 … 2`` (a Gramian diagonal within 4×)."""
    coef = torch.randn(k, r, generator=gen, dtype=F64)
    return coef * (1.0 + torch.rand(k, 1, generator=gen, dtype=F64)) / coef.norm(dim=1,
                                                                               keepdim=True)


def _in_span(coef: Tensor, gen: torch.Generator) -> Tensor:
    """``coef`` times ``r`` orthonormal rows of ``3K`` entries: rows of the same norms."""
    k, r = coef.shape
    return coef @ torch.linalg.qr(torch.randn(3 * k, r, generator=gen, dtype=F64))[0].T


def _spied_projection(gram: Tensor, u: Tensor) -> tuple[Tensor, list[str]]:
    """``project_dual_cone(gram, u)`` with the eigenvalue decompositions and the shared
    factor watched: ``"eigvalsh"``, ``"eigh"`` and ``"shared r"`` (its rank) in call order."""
    seen: list[str] = []
    spectrum, top = _boxqp._spectrum, _boxqp._top_factor

    def spy_spectrum(q: Tensor, vectors: bool = False) -> _boxqp._Spectrum:
        seen.append("eigh" if vectors else "eigvalsh")
        return spectrum(q, vectors)

    def spy_top(lam: Tensor, vec: Tensor, rank: int) -> Tensor:
        seen.append(f"shared {rank}")
        return top(lam, vec, rank)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_boxqp, "_spectrum", spy_spectrum)
        mp.setattr(_boxqp, "_top_factor", spy_top)
        v = project_dual_cone(gram, u)
    return v, seen


@settings(max_examples=10, deadline=None)
@given(st.integers(64, 112), st.floats(0.3, 0.45), st.integers(0, 2**16))
def test_balanced_low_rank_rows_take_the_shared_factor(k: int, fraction: float,
                                                       seed: int) -> None:
    """Gaussian directions of rank ``r`` between ``0.3 K`` and ``0.45 K`` (norms 1 … 2): the
    batch takes ``Q``'s own eigenvectors (one decomposition), and every update of UPGrad is
    scipy's on the rows (zero where the certificate holds) with ``v ≥ u``."""
    r = int(fraction * k)
    gen = torch.Generator().manual_seed(seed)
    g = _in_span(_balanced_coefficients(k, r, gen), gen)
    u = torch.diag(torch.rand(k, generator=gen, dtype=F64) + 0.5)
    gram, trace = trace_normalized(g @ g.T)
    v, seen = _spied_projection(gram, u)
    assert seen == ["eigh", f"shared {r}"]
    unit = g / trace.sqrt()
    for i in range(0, k, 7):
        assert_same_update(v[i] @ g, nnls_dual_cone(unit, u[i]) * trace.sqrt(), g)
        assert bool((v[i] >= u[i] * (1 - 1e-12)).all())


@settings(max_examples=4, deadline=None)
@given(st.integers(64, 80), st.integers(0, 2**16))
def test_balanced_rows_in_a_half_space_go_on_from_the_shared_factor(k: int, seed: int) -> None:
    """Balanced rows of rank ``K/3`` in an open half-space: the shared factor is taken, no
    certificate exists, the dense paths answer, and every update is scipy's (not zero)."""
    r = k // 3
    gen = torch.Generator().manual_seed(seed)
    coef = torch.randn(k, r, generator=gen, dtype=F64)
    coef[:, 0] = coef[:, 0].abs() + 0.5
    coef /= coef.norm(dim=1, keepdim=True)
    g = _in_span(coef, gen)
    u = torch.diag(torch.rand(k, generator=gen, dtype=F64) + 0.5)[::9]
    gram, trace = trace_normalized(g @ g.T)
    v, seen = _spied_projection(gram, u)
    assert seen == ["eigh", f"shared {r}"]
    unit = g / trace.sqrt()
    for i in range(u.shape[0]):
        ref = nnls_dual_cone(unit, u[i]) * trace.sqrt()
        assert float(ref.norm()) > 0.0
        assert_same_update(v[i] @ g, ref, g)


@settings(max_examples=6, deadline=None)
@given(st.integers(64, 128), st.integers(0, 2**16))
def test_one_problem_on_full_rank_rows_is_certified_without_eigenvalues(k: int,
                                                                       seed: int) -> None:
    """DualProj's one problem on Gaussian rows (``P = 3K``: well conditioned): the Cholesky
    certificate classifies ``Q``, no eigenvalue decomposition runs, and the update is
    scipy's."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(k, 3 * k, generator=gen, dtype=F64)
    g[: k // 2] -= 2.0 * g[k // 2:].mean(dim=0)  # conflicting halves: the projection moves
    u = (torch.rand(k, generator=gen, dtype=F64) + 0.5)[None]
    gram, trace = trace_normalized(g @ g.T)
    v, seen = _spied_projection(gram, u)
    assert seen == []
    unit = g / trace.sqrt()
    ref = nnls_dual_cone(unit, u[0]) * trace.sqrt()
    assert float((ref - u[0] @ g).norm()) > 1e-6 * float(ref.norm())  # not the bound itself
    assert_same_update(v[0] @ g, ref, g)


@settings(max_examples=6, deadline=None)
@given(st.integers(64, 112), st.floats(0.3, 0.45), st.integers(0, 2**16))
def test_one_problem_on_balanced_low_rank_rows_shares_the_decomposition(
        k: int, fraction: float, seed: int) -> None:
    """DualProj's one problem on balanced rows of rank ``0.3 … 0.45 K``: one decomposition
    with vectors, the shared factor, and scipy's update (zero where certified)."""
    r = int(fraction * k)
    gen = torch.Generator().manual_seed(seed)
    g = _in_span(_balanced_coefficients(k, r, gen), gen)
    u = (torch.rand(k, generator=gen, dtype=F64) + 0.5)[None]
    gram, trace = trace_normalized(g @ g.T)
    v, seen = _spied_projection(gram, u)
    assert seen == ["eigh", f"shared {r}"]
    unit = g / trace.sqrt()
    assert_same_update(v[0] @ g, nnls_dual_cone(unit, u[0]) * trace.sqrt(), g)


def _kkt_stop(factor: Tensor, lower: Tensor, v: Tensor, tol: float) -> Tensor:
    """The stop's conditions as its docstring states them, every multiplier formed:
    ``v ≥ lower``, ``wⱼ ≤ max(tol‖x‖, ν)‖Lⱼ‖``, ``|wⱼ| ≤ ν‖Lⱼ‖`` where ``vⱼ > lowerⱼ``, finite."""
    k = factor.shape[0]
    x = v @ factor
    size = x.norm(dim=1, keepdim=True)
    norms = factor.norm(dim=1)
    nu = 8 * 4 * EPS * k * ((lower @ factor).norm(dim=1, keepdim=True) + size
                            + (v.abs() @ norms)[:, None])
    w = -(x @ factor.T)
    ok = (w <= torch.maximum(tol * size * norms, nu * norms)).all(dim=1)
    ok &= ((w.abs() <= nu * norms) | (v <= lower)).all(dim=1)
    return ok & (v >= lower).all(dim=1) & torch.isfinite(v).all(dim=1)


@settings(max_examples=30, deadline=None)
@given(st.integers(8, 48), st.integers(2, 6), st.integers(0, 2**16),
       st.sampled_from([0.0, 1e-14, 1e-9, 1e-3]))
def test_passes_stop_agrees_with_every_multiplier_formed(k: int, r: int, seed: int,
                                                         shake: float) -> None:
    """The stop with its Cauchy–Schwarz shortcut against the conditions with every multiplier
    formed: certificates (Gaussian rows, ``K ≥ 4r``, shaken by ``shake`` of their size, which
    moves ``x`` off zero) and feasible points that are not optimal (``v = lower`` and random
    ``v ≥ lower``): the same verdict on each."""
    gen = torch.Generator().manual_seed(seed)
    factor = torch.randn(max(k, 4 * r), r, generator=gen, dtype=F64)
    k = factor.shape[0]
    lower = torch.diag(torch.rand(k, generator=gen, dtype=F64) + 0.5)
    found = _zero_cone.zero_cone_box(factor, lower, 1e-12, 1024, _boxqp._nnls_point)
    points = [lower, lower + torch.rand(k, k, generator=gen, dtype=F64)]
    if found is not None:
        v = found[0]
        points.append(v + shake * v.abs() * torch.rand(k, k, generator=gen, dtype=F64))
    for v in points:
        assert torch.equal(_zero_cone.passes_stop(factor, lower, v, 1e-12),
                           _kkt_stop(factor, lower, v, 1e-12))


@settings(max_examples=10, deadline=None)
@given(st.integers(48, 128), st.floats(0.2, 0.42), st.integers(0, 2**16))
def test_an_orthonormal_basis_gives_the_same_certificate(k: int, fraction: float,
                                                         seed: int) -> None:
    """Balanced Gaussian rows (norms 1 … 2) factored by their eigenpairs ``L = VΛ^{1/2}``:
    with ``V`` as the basis (no QR) the search finds ``c ≥ 1`` with ``Lᵀc`` at the rounding
    of ``Σ cⱼ‖Lⱼ‖`` (always for ``K/r ≥ 3.3``: Wendel 1962), and every problem it certifies
    meets the stop's conditions with every multiplier formed (:func:`_kkt_stop`)."""
    r = max(2, int(fraction * k))
    gen = torch.Generator().manual_seed(seed)
    coef = _balanced_coefficients(k, r, gen)
    lam, vec = torch.linalg.eigh(coef @ coef.T)
    factor = _boxqp._top_factor(lam, vec, r)
    basis = vec[:, k - r:]
    lower = torch.diag(torch.rand(k, generator=gen, dtype=F64) + 0.5)
    c = _zero_cone.interior_null(factor, 1024, _boxqp._nnls_point, basis)
    if c is None:  # K/r near 2: a conic hull that may not be the span
        assert fraction > 0.3
        return
    assert float(c.min()) == pytest.approx(1.0)
    assert float((c @ factor).norm()) <= 1e3 * EPS * k * float(c @ factor.norm(dim=1))
    found = _zero_cone.zero_cone_box(factor, lower, 1e-12, 1024, _boxqp._nnls_point, basis)
    assert found is not None
    v, done = found
    assert bool(done.any())
    assert torch.equal(done, _kkt_stop(factor, lower, v, 1e-12))
