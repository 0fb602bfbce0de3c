"""The block pivoting on the weighted simplex ``aᵀx = 1`` (CAGrad's QPs on the cosine matrix).

``argmin ½ xᵀQx + cᵀx`` s.t. ``x ≥ 0``, ``aᵀx = 1`` is judged by its own optimality conditions
(feasibility; the gradient ``Qx + c`` equal to ``νa`` on the support and at least ``νa`` off
it, ``ν`` fitted on the support) and against cvxpy's Clarabel on the same QP (pinned with the
test tools), by the objective value, not by the solver's status. The weights span up to
twelve decades, as ``aⱼ = min d/dⱼ`` does for rows of norms ``1e-6 … 1e6``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradbalance.balancers import CAGrad
from gradbalance.balancers import _cagrad_scaled as scaled
from gradbalance.balancers._boxqp import min_norm_ls, pivot_weighted_simplex
from gradbalance.balancers._cholesky import BlockFactors

cp = pytest.importorskip("cvxpy")

F64 = torch.float64
TOL = 1e-12


def _problem(k: int, p: int, decades: float, seed: int) -> tuple[torch.Tensor, ...]:
    """A cosine matrix of ``k`` random rows in ``p`` dimensions, a linear term, weights
    ``logspace(0, −decades)`` shuffled."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(k, p, generator=gen, dtype=F64)
    rows = rows / rows.norm(dim=1, keepdim=True)
    q = rows @ rows.T
    c = torch.randn(k, generator=gen, dtype=F64) * 0.3
    a = torch.logspace(0.0, -decades, k, dtype=F64)[torch.randperm(k, generator=gen)]
    return q, c, a


def _kkt_gap(q: torch.Tensor, c: torch.Tensor, a: torch.Tensor, x: torch.Tensor) -> float:
    """The largest violation of the optimality conditions, relative to the gradient's size."""
    grad = q @ x + c
    on = x > 0
    nu = (a[on] @ grad[on]) / (a[on] @ a[on])
    dev = torch.where(on, (grad - nu * a).abs(), (nu * a - grad).clamp_min(0.0)).max()
    return float(dev / (1.0 + grad.abs().max()))


def _reference_value(q: torch.Tensor, c: torch.Tensor, a: torch.Tensor) -> float | None:
    x = cp.Variable(q.shape[0])
    problem = cp.Problem(cp.Minimize(0.5 * cp.quad_form(x, cp.psd_wrap(q.numpy())) + c.numpy() @ x),
                         [x >= 0, a.numpy() @ x == 1])
    try:
        problem.solve(solver=cp.CLARABEL)
    except cp.error.SolverError:
        return None
    if x.value is None:
        return None
    v = np.maximum(np.asarray(x.value), 0.0)
    v = v / float(a.numpy() @ v)  # feasible: its value bounds the optimum from above
    return float(0.5 * v @ q.numpy() @ v + c.numpy() @ v)


def _solve(q: torch.Tensor, c: torch.Tensor, a: torch.Tensor,
           x0: torch.Tensor | None = None) -> torch.Tensor | None:
    blocks = BlockFactors(q)  # x0 = 0: from the vertex the linear part prefers
    start = torch.zeros_like(c) if x0 is None else x0
    return pivot_weighted_simplex(q, c, a, start, TOL, blocks.factor)


