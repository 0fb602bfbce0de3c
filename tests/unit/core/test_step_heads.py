"""The heads' plain gradient and the cost of the task passes through the heads.

Reference everywhere: ``sum(losses).backward()`` on an identical model (the PCGrad paper's
rule for task-specific parameters). Cost: each task's pass must start at that task's own
loss, so every head is backpropagated a fixed number of times per step, not once per task.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

from gradbalance import TaskGradBuffer, balanced_backward
from gradbalance.balancers import Mean, Sum
from support.helpers import assert_close_lists, build, grads_of, losses_of
from support.perf import losses_of_features

FORMS = ("stacked", "list", "divided")  # divided: a [K] tensor that is not a plain stack


def _as_form(losses: torch.Tensor, form: str) -> torch.Tensor | list[torch.Tensor]:
    if form == "list":
        return list(losses.unbind())
    if form == "divided":
        return losses * 2 / 2
    return losses


def _plain(kind: str, micro: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model, x, y = build(kind, dtype=torch.float64)
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        losses_of(model, xs, ys).sum().backward()
    return grads_of(model.shared_parameters()), grads_of(model.head_parameters())


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("passes", ["loop", "batched"])
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_heads_get_plain_gradient_over_micro_batches(kind: str, passes: str,
                                                     form: str) -> None:
    model, x, y = build(kind, dtype=torch.float64)
    for p in model.head_parameters():  # .grad is added to, never overwritten
        p.grad = torch.ones_like(p)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), passes=passes)
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        buf.backward(_as_form(losses_of(model, xs, ys), form))
    buf.apply_(Sum())
    trunk_ref, heads_ref = _plain(kind, micro=2)
    assert_close_lists(grads_of(model.head_parameters()), [g + 1 for g in heads_ref],
                       rtol=1e-12, atol=1e-14)
    assert_close_lists(grads_of(model.shared_parameters()), trunk_ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["features", "gramian"])
def test_heads_get_plain_gradient_in_other_modes(mode: str) -> None:
    model, x, y = build("mlp", dtype=torch.float64)
    kwargs = {"modules": model.trunk} if mode == "gramian" else {}
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode=mode,
                         **kwargs)
    feats = model.trunk(x)
    buf.backward(list(losses_of_features(model, feats, y).unbind()),
                 features=feats if mode == "features" else None)
    buf.apply_(Mean())
    _, heads_ref = _plain("mlp")
    assert_close_lists(grads_of(model.head_parameters()), heads_ref, rtol=1e-12, atol=1e-14)


class _Count(torch.autograd.Function):
    """Identity whose backward counts its calls."""

    calls: ClassVar[list[int]] = []

    @staticmethod
    def forward(ctx, x, index):  # type: ignore[no-untyped-def]
        ctx.index = index
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        _Count.calls[ctx.index] += 1
        return grad, None


class _CountedHead(nn.Module):
    def __init__(self, width: int, index: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, 1)
        self.index = index

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return _Count.apply(self.linear(feats), self.index)


@pytest.mark.parametrize("form", ["stacked", "list", "divided"])
@pytest.mark.parametrize("mode", ["matrix", "features", "gramian"])
def test_each_head_is_backpropagated_twice_per_step(mode: str, form: str) -> None:
    # Once in the heads' pass (their plain gradient) and once in its own task's pass.
    # Backpropagating stacked[k] would also send zeros through the K - 1 other heads:
    # K + 1 passes over every head.
    k = 4
    trunk = nn.Sequential(nn.Linear(5, 8), nn.Tanh())
    heads = nn.ModuleList(_CountedHead(8, i) for i in range(k))
    params = list(trunk.parameters())
    buf = TaskGradBuffer(params, list(heads.parameters()), mode=mode, passes="loop",
                         **({"modules": trunk} if mode == "gramian" else {}))
    x, y = torch.randn(6, 5), torch.randn(6, k)
    feats = trunk(x)
    parts = [((h(feats).squeeze(-1) - y[:, i]) ** 2).mean() for i, h in enumerate(heads)]
    _Count.calls = [0] * k
    given = {"list": parts, "stacked": torch.stack(parts),
             "divided": torch.stack(parts) / 2}[form]  # micro-batch averaging
    buf.backward(given, features=feats if mode == "features" else None)
    buf.apply_(Mean())
    assert _Count.calls == [2] * k


def test_head_shared_by_tasks_and_aliased_gradients() -> None:
    # a: one head parameter read by two tasks; b, c: their gradient comes from one
    # AddBackward (the same tensor, an expanded view) and must not share storage as .grad.
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    a = torch.tensor(3.0, requires_grad=True)
    b = torch.zeros(2, requires_grad=True)
    c = torch.zeros(2, requires_grad=True)

    def losses() -> list[torch.Tensor]:
        return [a * (w**2).sum(), a * w.sum() + (b + c).sum()]

    buf = TaskGradBuffer([w], [a, b, c])
    for _ in range(2):  # two identical micro-batches: .grad accumulates in place
        buf.backward(losses())
    buf.apply_(Sum())
    # ∂/∂a = Σ w² + Σ w = 5 - 1 = 4 per micro-batch; ∂/∂b = ∂/∂c = 1 per entry.
    torch.testing.assert_close(a.grad, torch.tensor(8.0))
    torch.testing.assert_close(b.grad, torch.full((2,), 2.0))
    assert b.grad.data_ptr() != c.grad.data_ptr()
    b.grad.add_(1.0)
    torch.testing.assert_close(c.grad, torch.full((2,), 2.0))
    # trunk: 2 · (a·2w + a) = 2 · 3 · (2w + 1)
    torch.testing.assert_close(w.grad, 6 * (2 * w.detach() + 1))


def test_constant_task_loss_gives_zero_row_and_all_constant_raises() -> None:
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    stats = balanced_backward([(3 * w).sum(), torch.tensor(5.0)], Sum(), shared_params=[w])
    torch.testing.assert_close(w.grad, torch.full((2,), 3.0))
    torch.testing.assert_close(stats.task_norms,
                               torch.tensor([18.0**0.5, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="losses do not require grad"):
        balanced_backward([torch.tensor(1.0), torch.tensor(2.0)], Sum(), shared_params=[w])
