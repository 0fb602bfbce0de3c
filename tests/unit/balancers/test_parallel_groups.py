"""The dual-cone projection with groups of parallel rows collapsed (``_parallel_groups``)
against scipy's NNLS on the rows and the optimality conditions on the rows: planted groups
with both signs, one sign, several of them, beside conflicting, zero and wide-norm rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import _cone, _parallel_groups
from gradbalance.balancers._solvers import project_dual_cone, trace_normalized
from gradbalance.gramian import compute_gramian
from support.cone_reference import assert_projections

F64 = torch.float64
#: Each group: its size, whether it has both signs, whether its norms span 1e-6 … 1e6.
GROUP = st.tuples(st.integers(3, 10), st.booleans(), st.booleans())
#: The groups, the lone conflicting rows, the zero rows, a seed.
CASES = st.tuples(st.lists(GROUP, min_size=1, max_size=3), st.integers(14, 28),
                  st.integers(0, 4), st.integers(0, 2**16))


pytestmark = pytest.mark.usefixtures("one_thread")  # K ≤ 100: one thread is faster


def _planted(case: tuple[list[tuple[int, bool, bool]], int, int, int], p: int) -> Tensor:
    """``[K, P]`` float64 rows: each group ``± cⱼ a`` (both signs, or one), lone conflicting
    rows (a third with norms over 1e-3 … 1e3), zero rows, shuffled."""
    groups, lone, zeros, seed = case
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(p, generator=gen, dtype=F64)
    rest = torch.randn(lone, 1, generator=gen, dtype=F64) * shared
    rest = rest + 0.5 * torch.randn(lone, p, generator=gen, dtype=F64)
    rest[: lone // 3] *= torch.logspace(-3, 3, lone // 3, dtype=F64)[:, None]
    parts = [rest, torch.zeros(zeros, p, dtype=F64)]
    for size, both, wide in groups:
        direction = torch.randn(p, generator=gen, dtype=F64)
        c = torch.rand(size, generator=gen, dtype=F64) + 0.5
        if wide:
            c = c * torch.logspace(-6, 6, size, dtype=F64)
        if both:
            c[: max(1, size // 3)] *= -1.0
        parts.append(c[:, None] * direction)
    g = torch.cat(parts)
    return g[torch.randperm(g.shape[0], generator=gen)]


def _problems(k: int, seed: int) -> Tensor:
    """UPGrad's K bounds ``pᵢeᵢ`` and DualProj's ``p``, for a random positive ``p``."""
    pref = torch.rand(k, generator=torch.Generator().manual_seed(seed), dtype=F64) + 0.1
    return torch.cat([torch.diag(pref), pref[None]])


class _Spy:
    """Records what :func:`~._parallel_groups.grouped_projection` returned on each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Tensor, Tensor] | None] = []

    def __call__(self, q: Tensor, lower: Tensor, reduced: _parallel_groups.Solve
                 ) -> tuple[Tensor, Tensor] | None:
        out = _parallel_groups.grouped_projection(q, lower, reduced)
        self.calls.append(out)
        return out


@settings(max_examples=40, deadline=None)
@given(CASES)
def test_planted_groups_are_collapsed_and_exact(
        case: tuple[list[tuple[int, bool, bool]], int, int, int]) -> None:
    """The groups are found, every problem certified, and each answer is scipy's projection
    and meets the KKT conditions on the rows; so is DualProj's one problem alone (collapsed
    only where a group has both signs)."""
    g = _planted(case, 40)
    k = g.shape[0]
    u = _problems(k, case[3])
    spy = _Spy()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_cone, "grouped_projection", spy)
        v = project_dual_cone(trace_normalized(g @ g.T)[0], u)
    assert spy.calls and spy.calls[0] is not None and bool(spy.calls[0][1].all())
    assert_projections(g, u, v)
    one = project_dual_cone(trace_normalized(g @ g.T)[0], u[-1])  # DualProj's one problem
    assert_projections(g, u[-1:], one[None])


