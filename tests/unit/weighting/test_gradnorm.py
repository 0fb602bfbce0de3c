"""GradNorm: the paper's targets, no leakage into the model, renormalisation, AMP, micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from gradbalance import NonFiniteGradientError
from gradbalance.weighting import GradNorm

K = 3


def _problem(scales: tuple[float, ...] = (1.0, 3.0, 10.0), n: int = 128,
             dtype: torch.dtype = torch.float32) -> tuple[nn.Module, nn.ModuleList, Tensor,
                                                          Tensor]:
    """A 3-task regression (the paper's synthetic form ``σₖ tanh((B + εₖ) x)``)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    d, h = 8, 16
    x = torch.randn(n, d, generator=g)
    base = torch.randn(d, h, generator=g)
    ys = torch.stack([s * torch.tanh(x @ (base + 0.3 * torch.randn(d, h, generator=g))).sum(1) / 4
                      for s in scales], 1)
    trunk = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh()).to(dtype)
    heads = nn.ModuleList([nn.Linear(h, 1) for _ in scales]).to(dtype)
    return trunk, heads, x.to(dtype), ys.to(dtype)


def _losses(trunk: nn.Module, heads: nn.ModuleList, x: Tensor, y: Tensor) -> Tensor:
    f = trunk(x)
    return torch.stack([((head(f).squeeze(1) - y[:, k]) ** 2).mean()
                        for k, head in enumerate(heads)])


def _layer_norms(losses: Tensor, layer: list[Tensor]) -> Tensor:
    """‖∇_W Lₖ‖ computed directly, as the reference."""
    out = []
    for k in range(losses.shape[0]):
        grads = torch.autograd.grad(losses[k], layer, retain_graph=True)
        out.append(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
    return torch.stack(out)


def _train(steps: int, model_lr: float, renormalize: bool = True, alpha: float = 1.5):
    """GradNorm in a plain loop; ``model_lr=0`` freezes the model (one forward, graph kept)."""
    trunk, heads, x, y = _problem()
    gn = GradNorm(K, trunk, alpha=alpha, renormalize=renormalize)
    opt = torch.optim.Adam([*trunk.parameters(), *heads.parameters()], lr=model_lr or 1.0)
    frozen = _losses(trunk, heads, x, y) if model_lr == 0 else None
    sums = []
    for _ in range(steps):
        if frozen is not None:
            gn(frozen)  # the model does not move: only w learns
        else:
            weighted = gn(_losses(trunk, heads, x, y))
            opt.zero_grad()
            weighted.sum().backward()
            opt.step()
        gn.update()
        sums.append(float(gn.weights.sum()))
        assert bool((gn.weights > 0).all())
    return gn, trunk, heads, x, y, sums


def test_default_layer_is_the_last_shared_layer() -> None:
    trunk, *_ = _problem()
    gn = GradNorm(K, trunk)
    assert gn.layer_params == [trunk[2].weight, trunk[2].bias]


def test_frozen_model_weights_reach_inverse_norms() -> None:
    # Losses constant -> r = 1 -> target: equal weighted norms, i.e. wₖ ∝ 1/‖∇_W Lₖ‖.
    gn, trunk, heads, x, y, _ = _train(200, model_lr=0.0)
    norms = _layer_norms(_losses(trunk, heads, x, y), [trunk[2].weight, trunk[2].bias])
    expected = K * (1 / norms) / (1 / norms).sum()
    torch.testing.assert_close(gn.weights, expected, rtol=0.05, atol=0)


def test_weighted_norms_approach_the_paper_targets() -> None:
    gn, trunk, heads, x, y, sums = _train(150, model_lr=3e-3)
    losses = _losses(trunk, heads, x, y)
    layer = [trunk[2].weight, trunk[2].bias]
    norms = _layer_norms(losses, layer)
    share = gn.weights * norms / (gn.weights * norms).sum()
    # the rule's target: Gₖ ∝ rₖ^α, rₖ = (Lₖ/Lₖ(0)) / mean
    ratio = losses.detach().double() / gn.initial_losses
    target = (ratio / ratio.mean()) ** 1.5
    target = target / target.sum()
    start = norms / norms.sum()  # the shares with w = 1
    assert float((share - target).abs().max()) < 0.15 * float(target.max())
    assert float((share - target).abs().max()) < 0.5 * float((start - target).abs().max())
    assert max(abs(s - K) for s in sums) < 1e-6


def test_without_renormalisation_the_sum_drifts() -> None:
    _, _, _, _, _, sums = _train(300, model_lr=3e-3, renormalize=False)
    # the sum wanders with the model (renormalised: within 1e-6 of K, see above)
    assert abs(sums[-1] - K) > 0.3
    assert abs(sums[-1] - K) > abs(sums[99] - K)


def test_no_leakage_into_the_model_gradient() -> None:
    trunk, heads, x, y = _problem()
    gn = GradNorm(K, trunk)
    opt = torch.optim.SGD([*trunk.parameters(), *heads.parameters()], lr=1e-3)
    for _ in range(5):  # move w away from 1
        weighted = gn(_losses(trunk, heads, x, y))
        opt.zero_grad()
        weighted.sum().backward()
        opt.step()
        gn.update()
    w = gn.weights
    assert not torch.allclose(w, torch.ones(K, dtype=torch.float64))
    ref_trunk, ref_heads = copy.deepcopy(trunk), copy.deepcopy(heads)
    opt.zero_grad()
    weighted = gn(_losses(trunk, heads, x, y))
    weighted.sum().backward()
    grads = [p.grad.clone() for p in trunk.parameters()]
    gn.update()  # L_grad's backward must not touch the model's .grad
    after = [p.grad for p in trunk.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads, after))
    plain = (w.float() * _losses(ref_trunk, ref_heads, x, y)).sum()
    ref = torch.autograd.grad(plain, list(ref_trunk.parameters()))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)


