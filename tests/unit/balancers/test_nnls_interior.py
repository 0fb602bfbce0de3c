"""Lawson–Hanson's interior-point start and block entry (``balancers/_interior.py``,
``ColumnQR.add_block`` in ``balancers/_qr_update.py``).

A block of columns entered at once against a factorisation from scratch; the NNLS with its
interior-point start forced on small problems (every cold start of four columns or more goes
there after one addition) against scipy's ``nnls`` and its own KKT conditions, on the kinds of
``test_nnls_updated_qr.py``; MGDA through it on the Gramian of float32 rows in a rank-1 or
rank-8 span (the rounding makes the min-norm point's support about half the tasks) against
its KKT conditions and the min-norm value of scipy's NNLS on a factor from numpy's
eigen-decomposition; the PCD and per-sample-spectrum cases of ``test_nnls_updated_qr.py``
through it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import _boxqp
from gradbalance.balancers._boxqp import nnls
from gradbalance.balancers._qr_update import ColumnQR
from gradbalance.functional import mgda_weights
from gradbalance.gramian import compute_gramian
from support.balancers import scipy_min_norm_value
from unit.balancers import test_nnls_updated_qr as lh
from unit.balancers.test_nnls_updated_qr import (
    KINDS,
    _assert_nnls_optimal,
    assert_matches_from_scratch,
    matrix,
)

F64 = torch.float64
FIXTURE = [HealthCheck.function_scoped_fixture]  # the same patch for every example


@pytest.fixture
def interior(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cold start of four columns or more goes to the interior point."""
    monkeypatch.setattr(_boxqp, "INTERIOR_MIN_COLUMNS", 4)
    monkeypatch.setattr(_boxqp, "INTERIOR_AFTER", 1)


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(("random", "wide_scale")), st.integers(4, 24), st.integers(0, 2**31 - 1),
       st.data())
def test_block_entry_matches_from_scratch(kind: str, m: int, seed: int,
                                          data: st.DataObject) -> None:
    # Columns entered one by one, then a block at once, the block cut short, one dropped:
    # the same least-squares fit, residual and distances as a factorisation from scratch
    # (n ≤ m random columns: independent).
    n = data.draw(st.integers(2, m))
    a, b = matrix(kind, m, n, seed)
    single = data.draw(st.integers(0, n - 1))
    block = data.draw(st.integers(1, n - single))
    kept = data.draw(st.integers(1, single + block))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    qr = ColumnQR(a, b)
    for j in order[:single]:
        qr.add(j)
    qr.add_block(order[single : single + block])
    steps = [lambda: None, lambda: qr.truncate(kept), lambda: qr.drop(qr.cols[0])]
    for step in steps:
        step()
        if not qr.cols:
            continue
        assert_matches_from_scratch(qr, a, b)
        assert torch.equal(qr.cols_t, torch.tensor(qr.cols, dtype=torch.int64))


@settings(max_examples=40, deadline=None, suppress_health_check=FIXTURE)
@given(st.sampled_from(KINDS), st.integers(1, 40), st.integers(4, 64), st.integers(0, 2**31 - 1))
def test_nnls_from_the_interior_point_is_optimal(interior: None, kind: str, m: int, n: int,
                                                 seed: int) -> None:
    a, b = matrix(kind, m, n, seed)
    result = nnls(a, b)
    _assert_nnls_optimal(a, b, result.x)
    assert result.fallback_steps == 0


def _psd_part(gram: Tensor) -> tuple[Tensor, np.ndarray]:
    """The Gramian the solver works on and its factor ``P`` (``G₊ = PᵀP``), from numpy's
    eigen-decomposition of the cosine matrix, its eigenvalues below ``4 eps n λ_max`` (the
    rounding) dropped (``psd_factor``'s definition; no zero rows here)."""
    g = gram.numpy()
    d = np.sqrt(np.diag(g))
    lam, vec = np.linalg.eigh(g / np.outer(d, d))
    keep = lam > 4 * np.finfo(np.float64).eps * len(d) * lam[-1]
    points = (d[:, None] * vec[:, keep] * np.sqrt(lam[keep])).T
    return torch.from_numpy(points.T @ points), points