@settings(max_examples=15, deadline=None)
@given(CASES)
def test_a_failed_check_falls_back_to_the_exact_path(
        case: tuple[list[tuple[int, bool, bool]], int, int, int]) -> None:
    """With a KKT tolerance no answer meets, every problem goes to the exact path: the same
    projections."""
    g = _planted(case, 40)
    u = _problems(g.shape[0], case[3])
    spy = _Spy()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_parallel_groups, "KKT_RTOL", -1.0)
        mp.setattr(_cone, "grouped_projection", spy)
        v = project_dual_cone(trace_normalized(g @ g.T)[0], u)
    assert spy.calls and spy.calls[0] is not None and not bool(spy.calls[0][1].any())
    assert_projections(g, u, v)


def _reference_weights(g: Tensor, u: Tensor) -> Tensor:
    """scipy's weights ``s*`` on the unit rows (zero rows left out): ``uⱼ‖gⱼ‖ + yⱼ``."""
    from scipy.optimize import nnls

    norms = g.norm(dim=1)
    live = norms > 0
    unit = g[live] / norms[live, None]
    y, _ = nnls(unit.T.numpy(), -(g.T @ u).numpy(), maxiter=10_000)
    return u[live] * norms[live] + torch.from_numpy(y)


def _collapsed(cos: Tensor) -> Tensor:
    """``C̃``: each group's rows and columns its representative's, with their signs."""
    groups = _parallel_groups.find_groups(cos.clone())
    if groups is None:
        return cos
    rep, sign = groups.rep, groups.sign
    return torch.outer(sign, sign) * cos[rep][:, rep]


@settings(max_examples=20, deadline=None)
@given(CASES)
def test_float32_rounded_gramian(case: tuple[list[tuple[int, bool, bool]], int, int, int]
                                 ) -> None:
    """Rows in float32, the Gramian multiplied in float32 (cosines ``±1`` only within about
    ``1e-7``, which the groups are found through): each update ``x`` is within the bound of a
    solve on ``C̃`` (the matrix with the groups collapsed) of scipy's ``x*`` on the rows,
    ``‖x − x*‖² ≤ ε (‖s‖² + ‖s*‖²)`` with ``ε = ‖C̃ − C*‖₂`` (``C*`` the rows' exact
    cosines; ``vᵀQ*v − v*ᵀQ*v* ≥ ‖x − x*‖²`` on the cone, docs/balancers.md, "Solvers"),
    times 2."""
    g = _planted(case, 200).float().double()
    u = _problems(g.shape[0], case[3])
    gram = compute_gramian(g.float())
    v = project_dual_cone(trace_normalized(gram)[0], u)
    norms = g.norm(dim=1)
    live = norms > 0
    unit = g[live] / norms[live, None]
    d = torch.diagonal(gram)[live].sqrt()
    eps = float(torch.linalg.matrix_norm(
        _collapsed(gram[live][:, live] / torch.outer(d, d)) - unit @ unit.T, ord=2))
    floor = float(norms.sum())
    for i in range(u.shape[0]):
        s, s_ref = v[i, live] * norms[live], _reference_weights(g, u[i])
        gap = float((s @ unit - s_ref @ unit).norm()) ** 2
        assert gap <= 2.0 * eps * float(s @ s + s_ref @ s_ref) + (1e-9 * floor) ** 2