def test_mixed_precision_uses_true_norms() -> None:
    fp32, scaled = _problem(), _problem()
    gn_ref, gn_amp = GradNorm(K, fp32[0]), GradNorm(K, scaled[0])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    assert scaler.is_enabled()
    opt_ref = torch.optim.SGD([*fp32[0].parameters(), *fp32[1].parameters()], lr=1e-3)
    opt_amp = torch.optim.SGD([*scaled[0].parameters(), *scaled[1].parameters()], lr=1e-3)
    for _ in range(5):
        w = gn_ref(_losses(*fp32))
        opt_ref.zero_grad()
        w.sum().backward()
        opt_ref.step()
        gn_ref.update()

        w = gn_amp(_losses(*scaled), scaler=scaler)
        opt_amp.zero_grad()
        scaler.scale(w.sum()).backward()
        before = scaler.get_scale()
        scaler.step(opt_amp)
        scaler.update()
        gn_amp.update(found_inf=scaler.get_scale() < before)
        torch.testing.assert_close(gn_amp.last_norms, gn_ref.last_norms, rtol=1e-5, atol=0)
        torch.testing.assert_close(gn_amp.weights, gn_ref.weights, rtol=1e-5, atol=1e-7)

    # an overflowing step: the scaler skips it and GradNorm's state stays bit-identical
    state = gn_amp.state_dict()
    losses = _losses(*scaled) * torch.tensor([1.0, float("inf"), 1.0])
    w = gn_amp(losses, scaler=scaler)
    opt_amp.zero_grad()
    scaler.scale(w.sum()).backward()
    before = scaler.get_scale()
    scaler.step(opt_amp)
    scaler.update()
    assert scaler.get_scale() < before
    assert gn_amp.update(found_inf=scaler.get_scale() < before) is False
    assert all(torch.equal(a, b) for a, b in zip(state["task_weights"], gn_amp.weights))
    gn_amp(_losses(*scaled) * torch.tensor([1.0, float("inf"), 1.0]), scaler=scaler)
    with pytest.raises(NonFiniteGradientError):
        gn_amp.update()  # told the step was fine: refused, state unchanged
    assert all(torch.equal(a, b) for a, b in zip(state["task_weights"], gn_amp.weights))


def test_micro_batches_give_the_full_batch_update() -> None:
    full, micro = _problem(dtype=torch.float64), _problem(dtype=torch.float64)
    gn_full, gn_micro = GradNorm(K, full[0]), GradNorm(K, micro[0])
    for _ in range(3):
        gn_full(_losses(*full)).sum().backward()
        gn_full.update()
        trunk, heads, x, y = micro
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            (gn_micro(_losses(trunk, heads, xs, ys) / 2)).sum().backward()
        gn_micro.update()
        torch.testing.assert_close(gn_micro.last_norms, gn_full.last_norms)
        torch.testing.assert_close(gn_micro.weights, gn_full.weights)


def test_a_layer_no_loss_reaches_is_named() -> None:
    # another model's layer (or FSDP2's sharded parameters under a framework): every norm was
    # 0 and the weights never moved, without a word
    trunk, heads, x, y = _problem()
    other, _, _, _ = _problem()
    gn = GradNorm(K, other)
    with pytest.warns(RuntimeWarning, match="no task loss of this batch reaches its layer"):
        gn(_losses(trunk, heads, x, y))
    gn.update()
    assert gn.last_norms is not None and gn.last_norms.tolist() == [0.0] * K
    # a layer reached by one task only still counts: the others' rows are zero there
    gn = GradNorm(K, heads[0])
    gn(_losses(trunk, heads, x, y))
    gn.update()
    assert gn.last_norms is not None and float(gn.last_norms[0]) > 0.0
    assert gn.last_norms[1:].tolist() == [0.0, 0.0]


def test_a_layer_one_micro_batch_skips_counts_the_others() -> None:
    # a layer some batches skip (LayerDrop): the step's norms are the other micro-batch's
    trunk, heads, x, y = _problem()
    block = trunk[2]
    gn = GradNorm(K, block)

    def losses(skip: bool) -> Tensor:
        f = trunk[1](trunk[0](x[:64]))
        f = f if skip else trunk[3](block(f))
        return torch.stack([((head(f).squeeze(1) - y[:64, k]) ** 2).mean()
                            for k, head in enumerate(heads)])

    with pytest.warns(RuntimeWarning, match="no task loss of this batch"):
        gn(losses(skip=True), micro_batches=2)
    gn(losses(skip=False), micro_batches=2)
    gn.update()
    reached = _layer_norms(losses(skip=False), list(block.parameters())) / 2
    assert gn.last_norms is not None
    torch.testing.assert_close(gn.last_norms.double(), reached, rtol=1e-5, atol=0.0)
