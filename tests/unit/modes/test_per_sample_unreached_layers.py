"""Per-sample objectives over micro-batches where a trunk layer is reached by some
micro-batches only (a branch one micro-batch skips, an output computed but off its losses'
graph, a fallback module): the blocks between two micro-batches on such a layer are zero.

The reference is the matrix route with every sample's loss a task of one step, an
independent computation of the same rows (docs/per_sample.md, "Micro-batches").
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, Sum, UPGrad


class _Branchy(nn.Module):
    """``tanh(b(x) + a(x))`` summed over features, ``a`` skipped where ``use_a`` is False
    (``off_graph``: computed all the same, its output left off the losses' graph); ``kind``
    ``"groupnorm"``: ``a`` is a fallback module after a linear layer."""

    def __init__(self, kind: str, off_graph: bool) -> None:
        super().__init__()
        self.kind, self.off_graph = kind, off_graph
        self.pre = nn.Linear(4, 3)
        self.a = nn.GroupNorm(1, 3) if kind == "groupnorm" else nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def branch(self, x: Tensor) -> Tensor:
        if self.kind == "groupnorm":
            out: Tensor = self.a(self.pre(x).unsqueeze(-1)).squeeze(-1)
            return out
        return self.a(x)  # type: ignore[no-any-return]

    def forward(self, x: Tensor, use_a: bool) -> Tensor:
        h = self.b(x)
        if use_a or self.off_graph:
            a = self.branch(x)
            if use_a:
                h = h + a
        return torch.tanh(h).sum(dim=1)


def _flat_grads(model: nn.Module) -> Tensor:
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
                      for p in model.parameters()])


@pytest.mark.parametrize("balancer", [UPGrad, MGDA, Sum])
@pytest.mark.parametrize("order", [(True, False), (False, True), (True, False, True),
                                   (False, True, False)])
@pytest.mark.parametrize("sizes", [(3, 3), (2, 4), (4, 1, 1)])
@pytest.mark.parametrize("kind,off_graph", [("linear", False), ("linear", True),
                                            ("groupnorm", False)])
def test_a_layer_some_micro_batches_skip_gives_the_matrix_route_update(
        balancer: type, order: tuple[bool, ...], sizes: tuple[int, ...], kind: str,
        off_graph: bool) -> None:
    n = len(min(order, sizes, key=len))
    flags, parts = order[:n], sizes[:n]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(parts), 4, generator=gen, dtype=torch.float64)
    y = torch.randn(sum(parts), generator=gen, dtype=torch.float64)
    bounds = [sum(parts[:i]) for i in range(n + 1)]
    results = []
    for route in ("matrix", "per-sample"):
        torch.manual_seed(0)
        model = _Branchy(kind, off_graph).double()
        params = list(model.parameters())
        if route == "matrix":
            buf = TaskGradBuffer(params)
            losses = torch.cat([(model(x[lo:hi], f) - y[lo:hi]) ** 2
                                for lo, hi, f in zip(bounds, bounds[1:], flags)])
            buf.backward(list(losses.unbind()))
        else:
            buf = TaskGradBuffer(params, modules=model, batch_dim=0)
            for lo, hi, f in zip(bounds, bounds[1:], flags):
                buf.backward((model(x[lo:hi], f) - y[lo:hi]) ** 2)
        buf.apply_(balancer())
        results.append(_flat_grads(model))
    torch.testing.assert_close(results[1], results[0], rtol=1e-9, atol=1e-12)
