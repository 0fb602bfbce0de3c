"""The K-dimensional solvers: batched QPs, closed forms and CAGrad's root search.

References are independent: scipy's NNLS and SLSQP, hand-derived optima, and the KKT
conditions of each problem.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import gradbalance as gb
from gradbalance.balancers._boxqp import factored_box_qp, psd_factor
from gradbalance.balancers._cagrad_root import support_root
from gradbalance.balancers._solvers import (
    cagrad_dual,
    min_norm_simplex,
    project_dual_cone,
    project_simplex,
    solve_box_qp,
)
from support.balancers import (
    matrices,
    nnls_dual_cone,
    random_matrix,
    scipy_cagrad_value,
    scipy_min_norm,
)

SETTINGS = settings(max_examples=30, deadline=None)
F64 = torch.float64


def _unit(g: Tensor) -> Tensor:
    gram = g @ g.T
    return gram / gram.trace()


@SETTINGS
@given(matrices(min_k=2, max_k=7, max_p=9), st.booleans())
def test_batched_dual_cone_projections_match_nnls(g: Tensor, well: bool) -> None:
    # Both linear-algebra paths (pivoting + Cholesky; active set + pseudo-inverse) against
    # scipy's NNLS on the rows, for all K projections at once and for a random preference.
    k = g.shape[0]
    gram = _unit(g)
    if well and bool(torch.linalg.eigvalsh(gram)[0] < 1e-9):
        well = False  # the Cholesky path needs a positive definite Gramian
    u = torch.diag(torch.rand(k, generator=torch.Generator().manual_seed(k), dtype=F64))
    v = solve_box_qp(gram, torch.zeros_like(u), u, well_conditioned=well)
    assert v.shape == (k, k) and bool((v >= u).all())
    scale = float(gram.trace() / (g * g).sum()) ** 0.5  # rows of J for the unit Gramian
    for i in range(k):
        torch.testing.assert_close(g.T @ v[i] * scale, nnls_dual_cone(g * scale, u[i]),
                                   rtol=1e-7, atol=1e-9)


@SETTINGS
@given(matrices(min_k=2, max_k=7, max_p=9), st.booleans())
def test_factored_path_matches_nnls_and_slsqp(g: Tensor, simplex: bool) -> None:
    # The least-squares path on a factor of Q runs alone here (it also finishes what block
    # pivoting leaves open).
    k = g.shape[0]
    gram = _unit(g)
    factor = psd_factor(gram)
    scale = float(gram.trace() / (g * g).sum()) ** 0.5
    zeros = torch.zeros(k, dtype=F64)
    if simplex:
        w = factored_box_qp(factor, zeros, zeros, True, None, 1e-12)
        value = float(w @ gram @ w)
        assert abs(value - scipy_min_norm(g) / float((g @ g.T).trace())) <= 1e-8
    else:
        u = torch.eye(k, dtype=F64) / k
        for i in range(k):
            v = factored_box_qp(factor, zeros, u[i], False, None, 1e-12)
            torch.testing.assert_close(g.T @ v * scale, nnls_dual_cone(g * scale, u[i]),
                                       rtol=1e-7, atol=1e-9)


@SETTINGS
@given(matrices(min_k=3, max_k=7, max_p=9), st.booleans())
def test_min_norm_simplex_matches_slsqp_and_kkt(g: Tensor, well: bool) -> None:
    gram = _unit(g)
    if well and bool(torch.linalg.eigvalsh(gram)[0] < 1e-9):
        well = False
    k = g.shape[0]
    zeros = torch.zeros(k, dtype=F64)
    w = solve_box_qp(gram, zeros, zeros, simplex=True, well_conditioned=well)
    assert float(w.min()) >= 0 and abs(float(w.sum()) - 1) < 1e-12
    gw = gram @ w
    value = float(w @ gw)
    assert float((gw - value).min()) >= -1e-10  # KKT: (Gw)ₖ ≥ wᵀGw, equality on the support
    assert float((gw[w > 1e-9] - value).abs().max()) <= 1e-10
    assert abs(value - scipy_min_norm(g) / float((g @ g.T).trace())) <= 1e-8


@pytest.mark.parametrize("seed", range(4))
def test_batched_simplex_with_lower_bounds_satisfies_kkt(seed: int) -> None:
    # min ½ xᵀQx + cᵀx s.t. x ≥ lower, Σx = 1, three problems at once (batched pivoting).
    g = random_matrix(seed, 5, 4 + 4 * (seed % 2))  # rank-deficient for odd seeds
    gram = _unit(g)
    gen = torch.Generator().manual_seed(seed)
    lower = torch.rand(3, 5, generator=gen, dtype=F64) * 0.1
    c = (torch.rand(3, 5, generator=gen, dtype=F64) @ gram)  # in the range of Q
    x = solve_box_qp(gram, c, lower, simplex=True)
    for b in range(3):
        assert bool((x[b] >= lower[b]).all()) and abs(float(x[b].sum()) - 1) < 1e-12
        grad = gram @ x[b] + c[b]
        free = x[b] > lower[b] + 1e-12
        nu = float(grad[free].mean())
        assert float((grad[free] - nu).abs().max()) <= 1e-10
        assert float((grad - nu).min()) >= -1e-10
        # Alone (the single-problem code path) it is the same optimum.
        alone = solve_box_qp(gram, c[b], lower[b], simplex=True)
        value = float(0.5 * alone @ gram @ alone + c[b] @ alone)
        assert abs(value - float(0.5 * x[b] @ gram @ x[b] + c[b] @ x[b])) <= 1e-12


def test_two_task_min_norm_closed_form_hand_derived() -> None:
    # g1 = (1, 0), g2 = (0, 2): γ = (4 − 0)/(1 + 4) = 0.8, update (0.8, 0.4).
    gram = torch.tensor([[1.0, 0.0], [0.0, 4.0]], dtype=F64)
    torch.testing.assert_close(min_norm_simplex(gram), torch.tensor([0.8, 0.2], dtype=F64))
    # One row shorter and aligned: the min-norm point is that row (γ clipped to 1).
    aligned = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=F64)
    torch.testing.assert_close(min_norm_simplex(aligned), torch.tensor([1.0, 0.0], dtype=F64))
    # Equal rows: any point is optimal, γ = ½.
    equal = torch.ones(2, 2, dtype=F64)
    torch.testing.assert_close(min_norm_simplex(equal), torch.tensor([0.5, 0.5], dtype=F64))


@pytest.mark.parametrize("seed", range(6))
def test_two_task_dual_cone_closed_form_matches_nnls(seed: int) -> None:
    g = random_matrix(seed, 2, 5)
    pref = torch.rand(2, generator=torch.Generator().manual_seed(seed), dtype=F64)
    if seed == 5:
        g[1] = 0  # a zero row: nothing to project on
    expected = sum(nnls_dual_cone(g, torch.diag(pref)[i]) for i in range(2))
    torch.testing.assert_close(gb.balancers.UPGrad(pref=pref)(g), expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gb.balancers.DualProj(pref=pref)(g), nnls_dual_cone(g, pref),
                               rtol=1e-9,
                               atol=1e-12)


def test_dual_cone_single_and_batched_agree() -> None:
    g = random_matrix(7, 5, 11)
    gram = _unit(g)
    u = torch.eye(5, dtype=F64) / 5
    batched = project_dual_cone(gram, u)
    for i in range(5):
        # One problem alone must not depend on the others solved beside it.
        torch.testing.assert_close(project_dual_cone(gram, u[i]), batched[i], rtol=0,
                                   atol=1e-14)


def test_warm_started_simplex_qp_reaches_the_same_optimum() -> None:
    g = random_matrix(3, 6, 10)
    gram = _unit(g)
    zeros = torch.zeros(6, dtype=F64)
    cold = solve_box_qp(gram, zeros, zeros, simplex=True)
    start = torch.zeros(6, dtype=F64)
    start[int(torch.argmax(cold))] = 1.0  # a feasible vertex, possibly with the wrong support
    for well in (True, False):
        warm = solve_box_qp(gram, zeros, zeros, simplex=True, x0=start, well_conditioned=well)
        torch.testing.assert_close(warm @ gram @ warm, cold @ gram @ cold, rtol=1e-12,
                                   atol=1e-15)


def test_rank_deficient_dual_cone_needs_no_option() -> None:
    # rank 3 < K: every projection is answered (no iteration budget to raise), and it is the
    # projection: scipy's NNLS on the rows gives the same vectors.
    g = random_matrix(4, 6, 3)
    gram = _unit(g)
    u = torch.eye(6, dtype=F64)
    v = solve_box_qp(gram, torch.zeros_like(u), u)
    scale = float(gram.trace() / (g * g).sum()) ** 0.5
    for i in range(6):
        torch.testing.assert_close(g.T @ v[i] * scale, nnls_dual_cone(g * scale, u[i]),
                                   rtol=1e-9, atol=1e-12)


def test_support_root_hand_derived() -> None:
    # Orthogonal equal-norm gradients, G = I/K: by symmetry w* = 1/K, and
    # ‖g_w*‖² = K · (1/K)² · (1/K) = 1/K², so ρ* = ‖g_w*‖ = 1/K.
    k = 4
    gram = torch.eye(k, dtype=F64) / k
    w = torch.full((k,), 1.0 / k, dtype=F64)
    r = 0.4 * float(w @ gram @ w) ** 0.5
    root = support_root(gram, gram @ w, r, w > 0)
    assert root is not None
    assert root[0] == pytest.approx(1.0 / k, rel=1e-12)
    torch.testing.assert_close(root[1], w, rtol=0, atol=1e-15)
    torch.testing.assert_close(cagrad_dual(gram, 0.4), w, rtol=0, atol=1e-12)


@SETTINGS
@given(matrices(min_k=2, max_k=8, min_p=2, max_p=12), st.sampled_from([0.1, 0.5, 0.9]))
def test_cagrad_dual_satisfies_its_kkt_conditions(g: Tensor, c: float) -> None:
    # min_{w∈Δ} wᵀlin + r‖g_w‖: ∇ = lin + r G w/‖g_w‖ is equal (ν) on the support and ≥ ν
    # elsewhere.
    gram = _unit(g)
    k = g.shape[0]
    mean = torch.full((k,), 1.0 / k, dtype=F64)
    lin = gram @ mean
    r = c * float(mean @ lin) ** 0.5
    if r < 1e-6:
        return
    w = cagrad_dual(gram, c)
    norm = float(w @ gram @ w) ** 0.5
    if norm < 1e-6:
        return  # degenerate (a zero-norm combination is optimal): covered elsewhere
    assert float(w.min()) >= 0 and abs(float(w.sum()) - 1) < 1e-12
    grad = lin + r * (gram @ w) / norm
    support = w > 1e-9
    nu = float(grad[support].mean())
    assert float((grad[support] - nu).abs().max()) <= 1e-8
    assert float((grad - nu).min()) >= -1e-8


@pytest.mark.parametrize("seed", range(3))
def test_cagrad_large_k_matches_scipy(seed: int) -> None:
    g = random_matrix(seed, 9, 20)
    d = gb.balancers.CAGrad(c=0.5)(g)
    expected = scipy_cagrad_value(g, 0.5)
    assert float((g @ d).min()) == pytest.approx(expected, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize(("seed", "k", "p"), [(47, 4, 2), (101, 4, 2), (3, 5, 3), (8, 6, 2)])
def test_cagrad_rank_deficient_matches_scipy(seed: int, k: int, p: int) -> None:
    # K > P can put 0 in the convex hull of the rows: the root search must not mistake a
    # nearly zero-norm combination (a QP solved at a tiny, badly scaled ρ) for the optimum
    # when a better one exists (regression: the first two inputs caught it).
    g = random_matrix(seed, k, p)
    d = gb.balancers.CAGrad(c=0.4)(g)
    expected = scipy_cagrad_value(g, 0.4)
    scale = float((g * g).sum())
    assert float((g @ d).min()) >= expected - 1e-6 * scale


@pytest.mark.parametrize("c", [0.1, 0.5, 0.9])
@pytest.mark.parametrize(("seed", "lean"), [(0, 0.0), (1, 1.5), (2, -0.9), (3, 0.3)])
def test_cagrad_two_tasks_closed_form_matches_scipy(c: float, seed: int, lean: float) -> None:
    # lean < 0 makes the rows nearly aligned (a vertex of the simplex can be optimal),
    # lean > 0 makes them conflict (an interior optimum).
    g = random_matrix(seed, 2, 5, conflict=False)
    g[1] = g[1] - lean * g[0]
    d = gb.balancers.CAGrad(c=c)(g)
    g0 = g.mean(dim=0)
    assert float((d - g0).norm()) <= c * float(g0.norm()) * (1 + 1e-9)
    expected = scipy_cagrad_value(g, c)
    assert float((g @ d).min()) == pytest.approx(expected, rel=1e-6, abs=1e-8)


@SETTINGS
@given(st.lists(st.floats(-3, 3), min_size=1, max_size=9))
def test_project_simplex_kkt(values: list[float]) -> None:
    v = torch.tensor(values, dtype=F64)
    w = project_simplex(v)
    assert float(w.min()) >= 0 and abs(float(w.sum()) - 1) < 1e-12
    # w = max(v − θ, 0): v − w is one constant θ on the support and v ≤ θ off it.
    support = w > 0
    theta = (v - w)[support]
    assert float(theta.max() - theta.min()) <= 1e-12
    assert bool((v[~support] <= theta[0] + 1e-12).all())


def test_pcd_large_k_matches_torchjd() -> None:
    # Ten tasks (2⁹ working sets for an enumeration); the QP solver must give TorchJD's answer.
    from torchjd.aggregation import PCDWeighting

    g = random_matrix(5, 10, 30)
    g[0] *= 3
    a = g @ g.T
    ours, ref = gb.balancers.PCD(tau=0.3, beta=0.9), PCDWeighting(tau=0.3, beta=0.9)
    for _ in range(2):
        torch.testing.assert_close(ours.compute_weights(a), ref(a), rtol=1e-9, atol=1e-12)
