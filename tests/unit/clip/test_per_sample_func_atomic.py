"""``per_sample_grad_norms_of_model`` (torch.func) moves nothing the user owns: a BatchNorm in
training mode is refused before any forward (its running statistics as they were), a
forward that writes a buffer writes a copy, and a refused dropout leaves torch's generator
where it was."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gradbalance.clip import per_sample_grad_norms, per_sample_grad_norms_of_model


def _loss(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2)[:, 0]


def test_a_training_batch_norm_is_refused_before_any_forward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten(),
                          nn.Linear(48, 1))
    x, y = torch.randn(4, 2, 6, 6), torch.randn(4, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"'1' \(BatchNorm2d in training mode\)"):
        per_sample_grad_norms_of_model(model, _loss, x, y)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    model.eval()  # the fix the message names: then the norms are the graph route's
    norms = per_sample_grad_norms_of_model(model, _loss, x, y)
    torch.testing.assert_close(norms, per_sample_grad_norms(_loss(model(x), y),
                                                            list(model.parameters())))


class _Counting(nn.Module):
    """A linear layer that counts its calls in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        out: Tensor = self.lin(x)
        return out


def test_a_forward_writing_a_buffer_writes_a_copy() -> None:
    torch.manual_seed(0)
    model = _Counting()
    x, y = torch.randn(5, 3), torch.randn(5, 1)
    with pytest.raises(RuntimeError, match="in-place"):  # torch.func's refusal of the write
        per_sample_grad_norms_of_model(model, _loss, x, y)
    assert float(model.calls) == 0.0  # the probe forward wrote the copy


def test_a_refused_dropout_leaves_the_generator_where_it_was() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 1))
    x, y = torch.randn(5, 3), torch.randn(5, 1)
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError):  # vmap's randomness="error"
        per_sample_grad_norms_of_model(model, _loss, x, y)
    assert torch.equal(torch.get_rng_state(), state)
