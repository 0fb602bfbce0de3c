"""GhostNorms and an in-place op on a hooked layer's output.

``nn.ReLU(inplace=True)`` after ``nn.Linear`` is legal in plain PyTorch (Linear does not save
its output), but it turns the recorded output into the ReLU's: the gradient at it is the
ReLU's output gradient, and the per-sample norms would be silently wrong (0.23 off on this
model). ``norms`` refuses it, naming the layer, and drops the records; without the in-place op
the norms equal per-sample autograd.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradbalance.clip import GhostNorms


def _model(inplace: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=inplace), nn.Linear(5, 1)).double()


def _reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = list(model.parameters())
    norms = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(model(x[i:i + 1]).squeeze() ** 2, params)
        norms.append(torch.sqrt(sum((g ** 2).sum() for g in grads)))
    return torch.stack(norms)


def test_without_the_in_place_op_the_norms_are_per_sample_autograd() -> None:
    model = _model(inplace=False)
    x = torch.randn(6, 4, dtype=torch.float64)
    ghost = GhostNorms(model)
    norms = ghost.norms(model(x).squeeze(-1) ** 2)
    torch.testing.assert_close(norms, _reference(model, x), rtol=1e-12, atol=1e-12)


def test_an_in_place_op_on_a_hooked_output_is_refused_naming_the_layer() -> None:
    model = _model(inplace=True)
    x = torch.randn(6, 4, dtype=torch.float64)
    ghost = GhostNorms(model)
    losses = model(x).squeeze(-1) ** 2
    with pytest.raises(ValueError, match=r"layer '0' \(Linear\) was modified in place.*"
                                         r"inplace=False"):
        ghost.norms(losses)
    assert all(p.grad is None for p in model.parameters())
    model[1].inplace = False  # the fix: the next forward is recorded afresh and is right
    norms = ghost.norms(model(x).squeeze(-1) ** 2)
    torch.testing.assert_close(norms, _reference(model, x), rtol=1e-12, atol=1e-12)