@settings(max_examples=6, deadline=None, suppress_health_check=FIXTURE)
@given(st.sampled_from((1, 8)), st.integers(0, 2**31 - 1))
def test_mgda_on_rounded_low_rank_rows(interior: None, rank: int, seed: int) -> None:
    # float32 rows in a rank-1 or rank-8 span, K = 48: their Gramian's float32 rounding
    # gives it about K/2 positive rounding-level eigenvalues, and the min-norm point a
    # support of about K/2 (the case the interior point is for). KKT on the Gramian's
    # positive part, and the min-norm value of an independent solve, to 1e-12 of the trace.
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(48, rank, generator=gen) @ torch.randn(rank, 300, generator=gen)
    gram = compute_gramian(rows).to(F64)  # float32 products: rounding 6e-8 of each
    unit = gram / gram.trace()
    w = mgda_weights(gram)
    positive, points = _psd_part(unit)
    gw = positive @ w
    value = float(w @ gw)
    assert float(w.min()) >= 0.0 and float(w.sum()) == pytest.approx(1.0, abs=1e-12)
    assert float(gw.min()) >= value - 1e-12
    assert float((gw - value)[w > 0].abs().max()) <= 1e-12
    assert value == pytest.approx(scipy_min_norm_value(points), abs=1e-12)


@pytest.mark.parametrize("seed", range(2))
def test_pcd_and_per_sample_cases_through_the_interior_point(interior: None, seed: int) -> None:
    lh.test_pcd_on_rank_deficient_near_duplicate_rows(seed)
    lh.test_mgda_least_squares_route_on_a_per_sample_spectrum(seed)


