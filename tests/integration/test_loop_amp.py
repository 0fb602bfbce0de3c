"""Mixed precision: G is unscaled before balancing, so scale-sensitive balancers give the fp32
update; a forced overflow changes no state and the scaler skips the step."""

from __future__ import annotations

import copy

import pytest
import torch

from gradbalance import (
    BALANCERS,
    Balancer,
    StepStats,
    TaskAutoClip,
    TaskClip,
    TaskGradBuffer,
    task_gradients,
)
from gradbalance.balancers import Sum
from gradbalance_lab.models import regression_losses
from support.helpers import build, grads_of, losses_of
from support.loop_state import assert_same_state

K = 3

#: The balancers the AMP contract names; MGDA with l2 normalisation is not homogeneous.
AMP_BALANCERS = {
    "nashmtl": {},
    "mgda-l2": {"normalization": "l2"},
    "pcgrad": {"generator": True},
    "gradvac": {},
}


def _balancer(spec: str, seed: int = 0) -> Balancer:
    name = spec.split("-")[0]
    if name not in BALANCERS:
        pytest.skip(f"balancer {name!r} is not in the registry")
    kwargs = dict(AMP_BALANCERS[spec])
    if kwargs.pop("generator", False):
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    return BALANCERS[name](num_tasks=K, **kwargs)


def _gradnorm(model):
    from gradbalance.weighting import WEIGHTINGS

    if "gradnorm" not in WEIGHTINGS:
        pytest.skip("GradNorm is not in the weighting registry")
    return WEIGHTINGS["gradnorm"](K, model.trunk)


def _scaler() -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu")
    assert scaler.is_enabled()
    return scaler


def _trunk_grad(model) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads_of(model.shared_parameters())])


def _run(spec: str, steps: int, scaler: torch.amp.GradScaler | None,
         autocast: torch.dtype | None = None) -> tuple[list[torch.Tensor], object]:
    """``steps`` Adam steps; returns the gradient (unscaled, trunk and heads) of every step."""
    model, x, y = build("mlp", num_tasks=K)
    weighting = _gradnorm(model) if spec == "gradnorm" else None
    balancer = Sum() if spec == "gradnorm" else _balancer(spec)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    updates = []
    for _ in range(steps):
        if autocast is None:
            losses = losses_of(model, x, y)
        else:
            with torch.autocast("cpu", dtype=autocast):
                losses = losses_of(model, x, y).float()
        if weighting is not None:
            losses = weighting(losses, scaler=scaler)
        buf.backward(losses, scaler=scaler)
        stats = buf.apply_(balancer, scaler=scaler, clip=TaskClip(50.0))
        assert not stats.found_inf
        if scaler is not None:
            scaler.unscale_(opt)
        updates.append(torch.cat([g.reshape(-1) for g in grads_of(list(model.parameters()))]))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if weighting is not None:
            weighting.update(found_inf=stats.found_inf)
        opt.zero_grad(set_to_none=True)
    return updates, weighting


SPECS = [*AMP_BALANCERS, "gradnorm"]


