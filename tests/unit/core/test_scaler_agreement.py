"""``StepStats.found_inf`` and the ``GradScaler`` agree: a step reported non-finite is a step
the scaler skips (every optimizer, the scale drops), and a step the scaler takes wrote the
balanced update, in every mode, on refresh and reused steps, over micro-batches.

Overflow is forced at each place it can arise: a task gradient, a finite task gradient whose
Gramian overflows in float32, a head's gradient only, and a balanced update that overflows
once re-scaled. Expected updates come from ``sum(losses).backward()`` on a copy of the model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gradbalance import NonFiniteGradientError, StepStats, TaskGradBuffer
from gradbalance.balancers import Constant

K = 3
SCALE = 2.0**10
SCENARIOS = ("none", "task_inf", "gramian_overflow", "head_inf", "update_overflow")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh())
        self.heads = nn.ModuleList(nn.Linear(5, 1) for _ in range(K))

    def losses(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats = self.trunk(x)
        outs = [head(feats).squeeze(-1) for head in self.heads]
        return feats, torch.stack([((o - y[:, k]) ** 2).mean() for k, o in enumerate(outs)])


@dataclass
class Case:
    mode: str
    scenario: str
    micro: int
    bump_mb: int
    reused: bool


def bumped(net: Net, losses: torch.Tensor, scenario: str) -> torch.Tensor:
    """The losses of the micro-batch where ``scenario`` strikes."""
    if scenario == "task_inf":
        return losses * torch.tensor([1.0, float("inf"), 1.0])
    if scenario == "gramian_overflow":  # gradients ~1e21: finite, their squares are not
        return losses * torch.tensor([1.0, 1e22, 1.0])
    if scenario == "head_inf":  # only head 0's bias sees it: the trunk's rows stay finite
        bias = net.heads[0].bias.sum()
        return losses + torch.stack([1e38 * bias, 0 * bias, 0 * bias])
    return losses


def balancer_for(scenario: str) -> Constant:
    """The mean of the rows; ``update_overflow``: a weight that overflows the update."""
    weights = [1e36 if scenario == "update_overflow" else 1 / K, 1 / K, 1 / K]
    return Constant(weights)


def run_step(net: Net, buf: TaskGradBuffer, case: Case, scaler: torch.amp.GradScaler,
             x: torch.Tensor, y: torch.Tensor, scenario: str) -> tuple[StepStats, list]:
    micro = 1 if case.mode == "features" and not buf._cache.reuse_now() else case.micro
    raws = []
    for m, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
        feats, losses = net.losses(xs, ys)
        losses = losses / micro
        if m == min(case.bump_mb, micro - 1):
            losses = bumped(net, losses, scenario)
        raws.append(losses)
        buf.backward(losses, scaler=scaler, features=feats if case.mode == "features" else None)
    return buf.apply_(balancer_for(scenario), scaler=scaler), raws


def expected_grads(net: Net, case: Case, x: torch.Tensor, y: torch.Tensor,
                   scenario: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The balanced step, independently: trunk ``∂(Σ L)/∂θ / K`` (Mean is linear, so every
    mode gives it), heads ``∂(Σ L)/∂h``."""
    micro = case.micro if (case.mode != "features" or case.reused) else 1
    total = torch.zeros(())
    for m, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
        _, losses = net.losses(xs, ys)
        losses = losses / micro
        if m == min(case.bump_mb, micro - 1):
            losses = bumped(net, losses, scenario)
        total = total + losses.sum()
    trunk = torch.autograd.grad(total / K, list(net.trunk.parameters()), retain_graph=True)
    heads = torch.autograd.grad(total, list(net.heads.parameters()))
    return list(trunk), list(heads)


