"""MGDA's min-norm point and CAGrad's dual with groups of parallel rows collapsed
(``_min_norm_groups``): MGDA against scipy's NNLS of the least-distance program on all the
rows and its KKT conditions on the whole Gramian (exact copies of tasks, longer positive
multiples, float32 copies against the exact path, and the cases the collapse must leave
alone: no groups, both signs, a zero row, a reduced answer that fails the check); CAGrad on
copies and on shorter and longer multiples against SLSQP's primal value on all the rows (the
weighted side of each group the one the optimal value's sign decides); PCD on copies
against scipy's NNLS of its least-distance program (copies with other guarantees not
collapsed); float32 copies against each method's exact path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import MGDA, PCD, CAGrad, _min_norm_groups, _pcd, _solvers
from gradbalance.balancers._min_norm_groups import grouped_min_norm
from gradbalance.balancers._solvers import cagrad_dual, min_norm_simplex
from gradbalance.functional import mgda_weights, pcd_weights
from gradbalance.gramian import compute_gramian, products_rounding
from support.balancers import scipy_cagrad_value, scipy_min_norm_value, scipy_pcd
from support.many_kinds import assert_same_update

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")  # K ≤ 96: one thread is faster


def _assert_kkt(gram: Tensor, w: Tensor, atol: float) -> None:
    """MGDA's KKT conditions on ``gram``: ``w ∈ Δ``, ``(Gw)ₖ ≥ wᵀGw``, equal where ``wₖ > 0``."""
    gw = gram @ w
    value = float(w @ gw)
    assert float(w.min()) >= 0.0 and float(w.sum()) == pytest.approx(1.0, abs=1e-12)
    assert float(gw.min()) >= value - atol
    assert float((gw - value)[w > 0].abs().max()) <= atol


def _with_copies(distinct: int, copies: list[tuple[int, float]], seed: int, p: int = 0,
                 conflict: bool = True, spread: float = 0.0) -> Tensor:
    """``[K, P]`` float64: ``distinct`` rows sharing a direction with signs that conflict
    (``aᵢ s + nᵢ/2``), their norms spread over ``10^±spread``, then for each ``(i, c)`` the
    row ``c·gᵢ``; shuffled."""
    gen = torch.Generator().manual_seed(seed)
    p = p or 2 * distinct + 10
    rows = 0.5 * torch.randn(distinct, p, generator=gen, dtype=F64)
    if conflict:
        rows += torch.randn(distinct, 1, generator=gen, dtype=F64) * torch.randn(
            p, generator=gen, dtype=F64)
    if spread:
        rows *= torch.logspace(-spread, spread, distinct, dtype=F64)[
            torch.randperm(distinct, generator=gen)][:, None]
    extra = torch.stack([c * rows[i] for i, c in copies]) if copies else rows[:0]
    both = torch.cat([rows, extra])
    return both[torch.randperm(both.shape[0], generator=gen)]


def _unit(rows: Tensor) -> Tensor:
    gram = rows @ rows.T
    return gram / gram.trace()


#: Copies: the row copied and its scale (1: an exact copy; above: a longer multiple).
COPY = st.tuples(st.integers(0, 11), st.sampled_from((1.0, 1.0, 1.5, 4.0)))


@settings(max_examples=40, deadline=None)
@given(st.integers(12, 30), st.lists(COPY, min_size=2, max_size=14), st.booleans(),
       st.sampled_from((0.0, 0.0, 3.0)), st.integers(0, 2**16))
