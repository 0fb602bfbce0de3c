"""CAGrad: scipy's primal value, c = 0, rescale options, degenerate inputs (a zero row, a
task and its reversal: the conflict-free update closest to the mean)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradbalance.balancers import CAGrad
from support.balancers import check_cagrad_zero_optimum, random_matrix, scipy_cagrad_value


@pytest.mark.parametrize("c", [0.1, 0.4, 0.9])
@pytest.mark.parametrize(("k", "p", "seed"), [(2, 4, 0), (3, 7, 1), (5, 12, 2), (6, 3, 3)])
def test_worst_task_improvement_matches_scipy(c: float, k: int, p: int, seed: int) -> None:
    # A second solver (SLSQP on the primal max_d min_k gₖ·d, ‖d − g₀‖ ≤ c‖g₀‖) finds the same
    # optimal value; ours must be feasible and at least as good (to the solver tolerance).
    g = random_matrix(seed, k, p)
    d = CAGrad(c=c)(g)
    g0 = g.mean(dim=0)
    assert float((d - g0).norm()) <= c * float(g0.norm()) * (1 + 1e-9)
    value = float((g @ d).min())
    expected = scipy_cagrad_value(g, c)
    assert value >= expected - 1e-6 * float(g.norm() ** 2)
    assert value == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_c_zero_is_mean_and_rescale() -> None:
    g = random_matrix(1, 3, 5)
    torch.testing.assert_close(CAGrad(c=0.0)(g), g.mean(dim=0), rtol=1e-12, atol=1e-14)
    base = CAGrad(c=0.5)(g)
    torch.testing.assert_close(CAGrad(c=0.5, rescale="c2")(g), base / 1.25)
    torch.testing.assert_close(CAGrad(c=0.5, rescale="c")(g), base / 1.5)


@pytest.mark.parametrize(("k", "seed"), [(3, 4), (5, 1), (8, 2), (24, 5), (40, 3)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_zero_row_gives_the_closest_conflict_free_update(k: int, seed: int,
                                                         dtype: torch.dtype) -> None:
    # min_k gₖ·d ≤ 0 for every d (a task with zero gradient): the dual optimum has g_w = 0.
    # Before, the update was g₀ (the authors' code), which conflicts with tasks here. The
    # cases: seeds whose optimum is 0 with g₀ conflicting (most are; the others' ball does
    # not reach a conflict-free update).
    g = random_matrix(seed, k, 60).to(dtype)
    g[seed % k] = 0
    exact = g.double()
    assert float((exact @ exact.mean(dim=0)).min()) < 0  # g₀ itself is not optimal
    update = CAGrad(c=0.4)(g).double()
    assert check_cagrad_zero_optimum(exact, update, 1e-10 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize(("k", "seed"), [(48, 4), (64, 24)])
def test_zero_row_among_norms_twelve_decades_apart(k: int, seed: int) -> None:
    # Norms 1e-6 … 1e6: the active set's rounding bound (the largest norm times the weights'
    # sum, which the shortest rows' large weights inflate) had hidden violations (K = 64:
    # the projection stopped 5e-4 of ‖g₀‖ short of the cone).
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(4 * k, generator=gen, dtype=torch.float64)
    g = torch.randn(k, 1, generator=gen, dtype=torch.float64) * shared + 0.5 * torch.randn(
        k, 4 * k, generator=gen, dtype=torch.float64)
    g = g * torch.logspace(-6, 6, k, dtype=torch.float64)[torch.randperm(k, generator=gen), None]
    g[seed % k] = 0
    assert check_cagrad_zero_optimum(g, CAGrad(c=0.4)(g), 1e-9)


def test_zero_row_with_a_conflict_free_mean_gives_the_mean() -> None:
    # g₀ conflicts with no task: it is its own projection, the update.
    g = torch.tensor([[1.0, 0.0, 0.0], [0.5, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(CAGrad()(g), g.mean(dim=0), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(("k", "seed"), [(4, 0), (6, 10), (8, 3), (16, 5), (24, 7)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_task_and_its_reversal_give_the_closest_conflict_free_update(
        k: int, seed: int, dtype: torch.dtype) -> None:
    # g and −2g (exact in float32) among rows conflicting along g: min(g·d, −2g·d) ≤ 0 for
    # every d, and SLSQP on the primal finds the value 0, so the dual optimum has g_w = 0.
    # The float32 Gramian left ‖g_w‖² at 1e-24 of (Σ wₖ‖gₖ‖)² (K = 4), above the
    # float64-only cut it had: weights of 3.5e10 on the pair and an update of 0; the
    # projection's own weights on the pair must not lean on the rounding either.
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(500, generator=gen)
    scale = torch.randn(k - 2, 1, generator=gen)
    others = scale * g + 0.5 * torch.randn(k - 2, 500, generator=gen)
    rows = torch.cat([others, g[None], -2 * g[None]]).to(dtype)
    out = CAGrad(c=0.4).combine(rows)
    assert check_cagrad_zero_optimum(rows.double(), out.vector,
                                     1e-10 if dtype == torch.float64 else 1e-5)
    assert float(out.weights.abs().max()) <= 1.0


def test_extreme_scale_is_not_uniform() -> None:
    # LibMTL-style +1e-4 terms turn CAGrad into the mean at tiny scales; here the weights are
    # the same at every scale.
    g = random_matrix(3, 3, 6)
    w1 = CAGrad().combine(g).weights
    w2 = CAGrad().combine(g * 1e-8).weights
    torch.testing.assert_close(w1, w2, rtol=1e-9, atol=1e-12)
    assert float((w1 - 1 / 3).abs().max()) > 1e-3


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="c"):
        CAGrad(c=1.0)
    with pytest.raises(ValueError, match="rescale"):
        CAGrad(rescale="yes")  # type: ignore[arg-type]


def test_agrees_with_torchjd_when_cvxpy_is_installed() -> None:
    pytest.importorskip("cvxpy")
    import torchjd.aggregation as tjd

    g = random_matrix(4, 3, 8)
    # TorchJD normalises the Gramian by its trace and uses CLARABEL; tolerance 1e-5.
    torch.testing.assert_close(CAGrad(c=0.4)(g), tjd.CAGrad(c=0.4)(g), rtol=1e-5, atol=1e-6)


def test_the_projection_falls_back_to_the_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    # The active set left open: Lawson–Hanson on the Gramian's factor gives the same
    # projection (scipy's NNLS on the unit rows).
    from gradbalance.balancers import _cagrad

    def never_done(q: torch.Tensor, lower: torch.Tensor, *args: object) -> tuple[
            torch.Tensor, torch.Tensor]:
        return lower.clone(), torch.zeros(lower.shape[0], dtype=torch.bool)

    monkeypatch.setattr(_cagrad, "box_active_set", never_done)
    g = random_matrix(2, 8, 60)
    g[2] = 0
    assert check_cagrad_zero_optimum(g, CAGrad(c=0.4)(g), 1e-10)


def test_a_projection_beyond_the_ball_is_shortened_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # g_w taken for zero where the optimum is negative (forced here): the conflict-free point
    # lies beyond the ball, and the update stops on its surface on the way there.
    from gradbalance.balancers import _cagrad
    from support.balancers import unit_dual_cone_projection

    g = random_matrix(3, 3, 40)
    g0 = g.mean(dim=0)
    target = unit_dual_cone_projection(g, g0)
    radius = 0.4 * float(g0.norm())
    assert float((target - g0).norm()) > 1.2 * radius  # the premise: beyond the ball
    monkeypatch.setattr(_cagrad, "_vanishes", lambda *args: True)
    d = CAGrad(c=0.4)(g)
    step = d - g0
    assert float(step.norm()) == pytest.approx(radius, rel=1e-9)
    cos = float(step @ (target - g0) / (step.norm() * (target - g0).norm()))
    assert cos >= 1 - 1e-9


@settings(max_examples=40, deadline=None)
@given(st.integers(3, 24), st.integers(0, 2**16), st.floats(0.05, 1.0), st.floats(0.0, 0.6),
       st.sampled_from([torch.float64, torch.float32]))
def test_a_zero_row_gives_the_primals_optimum(k: int, seed: int, noise: float,
                                              opposed: float, dtype: torch.dtype) -> None:
    # A zero row among rows sharing a direction, a share of them opposed: where g₀'s
    # projection lies in the ball (the optimum 0) it is the update, else the dual's answer
    # meets SLSQP's value on the primal, inside the ball. Both occur among these draws.
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(3 * k, generator=gen, dtype=torch.float64)
    signs = torch.where(torch.rand(k, 1, generator=gen, dtype=torch.float64) < opposed, -0.2, 1.0)
    g = signs * shared + noise * torch.randn(k, 3 * k, generator=gen, dtype=torch.float64)
    g[seed % k] = 0
    rows = g.to(dtype)
    exact = rows.double()
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    d = CAGrad(c=0.4)(rows).double()
    if check_cagrad_zero_optimum(exact, d, tol):
        return
    g0 = exact.mean(dim=0)
    assert float((d - g0).norm()) <= 0.4 * float(g0.norm()) * (1 + tol)
    scale = float(exact.norm(dim=1).max() * g0.norm())
    assert float((exact @ d).min()) >= scipy_cagrad_value(exact, 0.4) - 10 * tol * scale