@pytest.mark.parametrize("spec", SPECS)
def test_scaler_update_matches_fp32(spec: str) -> None:
    # Scaling by a power of two and back is exact: only summation order differs.
    ref, ref_w = _run(spec, 3, None)
    amp, amp_w = _run(spec, 3, _scaler())
    for a, r in zip(amp, ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-7)
    if ref_w is not None:
        torch.testing.assert_close(amp_w.weights, ref_w.weights, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("spec", SPECS)
def test_autocast_update_matches_fp32(spec: str, dtype: torch.dtype) -> None:
    # Stated tolerance: the 16-bit forward perturbs each gradient by ~1% (bf16 keeps 8 bits);
    # the update must keep its direction (cosine > 0.99) and norm (within 5%) — a scaled-G bug
    # is off by the loss scale (65536x).
    ref, _ = _run(spec, 1, None)
    amp, _ = _run(spec, 1, _scaler(), autocast=dtype)
    a, r = amp[0].double(), ref[0].double()
    assert torch.nn.functional.cosine_similarity(a, r, dim=0).item() > 0.99
    assert abs(a.norm().item() / r.norm().item() - 1) < 0.05


@pytest.mark.parametrize("spec", ["nashmtl", "mgda-l2"])
def test_scaled_gradients_would_change_the_update(spec: str) -> None:
    # Sensitivity of the test above: these balancers are not homogeneous, so feeding them
    # the scaled G (the failure of other libraries) gives a different update.
    model, x, y = build("mlp", num_tasks=K)
    G = task_gradients(losses_of(model, x, y), model.shared_parameters())
    bal = _balancer(spec)
    true = bal(G.clone())
    naive = _balancer(spec)(G * 65536.0) / 65536.0
    assert not torch.allclose(naive, true, rtol=1e-2)


@pytest.mark.parametrize("spec", SPECS)
def test_forced_overflow_changes_no_state_and_skips(spec: str) -> None:
    model, x, y = build("mlp", num_tasks=K)
    gen_spec = spec if spec != "gradnorm" else None
    balancer = Sum() if gen_spec is None else _balancer(spec)
    weighting = _gradnorm(model) if spec == "gradnorm" else None
    clipper = TaskAutoClip(percentile=50, history_size=8)
    scaler = _scaler()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())

    def step(factor: float):
        losses = losses_of(model, x, y) * torch.tensor([1.0, factor, 1.0])
        if weighting is not None:
            losses = weighting(losses, scaler=scaler)
        buf.backward(losses, scaler=scaler)
        stats = buf.apply_(balancer, scaler=scaler, clip=clipper)
        return stats, losses

    for _ in range(2):  # healthy steps build up state (EMA targets, history, Adam moments)
        stats, _ = step(1.0)
        s = scaler.get_scale()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        if weighting is not None:
            weighting.update(found_inf=scaler.get_scale() < s)
        opt.zero_grad(set_to_none=True)

    saved = {
        "balancer": copy.deepcopy(balancer.state_dict()),
        "clipper": copy.deepcopy(clipper.state_dict()),
        "optimizer": copy.deepcopy(opt.state_dict()),
        "weighting": None if weighting is None else copy.deepcopy(weighting.state_dict()),
        "generator": None if getattr(balancer, "generator", None) is None
        else balancer.generator.get_state(),
    }
    params = [p.detach().clone() for p in model.parameters()]
    ref_model = copy.deepcopy(model)

    stats, _ = step(1e38)  # 1e38 * 65536 overflows float32
    assert stats.found_inf
    # .grad of the trunk is the plain (non-finite) sum, not a balancer's output
    ref_losses = losses_of(ref_model, x, y) * torch.tensor([1.0, 1e38, 1.0])
    if weighting is not None:
        ref_losses = ref_losses * weighting.weights.float()
    scaler.scale(ref_losses.sum()).backward()
    trunk = _trunk_grad(model)
    assert not bool(torch.isfinite(trunk).all())
    torch.testing.assert_close(trunk, _trunk_grad(ref_model), equal_nan=True)

    s = scaler.get_scale()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    skipped = scaler.get_scale() < s
    assert skipped
    if weighting is not None:
        assert weighting.update(found_inf=skipped) is False
    for p, before in zip(model.parameters(), params):
        assert torch.equal(p.detach(), before)
    assert_same_state(balancer.state_dict(), saved["balancer"])
    assert_same_state(clipper.state_dict(), saved["clipper"])
    assert_same_state(opt.state_dict(), saved["optimizer"])
    if weighting is not None:
        assert_same_state(weighting.state_dict(), saved["weighting"])
    if saved["generator"] is not None:
        assert torch.equal(balancer.generator.get_state(), saved["generator"])


@pytest.mark.parametrize("mode", ["matrix", "features", "gramian"])
def test_overflow_in_heads_only_changes_no_balancer_state(mode: str) -> None:
    # The trunk's task gradients are finite but a head's gradient overflows: the scaler will
    # skip the step, so the balancer must not run (GradVac's EMA would move on a lost step).
    model, x, y = build("mlp", num_tasks=K)
    balancer = _balancer("gradvac")
    scaler = _scaler()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode=mode,
                         **({"modules": model.trunk} if mode == "gramian" else {}))

    def step(bump: torch.Tensor | float = 0.0) -> StepStats:
        feats = model.trunk(x)
        losses = regression_losses([head(feats) for head in model.heads], y) + bump
        buf.backward(losses, scaler=scaler, features=feats if mode == "features" else None)
        return buf.apply_(balancer, scaler=scaler)

    step()
    opt.zero_grad(set_to_none=True)
    saved = copy.deepcopy(balancer.state_dict())
    head_bias = model.heads[0].bias
    stats = step(torch.stack([1e38 * head_bias.sum(), 0 * head_bias.sum(), 0 * head_bias.sum()]))
    assert stats.found_inf
    assert bool(torch.isfinite(stats.task_norms).all())  # the trunk's task gradients were finite
    assert not bool(torch.isfinite(_trunk_grad(model)).all())  # so that every optimizer skips
    assert not bool(torch.isfinite(head_bias.grad).all())
    assert_same_state(balancer.state_dict(), saved)
    params = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