def _least_distance(q: torch.Tensor, c: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The same QP by CAGrad's fallback where the pivoting gives up (``_cagrad_scaled``):
    ``min ‖Σ uⱼ pⱼ‖`` over ``u ≥ 0``, ``aᵀu = 1``, with ``pⱼ = ℓⱼ + aⱼ h`` (``Q = LLᵀ``,
    ``c = Lh``), whose square is twice the objective plus a constant on the constraint."""
    low = torch.linalg.cholesky(q)
    h = torch.linalg.solve_triangular(low, c[:, None], upper=False)[:, 0]
    return min_norm_ls(low.T + h[:, None] * a[None, :], None, TOL, a)


@settings(max_examples=20, deadline=None)
@given(k=st.integers(3, 40), p=st.integers(50, 200), decades=st.floats(0.0, 12.0),
       seed=st.integers(0, 2**16), scale=st.sampled_from([1e-6, 1.0, 1e4]))
def test_optimal_against_its_conditions_and_clarabel(k: int, p: int, decades: float,
                                                       seed: int, scale: float) -> None:
    """The pivoting's answer, or where it gives up (``None``, as documented: it stalls where
    the linear part dominates, ``scale = 1e-6``, weights five decades apart) CAGrad's
    fallback's, is optimal."""
    q, c, a = _problem(k, p, decades, seed)
    q = q * scale  # CAGrad's (r/ρ) C: a scalar multiple far from 1 at the search's ends
    x = _solve(q, c, a)
    if x is None:
        x = _least_distance(q, c, a)
    assert bool((x >= 0).all())
    assert abs(float(a @ x) - 1.0) <= 1e-10  # the rounding of the solve (its ν, from sums)
    assert _kkt_gap(q, c, a, x) <= 1e-10
    ref = _reference_value(q, c, a)
    if ref is not None:
        ours = float(0.5 * x @ q @ x + c @ x)
        assert ours <= ref + 1e-7 * (1.0 + abs(ref))


def test_closed_form_two_tasks() -> None:
    # min ½(x₁² + x₂²) over x ≥ 0, x₁ + 2x₂ = 1 (c = 0): x ∝ a, x = a/‖a‖² = (0.2, 0.4)
    q = torch.eye(2, dtype=F64)
    a = torch.tensor([1.0, 2.0], dtype=F64)
    x = _solve(q, torch.zeros(2, dtype=F64), a)
    assert x is not None
    assert torch.allclose(x, torch.tensor([0.2, 0.4], dtype=F64), atol=1e-15)


def test_vertex_where_the_linear_part_dominates() -> None:
    # a tiny quadratic: the optimum is the vertex e_j/a_j of the smallest c_j/a_j
    q = 1e-12 * torch.eye(3, dtype=F64)
    c = torch.tensor([1.0, -1.0, -3.0], dtype=F64)
    a = torch.tensor([1.0, 0.1, 1.0], dtype=F64)  # c/a = 1, −10, −3
    x = _solve(q, c, a)
    assert x is not None
    assert torch.allclose(x, torch.tensor([0.0, 10.0, 0.0], dtype=F64), rtol=1e-9)


def test_warm_start_reaches_the_same_point() -> None:
    q, c, a = _problem(30, 80, 9.0, 7)
    cold = _solve(q, c, a)
    assert cold is not None
    wrong = torch.zeros(30, dtype=F64)
    wrong[(cold == 0).nonzero().flatten()[:5]] = 1.0  # a support that is all wrong
    warm = _solve(q, c, a, wrong)
    assert warm is not None
    assert torch.allclose(warm, cold, rtol=1e-10, atol=1e-14)


def test_cagrad_falls_back_to_lawson_hanson(monkeypatch: pytest.MonkeyPatch) -> None:
    # where the pivoting does not finish, the QPs go to the least-distance program: the
    # same update
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(12, 60, generator=gen, dtype=F64) * torch.logspace(-5, 5, 12,
                                                                          dtype=F64)[:, None]
    pivoted = CAGrad(c=0.5).combine(rows).vector
    calls: list[int] = []

    def never(*args: object) -> None:
        calls.append(1)
        return None
    monkeypatch.setattr(scaled, "pivot_weighted_simplex", never)
    fallback = CAGrad(c=0.5).combine(rows).vector
    # the route was taken; after the pivoting's one failure the search's other QPs went to
    # Lawson–Hanson without trying it again
    assert len(calls) == 1
    cos = float(pivoted @ fallback / (pivoted.norm() * fallback.norm()))
    assert cos >= 1 - 1e-12
    assert abs(float(pivoted.norm() / fallback.norm()) - 1.0) <= 1e-9