def test_copies_meet_the_references(distinct: int, copies: list[tuple[int, float]],
                                    conflict: bool, spread: float, seed: int) -> None:
    # Tasks given again (exact copies, or multiples c ≥ 1), norms equal-ish or spread over
    # six decades: the collapse answers (enough rows removed), with the min-norm value of
    # scipy's NNLS on all the rows, MGDA's KKT on the whole Gramian, equal weights for exact
    # copies and none for a longer multiple.
    rows = _with_copies(distinct, copies, seed, conflict=conflict, spread=spread)
    k = rows.shape[0]
    unit = _unit(rows)
    removed = len(copies)  # each copy joins its original's group
    w = grouped_min_norm(unit, min_norm_simplex)
    if k < 17 or removed < max(1, k // 16):  # below the groups' size or share: not taken
        assert w is None
        return
    assert w is not None
    _assert_kkt(unit, w, 1e-12)
    value = float(w @ unit @ w) * float((rows @ rows.T).trace())
    scale = float((rows * rows).sum(dim=1).max())
    assert value == pytest.approx(scipy_min_norm_value(rows.T.numpy()), abs=1e-11 * scale)
    norms = rows.norm(dim=1)
    cos = (rows @ rows.T) / torch.outer(norms, norms)
    for a in range(k):
        for b in range(k):
            if a != b and float(cos[a, b]) > 1 - 1e-12:
                ratio = float(norms[b] / norms[a])
                if abs(ratio - 1.0) < 1e-12:  # exact copies: one weight
                    assert float(w[a]) == pytest.approx(float(w[b]), abs=1e-14)
                elif ratio > 1.0:  # the longer of two parallel rows: none
                    assert float(w[b]) == 0.0


@pytest.mark.parametrize("seed", range(3))
def test_mgda_on_a_task_given_twice_is_mgda_on_the_distinct_tasks(seed: int) -> None:
    # 24 tasks, the first 12 given a second time: MGDA's update is that of the 24 distinct
    # tasks (the copies' weights summed), each copy half of it.
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(24, 60, generator=gen, dtype=F64)
    rows[:, :1] += 3.0 * torch.randn(24, 1, generator=gen, dtype=F64)
    both = torch.cat([rows, rows[:12]])
    w_both = mgda_weights(both @ both.T)
    w_distinct = mgda_weights(rows @ rows.T)
    torch.testing.assert_close(both.T @ w_both, rows.T @ w_distinct, rtol=0, atol=1e-12)
    torch.testing.assert_close(w_both[:12], w_both[24:], rtol=0, atol=1e-15)
    torch.testing.assert_close(MGDA()(both), rows.T @ w_distinct, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(2))
def test_float32_copies_match_the_exact_path(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # float32 rows, 48 distinct each given twice (their Gramian's cosines within about 1e-7 of
    # 1): the collapsed answer's update within the rounding of the exact path's (the
    # collapse switched off), and MGDA's KKT on the whole Gramian to the grouping's bound.
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(48, 400, generator=gen)
    rows += torch.randn(48, 1, generator=gen) * torch.randn(400, generator=gen)
    both = torch.cat([rows, rows])[torch.randperm(96, generator=gen)].contiguous()
    gram = compute_gramian(both).to(F64)
    calls: list[bool] = []
    real = _solvers.grouped_min_norm

    def spy(g: Tensor, solve: _min_norm_groups.MinNorm) -> Tensor | None:
        out = real(g, solve)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(_solvers, "grouped_min_norm", spy)
    w = mgda_weights(gram)
    assert calls == [True]
    monkeypatch.setattr(_solvers, "grouped_min_norm", lambda g, solve: None)
    exact = mgda_weights(gram)
    update, reference = both.double().T @ w, both.double().T @ exact
    assert float((update - reference).norm()) <= 1e-6 * float(reference.norm())
    unit = gram / gram.trace()
    _assert_kkt(unit, w, 1e-6)


def test_no_groups_both_signs_or_a_zero_row_leave_the_exact_path() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(32, 80, generator=gen, dtype=F64)
    assert grouped_min_norm(_unit(rows), min_norm_simplex) is None  # nothing parallel
    opposite = torch.cat([rows, -rows[:8]])  # a group of both signs: 0 in the hull
    assert grouped_min_norm(_unit(opposite), min_norm_simplex) is None
    w = mgda_weights(opposite @ opposite.T)  # the exact path: the min-norm value is 0
    assert float((opposite.T @ w).norm()) <= 1e-10 * float(opposite.norm(dim=1).max())
    zero = torch.cat([rows, rows[:8], torch.zeros(1, 80, dtype=F64)])
    assert grouped_min_norm(_unit(zero), min_norm_simplex) is None
    assert grouped_min_norm(_unit(rows[:12].repeat(1, 1)), min_norm_simplex) is None  # K < 17


def test_a_reduced_answer_that_fails_the_check_is_refused() -> None:
    # The reduced problem "solved" by equal weights (not its min-norm point): the KKT check
    # on the whole Gramian refuses it, and the caller's exact path answers.
    rows = _with_copies(20, [(i, 1.0) for i in range(6)], seed=3)
    unit = _unit(rows)
    assert grouped_min_norm(unit, lambda g: torch.full((g.shape[0],), 1.0 / g.shape[0],
                                                       dtype=F64)) is None
    w = grouped_min_norm(unit, min_norm_simplex)
    assert w is not None
    _assert_kkt(unit, w, 1e-12)


def _assert_slsqp_value(rows: Tensor, c: float, d: Tensor) -> float:
    """CAGrad's update ``d`` inside its ball ``‖d − g₀‖ ≤ c‖g₀‖``, with the worst task
    improvement of SLSQP's on the same rows (returned)."""
    g0 = rows.mean(dim=0)
    assert float((d - g0).norm()) <= c * float(g0.norm()) * (1 + 1e-9)
    expected = scipy_cagrad_value(rows, c)
    value = float((rows @ d).min())
    assert value >= expected - 1e-6 * float(rows.norm() ** 2)
    assert value == pytest.approx(expected, rel=1e-5, abs=1e-7)
    return expected


def _spy_collapse(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records whether each of CAGrad's collapses found groups."""
    calls: list[bool] = []
    real = _solvers.collapse

    def spy(gram: Tensor, copies_only: bool = False,
            rounding: float = 0.0) -> _min_norm_groups.Collapse | None:
        out = real(gram, copies_only, rounding=rounding)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(_solvers, "collapse", spy)
    return calls


@pytest.mark.parametrize(("c", "seed"), [(0.2, 0), (0.5, 1), (0.9, 2)])
def test_cagrad_on_copies_meets_the_primal_value(c: float, seed: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # 20 conflicting tasks, 8 of them given twice or three times: the collapsed dual (the
    # copies' share of g₀ kept) gives a feasible update whose worst task improvement is
    # SLSQP's on all 28+ rows, and the copies equal weights.
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, 20, (8,), generator=gen).tolist()
    rows = _with_copies(20, [(i, 1.0) for i in picks], seed, p=30)
    calls = _spy_collapse(monkeypatch)
    d = CAGrad(c=c)(rows)
    assert calls == [True]
    _assert_slsqp_value(rows, c, d)
    gram = rows @ rows.T
    w = cagrad_dual(gram / gram.trace(), c)
    norms = rows.norm(dim=1)
    same = (rows[:, None, :] == rows[None, :, :]).all(dim=2)
    for a, b in torch.nonzero(same & ~torch.eye(len(rows), dtype=torch.bool)).tolist():
        assert float(w[a]) == pytest.approx(float(w[b]), abs=1e-15)
    assert bool((norms > 0).all())


def _assert_cagrad_side(rows: Tensor, c: float, expected: float) -> None:
    """Of each pair of parallel rows of unequal length, only the side the optimal value's sign
    picks carries weight: the shorter where it is positive, the longer where negative (at the
    optimum ``gⱼ·d ≥ value`` with equality on the support, and ``gⱼ·d`` scales with the row)."""
    gram = rows @ rows.T
    w = cagrad_dual(gram / gram.trace(), c)
    unit = rows / rows.norm(dim=1, keepdim=True)
    norms = rows.norm(dim=1)
    same = (unit @ unit.T) > 1.0 - 1e-12
    pairs = torch.nonzero(torch.triu(same, diagonal=1)).tolist()
    assert pairs
    for a, b in pairs:
        if abs(float(norms[a] - norms[b])) <= 1e-9 * float(norms[a]):
            continue
        short, long = (a, b) if norms[a] < norms[b] else (b, a)
        assert float(w[long if expected > 0 else short]) == 0.0


@pytest.mark.parametrize(("c", "seed", "scale", "conflict"),
                         [(0.2, 0, 2.0, True), (0.5, 1, 0.5, True), (0.9, 2, 3.0, True),
                          (0.5, 4, 2.0, False), (0.8, 5, 0.25, False)])
def test_cagrad_on_longer_multiples_meets_the_primal_value(
        c: float, seed: int, scale: float, conflict: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 20 tasks, 6 of them also given `scale` times as long: the dual collapsed to one side of
    # each pair (the optimal value's sign decides which), the update SLSQP's worst-task value
    # on all 26 rows, inside CAGrad's ball, and only the decided side weighted.
    rows = _with_copies(20, [(i, scale) for i in range(6)], seed, p=30, conflict=conflict)
    calls = _spy_collapse(monkeypatch)
    d = CAGrad(c=c)(rows)
    assert calls == [True]
    expected = _assert_slsqp_value(rows, c, d)
    # the value's sign is clear of the rounding
    assert abs(expected) > 1e-3 * float(rows.norm(dim=1).max() * rows.mean(dim=0).norm())
    _assert_cagrad_side(rows, c, expected)


@pytest.mark.parametrize(("seed", "scale"), [(2, 2.0), (5, 2.0), (28, 10.0)])
def test_cagrad_tries_the_other_side_where_the_first_fails(
        seed: int, scale: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # No task alone has F(eⱼ) < 0, so the shortest members are tried first; the optimal value
    # is negative (SLSQP's), their answer fails the check and the longest members' answers:
    # SLSQP's worst-task value, only the longer of each pair weighted.
    rows = _with_copies(20, [(i, scale) for i in range(6)], seed, p=40)
    tried: list[tuple[bool, bool]] = []
    real = _solvers._grouped_kkt_holds

    def spy(*args: Any) -> bool:
        ok = real(*args)
        tried.append((args[-1].longest, ok))
        return ok

    monkeypatch.setattr(_solvers, "_grouped_kkt_holds", spy)
    d = CAGrad(c=0.9)(rows)
    assert tried == [(False, False), (True, True)]
    expected = _assert_slsqp_value(rows, 0.9, d)
    assert expected < 0.0
    _assert_cagrad_side(rows, 0.9, expected)


@settings(max_examples=20, deadline=None)
@given(st.integers(17, 26), st.lists(st.tuples(st.integers(0, 16), st.sampled_from(
    (0.1, 0.5, 2.0, 10.0))), min_size=2, max_size=8), st.sampled_from((0.3, 0.6, 0.9)),
    st.booleans(), st.integers(0, 2**16))
def test_cagrad_on_longer_multiples_property(distinct: int, copies: list[tuple[int, float]],
                                             c: float, conflict: bool, seed: int) -> None:
    # Random multiples (shorter and longer, a decade either way) of random tasks: the
    # worst-task value of SLSQP on all the rows, whichever path answers.
    rows = _with_copies(distinct, copies, seed, p=40, conflict=conflict)
    d = CAGrad(c=c)(rows)
    g0 = rows.mean(dim=0)
    assert float((d - g0).norm()) <= c * float(g0.norm()) * (1 + 1e-9)
    expected = scipy_cagrad_value(rows, c)
    value = float((rows @ d).min())
    scale = float(rows.norm(dim=1).max() * g0.norm())
    assert value >= expected - 1e-6 * scale
    assert value == pytest.approx(expected, rel=1e-5, abs=1e-7 * scale)


def _wide_multiples(seed: int) -> Tensor:
    """``[48, 200]`` float32: 24 conflicting rows with norms over four decades, and 24
    multiples of them by ``1e3``, ``1e-3``, ``0.3`` and ``3`` (norms over ten decades)."""
    gen = torch.Generator().manual_seed(seed)
    rows = 0.5 * torch.randn(24, 200, generator=gen, dtype=F64)
    rows += torch.randn(24, 1, generator=gen, dtype=F64) * torch.randn(200, generator=gen,
                                                                       dtype=F64)
    rows *= torch.logspace(-2, 2, 24, dtype=F64)[torch.randperm(24, generator=gen)][:, None]
    picks = torch.randint(0, 24, (24,), generator=gen).tolist()
    scales = (1e3, 1e-3, 0.3, 3.0)
    extra = torch.stack([scales[j % 4] * rows[i] for j, i in enumerate(picks)])
    return torch.cat([rows, extra])[torch.randperm(48, generator=gen)].float()


@pytest.mark.parametrize(("seed", "c"), [(4, 0.5), (6, 0.9), (6, 0.5)])
def test_cagrad_on_multiples_over_ten_decades_keeps_each_row_exact(seed: int, c: float) -> None:
    # A float32 Gramian's grouping deviation (about 7e-7 of the cosines) checked against each
    # row's own scale, not the largest gradient's: the worst task's improvement within the
    # float32 Gramian's rounding (products_rounding, 3.6e-7 at P = 200, relative to the
    # largest row times ‖g₀‖) of SLSQP's on the float64 rows. A uniform check kept a
    # collapsed answer 1.5e-5 off at seed 6, c = 0.9.
    rows = _wide_multiples(seed)
    exact = rows.double()
    d = CAGrad(c=c)(rows).double()
    g0 = exact.mean(dim=0)
    scale = float(exact.norm(dim=1).max() * g0.norm())
    expected = scipy_cagrad_value(exact, c)
    assert float((exact @ d).min()) >= expected - products_rounding(rows) * scale
    assert float((d - g0).norm()) <= c * float(g0.norm()) * (1 + 1e-6)


def test_cagrad_float32_copies_match_the_exact_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # float32 rows, 40 tasks each given twice: the collapsed update within the rounding of the
    # exact path's (the collapse switched off).
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(40, 300, generator=gen)
    rows += torch.randn(40, 1, generator=gen) * torch.randn(300, generator=gen)
    both = torch.cat([rows, rows])[torch.randperm(80, generator=gen)].contiguous()
    calls = _spy_collapse(monkeypatch)
    d = CAGrad(c=0.5)(both)
    assert calls == [True]
    monkeypatch.setattr(_solvers, "collapse", lambda *args, **kwargs: None)
    exact = CAGrad(c=0.5)(both)
    assert float((d - exact).norm()) <= 1e-6 * float(exact.norm())


@pytest.mark.parametrize("seed", range(3))
def test_cagrad_float32_copies_at_any_norms_match_the_float64_rows(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # 40 tasks each given twice at norms 12 decades apart, not power-of-two multiples, in
    # float32: the Gramian CAGrad reads has its rounding removed and shows none, its copies'
    # cosines with the others apart by up to the removed rounding (the kept spectrum's cut),
    # within which the grouping now finds them. Reference: the same rows in float64; the
    # grouped update no further from it than the ungrouped path's on the float32 rows.
    both = _copies_at_any_norms(seed, 0)
    both = both[torch.randperm(80, generator=torch.Generator().manual_seed(seed))].contiguous()
    calls = _spy_collapse(monkeypatch)
    d = CAGrad(c=0.5)(both)
    assert calls == [True]
    monkeypatch.setattr(_solvers, "collapse", lambda *args, **kwargs: None)
    _no_further_than_ungrouped(d, CAGrad(c=0.5)(both), CAGrad(c=0.5)(both.double()))


def _copies_at_any_norms(seed: int, first: int) -> Tensor:
    """``[80 − first, 300]`` float32: 40 conflicting rows, those from ``first`` on given again,
    every row scaled by ``c·2^e`` (``c`` uniform in ``[1, 2)``, ``e`` from −20 to 20)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(40, 300, generator=gen)
    rows += torch.randn(40, 1, generator=gen) * torch.randn(300, generator=gen)
    both = torch.cat([rows, rows[first:]])
    scales = (1.0 + torch.rand(both.shape[0], generator=gen)) * torch.pow(
        2.0, torch.randint(-20, 21, (both.shape[0],), generator=gen).float())
    return (both * scales[:, None]).contiguous()


def _no_further_than_ungrouped(grouped: Tensor, ungrouped: Tensor, truth: Tensor) -> None:
    """The grouped update no further from the float64 rows' than the ungrouped path's (both
    within the products' rounding of it)."""
    off = float((ungrouped.double() - truth).norm())
    assert float((grouped.double() - truth).norm()) <= 1.5 * off + 1e-7 * float(truth.norm())
    assert off <= 1e-5 * float(truth.norm())


def _spy_pcd_collapse(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records whether each of PCD's collapses found groups."""
    calls: list[bool] = []
    real = _pcd.collapse

    def spy(gram: Tensor, copies_only: bool = False, labels: Tensor | None = None,
            longest: bool = False, rounding: float = 0.0) -> _min_norm_groups.Collapse | None:
        out = real(gram, copies_only, labels, longest, rounding)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(_pcd, "collapse", spy)
    return calls


@settings(max_examples=12, deadline=None)
@given(st.integers(18, 30), st.integers(2, 10), st.sampled_from((0.02, 0.3)),
       st.integers(0, 2**16))
def test_pcd_on_copies_is_scipys(distinct: int, copies: int, tau: float, seed: int) -> None:
    # Secondary tasks given again (the same row, the same τ: one constraint): PCD's update
    # d = g₁ + Σ μⱼgⱼ is scipy's NNLS of the least-distance program on all the rows, and the
    # copies' multipliers are equal.
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(1, distinct, (copies,), generator=gen).tolist()
    rows = _with_copies(distinct, [(i, 1.0) for i in picks], seed, p=3 * distinct)
    rows = rows / rows.norm(dim=1, keepdim=True)  # PCD's normalised rows
    k = rows.shape[0]
    taus = torch.full((k - 1,), tau, dtype=F64)
    with pytest.MonkeyPatch.context() as mp:
        calls = _spy_pcd_collapse(mp)
        mult = pcd_weights(rows @ rows.T, taus)
    assert calls[0] == (copies >= max(1, (k - 1) // 16))
    assert_same_update(mult @ rows, scipy_pcd(rows, tau), rows)
    same = (rows[1:, None, :] == rows[None, 1:, :]).all(dim=2)
    for a, b in torch.nonzero(same).tolist():
        assert float(mult[1 + a]) == pytest.approx(float(mult[1 + b]), abs=1e-14)


@settings(max_examples=12, deadline=None)
@given(st.integers(18, 30), st.integers(2, 10), st.sampled_from((0.0, 0.02, 0.3)),
       st.sampled_from((0.0, 3.0)), st.integers(0, 2**16))
def test_pcd_on_longer_multiples_is_scipys(distinct: int, copies: int, tau: float,
                                           spread: float, seed: int) -> None:
    # Secondary tasks given again at other lengths (gⱼ = c·gᵢ, c from 1/8 to 8; the rows
    # over 10^±spread): the longest member's constraint implies the others' (τ ≥ 0), the collapse
    # keeps it alone, and PCD's update is scipy's NNLS of the least-distance program on all
    # the rows, the shorter members' multipliers zero.
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(1, distinct, (copies,), generator=gen).tolist()
    lengths = torch.tensor([0.125, 0.5, 2.0, 3.0, 8.0], dtype=F64)
    factors = lengths[torch.randint(0, 5, (copies,), generator=gen)].tolist()
    rows = _with_copies(distinct, list(zip(picks, factors, strict=True)), seed,
                        p=3 * distinct, spread=spread)
    k = rows.shape[0]
    taus = torch.full((k - 1,), tau, dtype=F64)
    with pytest.MonkeyPatch.context() as mp:
        calls = _spy_pcd_collapse(mp)
        mult = pcd_weights(rows @ rows.T, taus)
    if copies >= max(1, (k - 1) // 16):
        assert any(calls)  # the whole problem's second collapse (then the reduced one's)
    assert_same_update(mult @ rows, scipy_pcd(rows, tau), rows)


def test_pcd_copies_with_other_guarantees_are_not_collapsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The same row asked for two different shares τ is two constraints (the larger binds):
    # no collapse, and the exact path is scipy's.
    rows = _with_copies(24, [(i, 1.0) for i in range(1, 9)], seed=6, p=60)
    rows = rows / rows.norm(dim=1, keepdim=True)
    k = rows.shape[0]
    taus = torch.full((k - 1,), 0.05, dtype=F64)
    same = (rows[1:, None, :] == rows[None, 1:, :]).all(dim=2) & ~torch.eye(k - 1, dtype=torch.bool)
    a, _ = torch.nonzero(same)[0].tolist()
    taus[a] = 0.2
    calls = _spy_pcd_collapse(monkeypatch)
    mult = pcd_weights(rows @ rows.T, taus)
    assert calls and not any(calls)
    reference = scipy_pcd(rows, taus)
    assert_same_update(mult @ rows, reference, rows)


@pytest.mark.parametrize("seed", range(2))
def test_pcd_float32_copies_match_the_exact_path(seed: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # PCD on float32 rows with every secondary task given twice: the update within the
    # rounding of the exact path's (the collapse switched off).
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(40, 300, generator=gen)
    rows += torch.randn(40, 1, generator=gen) * torch.randn(300, generator=gen)
    both = torch.cat([rows, rows[1:]]).contiguous()
    calls = _spy_pcd_collapse(monkeypatch)
    d = PCD(tau=0.1)(both)
    assert calls[0]
    monkeypatch.setattr(_pcd, "collapse", lambda *args, **kwargs: None)
    exact = PCD(tau=0.1)(both)
    assert float((d - exact).norm()) <= 1e-6 * float(exact.norm())


@pytest.mark.parametrize("seed", range(3))
def test_pcd_float32_copies_at_any_norms_match_the_exact_path(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every secondary task given twice at norms 12 decades apart that are not power-of-two
    # multiples, in float32: the rounding's removal leaves the copies parallel to 1e-15 but
    # their cosines with the others up to 9e-7 apart (P = 300), within the products'
    # rounding, which the grouping now reads. Reference: the same rows in float64 (exact
    # products); the grouped update is no further from it than the exact path's on the
    # float32 rows (both about 1e-6: the rounding of the products decides that much).
    both = _copies_at_any_norms(seed, 1)
    calls = _spy_pcd_collapse(monkeypatch)
    d = PCD(tau=0.1)(both)
    assert any(calls)
    monkeypatch.setattr(_pcd, "collapse", lambda *args, **kwargs: None)
    _no_further_than_ungrouped(d, PCD(tau=0.1)(both), PCD(tau=0.1)(both.double()))
