"""Subclasses of the layers with a ghost form (``nn.Linear``, ``nn.Conv2d``, ``nn.LayerNorm``,
``nn.Embedding``) that override ``forward``: the form is the plain layer's and the hooks see
only the call's input and output, so such a layer is no ghost layer. ``GhostNorms`` refuses
it, naming it; ``batch_dim=0`` takes it as a fallback module and gives the matrix route's
update (every sample a task: an independent computation), Sum's the plain gradient. A
subclass that keeps the plain ``forward`` stays a ghost layer."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Sum, UPGrad
from gradbalance.clip import GhostNorms, per_sample_grad_norms


class _ScaledReadout(nn.Linear):  # a readout scaling its input (as muP's)
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(0.5 * x)


class _StdConv2d(nn.Conv2d):  # weight standardisation inside forward
    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True)
                                                         + 1e-5)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class _ScaledNorm(nn.LayerNorm):
    def forward(self, x: Tensor) -> Tensor:
        return 2.0 * super().forward(x)


class _ScaledEmbedding(nn.Embedding):
    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids) * 3.0


class _NamedLinear(nn.Linear):  # keeps nn.Linear.forward: still a ghost layer
    pass


def _readout() -> tuple[nn.Module, Tensor]:
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), _ScaledReadout(6, 2))
    return model, torch.randn(5, 4, dtype=torch.float64)


def _std_conv() -> tuple[nn.Module, Tensor]:
    model = nn.Sequential(_StdConv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(27, 2))
    return model, torch.randn(5, 2, 5, 5, dtype=torch.float64)


def _norm() -> tuple[nn.Module, Tensor]:
    model = nn.Sequential(nn.Linear(4, 6), _ScaledNorm(6), nn.Tanh(), nn.Linear(6, 2))
    return model, torch.randn(5, 4, dtype=torch.float64)


def _embedding() -> tuple[nn.Module, Tensor]:
    model = nn.Sequential(_ScaledEmbedding(7, 4), nn.Flatten(), nn.Linear(12, 2))
    return model, torch.randint(0, 7, (5, 3))


MODELS: dict[str, Callable[[], tuple[nn.Module, Tensor]]] = {
    "readout": _readout, "std_conv": _std_conv, "norm": _norm, "embedding": _embedding}


def _built(name: str) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model, x = MODELS[name]()
    return model.double(), x, torch.randn(5, 2, dtype=torch.float64)


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("name", MODELS)
def test_ghost_norms_refuse_a_layer_with_its_own_forward(name: str) -> None:
    model, _, _ = _built(name)
    with pytest.raises(ValueError, match=r"overrides nn\.\w+\.forward"):
        GhostNorms(model)


def test_a_subclass_keeping_the_plain_forward_is_still_a_ghost_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_NamedLinear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    ghost = GhostNorms(model)
    losses = (model(x)[:, 0] - y) ** 2
    torch.testing.assert_close(ghost.norms(losses),
                               per_sample_grad_norms(losses, list(model.parameters())),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("balancer", [Sum, UPGrad])
@pytest.mark.parametrize("name", MODELS)
def test_batch_dim_takes_it_as_a_fallback_with_the_matrix_route_update(
        name: str, balancer: type) -> None:
    results = []
    for route in ("matrix", "per-sample"):
        model, x, y = _built(name)
        if route == "matrix":
            buf = TaskGradBuffer(list(model.parameters()))
            buf.backward(list(((model(x) - y) ** 2).sum(dim=1).unbind()))
        else:  # built before the forward: its hooks record it
            buf = TaskGradBuffer(list(model.parameters()), modules=model, batch_dim=0)
            buf.backward(((model(x) - y) ** 2).sum(dim=1))  # [B]
        buf.apply_(balancer())
        results.append(_flat(model))
    torch.testing.assert_close(results[1], results[0], rtol=1e-9, atol=1e-12)
    if balancer is Sum:  # the plain gradient
        model, x, y = _built(name)
        ((model(x) - y) ** 2).sum().backward()
        torch.testing.assert_close(results[1], _flat(model), rtol=1e-9, atol=1e-12)
