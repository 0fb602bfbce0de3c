"""Weightings compose with the balanced step and cost no extra backward in a plain loop."""

from __future__ import annotations

import copy

import pytest
import torch

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Sum
from gradbalance.weighting import FAMO, WEIGHTINGS
from support.helpers import assert_close_lists, grads_of
from support.weighting import Tiny, data, make, train_step, user_optimizer

NAMES = sorted(WEIGHTINGS)


@pytest.mark.parametrize("name", NAMES)
def test_buffer_with_sum_equals_plain_backward(name: str) -> None:
    x, y = data(dtype=torch.float64)
    plain_model = Tiny(dtype=torch.float64)
    plain = make(name, plain_model)
    opt = user_optimizer(plain, plain_model)
    for _ in range(3):  # move the state away from its start
        train_step(plain, plain_model, opt, x, y)
    buf_model = copy.deepcopy(plain_model)
    balanced = make(name, buf_model)
    balanced.load_state_dict(plain.state_dict())
    plain_model.zero_grad()
    for p in plain.parameters():
        p.grad = None

    plain(plain_model.losses(x, y)).sum().backward()
    heads = [*buf_model.heads.parameters(), *balanced.parameters()]
    buf = TaskGradBuffer(list(buf_model.trunk.parameters()), head_params=heads)
    buf.backward(balanced(buf_model.losses(x, y)))
    buf.apply_(Sum())

    assert_close_lists(grads_of(list(buf_model.trunk.parameters())),
                       grads_of(list(plain_model.trunk.parameters())), rtol=1e-10, atol=1e-12)
    assert_close_lists(grads_of(list(buf_model.heads.parameters())),
                       grads_of(list(plain_model.heads.parameters())), rtol=1e-10, atol=1e-12)
    assert_close_lists(grads_of(balanced.parameters()), grads_of(plain.parameters()),
                       rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_plain_loop_costs_no_task_gradients(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = Tiny()
    x, y = data()
    w = make(name, model)
    losses = model.losses(x, y)
    calls = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    out = w(losses)
    assert len(calls) == (3 if w.needs_task_gradients else 0)
    # and the weighted losses are wₖ·Lₖ (plus the learnable methods' own terms)
    if not w.learnable:
        weights = w.weights.to(losses.dtype)
        torch.testing.assert_close(out, weights * losses.detach())


def test_famo_micro_batches_use_the_summed_losses() -> None:
    model = Tiny(dtype=torch.float64)
    x, y = data(dtype=torch.float64)
    full, micro = FAMO(3), FAMO(3)
    before = model.losses(x, y).detach()
    full(before)
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        micro(model.losses(xs, ys).detach() / 2)
    after = before * torch.tensor([0.5, 0.9, 1.0], dtype=torch.float64)
    full.update(after)
    micro.update(after)
    torch.testing.assert_close(micro.logits.detach(), full.logits.detach())


@pytest.mark.parametrize("name", NAMES)
def test_mixed_precision_loop_matches_fp32(name: str) -> None:
    x, y = data()
    runs = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**8)):
        model = Tiny()
        w = make(name, model)
        opt = torch.optim.SGD([*model.parameters(), *w.parameters()], lr=0.01)
        for _ in range(3):
            weighted = w(model.losses(x, y), scaler=scaler)
            opt.zero_grad()
            if scaler is None:
                weighted.sum().backward()
                opt.step()
                skipped = False
            else:
                assert scaler.is_enabled()
                scaler.scale(weighted.sum()).backward()
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                skipped = scaler.get_scale() < before
            with torch.no_grad():
                after = model.losses(x, y) if name == "famo" else None
            assert w.update(after, found_inf=skipped) is True
        runs.append(w)
    torch.testing.assert_close(runs[1].weights, runs[0].weights, rtol=1e-5, atol=1e-7)
