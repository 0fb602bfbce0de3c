"""``balanced_backward(..., modules=trunk, batch_dim=0)``: the update and statistics of
``TaskGradBuffer(..., batch_dim=0)`` in one call (the rows route: the hooks of the buffer
must exist before the forward), and its refusals (docs/per_sample.md)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gradbalance import TaskGradBuffer, balanced_backward
from gradbalance.balancers import IMTLG, MGDA, UPGrad
from gradbalance.clip import TaskClip

from .per_sample_runs import flat_grads, losses_of, models

pytestmark = pytest.mark.usefixtures("float64")


@pytest.mark.parametrize("name", ["mlp", "cnn", "mixed", "attention"])
@pytest.mark.parametrize("tasks", [1, 2])
@pytest.mark.parametrize(("balancer", "clip"), [(UPGrad, None), (MGDA, None),
                                                (IMTLG, TaskClip(max_norm=0.3))])
def test_one_call_equals_the_buffer_route(name: str, tasks: int, balancer: type,
                                          clip: Any) -> None:
    trunk, heads, inputs = models(name, tasks, 11)
    x, y = inputs(5), torch.randn(5, tasks)
    params = [*trunk.parameters(), *heads.parameters()]
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    buf.backward(losses_of(trunk, heads, x, y))
    want = buf.apply_(balancer(), clip=clip)
    assert buf._per_sample is not None
    buf._per_sample.gramian.remove()
    want_update = flat_grads(params)
    for p in params:
        p.grad = None
    got = balanced_backward(losses_of(trunk, heads, x, y), balancer(),
                            shared_params=trunk.parameters(), head_params=heads.parameters(),
                            clip=clip, modules=trunk, batch_dim=0)
    update = flat_grads(params)
    assert torch.allclose(update, want_update, rtol=1e-8, atol=1e-10 * want_update.abs().max())
    assert got.mode == want.mode == "per_sample"
    assert got.weights is not None and want.weights is not None
    assert torch.allclose(got.weights, want.weights, rtol=1e-7, atol=1e-10)
    assert got.per_task is not None and want.per_task is not None
    for field in ("losses", "task_norms", "cosine", "cosine_to_update", "weights"):
        a, b = getattr(got.per_task, field), getattr(want.per_task, field)
        assert torch.allclose(a, b, rtol=1e-7, atol=1e-9), field


def _half(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"mode": "features"}, r"\['mode'\] are not available with balanced_backward"),
    ({"active": torch.ones(4, dtype=torch.bool)}, r"\['active'\] are not available"),
    ({"batch_dim": 1}, "batch_dim must be 0"),
    ({"modules": None}, "batch_dim=0 needs modules="),
])
def test_refusals_move_nothing(kwargs: dict[str, Any], match: str) -> None:
    model = nn.Linear(3, 1)
    _half(model)
    options: dict[str, Any] = {"modules": model, "batch_dim": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        balanced_backward(model(torch.randn(4, 3))[:, 0] ** 2, UPGrad(),
                          shared_params=model.parameters(), **options)
    assert all(bool((p.grad == 0.5).all()) for p in model.parameters() if p.grad is not None)


def test_batchnorm_in_training_mode_and_wrong_shapes_are_refused() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    _half(model)
    with pytest.raises(ValueError, match=r"layer '1' \(BatchNorm1d in training mode\)"):
        balanced_backward(model(torch.randn(4, 3))[:, 0], UPGrad(),
                          shared_params=model.parameters(), modules=model, batch_dim=0)
    model.eval()
    with pytest.raises(ValueError, match=r"shape \[B\].*or \[B, K\].*got \(4, 1, 1\)"):
        balanced_backward(model(torch.randn(4, 3))[:, :, None], UPGrad(),
                          shared_params=model.parameters(), modules=model, batch_dim=0)
    assert all(bool((p.grad == 0.5).all()) for p in model.parameters() if p.grad is not None)
    stats = balanced_backward(model(torch.randn(4, 3))[:, 0] ** 2, UPGrad(),
                              shared_params=model.parameters(), modules=model, batch_dim=0)
    assert stats.weights is not None and stats.weights.shape == (4,)


def test_batched_passes_and_a_scaler_give_the_same_update() -> None:
    trunk, heads, inputs = models("mlp", 2, 13)
    x, y = inputs(6), torch.randn(6, 2)
    params = [*trunk.parameters(), *heads.parameters()]
    updates = []
    for options in ({"passes": "loop"}, {"passes": "batched"},
                    {"scaler": torch.amp.GradScaler("cpu", init_scale=2.0**8)}):
        for p in params:
            p.grad = None
        stats = balanced_backward(losses_of(trunk, heads, x, y), UPGrad(),
                                  shared_params=trunk.parameters(),
                                  head_params=heads.parameters(), modules=trunk, batch_dim=0,
                                  **options)  # type: ignore[arg-type]
        scale = 1.0 if stats.loss_scale is None else stats.loss_scale
        updates.append(flat_grads(params) / scale)
    assert torch.allclose(updates[1], updates[0], rtol=1e-9, atol=1e-12)
    assert torch.allclose(updates[2], updates[0], rtol=1e-9, atol=1e-12)