def check_agreement(case: Case) -> None:
    torch.manual_seed(0)
    net = Net()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=gen), torch.randn(6, K, generator=gen)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    assert scaler.is_enabled()
    trunk, heads = list(net.trunk.parameters()), list(net.heads.parameters())
    opt_trunk = torch.optim.SGD(trunk, lr=0.1)  # two optimizers: each must skip on its own
    opt_heads = torch.optim.SGD(heads, lr=0.1)
    buf = TaskGradBuffer(trunk, heads, mode=case.mode, update_every=2 if case.reused else 1,
                         **({"modules": net.trunk} if case.mode == "gramian" else {}))
    if case.reused:  # a clean refresh step caches the weights the next step reuses
        run_step(net, buf, case, scaler, x, y, "none")
        net.zero_grad(set_to_none=True)
    reference = copy.deepcopy(net)
    before = [p.detach().clone() for p in net.parameters()]
    scenario = case.scenario
    if case.reused and scenario == "update_overflow":
        scenario = "none"  # a reused step runs no balancer
    stats, _ = run_step(net, buf, case, scaler, x, y, scenario)
    assert stats.weights_reused == case.reused

    s = scaler.get_scale()
    scaler.unscale_(opt_trunk)
    scaler.unscale_(opt_heads)
    written = [None if p.grad is None else p.grad.detach().clone() for p in net.parameters()]
    scaler.step(opt_trunk)
    scaler.step(opt_heads)
    scaler.update()
    skipped = scaler.get_scale() < s
    assert stats.found_inf == skipped
    moved = [not torch.equal(p.detach(), b) for p, b in zip(net.parameters(), before)]
    if stats.found_inf:
        assert not any(moved)  # neither optimizer stepped
        return
    assert all(moved)
    exp_trunk, exp_heads = expected_grads(reference, case, x, y, scenario)
    for got, exp in zip(written, [*exp_trunk, *exp_heads]):
        assert got is not None
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-6 * float(exp.abs().max()))


GRID = [Case(mode, scenario, micro=2, bump_mb=1, reused=reused)
        for mode in ("matrix", "gramian", "features") for reused in (False, True)
        for scenario in SCENARIOS]


@pytest.mark.parametrize("case", GRID, ids=[
    f"{c.mode}-{'reused-' if c.reused else ''}{c.scenario}" for c in GRID])
def test_found_inf_is_the_scalers_skip(case: Case) -> None:
    check_agreement(case)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    micro = draw(st.integers(1, 3))
    return Case(draw(st.sampled_from(["matrix", "gramian", "features"])),
                draw(st.sampled_from(SCENARIOS)), micro, draw(st.integers(0, micro - 1)),
                draw(st.booleans()))


@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_found_inf_is_the_scalers_skip_anywhere(case: Case) -> None:
    check_agreement(case)


@pytest.mark.parametrize("mode", ["matrix", "gramian", "features"])
def test_overflowing_gramian_is_skipped_not_written_unbalanced(mode: str) -> None:
    # The reported failure: a finite G whose float32 Gramian overflows. Whatever the Gramian
    # gives, the step the scaler takes is the balanced one, and found_inf means a skip.
    check_agreement(Case(mode, "gramian_overflow", micro=1, bump_mb=0, reused=False))


@pytest.mark.parametrize("mode", ["matrix", "gramian", "features"])
def test_overflowing_update_without_scaler_raises_and_writes_nothing(mode: str) -> None:
    torch.manual_seed(0)
    net = Net()
    x, y = torch.randn(6, 4), torch.randn(6, K)
    for p in net.parameters():
        p.grad = torch.full_like(p, 0.5)
    buf = TaskGradBuffer(list(net.trunk.parameters()), list(net.heads.parameters()), mode=mode,
                         **({"modules": net.trunk} if mode == "gramian" else {}))
    feats, losses = net.losses(x, y)
    buf.backward(losses * 1e4, features=feats if mode == "features" else None)
    with pytest.raises(NonFiniteGradientError, match="inf or NaN"):
        buf.apply_(Constant([1e38, 1.0, 1.0]))  # finite G, wᵀG overflows float32
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in net.parameters())
