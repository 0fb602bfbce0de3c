"""Row clipping with ``batch_dim=0``: 2-norm clippers act through the Gramian as ``D G D``
and equal the matrix route with the same clipper over the same objectives; the global
clip of the update stays ``clip_grad_norm_`` after ``apply_`` (docs/per_sample.md)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, Sum, UPGrad
from gradbalance.clip import TaskAutoClip, TaskClip, TaskValueClip

from .per_sample_runs import batches, close, flat_grads, losses_of, models, run

pytestmark = pytest.mark.usefixtures("float64")


@pytest.mark.parametrize("name", ["mlp", "cnn", "mixed"])
@pytest.mark.parametrize("tasks", [1, 2])
@pytest.mark.parametrize("make", [lambda: TaskClip(max_norm=0.3),
                                  lambda: TaskAutoClip(percentile=50)])
def test_row_clipping_equals_matrix_route(name: str, tasks: int, make: object) -> None:
    trunk, heads, inputs = models(name, tasks, 0)
    data = batches(inputs, [5, 5, 5], tasks)
    got, got_stats = run(trunk, heads, data, UPGrad(), True, clip=make())  # type: ignore[operator]
    want, want_stats = run(trunk, heads, data, UPGrad(), False, clip=make())  # type: ignore[operator]
    assert close(got, want)
    for a, b in zip(got_stats, want_stats):
        assert a.pre_clip_norms is not None and b.pre_clip_norms is not None
        assert torch.allclose(a.pre_clip_norms, b.pre_clip_norms, rtol=1e-9)
        assert a.task_norms is not None and b.task_norms is not None  # the clipped norms
        assert torch.allclose(a.task_norms, b.task_norms, rtol=1e-9, atol=1e-12)


def test_pre_clip_norms_are_the_per_sample_gradient_norms() -> None:
    trunk, heads, inputs = models("cnn", 1, 1)
    x, y = inputs(4), torch.randn(4, 1)
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    losses = losses_of(trunk, heads, x, y)
    norms = torch.stack([torch.cat([g.flatten() for g in torch.autograd.grad(
        losses[i], list(trunk.parameters()), retain_graph=True)]).norm() for i in range(4)])
    buf.backward(losses)
    stats = buf.apply_(MGDA(), clip=TaskClip(max_norm=0.1))
    assert stats.pre_clip_norms is not None
    assert torch.allclose(stats.pre_clip_norms, norms, rtol=1e-10)


def test_clipped_sum_in_closed_form() -> None:
    """``ℓᵢ = wᵀxᵢ``: ``∇ℓᵢ = xᵢ``, and Sum with ``TaskClip(τ)`` writes
    ``Σᵢ min(1, τ/(‖xᵢ‖ + 10⁻⁶)) xᵢ`` (norms 5, 0.5, 3; τ = 1)."""
    layer = nn.Linear(3, 1, bias=False)
    x = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.3, 0.4], [1.0, 2.0, 2.0]])
    buf = TaskGradBuffer(layer.parameters(), modules=layer, batch_dim=0)
    buf.backward(layer(x)[:, 0])
    buf.apply_(Sum(), clip=TaskClip(max_norm=1.0))
    want = x[0] / (5 + 1e-6) + x[1] + x[2] / (3 + 1e-6)
    assert layer.weight.grad is not None
    assert torch.allclose(layer.weight.grad[0], want, rtol=1e-12)


def test_global_clip_after_apply_equals_matrix_route() -> None:
    """``clip_grad_norm_`` after ``apply_``: the same ``.grad`` as the matrix route, and its
    total norm is ``√(wᵀGw + ‖heads‖²)`` from the step's statistics."""
    trunk, heads, inputs = models("mlp", 2, 2)
    x, y = inputs(6), torch.randn(6, 2)
    params = [*trunk.parameters(), *heads.parameters()]
    results = []
    for per_sample in (True, False):
        for p in params:
            p.grad = None
        kwargs = {"modules": trunk, "batch_dim": 0} if per_sample else {}
        buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), **kwargs)  # type: ignore[arg-type]
        losses = losses_of(trunk, heads, x, y)
        buf.backward(losses if per_sample else losses.reshape(-1))
        stats = buf.apply_(UPGrad())
        heads_sq = sum(float(p.grad.pow(2).sum()) for p in heads.parameters()
                       if p.grad is not None)
        total = torch.nn.utils.clip_grad_norm_(params, max_norm=0.05)
        assert stats.update_norm is not None
        assert float(total) == pytest.approx((float(stats.update_norm) ** 2 + heads_sq) ** 0.5,
                                             rel=1e-9)
        results.append(flat_grads(params))
        if buf._per_sample is not None:
            buf._per_sample.gramian.remove()
    assert float(results[0].norm()) == pytest.approx(0.05, rel=1e-6)
    assert close(results[:1], results[1:])


def _half(model: nn.Module) -> list[Tensor]:
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    return [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("clip", [TaskValueClip(0.1), TaskClip(max_norm=1.0, norm_type=1.0),
                                  lambda m: m.norm(dim=1)])
def test_clippers_without_a_gramian_form_are_refused(clip: object) -> None:
    model = nn.Linear(3, 1)
    _half(model)
    buf = TaskGradBuffer(model.parameters(), modules=model, batch_dim=0)
    buf.backward(model(torch.randn(4, 3))[:, 0] ** 2)
    with pytest.raises(ValueError, match=r"clip=.*not available with batch_dim=0.*TaskClip"):
        buf.apply_(UPGrad(), clip=clip)  # type: ignore[arg-type]
    assert all(bool((p.grad == 0.5).all()) for p in model.parameters() if p.grad is not None)
    buf.apply_(UPGrad(), clip=TaskClip(max_norm=1.0))  # the step was left as it was


def test_a_failed_step_leaves_the_clipper_state() -> None:
    model = nn.Linear(3, 1)
    _half(model)
    clip = TaskAutoClip(percentile=50)
    before = clip.state_dict()
    buf = TaskGradBuffer(model.parameters(), modules=model, batch_dim=0)
    buf.backward(model(torch.randn(4, 3))[:, 0] ** 2)
    with pytest.raises(ValueError):
        buf.apply_(UPGrad(num_tasks=5), clip=clip)  # 4 objectives: the balancer refuses
    after = clip.state_dict()
    assert str(after) == str(before)
    assert all(bool((p.grad == 0.5).all()) for p in model.parameters() if p.grad is not None)
