"""``batch_dim=0`` after an abandoned micro-batch (docs/loop.md, "Recovering a step"): a
forward whose loss never reached ``backward``, or a micro-batch dropped by ``reset()``, leaves
no trace in the next step, as with plain ``loss.backward()`` after ``zero_grad``.

The reference is the matrix route over the same objectives (each sample × task loss a task of
its own) on an identical model that never saw the abandoned micro-batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, UPGrad

from .per_sample_runs import flat_grads, losses_of, models, run


@pytest.mark.parametrize("how", ["forward_only", "backward_then_reset"])
@pytest.mark.parametrize(("name", "tasks", "balancer"),
                         [("mlp", 1, UPGrad), ("cnn", 2, MGDA), ("mixed", 2, UPGrad)])
def test_an_abandoned_micro_batch_leaves_no_trace(how: str, name: str, tasks: int,
                                                  balancer: type) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        trunk, heads, inputs = models(name, tasks, seed=3)
        twin = copy.deepcopy((trunk, heads))
        dropped, (x, y) = (inputs(5), torch.randn(5, tasks)), (inputs(4), torch.randn(4, tasks))
        buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk,
                             batch_dim=0)
        losses = losses_of(trunk, heads, *dropped)
        if how == "backward_then_reset":
            buf.backward(losses)
            buf.reset()
        del losses  # the user's loop drops the failed micro-batch
        for p in [*trunk.parameters(), *heads.parameters()]:
            p.grad = None
        buf.backward(losses_of(trunk, heads, x, y))
        buf.apply_(balancer())
        got = flat_grads([*trunk.parameters(), *heads.parameters()])
        (want,), _ = run(*twin, [(x, y)], balancer(), False)
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.allclose(got, want, rtol=1e-8, atol=1e-10 * float(want.abs().max()))
    assert isinstance(trunk, nn.Module)
