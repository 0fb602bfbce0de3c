"""DWA and GradNorm read rates of the losses (``Lₖ(t−1)/Lₖ(t−2)``, ``Lₖ(t)/Lₖ(0)``): a
negative loss is refused naming the losses, before any state moves (DWA divided by a clamp,
giving weights from a rate of the wrong sign; GradNorm raised a negative mean rate to
``alpha``, a NaN that froze one task's weight without a word), and DWA's rate of a loss that
fell to 0 and rose again stays finite (its weight was NaN)."""

from __future__ import annotations

import copy

import pytest
import torch

from gradbalance.functional import dwa_weights
from gradbalance.weighting import DWA, GradNorm


def test_dwa_refuses_a_negative_loss_before_anything_moves() -> None:
    dwa = DWA(2)
    dwa(torch.tensor([1.0, 1.0]))
    dwa.update()
    before = copy.deepcopy(dwa.state_dict())
    with pytest.raises(ValueError, match=r"Invalid losses: \[-1\.0, 1\.0\] \(DWA expects"):
        dwa(torch.tensor([-1.0, 1.0]))
    after = dwa.state_dict()
    assert all(torch.equal(after[k], v) if isinstance(v, torch.Tensor) else after[k] == v
               for k, v in before.items())


def test_dwa_rate_after_a_zero_loss_is_finite() -> None:
    w = dwa_weights(torch.tensor([2e8, 1.0]), torch.tensor([0.0, 1.0]))
    assert bool(torch.isfinite(w).all())
    assert w.tolist() == pytest.approx([2.0, 0.0], abs=1e-12)  # K·softmax: all on task 0


def test_gradnorm_refuses_a_negative_loss_before_anything_moves() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 3)
    gradnorm = GradNorm(2, layer)
    x = torch.randn(4, 3)

    def losses(signs: tuple[float, float]) -> torch.Tensor:
        out = layer(x)
        return torch.stack([signs[0] * (out[:, 0] ** 2).mean() + 3.0 * (signs[0] < 0),
                            signs[1] * (out[:, 1] ** 2).mean()])

    gradnorm(losses((1.0, 1.0)))
    gradnorm.update()
    weights = gradnorm.task_weights.detach().clone()
    gradnorm(losses((-1.0, 1.0)) - 10.0 * torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"GradNorm's training rates .* need losses >= 0"):
        gradnorm.update()
    assert torch.equal(gradnorm.task_weights.detach(), weights)
