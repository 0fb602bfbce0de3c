"""Parameter coverage, property-based (issue class 1: parameters that silently stop training).

Random small models (a trunk of 1–3 linear layers, an optional learnable feature scale, K
linear heads) with one trainable leaf left out of both lists, at a random place: a trunk
layer, a head, the scale, or a trunk layer frozen when the buffer was built and unfrozen
later; in every mode. Under ``other_params="raise"`` the step is refused before anything
moves, naming the leaf by its module path; under ``"sum"`` every ``.grad`` (with the ``Sum``
balancer) equals plain ``sum(losses).backward()`` — the independent reference.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Sum

MODES = ["matrix", "features", "gramian", "auto"]
PLACES = ["trunk", "head", "scale", "unfrozen"]
EXAMPLES = 10  # per (place, mode) and property: 320 cases in all


class Net(nn.Module):
    """``depth`` linear layers with tanh, an optional learnable scale on their output, and K
    linear heads."""

    def __init__(self, k: int, d: int, h: int, depth: int, scale: bool) -> None:
        super().__init__()
        widths = [d] + [h] * depth
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.Tanh()]
        self.trunk = nn.Sequential(*layers)
        self.scale = nn.Parameter(torch.rand(h) + 0.5) if scale else None
        self.heads = nn.ModuleList([nn.Linear(h, 1) for _ in range(k)])

    def features(self, x: Tensor) -> Tensor:
        feats: Tensor = self.trunk(x)
        return feats if self.scale is None else feats * self.scale

    def losses(self, feats: Tensor, y: Tensor) -> Tensor:
        return torch.stack([((head(feats)[:, 0] - y[:, k]) ** 2).mean()
                            for k, head in enumerate(self.heads)])


@dataclass
class Case:
    k: int
    d: int
    h: int
    depth: int
    place: str
    index: int  # which trunk layer or head
    mode: str
    seed: int


@st.composite
def shapes(draw: st.DrawFn, place: str, mode: str) -> Case:
    """K, the widths, the depth (two layers at least when one is left out: a trunk stays),
    which layer or head is left out, and the seed."""
    k = draw(st.integers(2, 4))
    depth = draw(st.integers(2 if place in ("trunk", "unfrozen") else 1, 3))
    index = draw(st.integers(0, (k if place == "head" else depth) - 1))
    return Case(k, draw(st.integers(2, 5)), draw(st.integers(2, 5)), depth, place, index,
                mode, draw(st.integers(0, 2**16)))


def _set_up(case: Case) -> tuple[Net, list[Tensor], list[Tensor], str, list[Tensor]]:
    """The model, the lists, the left-out leaf's expected path, and the leaves to unfreeze."""
    torch.manual_seed(case.seed)
    net = Net(case.k, case.d, case.h, case.depth, scale=case.place == "scale").double()
    left: list[Tensor] = []
    if case.place in ("trunk", "unfrozen"):
        left, name = list(net.trunk[2 * case.index].parameters()), f"trunk.{2 * case.index}."
    elif case.place == "head":
        left, name = list(net.heads[case.index].parameters()), f"heads.{case.index}."
    else:
        assert net.scale is not None
        left, name = [net.scale], "scale"
    if case.place == "unfrozen":
        for p in left:
            p.requires_grad_(False)
    ids = {id(p) for p in left}
    heads = [p for p in net.heads.parameters() if id(p) not in ids]
    head_ids = {id(p) for p in net.heads.parameters()}
    shared = [p for p in net.parameters() if id(p) not in ids and id(p) not in head_ids]
    return net, shared, heads, name, left


def _step(net: Net, buf: TaskGradBuffer, mode: str, x: Tensor, y: Tensor) -> None:
    feats = net.features(x)
    buf.backward(net.losses(feats, y), features=feats if mode == "features" else None)


def _grads(net: nn.Module) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in net.parameters()]


def _run(case: Case, other: str) -> tuple[Net, Net, Tensor, Tensor, TaskGradBuffer, str]:
    net, shared, heads, name, left = _set_up(case)
    ref = copy.deepcopy(net)
    buf = TaskGradBuffer(shared, heads, mode=case.mode, modules=net,  # type: ignore[arg-type]
                         other_params=other)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(case.seed)
    x = torch.randn(6, case.d, generator=gen, dtype=torch.float64)
    y = torch.randn(6, case.k, generator=gen, dtype=torch.float64)
    if case.place == "unfrozen":  # a step while frozen: off the graph, nothing to refuse
        _step(net, buf, case.mode, x, y)
        buf.apply_(Sum())
        net.zero_grad(set_to_none=True)
        for p in [*left, *(q for q in ref.parameters() if not q.requires_grad)]:
            p.requires_grad_(True)  # progressive unfreezing
    return net, ref, x, y, buf, name


def _refused_with_its_path(case: Case) -> None:
    """``"raise"``: refused before anything moves, naming the leaf's module path."""
    net, _, x, y, buf, name = _run(case, "raise")
    for p in net.parameters():
        p.grad = torch.full_like(p, 0.25)
    before = _grads(net)
    with pytest.raises(ValueError, match=rf"neither shared_params nor head_params: .*"
                                         rf"'{name}[a-z]*' \(shape"):
        _step(net, buf, case.mode, x, y)
    after = _grads(net)
    assert all(a is not None and b is not None and torch.equal(a, b)
               for a, b in zip(before, after))  # nothing moved
    assert buf.matrix is None


def _plain_gradient_everywhere(case: Case) -> None:
    """``"sum"`` with the ``Sum`` balancer: every ``.grad`` is plain PyTorch's."""
    net, ref, x, y, buf, _ = _run(case, "sum")
    _step(net, buf, case.mode, x, y)
    buf.apply_(Sum())
    ref.losses(ref.features(x), y).sum().backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


PROPERTIES = {"raise": _refused_with_its_path, "sum": _plain_gradient_everywhere}


@pytest.mark.parametrize("other_params", sorted(PROPERTIES))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("place", PLACES)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_a_left_out_leaf(place: str, mode: str, other_params: str,
                         data: st.DataObject) -> None:
    PROPERTIES[other_params](data.draw(shapes(place, mode)))
