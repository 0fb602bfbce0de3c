"""Mathematical properties of the Gramian balancers on random and conflicting inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from torch import Tensor

import gradbalance as gb
from gradbalance.balancers._pcgrad import pcgrad_coefficients, pcgrad_orders
from support.balancers import matrices, nnls_dual_cone, random_matrix, textbook_pcgrad

SETTINGS = settings(max_examples=40, deadline=None)


def _tol(g: Tensor) -> float:
    return 1e-9 * float((g * g).sum())


@SETTINGS
@given(matrices())
def test_pcgrad_equals_textbook_rows(g: Tensor) -> None:
    orders = pcgrad_orders(g.shape[0], torch.Generator().manual_seed(0))
    coef = pcgrad_coefficients(g @ g.T, orders)
    torch.testing.assert_close(coef @ g, textbook_pcgrad(g, orders), rtol=1e-6, atol=1e-9)


@SETTINGS
@given(matrices(min_k=2, max_k=2))
def test_pcgrad_two_tasks_removes_the_conflict(g: Tensor) -> None:
    coef = pcgrad_coefficients(g @ g.T, pcgrad_orders(2, torch.Generator().manual_seed(1)))
    rows = coef @ g
    assert float(rows[0] @ g[1]) >= -_tol(g)
    assert float(rows[1] @ g[0]) >= -_tol(g)


@SETTINGS
@given(matrices())
def test_mgda_is_the_min_norm_point(g: Tensor) -> None:
    result = gb.balancers.MGDA().combine(g)
    w = result.weights
    assert w is not None
    gram = g @ g.T
    gw = gram @ w
    norm_sq = w @ gw
    tol = _tol(g)
    assert float(w.min()) >= 0 and abs(float(w.sum()) - 1) < 1e-12
    # KKT of min wᵀGw on the simplex: (Gw)_k >= wᵀGw, with equality where w_k > 0.
    assert float((gw - norm_sq).min()) >= -tol
    support = w > 1e-9
    assert float((gw[support] - norm_sq).abs().max()) <= tol
    # MGDA's guarantee: no task's gradient has a negative inner product with the update.
    assert float((g @ result.vector).min()) >= -tol


@SETTINGS
@given(matrices())
def test_dual_cone_methods_do_not_conflict(g: Tensor) -> None:
    k = g.shape[0]
    for balancer in (gb.balancers.UPGrad(), gb.balancers.DualProj()):
        out = balancer(g)
        assert float((g @ out).min()) >= -_tol(g), type(balancer).__name__
    # Second implementation: scipy's NNLS on the [K, P] rows.
    u = torch.full((k,), 1.0 / k, dtype=torch.float64)
    torch.testing.assert_close(gb.balancers.DualProj()(g), nnls_dual_cone(g, u),
                               rtol=1e-7, atol=1e-9)
    expected = sum(nnls_dual_cone(g, torch.eye(k, dtype=torch.float64)[i] / k) for i in range(k))
    torch.testing.assert_close(gb.balancers.UPGrad()(g), expected, rtol=1e-7, atol=1e-9)


@SETTINGS
@given(matrices(max_p=3))
def test_dual_cone_projection_is_identity_inside_the_cone(g: Tensor) -> None:
    # When the mean does not conflict with any task, DualProj returns it unchanged.
    mean = g.mean(dim=0)
    if float((g @ mean).min()) > 1e-6 * float((g * g).sum()):
        torch.testing.assert_close(gb.balancers.DualProj()(g), mean, rtol=1e-9, atol=1e-12)


@SETTINGS
@given(matrices(min_k=2, max_k=5, min_p=6, max_p=10))
def test_imtlg_equal_projections_on_unit_gradients(g: Tensor) -> None:
    # K <= P: the rows are linearly independent (almost surely), the equal-projection direction
    # exists and IMTL-G's weights sum to one.
    result = gb.balancers.IMTLG().combine(g)
    assert result.weights is not None
    proj = (g @ result.vector) / g.norm(dim=1)
    if float(result.weights.abs().sum()) > 0:
        torch.testing.assert_close(proj, proj[0].expand_as(proj), rtol=1e-7, atol=1e-9)
        assert abs(float(result.weights.sum()) - 1) < 1e-9


@SETTINGS
@given(matrices(min_k=2, max_k=5, min_p=6, max_p=10))
def test_config_equal_cosines_and_length(g: Tensor) -> None:
    out = gb.balancers.ConFIG()(g)
    unit = out / out.norm()
    cos = (g @ unit) / g.norm(dim=1)
    torch.testing.assert_close(cos, cos[0].expand_as(cos), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(out.norm(), (g @ unit).sum().abs(), rtol=1e-9, atol=1e-12)


@SETTINGS
@given(matrices(min_p=2))
def test_cagrad_constraint_and_optimality(g: Tensor) -> None:
    c = 0.4
    result = gb.balancers.CAGrad(c=c).combine(g)
    assert result.weights is not None
    d, g0 = result.vector, g.mean(dim=0)
    radius = c * float(g0.norm())
    # The update lies on the ball ‖d − g₀‖ = c‖g₀‖ (the constraint is active for c > 0).
    assert abs(float((d - g0).norm()) - radius) <= 1e-7 * max(radius, 1e-300) + 1e-12
    # Optimality (saddle point): d − g₀ = r g_w/‖g_w‖ with w on the simplex supported on the
    # tasks that attain min_k gₖ·d.
    k = g.shape[0]
    w = result.weights - 1.0 / k
    if float(w.abs().sum()) > 0:
        w = w / w.sum()
        assert float(w.min()) >= -1e-12
        dots = g @ d
        support = w > 1e-7
        scale = float(g.norm(dim=1).max() * d.norm())
        assert float((dots[support] - dots.min()).max()) <= 1e-6 * scale


@pytest.mark.parametrize("scale", [1e-8, 1e-4, 1e4, 1e8])
@pytest.mark.parametrize("name", ["pcgrad", "gradvac", "cagrad", "mgda", "imtlg", "alignedmtl",
                                  "upgrad", "dualproj", "config"])
def test_positive_homogeneity(name: str, scale: float) -> None:
    g = random_matrix(3, 4, 9)
    gen = {"generator": torch.Generator().manual_seed(0)} if name in ("pcgrad", "gradvac") else {}
    a = gb.get_balancer(name, **gen)
    gen = {"generator": torch.Generator().manual_seed(0)} if gen else {}
    b = gb.get_balancer(name, **gen)
    assert a.homogeneous
    for _ in range(2):  # two steps: GradVac's targets must also be scale-free
        torch.testing.assert_close(a(g * scale) / scale, b(g), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("scale", [1e-8, 1e-3, 1e3, 1e8])
def test_nashmtl_scaling_is_documented(scale: float) -> None:
    g = random_matrix(5, 3, 8)
    paper = gb.balancers.NashMTL()
    assert not paper.homogeneous
    # Paper's definition: B(sJ) = B(J) (weights scale by 1/s).
    torch.testing.assert_close(paper(g * scale), gb.balancers.NashMTL()(g), rtol=1e-9, atol=1e-12)
    frob = gb.balancers.NashMTL(normalization="frobenius")
    assert frob.homogeneous
    torch.testing.assert_close(frob(g * scale) / scale,
                               gb.balancers.NashMTL(normalization="frobenius")(g),
                               rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("normalization", "apply_to", "homogeneous"), [
    ("none", "normalized", True), ("loss", "normalized", True), ("l2", "normalized", False),
    ("loss+", "normalized", False), ("l2", "raw", True), ("loss+", "raw", True)])
def test_mgda_homogeneity_flag_is_truthful(normalization: str, apply_to: str,
                                           homogeneous: bool) -> None:
    g = random_matrix(7, 3, 6)
    losses = torch.tensor([0.5, 1.5, 2.0], dtype=torch.float64)
    b = gb.balancers.MGDA(normalization=normalization, apply_to=apply_to)  # type: ignore[arg-type]
    assert b.homogeneous is homogeneous
    s = 1e3
    expected = s * b(g, losses) if homogeneous else b(g, losses)
    torch.testing.assert_close(b(g * s, losses), expected, rtol=1e-9, atol=1e-12)
