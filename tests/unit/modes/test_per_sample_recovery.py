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


@pytest.mark.parametrize("where", ["head", "trunk"])
@pytest.mark.parametrize(("name", "tasks", "balancer"),
                         [("mlp", 1, UPGrad), ("cnn", 2, MGDA)])
def test_a_failure_in_a_later_micro_batch_drops_the_step(where: str, name: str, tasks: int,
                                                         balancer: type) -> None:
    """A hook raising in micro-batch 2's passes drops the whole step (docs/loop.md, "When a
    step fails"): nothing written, torch's generator put back (the hook drew from it
    first), and the retried batch gives the update of a run that never failed."""
    torch.set_default_dtype(torch.float64)
    try:
        trunk, heads, inputs = models(name, tasks, seed=5)
        twin = copy.deepcopy((trunk, heads))
        parts = [(inputs(3), torch.randn(3, tasks)), (inputs(2), torch.randn(2, tasks))]
        buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk,
                             batch_dim=0)
        buf.backward(losses_of(trunk, heads, *parts[0]))
        features = trunk(parts[1][0])
        out = heads(features)

        def hook(grad: torch.Tensor) -> torch.Tensor:
            torch.randn(3)  # draws, then fails
            raise RuntimeError("hook failed")

        (features if where == "trunk" else out).register_hook(hook)
        losses = (out - parts[1][1]) ** 2
        state = torch.get_rng_state()
        with pytest.raises(RuntimeError, match="hook failed"):
            buf.backward(losses[:, 0] if tasks == 1 else losses)
        assert torch.equal(torch.get_rng_state(), state)
        assert all(p.grad is None for p in [*trunk.parameters(), *heads.parameters()])
        results = []
        for model, buffer in ((trunk, heads), twin):
            if buffer is not heads:
                buf = TaskGradBuffer(model.parameters(), buffer.parameters(), modules=model,
                                     batch_dim=0)
            for x, y in parts:  # the batch again, whole (the twin: the first time)
                buf.backward(losses_of(model, buffer, x, y))
            buf.apply_(balancer())
            results.append(flat_grads([*model.parameters(), *buffer.parameters()]))
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.equal(results[0], results[1])
