"""A loss that is inf or NaN makes the step non-finite even where no trunk gradient shows it
(a head's ``0 · inf``): the head's ``.grad`` was written NaN with ``found_inf`` False and no
error. Without a scaler the step raises ``NonFiniteGradientError`` and nothing moves; with
``GradScaler("cpu")`` it is skipped (``found_inf``), on every route."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gradbalance import NonFiniteGradientError, TaskGradBuffer
from gradbalance.balancers import UPGrad


def _setup(kind: str, update_every: int) -> tuple[TaskGradBuffer, Any]:
    torch.manual_seed(0)
    trunk = nn.Linear(3, 4)
    heads = nn.ModuleList([nn.Linear(4, 1), nn.Linear(4, 1)])
    gain = nn.Parameter(torch.ones(()))
    head_params = [*heads.parameters(), gain]
    if kind == "per_sample":
        buf = TaskGradBuffer(trunk.parameters(), head_params, modules=trunk, batch_dim=0,
                             update_every=update_every)
    else:
        buf = TaskGradBuffer(list(trunk.parameters()), head_params, mode=kind,
                             modules=trunk if kind == "gramian" else None,
                             update_every=update_every)

    def losses(poison: bool) -> Tensor:
        x, y = torch.randn(4, 3), torch.randn(4)
        f = trunk(x)
        z = torch.tensor(float("inf") if poison else 0.0)
        if kind == "per_sample":
            out = (heads[0](f)[:, 0] - y) ** 2
            return out + gain * torch.stack([z * 0, z * 0 * 0, z * 0, z * 0]) * (1 if poison else 0)
        return torch.stack([((h(f)[:, 0] - y) ** 2).mean() for h in heads]) + gain * z * 0
    return buf, (losses, gain, [*trunk.parameters(), *head_params])


@pytest.mark.parametrize("kind", ["matrix", "gramian", "per_sample"])
@pytest.mark.parametrize("update_every", [1, 2])
def test_a_nan_loss_raises_without_a_scaler_and_moves_nothing(kind: str,
                                                              update_every: int) -> None:
    buf, (losses, _gain, params) = _setup(kind, update_every)
    buf.backward(losses(False))
    buf.apply_(UPGrad())  # a first finite step: a reused step follows with update_every=2
    before = [None if p.grad is None else p.grad.clone() for p in params]
    buf.backward(losses(True))
    with pytest.raises(NonFiniteGradientError, match="losses hold inf or NaN"):
        buf.apply_(UPGrad())
    after = [p.grad for p in params]
    assert all((a is None and b is None) or torch.equal(a, b)
               for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize("kind", ["matrix", "gramian", "per_sample"])
def test_a_nan_loss_is_a_skipped_step_with_a_scaler(kind: str) -> None:
    buf, (losses, _gain, _params) = _setup(kind, 1)
    scaler = torch.amp.GradScaler("cpu")
    assert scaler.is_enabled()
    buf.backward(losses(True), scaler=scaler)
    stats = buf.apply_(UPGrad(), scaler=scaler)
    assert stats.found_inf
