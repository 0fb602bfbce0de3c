"""The dual cone's projections with the tasks that are non-negative combinations of others
dropped (``balancers/_combinations.py``): the dependencies recovered from a hand-built null
space, UPGrad's and DualProj's projections on float32 Gramians of rows with such tasks
against scipy's NNLS on the float64 rows (:mod:`support.cone_reference`: the same update,
cosine ≥ 0.999999 and norm within 1e-6), with the reduction taken (from 64 tasks, where the
dual cone's batches reach it); a signed combination (no row a non-negative combination of
the others) left to the other routes; a wrong reduced answer refused by the whole problem's
KKT test; random combinations, signed or not (hypothesis, 12 examples), against scipy."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import _boxqp, _combinations
from gradbalance.balancers._solvers import project_dual_cone, trace_normalized
from support.cone_reference import scipy_projection
from support.many_kinds import assert_same_update

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(k: int, combos: list[tuple[int, list[tuple[int, float]]]], seed: int) -> Tensor:
    """``[K, 3K]`` float32 conflicting rows; for each ``(j, [(i, c), …])`` row ``j`` replaced
    by ``Σ c·gᵢ`` (in float32, as a model's summed losses)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(k, 1, generator=gen) * torch.randn(3 * k, generator=gen)
    g = g + 0.5 * torch.randn(k, 3 * k, generator=gen)
    for j, terms in combos:
        g[j] = sum(c * g[i] for i, c in terms)
    return g


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int] | None]:
    """Records each reduction's ``(problems done, problems)``, None where it did not apply."""
    calls: list[tuple[int, int] | None] = []
    real = _boxqp.without_combinations

    def spy(*args: Any) -> tuple[Tensor, Tensor] | None:
        out = real(*args)
        calls.append(None if out is None else (int(out[1].sum()), out[1].numel()))
        return out

    monkeypatch.setattr(_boxqp, "without_combinations", spy)
    return calls


def _assert_projections(rows: Tensor, u: Tensor) -> Tensor:
    """``project_dual_cone`` on the float32 product of ``rows``: ``v ≥ u`` and each update
    scipy's projection on the float64 rows; returns ``v``."""
    gram, _ = trace_normalized((rows @ rows.T).double())
    v = project_dual_cone(gram, u)
    g = rows.double()
    assert bool((v >= u).all())
    for i in range(u.shape[0]):
        assert_same_update(v[i] @ g, scipy_projection(g, u[i]), g)
    return v


def test_dependencies_from_a_hand_built_null_space() -> None:
    # Six unit rows with ĝ₄ = 2ĝ₂ and ĝ₅ = ĝ₀ + 0.5ĝ₁, the null space spanned by e₄ − 2e₂ and
    # e₅ − e₀ − 0.5e₁ given in a mixed orthonormal basis: two rows dropped (row 2 or 4 for
    # the first: each is a non-negative multiple of the other), each a non-negative
    # combination of the kept rows whose vector eⱼ − cⱼ lies in the null space, the kept
    # rows mapped to themselves.
    a = torch.zeros(6, dtype=F64)
    a[4], a[2] = 1.0, -2.0
    b = torch.zeros(6, dtype=F64)
    b[5], b[0], b[1] = 1.0, -1.0, -0.5
    null = torch.linalg.qr(torch.stack([a + b, a - 2 * b], dim=1)).Q
    found = _combinations._dependencies(null)
    assert found is not None
    keep, t = found
    assert keep.numel() == 4 and 5 not in keep.tolist() and {0, 1, 3} <= set(keep.tolist())
    torch.testing.assert_close(t[keep], torch.eye(4, dtype=F64), rtol=0, atol=0)
    assert bool((t >= 0).all())
    for j in sorted(set(range(6)) - set(keep.tolist())):
        vec = torch.zeros(6, dtype=F64)
        vec[keep] = -t[j]
        vec[j] = 1.0
        assert float((vec - null @ (null.T @ vec)).norm()) <= 1e-12


def test_two_signs_on_each_side_is_not_a_dependency() -> None:
    # ĝ₀ + ĝ₃ = ĝ₁ + ĝ₂: every row's representation has a negative coefficient; nothing dropped.
    n = torch.zeros(5, 1, dtype=F64)
    n[0], n[3], n[1], n[2] = 1.0, 1.0, -1.0, -1.0
    assert _combinations._dependencies(n / n.norm()) is None


