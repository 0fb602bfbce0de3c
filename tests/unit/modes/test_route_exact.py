"""One update whatever the route: a trunk weight with a tensor hook or used outside its
layer's forward gets ``matrix`` mode's update in ``gramian`` and ``auto`` modes
(docs/loop.md, "One update whatever the route").

The reference is ``matrix`` mode on an identical model (autograd's per-task gradients, which
run every hook and count every use). The altered layer is one the cost model puts on the
activations route on an unaltered step, so each case would differ on that route.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional

from gradbalance import TaskGradBuffer
from gradbalance.balancers import UPGrad
from gradbalance.modes._auto import AutoMode
from gradbalance.modes._gramian import GramianMode
from gradbalance_lab.models import MultiTaskModel, regression_losses
from support.helpers import build

ALTERATIONS = ("hook", "outside", "function")


class _Altered(nn.Module):
    """``model`` whose features also read ``extra(x)`` (a use outside the layer's forward)."""

    def __init__(self, model: MultiTaskModel, extra: Callable[[Tensor], Tensor] | None) -> None:
        super().__init__()
        self.model, self.extra = model, extra

    def forward(self, x: Tensor) -> list[Tensor]:
        features = self.model.trunk(x)
        if self.extra is not None:
            features = features + self.extra(x)
        return [head(features) for head in self.model.heads]


def _activations_layer(model: MultiTaskModel, x: Tensor, y: Tensor) -> str:
    """A trunk layer the cost model sends to the activations route on an unaltered step."""
    probe = copy.deepcopy(model)
    buf = TaskGradBuffer(probe.shared_parameters(), probe.head_parameters(), mode="gramian",
                         modules=probe.trunk)
    buf.backward(regression_losses(probe(x), y))
    engine = buf._engine
    assert isinstance(engine, GramianMode)
    names = [name for name, route in engine.recorder.routes.items() if route == "activations"]
    assert names, "no layer takes the activations route: the case tests nothing"
    return names[-1]


def _alter(model: MultiTaskModel, name: str, how: str, seed: int) -> _Altered:
    layer = model.trunk.get_submodule(name)
    weight = layer.weight
    gen = torch.Generator().manual_seed(seed)
    if how == "hook":  # a pruning mask on the weight's gradient
        mask = (torch.rand(weight.shape, generator=gen) > 0.4).to(weight.dtype)
        weight.register_hook(lambda g: g * mask)
        return _Altered(model, None)
    if how == "outside":  # the weight in a penalty read by every loss
        return _Altered(model, lambda x: 0.05 * (weight ** 2).sum())
    # the weight applied again by a function call, on a projection of the input
    probe = torch.randn(weight.shape[1:].numel(), generator=gen, dtype=weight.dtype)
    return _Altered(model, lambda x: torch.tanh(
        functional.linear(probe, weight.flatten(1))).mean())


def _updates(model: _Altered, mode: str, x: Tensor, y: Tensor, steps: int,
             route: str | None = None) -> list[list[Tensor]]:
    inner = model.model
    kwargs: dict[str, Any] = {} if mode == "matrix" else {"modules": inner.trunk}
    buf = TaskGradBuffer(inner.shared_parameters(), inner.head_parameters(), mode=mode,
                         **kwargs)
    if route is not None:  # auto mode held on one route
        engine = buf._engine
        assert isinstance(engine, AutoMode)
        engine._decide = lambda roots: route  # type: ignore[method-assign]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for _ in range(steps):
        half = x.shape[0] // 2
        for part in (slice(0, half), slice(half, None)):  # two micro-batches
            buf.backward(regression_losses(model(x[part]), y[part]) * 0.5)
        buf.apply_(UPGrad())
        grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone()
                      for p in inner.shared_parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("how", ALTERATIONS)
@pytest.mark.parametrize("seed", [0, 1])
def test_hooked_and_reused_weights_get_matrix_modes_update(kind: str, how: str,
                                                          seed: int) -> None:
    model, x, y = build(kind, num_tasks=3, batch=4, seed=seed, dtype=torch.float64)
    if kind == "cnn":  # 4 x 4 images: the last convolution sees one position per sample
        x = x[:, :, :4, :4]
    if kind == "transformer":  # one token: the feed-forward layers see few rows
        x = x[:, :1]
    name = _activations_layer(model, x[:2], y[:2])
    reference = _updates(_alter(copy.deepcopy(model), name, how, seed), "matrix", x, y, 2)
    for mode, route in (("gramian", None), ("auto", None), ("auto", "gramian")):
        got = _updates(_alter(copy.deepcopy(model), name, how, seed), mode, x, y, 2, route)
        for step_got, step_ref in zip(got, reference):
            for a, e in zip(step_got, step_ref):
                torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


class _TiedTrunk(nn.Module):
    """Token embedding, a linear layer, and an output projection tied to the embedding."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab)
        self.out.weight = self.embed.weight
        self.same = nn.Linear(width, width, bias=False)
        self.again = nn.Linear(width, width)
        self.again.weight = self.same.weight  # two layers, one weight

    def forward(self, ids: Tensor) -> Tensor:
        h = torch.tanh(self.mix(self.embed(ids)))
        h = torch.tanh(self.again(torch.tanh(self.same(h))))
        out: Tensor = self.out(h).mean(dim=1)
        return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("batch", [2, 6])
def test_weights_tied_between_layers_get_matrix_modes_update(seed: int, batch: int) -> None:
    torch.manual_seed(seed)
    vocab, width = 11, 24
    model = MultiTaskModel(_TiedTrunk(vocab, width),
                           nn.ModuleList(nn.Linear(vocab, 1) for _ in range(3))).double()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(vocab, (batch, 5), generator=gen)
    y = torch.randn(batch, 3, generator=gen, dtype=torch.float64)
    wrapped = _Altered(model, None)
    reference = _updates(copy.deepcopy(wrapped), "matrix", x, y, 2)
    for mode, route in (("gramian", None), ("auto", None), ("auto", "gramian")):
        got = _updates(copy.deepcopy(wrapped), mode, x, y, 2, route)
        for step_got, step_ref in zip(got, reference):
            for a, e in zip(step_got, step_ref):
                torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_a_forced_activations_route_on_a_hooked_weight_raises_naming_the_layer() -> None:
    model, x, y = build("mlp", num_tasks=2, batch=4, dtype=torch.float64)
    model.trunk[2].weight.register_hook(lambda g: 2 * g)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode="gramian",
                         modules=model.trunk)
    engine = buf._engine
    assert isinstance(engine, GramianMode)
    engine.recorder.force = {"2": "activations"}
    with pytest.raises(RuntimeError, match=r"layer 2 is forced onto the activations route"):
        buf.backward(regression_losses(model(x), y))
    assert all(p.grad is None for p in model.parameters())