@pytest.fixture
def short_interior(interior: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interior point forced as above and cut one step after it settles."""
    from gradbalance.balancers import _interior

    monkeypatch.setattr(_interior, "SETTLED_STEPS", 1)


@settings(max_examples=30, deadline=None, suppress_health_check=FIXTURE)
@given(st.sampled_from(KINDS), st.integers(1, 40), st.integers(4, 64), st.integers(0, 2**31 - 1))
def test_nnls_from_a_cut_interior_point_is_optimal(short_interior: None, kind: str, m: int,
                                                   n: int, seed: int) -> None:
    # The interior point stopped as soon as it settles hands Lawson–Hanson a rougher start:
    # the answer is still optimal (KKT, and scipy's residual).
    a, b = matrix(kind, m, n, seed)
    result = nnls(a, b)
    _assert_nnls_optimal(a, b, result.x)
    assert result.fallback_steps == 0


def _min_norm_kkt(gram: Tensor, w: Tensor) -> None:
    """MGDA's KKT on ``gram`` (trace 1): ``w ∈ Δ``, ``(Gw)ₖ ≥ wᵀGw`` with equality on the
    support, to 1e-12; and the value of scipy's SLSQP no lower."""
    from scipy.optimize import minimize

    gw = gram @ w
    value = float(w @ gw)
    assert float(w.min()) >= 0.0 and float(w.sum()) == pytest.approx(1.0, abs=1e-12)
    assert float(gw.min()) >= value - 1e-12
    assert float((gw - value)[w > 0].abs().max()) <= 1e-12
    g = gram.numpy()
    k = g.shape[0]
    ref = minimize(lambda v: v @ g @ v, np.full(k, 1.0 / k), jac=lambda v: 2 * g @ v,
                   bounds=[(0.0, None)] * k, method="SLSQP", options={"ftol": 1e-15},
                   constraints=[{"type": "eq", "fun": lambda v: v.sum() - 1.0}])
    assert value <= float(ref.fun) + 1e-12


@settings(max_examples=25, deadline=None)
@given(st.integers(3, 40), st.integers(1, 6), st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_singular_spectrum_decides_and_min_norm_is_exact(k: int, rank: int, zero_rows: int,
                                                       seed: int) -> None:
    # Rows of rank ≤ 6 (with exact zero rows, which no Cholesky factorisation passes) or
    # K independent ones: ``singular_spectrum`` is None exactly for the definite Gramian,
    # else its factor is psd_factor's (LLᵀ = G to rounding); MGDA's min-norm point through
    # either path meets its KKT conditions and SLSQP's value.
    from gradbalance.balancers._boxqp import eigen_factor, psd_factor, singular_spectrum
    from gradbalance.balancers._solvers import min_norm_simplex

    gen = torch.Generator().manual_seed(seed)
    definite = zero_rows == 0 and rank == 6
    width = k + 3 if definite else rank
    rows = torch.randn(k, width, generator=gen, dtype=F64) @ torch.randn(
        width, 50, generator=gen, dtype=F64)
    rows[:min(zero_rows, k - 1)] = 0.0  # one row left: an all-zero Gramian has no trace
    gram = rows @ rows.T
    gram = gram / gram.trace()
    spectrum = singular_spectrum(gram)
    if definite:
        assert spectrum is None
    if zero_rows:
        assert spectrum is not None
        factor, _ = eigen_factor(gram, 0.0, spectrum)
        assert torch.equal(factor, psd_factor(gram))
        torch.testing.assert_close(factor @ factor.T, gram, rtol=0, atol=1e-12)
    _min_norm_kkt(gram, min_norm_simplex(gram))


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 30), st.integers(1, 12), st.booleans(), st.integers(0, 2**31 - 1))
def test_ldp_meets_its_kkt_conditions_and_slsqp(n: int, r: int, duplicates: bool,
                                                seed: int) -> None:
    # ``min ½‖x‖²`` s.t. ``Mx ≥ h``, feasible by construction (``h ≤ M x₀``), with repeated
    # rows where drawn: ``x = Mᵀμ`` feasible, ``μ ≥ 0`` and complementary (relative to the
    # scale), and ``½‖x‖²`` no larger than SLSQP's.
    from scipy.optimize import minimize

    from gradbalance.balancers._boxqp import ldp

    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, r, generator=gen, dtype=F64)
    if duplicates:
        rows[n // 2 :] = rows[: n - n // 2].clone()
    h = rows @ torch.randn(r, generator=gen, dtype=F64) - torch.rand(n, generator=gen,
                                                                     dtype=F64)
    mu = ldp(rows, h)
    assert mu is not None
    x = rows.T @ mu
    scale = float(rows.norm(dim=1).max()) * (float(x.norm()) + 1.0) + float(h.abs().max())
    slack = rows @ x - h
    assert float(mu.min()) >= 0.0
    assert float(slack.min()) >= -1e-9 * scale
    assert float((mu * slack).abs().max()) <= 1e-9 * scale * max(1.0, float(mu.max()))
    m_np, h_np = rows.numpy(), h.numpy()
    ref = minimize(lambda v: 0.5 * v @ v, np.zeros(r), jac=lambda v: v, method="SLSQP",
                   constraints=[{"type": "ineq", "fun": lambda v: m_np @ v - h_np,
                                 "jac": lambda v: m_np}], options={"ftol": 1e-14})
    assert 0.5 * float(x @ x) <= float(ref.fun) * (1 + 1e-7) + 1e-12


@pytest.mark.parametrize(("delta", "polished"), [(1e-2, False), (1e-5, True), (1e-6, True)])
def test_ldp_polishes_only_a_multiplier_off_its_kkt_conditions(
        delta: float, polished: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Six random constraints and one nearly opposite the first with h = (1, 0, …, 0): met
    # only by ‖x‖ ≈ 1/δ, where dividing by ‖ρ‖² magnifies the rounding of μ. The support's
    # least squares run only where μ's KKT violation is above tol (δ = 1e-5, 1e-6: about
    # 3e-11 and 3e-10), never at δ = 1e-2 (about 2e-14); the answer meets its KKT conditions
    # to the scale either way, no worse than the unpolished μ.
    from gradbalance.balancers import _boxqp

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=gen, dtype=F64)
    rows = torch.cat([base, -base[:1] - delta * torch.randn(1, 8, generator=gen, dtype=F64)])
    h = torch.zeros(7, dtype=F64)
    h[0] = 1.0
    solves: list[int] = []
    violations: list[float] = []
    real_ls, real_violation = _boxqp.least_squares, _boxqp._ldp_violation
    monkeypatch.setattr(_boxqp, "least_squares",
                        lambda a, b: (solves.append(1), real_ls(a, b))[1])
    monkeypatch.setattr(_boxqp, "_ldp_violation",
                        lambda r, hh, m: (violations.append(real_violation(r, hh, m)),
                                          violations[-1])[1])
    mu = _boxqp.ldp(rows, h)
    assert mu is not None
    assert bool(solves) is polished
    assert (violations[0] > 1e-12) is polished
    x = rows.T @ mu
    assert float(x.norm()) == pytest.approx(1.0 / delta, rel=0.9)
    scale = float(rows.norm(dim=1).max()) * (float(x.norm()) + 1.0) + 1.0
    slack = rows @ x - h
    assert float(mu.min()) >= 0.0
    assert float(slack.min()) >= -1e-9 * scale
    assert float((mu * slack).abs().max()) <= 1e-9 * scale * max(1.0, float(mu.max()))
    assert real_violation(rows, h, mu) <= violations[0]


@pytest.fixture
def low_precision(interior: None, monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The interior point forced as above, its early Newton systems in float32 from four
    columns on; the dtypes its factorisations ran in, recorded."""
    from gradbalance.balancers import _interior

    monkeypatch.setattr(_interior, "LOW_PRECISION_MIN_COLUMNS", 4)
    seen: list[torch.dtype] = []
    real = _interior._newton

    def spy(u: Tensor, h: Tensor | None, d: Tensor):  # type: ignore[no-untyped-def]
        seen.append(u.dtype)
        return real(u, h, d)

    monkeypatch.setattr(_interior, "_newton", spy)
    return seen


@settings(max_examples=30, deadline=None, suppress_health_check=FIXTURE)
@given(st.sampled_from(KINDS), st.integers(1, 40), st.integers(4, 64), st.integers(0, 2**31 - 1))
def test_nnls_from_a_float32_start_is_optimal(low_precision: list[torch.dtype], kind: str,
                                              m: int, n: int, seed: int) -> None:
    # The interior point's early steps on float32 Newton systems: Lawson–Hanson from its
    # support still ends optimal (KKT, and scipy's residual), without the fallback.
    a, b = matrix(kind, m, n, seed)
    result = nnls(a, b)
    _assert_nnls_optimal(a, b, result.x)
    assert result.fallback_steps == 0


@pytest.mark.parametrize("rank", [1, 8])
def test_mgda_from_float32_steps_meets_its_kkt(low_precision: list[torch.dtype],
                                               rank: int) -> None:
    # MGDA on the rounded Gramian of low-rank float32 rows through the interior point with
    # float32 early steps: the KKT conditions and scipy's min-norm value, as in float64; the
    # first steps ran in float32, and once a step ran in float64 (a float32 step that did
    # not halve xᵀs/n) every later one did.
    test_mgda_on_rounded_low_rank_rows.hypothesis.inner_test(None, rank, 3)  # type: ignore[attr-defined]
    assert low_precision[0] == torch.float32
    first = low_precision.index(torch.float64) if torch.float64 in low_precision else None
    assert first is None or set(low_precision[first:]) == {torch.float64}


def test_a_failed_float32_factorisation_is_redone_in_float64(
        interior: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every float32 factorisation fails: each step is redone in float64 and the answer is
    # still optimal.
    from gradbalance.balancers import _interior

    monkeypatch.setattr(_interior, "LOW_PRECISION_MIN_COLUMNS", 4)
    real = _interior._newton

    def failing(u: Tensor, h: Tensor | None, d: Tensor):  # type: ignore[no-untyped-def]
        return None if u.dtype == torch.float32 else real(u, h, d)

    monkeypatch.setattr(_interior, "_newton", failing)
    a, b = matrix("random", 30, 40, 11)
    result = nnls(a, b)
    _assert_nnls_optimal(a, b, result.x)


def test_a_float32_factorisation_that_fails_goes_on_in_float64() -> None:
    """A Newton system ``I + UD⁻¹Uᵀ`` with ``U`` of rank 1 and ``D = 1e-10``: in float32 the
    identity is lost against ``2e10`` and the factorisation fails, in float64 it holds. The
    step is the float64 one, bit for bit, and the iterations go on in float64 (no float32
    attempt per later step: the iterates near the boundary make no later system better)."""
    from gradbalance.balancers import _interior

    u = torch.ones(2, 2, dtype=F64)
    b = torch.tensor([1.0, 1.0], dtype=F64)
    x = torch.tensor([1.0, 1.0], dtype=F64)
    s = torch.full((2,), 1e-10, dtype=F64)  # D = s/x
    low = (u.float(), None)
    assert _interior._low_newton(low, s / x) is None  # float32 cannot factorise it
    step, after = _interior._adaptive_step(u, None, b, x, s, float(x @ s) / 2, low)
    expected = _interior._step(u, None, b, x, s, float(x @ s) / 2)
    assert after is None and step is not None and expected is not None
    assert all(torch.equal(a, e) for a, e in zip(step[:2], expected[:2], strict=True))