@pytest.mark.parametrize(("k", "dependent", "seed"), [(64, 3, 0), (96, 6, 1), (128, 8, 2)])
def test_upgrad_on_tasks_that_are_sums_of_others(k: int, dependent: int, seed: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # The last rows sums of two others (float32, as summed losses): the reduction answers
    # every problem, each projection scipy's on the float64 rows, the dropped rows' own
    # multipliers zero (v = u there).
    gen = torch.Generator().manual_seed(seed + 10)
    pairs = torch.randint(0, k - dependent, (dependent, 2), generator=gen).tolist()
    combos = [(k - dependent + t, [(a, 1.0), (b, 1.0)]) for t, (a, b) in enumerate(pairs)]
    rows = _rows(k, combos, seed)
    calls = _spy(monkeypatch)
    u = torch.eye(k, dtype=F64)
    v = _assert_projections(rows, u)
    assert calls == [(k, k)]
    dropped = torch.tensor([j for j, _ in combos])
    assert bool((v[:, dropped] == u[:, dropped]).all())


def test_weighted_and_overlapping_combinations(monkeypatch: pytest.MonkeyPatch) -> None:
    # 64 rows: one is 0.5g₀ + 2g₁ + g₂, two share the summand g₃, one is a combination of
    # another dropped row (g₆₃ = g₆₂ + g₅): all found, every projection scipy's.
    k = 64
    combos = [(60, [(0, 0.5), (1, 2.0), (2, 1.0)]), (61, [(3, 1.0), (6, 1.0)]),
              (62, [(3, 1.0), (7, 3.0)])]
    rows = _rows(k, combos, 3)
    rows[63] = rows[62] + rows[5]
    calls = _spy(monkeypatch)
    _assert_projections(rows, torch.eye(k, dtype=F64))
    assert calls == [(k, k)]


def test_a_signed_combination_takes_the_other_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    # g₆₃ = g₀ + g₁ − g₂ and g₆₂ = g₃ + g₄ − g₅ (g₆₃ + g₂ = g₀ + g₁): dependencies in which
    # no row is a non-negative combination of the others; nothing is dropped (where the
    # Gramian is not certified positive definite first), the other routes answer, scipy's.
    rows = _rows(64, [(63, [(0, 1.0), (1, 1.0), (2, -1.0)]),
                      (62, [(3, 1.0), (4, 1.0), (5, -1.0)])], 4)
    calls = _spy(monkeypatch)
    _assert_projections(rows, torch.eye(64, dtype=F64))
    assert calls in ([], [None])


def test_a_wrong_reduced_answer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reduced problems "solved" at their lower bounds: the whole problem's KKT test
    # refuses (almost) all of them, the lifted route answers those, scipy's projections.
    k = 96
    rows = _rows(k, [(90 + t, [(2 * t, 1.0), (2 * t + 1, 1.0)]) for t in range(6)], 5)
    real = _combinations.without_combinations
    done: list[int] = []

    def wrong(q: Tensor, lower: Tensor, lift: float, nullity: int,
              solve: _combinations.Solve) -> tuple[Tensor, Tensor] | None:
        out = real(q, lower, lift, nullity, lambda reduced, low: low.clone())
        assert out is not None
        done.append(int(out[1].sum()))
        return out

    monkeypatch.setattr(_boxqp, "without_combinations", wrong)
    _assert_projections(rows, torch.eye(k, dtype=F64))
    assert done and done[0] < k // 4


def test_one_problem_is_left_to_the_lift(monkeypatch: pytest.MonkeyPatch) -> None:
    # One problem (DualProj's: the mean gradient projected) on rows with sums of others: not
    # reduced (the lifted single solve is as fast), scipy's projection.
    k = 64
    rows = _rows(k, [(60 + t, [(2 * t, 1.0), (2 * t + 1, 1.0)]) for t in range(4)], 6)
    calls = _spy(monkeypatch)
    _assert_projections(rows, torch.full((1, k), 1.0 / k, dtype=F64))
    assert calls == []


@settings(max_examples=12, deadline=None)
@given(st.integers(64, 96), st.lists(st.tuples(st.lists(st.integers(0, 40), min_size=2,
                                                        max_size=3, unique=True),
                                               st.sampled_from((0.5, 1.0, 2.0))),
                                     min_size=1, max_size=6),
       st.booleans(), st.integers(0, 2**16))
def test_random_combinations_property(k: int, combos: list[tuple[list[int], float]],
                                      signed: bool, seed: int) -> None:
    # Random rows that are combinations of 2–3 others (one coefficient scaled), one of them
    # signed where drawn (then nothing may be dropped): whichever route answers, v ≥ u and
    # the projections of four problems (the last row's among them) scipy's on the float64 rows.
    given_rows = [(k - 1 - t, [(i, c if n == 0 else 1.0) for n, i in enumerate(terms)])
                  for t, (terms, c) in enumerate(combos)]
    if signed:
        j, terms = given_rows[0]
        given_rows[0] = (j, [(terms[0][0], -terms[0][1]), *terms[1:]])
    rows = _rows(k, given_rows, seed)
    gram, _ = trace_normalized((rows @ rows.T).double())
    u = torch.eye(k, dtype=F64)
    v = project_dual_cone(gram, u)
    assert bool((v >= u).all()) and bool(torch.isfinite(v).all())
    g = rows.double()
    for i in (0, k // 3, 2 * k // 3, k - 1):
        assert_same_update(v[i] @ g, scipy_projection(g, u[i]), g)


def test_the_whole_problems_kkt_test_hand_derived() -> None:
    # min ½vᵀQv, Q = [[2, −1], [−1, 2]], v ≥ (1, 0): v = (1, ½) (w₂ = −1 + 2v₂ = 0) holds;
    # v₂ = 0.6 (w₂ = 0.2, above the bound) fails unless a slack of 0.25 is given; v = (1, 0)
    # (at the bound with w₂ = −1) and v₂ = −0.1 (below its bound) fail; v ≥ (1, 1) at
    # (1, 1) holds (w = (1, 1) ≥ 0).
    from gradbalance.balancers._box_kkt import box_kkt_holds

    q = torch.tensor([[2.0, -1.0], [-1.0, 2.0]], dtype=F64)
    lower = torch.tensor([[1.0, 0.0]] * 4, dtype=F64)
    v = torch.tensor([[1.0, 0.5], [1.0, 0.6], [1.0, 0.0], [1.0, -0.1]], dtype=F64)
    assert box_kkt_holds(q, lower, v, 1e-12).tolist() == [True, False, False, False]
    slack = torch.full((4, 2), 0.25, dtype=F64)
    assert box_kkt_holds(q, lower, v, 1e-12, slack).tolist() == [True, True, False, False]
    ones = torch.ones(1, 2, dtype=F64)
    assert box_kkt_holds(q, ones, ones, 1e-12).tolist() == [True]
