"""DWA, GLS, STCH, RLW, FAMO and IMTL-L against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from gradbalance.weighting import DWA, FAMO, GLS, IMTLL, RLW, STCH, ScaleInvariant


def _feed(w, losses, after=None) -> None:
    w(torch.tensor(losses, dtype=torch.float64))
    w.update(None if after is None else torch.tensor(after, dtype=torch.float64))


def test_dwa_weights_by_hand() -> None:
    w = DWA(3, temperature=2.0)
    _feed(w, [2.0, 2.0, 4.0])
    assert torch.equal(w.weights, torch.ones(3, dtype=torch.float64))  # first two periods: 1
    _feed(w, [1.0, 2.0, 4.0])
    # r = L(t-1)/L(t-2) = [0.5, 1, 1]; w = 3 e^{r/2} / Σ e^{r/2}
    e1, e2 = math.exp(0.25), math.exp(0.5)
    expected = torch.tensor([3 * e1, 3 * e2, 3 * e2], dtype=torch.float64) / (e1 + 2 * e2)
    torch.testing.assert_close(w.weights, expected)
    out = w(torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(out, expected)


def test_dwa_averages_over_a_period_and_end_period() -> None:
    w = DWA(2, temperature=1.0, period=2)
    for losses in ([4.0, 1.0], [2.0, 3.0], [1.0, 1.0], [1.0, 3.0]):
        _feed(w, losses)
    # period means: [3, 2] then [1, 2]; r = [1/3, 1]
    e = torch.exp(torch.tensor([1 / 3, 1.0], dtype=torch.float64))
    torch.testing.assert_close(w.weights, 2 * e / e.sum())
    manual = DWA(2, temperature=1.0, period=None)
    for losses in ([4.0, 1.0], [2.0, 3.0]):
        _feed(manual, losses)
    assert manual.end_period() and not manual.end_period()
    for losses in ([1.0, 1.0], [1.0, 3.0]):
        _feed(manual, losses)
    manual.end_period()
    torch.testing.assert_close(manual.weights, w.weights)


def test_gls_is_the_geometric_mean() -> None:
    theta = torch.tensor([1.0, 4.0, 2.0], dtype=torch.float64, requires_grad=True)
    losses = theta * torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    out = GLS(3)(losses)
    # (1·4·2)^{1/3} = 2; wₖ = 2 / (3 Lₖ)
    torch.testing.assert_close(out.sum(), torch.tensor(2.0, dtype=torch.float64))
    torch.testing.assert_close(out.detach() / losses.detach(),
                               torch.tensor([2 / 3, 1 / 6, 1 / 3], dtype=torch.float64))
    (grad,) = torch.autograd.grad(out.sum(), theta)
    ref_theta = theta.detach().clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(ref_theta.prod() ** (1 / 3), ref_theta)
    torch.testing.assert_close(grad, ref)
    with pytest.raises(ValueError, match="Invalid losses"):
        GLS(2)(torch.tensor([1.0, -1.0]))


def test_scale_invariant_is_the_sum_of_log_losses() -> None:
    theta = torch.tensor([1.0, 4.0, 2.0], dtype=torch.float64, requires_grad=True)
    scales = torch.tensor([1.0, 10.0, 0.1], dtype=torch.float64)
    out = ScaleInvariant(3)(theta * scales)
    torch.testing.assert_close(out.detach(), torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(ScaleInvariant(3).weights_of(theta * scales),
                               1 / (theta.detach() * scales))
    (grad,) = torch.autograd.grad(out.sum(), theta)
    # d/dθ Σ log(cₖθₖ) = 1/θₖ, whatever the constant scales cₖ
    torch.testing.assert_close(grad, 1 / theta.detach())
    with pytest.raises(ValueError, match="Invalid losses"):
        ScaleInvariant(2)(torch.tensor([1.0, -1.0]))


def test_stch_weights_by_hand_and_against_its_formula() -> None:
    w = STCH(2, mu=1.0)
    theta = torch.tensor([1.0, math.e], dtype=torch.float64, requires_grad=True)
    out = w(theta * 1.0)
    # f = log L = [0, 1]; w = 2·softmax(f)/L = 2/(1+e) for both tasks
    torch.testing.assert_close(w.weights, torch.full((2,), 2 / (1 + math.e), dtype=torch.float64))
    (grad,) = torch.autograd.grad(out.sum(), theta)
    t = theta.detach().clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(2 * 1.0 * torch.log(torch.exp(torch.log(t) / 1.0).sum()), t)
    torch.testing.assert_close(grad, ref)


def test_stch_small_mu_is_the_max_and_nadir_comes_from_warmup() -> None:
    sharp = STCH(2, mu=1e-3, nadir=[1.0, 4.0])
    sharp(torch.tensor([2.0, 4.0], dtype=torch.float64))
    # normalised log-losses [log 2, 0]: all weight on task 0, wₖ = K/Lₖ
    torch.testing.assert_close(sharp.weights, torch.tensor([1.0, 0.0], dtype=torch.float64))
    w = STCH(2, mu=1.0, warmup_steps=2)
    assert w.in_warmup
    _feed(w, [1.0, 4.0])
    torch.testing.assert_close(w.weights, torch.tensor([1.0, 0.25], dtype=torch.float64))
    _feed(w, [3.0, 2.0])
    assert not w.in_warmup
    torch.testing.assert_close(w.nadir, torch.tensor([2.0, 3.0], dtype=torch.float64))


def test_rlw_draws_softmax_of_a_normal_from_its_generator() -> None:
    w = RLW(4, seed=11)
    ref = torch.Generator().manual_seed(11)
    draws = [torch.softmax(torch.randn(4, generator=ref, dtype=torch.float64), 0)
             for _ in range(3)]
    torch.testing.assert_close(w.weights, draws[0])
    _feed(w, [1.0] * 4)
    torch.testing.assert_close(w.weights, draws[1])
    w(torch.ones(4))
    w.update(found_inf=True)          # skipped: same weights, generator not advanced
    torch.testing.assert_close(w.weights, draws[1])
    _feed(w, [1.0] * 4)
    torch.testing.assert_close(w.weights, draws[2])
    many = RLW(3, seed=0, distribution="dirichlet")
    total = torch.zeros(3, dtype=torch.float64)
    for _ in range(2000):
        torch.testing.assert_close(many.weights.sum(), torch.tensor(1.0, dtype=torch.float64))
        total += many.weights
        _feed(many, [1.0] * 3)
    torch.testing.assert_close(total / 2000, torch.full((3,), 1 / 3, dtype=torch.float64),
                               atol=0.02, rtol=0)


def test_famo_weights_and_first_logit_step_by_hand() -> None:
    w = FAMO(3, lr=0.025, gamma=0.01)
    out = w(torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64))
    # z uniform: wₖ ∝ 1/Lₖ, summing to 1
    torch.testing.assert_close(w.weights, torch.tensor([4.0, 2.0, 1.0], dtype=torch.float64) / 7)
    torch.testing.assert_close(out, torch.full((3,), 4 / 7, dtype=torch.float64))
    w.update(torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64))
    # δ = [log 2, 0, 0]: ∇ξ = z(δ − z·δ) has signs [+, −, −]; Adam's first step is lr·sign
    expected = torch.tensor([-0.025, 0.025, 0.025], dtype=torch.float64)
    torch.testing.assert_close(w.logits.detach(), expected, atol=1e-6, rtol=0)  # Adam eps
    with pytest.raises(ValueError, match="losses_after"):
        w(torch.ones(3))
        w.update()


def test_imtl_l_scales_converge_to_inverse_losses() -> None:
    w = IMTLL(3, dtype=torch.float64)
    losses = torch.tensor([0.5, 2.0, 8.0], dtype=torch.float64)
    torch.testing.assert_close(w(losses), losses)          # s = 0: e^0·L − 0
    opt = torch.optim.Adam(w.parameters(), lr=0.05)
    for _ in range(600):
        opt.zero_grad()
        w(losses).sum().backward()
        opt.step()
        w.update()
    torch.testing.assert_close(w.weights, 1 / losses, rtol=1e-3, atol=0)
