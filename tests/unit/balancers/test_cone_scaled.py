"""The dual-cone projection of UPGrad and DualProj (on the cosine matrix, zero rows set
aside) against scipy's NNLS on the rows and the optimality conditions on the rows, on every
kind of rows of the many-task check (``support.many_kinds``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers._solvers import project_dual_cone, trace_normalized
from support.cone_reference import assert_projections
from support.many_kinds import KIND_NAMES, assert_same_update, kind_rows

F64 = torch.float64
#: K from 3 (2 has its closed form) to 48, each kind, a seed.
CASES = st.tuples(st.integers(3, 48), st.sampled_from(KIND_NAMES), st.integers(0, 2**16))


pytestmark = pytest.mark.usefixtures("one_thread")  # K ≤ 100: one thread is faster


def _problems(k: int, seed: int) -> Tensor:
    """UPGrad's K bounds ``pᵢeᵢ`` and DualProj's ``p``, for a random positive ``p``."""
    pref = torch.rand(k, generator=torch.Generator().manual_seed(seed), dtype=F64) + 0.1
    return torch.cat([torch.diag(pref), pref[None]])


@settings(max_examples=30, deadline=None)
@given(CASES)
def test_projection_is_scipys_and_meets_kkt(case: tuple[int, str, int]) -> None:
    """Every problem: ``v ≥ u``, the update ``Jᵀv`` scipy's projection (cosine ≥ 0.999999,
    norm within 1e-6), in the dual cone and complementary to ``v − u``, relative to the
    rows' norms."""
    k, kind, seed = case
    g = kind_rows(kind, k, 2 * k + 3, seed)
    u = _problems(k, seed)
    v = project_dual_cone(trace_normalized(g @ g.T)[0], u)
    assert_projections(g, u, v)


def test_zero_rows_keep_their_bound_and_leave_the_rest() -> None:
    """A zero row's weight is its bound; the others are the projection without it."""
    g = kind_rows("conflicting", 6, 20, 3)
    g[[1, 4]] = 0.0
    u = _problems(6, 3)
    v = project_dual_cone(trace_normalized(g @ g.T)[0], u)
    live = torch.tensor([0, 2, 3, 5])
    rest = project_dual_cone(trace_normalized(g[live] @ g[live].T)[0], u[:, live])
    assert torch.equal(v[:, [1, 4]], u[:, [1, 4]])
    for i in range(u.shape[0]):
        assert_same_update(v[i, live] @ g[live], rest[i] @ g[live], g)


def test_wide_norms_match_the_unit_rows() -> None:
    """Rows scaled by 1e-6 … 1e6: the update is that of the unit rows with the bounds
    scaled by the norms (``s = Dv``), as the definition gives."""
    g = kind_rows("conflicting", 12, 40, 5)
    scales = torch.logspace(-6, 6, 12, dtype=F64)
    u = _problems(12, 5)
    gw = g * scales[:, None]
    wide = project_dual_cone(trace_normalized(gw @ gw.T)[0], u)
    unit = project_dual_cone(trace_normalized(g @ g.T)[0], u * scales)
    for i in range(u.shape[0]):
        assert_same_update(wide[i] @ gw, unit[i] @ g, gw)


def test_wide_norms_with_zero_bounds_project_the_others_only() -> None:
    """Norms 1e-6 … 1e6 and no zero row (the cosine matrix without gathers), some bounds
    zero: those problems' answer is 0 (``v ≥ 0`` at no cost), the others are each
    projected as they are alone (the same bound as a single problem)."""
    g = kind_rows("conflicting", 12, 40, 8)
    gw = g * torch.logspace(-6, 6, 12, dtype=F64)[:, None]
    u = _problems(12, 8)
    u[[2, 7]] = 0.0
    gram = trace_normalized(gw @ gw.T)[0]
    v = project_dual_cone(gram, u)
    assert torch.equal(v[[2, 7]], torch.zeros(2, 12, dtype=F64))
    for i in (0, 5, 12):
        alone = project_dual_cone(gram, u[i : i + 1])[0]
        assert_same_update(v[i] @ gw, alone @ gw, gw)
    assert_projections(gw, u, v)


@settings(max_examples=30, deadline=None)
@given(CASES)
def test_rows_already_in_the_cone_are_their_own_projection(case: tuple[int, str, int]) -> None:
    """A bound with ``uG ≥ 0`` (``Jᵀu`` in the cone: the KKT conditions hold at ``v = u``)
    comes back as it is; mixed with rows outside, each row is still scipy's projection, and
    projecting a projection gives it back (the cone's projection is idempotent)."""
    k, kind, seed = case
    g = kind_rows(kind, k, 2 * k + 3, seed)
    gram = trace_normalized(g @ g.T)[0]
    u = _problems(k, seed)
    v = project_dual_cone(gram, u)
    both = torch.cat([u, v])
    inside = (both @ gram >= 0).all(dim=1)
    again = project_dual_cone(gram, both)
    assert torch.equal(again[inside], both[inside])
    assert_projections(g, both, again)
    for i in range(k + 1):
        assert_same_update(again[k + 1 + i] @ g, v[i] @ g, g)


def test_agreeing_tasks_take_no_solve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows with pairwise non-negative inner products: every projection is its own bound,
    and the box solver is never called."""
    import gradbalance.balancers._solvers as solvers

    def refuse(*args: object, **kwargs: object) -> Tensor:
        raise AssertionError("the box solver ran on rows already in the cone")

    monkeypatch.setattr(solvers, "solve_box_qp", refuse)
    g = torch.rand(40, 90, generator=torch.Generator().manual_seed(0), dtype=F64)
    u = _problems(40, 0)
    v = project_dual_cone(trace_normalized(g @ g.T)[0], u)
    assert torch.equal(v, u)
    assert_projections(g, u, v)
