"""The coverage check warns once when ``shared_params`` and ``head_params`` look swapped
(docs/loop.md, "Parameter coverage").

Rule: every shared parameter the losses reach is reached by one task's loss only, while some
head parameter is reached by every task's loss. Correct set-ups of several models stay
silent; the same models with the lists swapped warn once, naming both sides.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Sum


class Mlp(nn.Module):
    """A two-layer trunk and K linear heads."""

    def __init__(self, k: int, d: int, h: int) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, h))
        self.heads = nn.ModuleList([nn.Linear(h, 1) for _ in range(k)])

    def losses(self, x: Tensor) -> Tensor:
        feats = self.trunk(x)
        return torch.stack([head(feats).pow(2).mean() for head in self.heads])


class Tokens(nn.Module):
    """An embedding, a LayerNorm and a scale in the trunk; two-layer heads."""

    def __init__(self, k: int, d: int, h: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, h)
        self.norm = nn.LayerNorm(h)
        self.scale = nn.Parameter(torch.ones(h))
        self.heads = nn.ModuleList([nn.Sequential(nn.Linear(h, d), nn.ReLU(), nn.Linear(d, 1))
                                    for _ in range(k)])

    def trunk_params(self) -> list[Tensor]:
        return [*self.embed.parameters(), *self.norm.parameters(), self.scale]

    def losses(self, x: Tensor) -> Tensor:
        ids = (x.abs() * 7).long() % 11
        feats = self.norm(self.embed(ids)).mean(dim=1) * self.scale
        return torch.stack([head(feats).pow(2).mean() / 2 for head in self.heads])


def _split(model: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """(trunk, heads) of a model."""
    heads = list(model.heads.parameters())  # type: ignore[union-attr]
    trunk = (model.trunk_params() if isinstance(model, Tokens)
             else list(model.trunk.parameters()))  # type: ignore[union-attr]
    return trunk, heads


MODELS: dict[str, Callable[[int, int, int], nn.Module]] = {"mlp": Mlp, "tokens": Tokens}
SHAPES = [(2, 3, 4), (3, 5, 2), (4, 2, 6)]


def _step(model: nn.Module, buf: TaskGradBuffer, x: Tensor, as_list: bool) -> None:
    losses = model.losses(x)  # type: ignore[operator]
    buf.backward(list(losses.unbind()) if as_list else losses)
    buf.apply_(Sum())
    model.zero_grad()


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("as_list", [False, True])
def test_a_correct_set_up_is_silent(name: str, shape: tuple[int, int, int],
                                    as_list: bool) -> None:
    torch.manual_seed(shape[0])
    model = MODELS[name](*shape)
    trunk, heads = _split(model)
    buf = TaskGradBuffer(trunk, heads, modules=model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(2):
            _step(model, buf, torch.randn(4, 3, shape[1]) + step, as_list)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("shape", SHAPES)
def test_swapped_lists_warn_once_naming_both_sides(name: str,
                                                   shape: tuple[int, int, int]) -> None:
    torch.manual_seed(shape[0] + 10)
    model = MODELS[name](*shape)
    trunk, heads = _split(model)
    buf = TaskGradBuffer(heads, trunk, modules=model)  # swapped
    with pytest.warns(UserWarning, match=r"look swapped.*'heads\.0\.[0-9a-z.]+'.*head "
                                         rf"parameter '[a-z]+[.a-z0-9]*' is reached by all "
                                         rf"{shape[0]} tasks"):
        _step(model, buf, torch.randn(4, 3, shape[1]), as_list=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per buffer
        _step(model, buf, torch.randn(4, 3, shape[1]), as_list=True)


def test_one_task_or_a_vector_of_unknown_origin_is_silent() -> None:
    torch.manual_seed(0)
    model = Mlp(2, 3, 4)
    trunk, heads = _split(model)
    buf = TaskGradBuffer(heads, trunk)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        feats = model.trunk(torch.randn(5, 3))
        joint = torch.cat([h(feats) for h in model.heads], dim=1).pow(2).mean(dim=0)
        buf.backward(joint)  # one [K] tensor, not a stack: the tasks cannot be told apart
        buf.apply_(Sum())
        single = TaskGradBuffer(list(model.heads[0].parameters()), trunk)
        single.backward([model.heads[0](model.trunk(torch.randn(5, 3))).pow(2).mean()])
        single.apply_(Sum())


def test_without_modules_the_warning_names_shapes() -> None:
    torch.manual_seed(1)
    model = Mlp(3, 2, 5)
    trunk, heads = _split(model)
    buf = TaskGradBuffer(heads, trunk)  # swapped, no modules= for the names
    with pytest.warns(UserWarning, match=r"look swapped.*e\.g\. a tensor of shape \(1[, 5]*\)\)"
                                         r".*head parameter a tensor of shape \(5[, 25]*\) is "
                                         r"reached by all 3"):
        _step(model, buf, torch.randn(4, 3, 2), as_list=False)