def test_rows_apart_beyond_the_rounding_are_not_grouped() -> None:
    """Two rows at an angle of 2e-3 whose cosine is within ``τ`` of 1 (the matrix shows a
    rounding of 1e-6 elsewhere) deviate from each other by far more than ``τ``: no groups."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(24, 30, generator=gen, dtype=F64)
    rows[1] = rows[0]
    rows[3] = rows[2] + 2e-3 * rows[2].norm() * torch.randn(30, generator=gen, dtype=F64) / 30**0.5
    unit = rows / rows.norm(dim=1, keepdim=True)
    cos = unit @ unit.T
    cos[0, 1] = cos[1, 0] = 1.0 + 1e-6
    assert 1.0 - float(cos[2, 3]) <= _parallel_groups.ROUNDING_MULTIPLE * 1e-6
    assert _parallel_groups.find_groups(cos) is None


@pytest.mark.parametrize("seed", range(3))
def test_one_problem_on_copies_of_independent_rows_is_collapsed(seed: int) -> None:
    """DualProj's one problem on 20 conflicting rows each given twice (one-signed groups whose
    representatives are independent): collapsed, certified, scipy's projection; on rows of
    a rank-6 span each given twice (representatives dependent) it is not collapsed and the
    exact path answers, scipy's projection too."""
    gen = torch.Generator().manual_seed(seed)
    for rank in (None, 6):
        if rank is None:
            base = torch.randn(20, 60, generator=gen, dtype=F64)
            base += torch.randn(20, 1, generator=gen, dtype=F64) * torch.randn(
                60, generator=gen, dtype=F64)
        else:
            base = torch.randn(20, rank, generator=gen, dtype=F64) @ torch.randn(
                rank, 60, generator=gen, dtype=F64)
        g = torch.cat([base, base])[torch.randperm(40, generator=gen)]
        u = _problems(40, seed)[-1:]
        spy = _Spy()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_cone, "grouped_projection", spy)
            one = project_dual_cone(trace_normalized(g @ g.T)[0], u[0])
        assert_projections(g, u, one[None])
        if rank is None:
            assert spy.calls and spy.calls[0] is not None and bool(spy.calls[0][1].all())
        else:
            assert spy.calls == [None]


def _spread_by_hand(low: Tensor, t: Tensor, rep: Tensor, sign: Tensor) -> Tensor:
    """The members' values one group at a time: a lone row its ``t``; a group's members their
    bound plus the excess ``σⱼ(t_rep − Σ σᵢ lowᵢ)`` split equally over those whose excess is
    above the rounding, the others at their bound."""
    s = t.clone()
    for r in rep.unique().tolist():
        members = torch.nonzero(rep == r).flatten().tolist()
        if len(members) == 1:
            continue
        for b in range(low.shape[0]):
            at_low = sum(float(low[b, j] * sign[j]) for j in members)
            size = sum(abs(float(low[b, j])) for j in members) + abs(float(t[b, r]))
            excess = {j: float(sign[j]) * (float(t[b, r]) - at_low) for j in members}
            takers = [j for j in members
                      if excess[j] > _parallel_groups.EXCESS_ROUNDING * size]
            for j in members:
                s[b, j] = low[b, j] + (excess[j] / len(takers) if j in takers else 0.0)
    return s


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 24), st.integers(1, 6), st.integers(0, 2**16))
def test_spread_splits_each_groups_excess_over_its_members(n: int, b: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rep = torch.arange(n)
    for j in range(1, n):  # each row joins an earlier one's group with probability 0.4
        if float(torch.rand(1, generator=gen)) < 0.4:
            rep[j] = rep[int(torch.randint(0, j, (1,), generator=gen))]
    sign = torch.where(torch.rand(n, generator=gen) < 0.3, -1.0, 1.0).to(F64)
    sign[rep == torch.arange(n)] = 1.0  # a representative has its own sign
    low = torch.randn(b, n, generator=gen, dtype=F64) * (torch.rand(b, n, generator=gen) < 0.5)
    t = torch.randn(b, n, generator=gen, dtype=F64)
    groups = _parallel_groups.Groups(rep, sign, torch.zeros(n, dtype=torch.bool),
                                     torch.arange(n), torch.zeros(0, dtype=torch.int64), 0.0)
    expected = _spread_by_hand(low, t, rep, sign)
    got = _parallel_groups._spread(low, t.clone(), groups)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
