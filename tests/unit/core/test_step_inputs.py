"""Inputs plain PyTorch takes (docs/loop.md): a trunk or heads with ``nn.Embedding(sparse=True)``
give the update of the same model with ``sparse=False`` in every
mode (the heads keep their sparse plain gradient, as ``sum(losses).backward()`` gives it);
complex parameters are refused at construction, naming them; ``backward`` called under
``torch.no_grad()`` gives the update of the call outside it, and losses built under it are
refused with a clear message before anything moves.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer, balanced_backward
from gradbalance.balancers import MGDA, PCGrad, UPGrad
from gradbalance.clip import GhostNorms
from support.step_net import StepNet


class EmbNet(nn.Module):
    """An embedding (sparse or not) and a linear layer as the trunk; K heads, each a linear
    layer on the features plus its own embedding of the tokens (sparse or not)."""

    def __init__(self, vocab: int, dim: int, num_tasks: int, seed: int, sparse: bool,
                 head_sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.ModuleList([nn.Embedding(vocab, dim, sparse=sparse), nn.Linear(dim, 3)])
        self.head_emb = nn.ModuleList([nn.Embedding(vocab, 3, sparse=head_sparse)
                                       for _ in range(num_tasks)])
        self.heads = nn.ModuleList([nn.Linear(3, 1) for _ in range(num_tasks)])
        self.double()

    def head_params(self) -> list[nn.Parameter]:
        return [*self.heads.parameters(), *self.head_emb.parameters()]

    def features(self, tokens: Tensor) -> Tensor:
        return torch.tanh(self.trunk[1](self.trunk[0](tokens)))

    def losses(self, feats: Tensor, tokens: Tensor, y: Tensor) -> Tensor:
        return torch.stack([((h(feats + e(tokens))[:, 0] - y[:, k]) ** 2).mean()
                            for k, (h, e) in enumerate(zip(self.heads, self.head_emb))])


SHAPES = [(10, 4, 2, 0), (7, 3, 3, 1), (12, 5, 4, 2)]


def _data(vocab: int, num_tasks: int, seed: int, micro: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed + 50)
    return [(torch.randint(0, vocab, (6,), generator=g),
             torch.randn(6, num_tasks, generator=g, dtype=torch.float64)) for _ in range(micro)]


def _grads(net: nn.Module) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.to_dense().clone() for p in net.parameters()]


def _run(shape: tuple[int, int, int, int], sparse: bool, head_sparse: bool, mode: str,
         route: str, update_every: int = 1, steps: int = 3, micro: int = 2
         ) -> list[list[Tensor | None]]:
    """The ``.grad`` of every parameter after each step (dense copies)."""
    vocab, dim, num_tasks, seed = shape
    net = EmbNet(vocab, dim, num_tasks, seed, sparse, head_sparse)
    balancer = UPGrad()
    buf = None if route == "balanced_backward" else TaskGradBuffer(
        net.trunk.parameters(), net.head_params(), mode=mode, modules=net.trunk,
        update_every=update_every)
    out = []
    for step in range(steps):
        for tokens, y in _data(vocab, num_tasks, seed + step, micro):
            feats = net.features(tokens)
            losses = net.losses(feats, tokens, y)
            extra: dict[str, Any] = {"features": feats} if mode == "features" else {}
            if buf is None:
                balanced_backward(losses, balancer, shared_params=net.trunk.parameters(),
                                  head_params=net.head_params(), mode=mode, **extra)
            else:
                buf.backward(losses, **extra)
        if buf is not None:
            buf.apply_(balancer)
        out.append(_grads(net))
        for p in net.parameters():
            p.grad = None
    return out


ROUTES = [("matrix", "buffer", 1), ("matrix", "buffer", 2), ("gramian", "buffer", 1),
          ("gramian", "buffer", 2), ("auto", "buffer", 1), ("features", "buffer", 1),
          ("matrix", "balanced_backward", 1), ("auto", "balanced_backward", 1),
          ("features", "balanced_backward", 1)]


@pytest.mark.parametrize(("mode", "route", "update_every"), ROUTES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("head_sparse", [False, True])
def test_sparse_embeddings_give_the_dense_embeddings_update(
        mode: str, route: str, update_every: int, shape: tuple[int, int, int, int],
        head_sparse: bool) -> None:
    micro = 1 if mode == "features" or route == "balanced_backward" else 2
    dense = _run(shape, False, False, mode, route, update_every, micro=micro)
    sparse = _run(shape, True, head_sparse, mode, route, update_every, micro=micro)
    for got, expected in zip(sparse, dense):
        for a, b in zip(got, expected):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_sparse_heads_keep_their_sparse_plain_gradient() -> None:
    """The heads' ``.grad`` is what ``sum(losses).backward()`` gives: sparse, same values."""
    vocab, dim, num_tasks, seed = SHAPES[1]
    net = EmbNet(vocab, dim, num_tasks, seed, True, True)
    twin = EmbNet(vocab, dim, num_tasks, seed, True, True)
    tokens, y = _data(vocab, num_tasks, seed, 1)[0]
    balanced_backward(net.losses(net.features(tokens), tokens, y), MGDA(),
                      shared_params=net.trunk.parameters(), head_params=net.head_params())
    twin.losses(twin.features(tokens), tokens, y).sum().backward()
    for p, q in zip(net.head_emb.parameters(), twin.head_emb.parameters()):
        assert p.grad is not None and q.grad is not None
        assert p.grad.is_sparse and q.grad.is_sparse
        torch.testing.assert_close(p.grad.to_dense(), q.grad.to_dense())
    # the trunk's embedding gets the balanced update, dense
    weight = net.trunk[0].weight
    assert weight.grad is not None and weight.grad.layout == torch.strided


@pytest.mark.parametrize("mode", ["matrix", "gramian", "auto"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_sparse_embedding_bag_gives_the_dense_bags_update(mode: str, seed: int) -> None:
    def step(sparse: bool) -> list[Tensor]:
        torch.manual_seed(seed)
        trunk = nn.ModuleList([nn.EmbeddingBag(9, 4, mode="sum", sparse=sparse),
                               nn.Linear(4, 3)]).double()
        heads = nn.ModuleList([nn.Linear(3, 1) for _ in range(3)]).double()
        buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), mode=mode, modules=trunk)
        g = torch.Generator().manual_seed(seed)
        for _ in range(2):
            tokens = torch.randint(0, 9, (5, 3), generator=g)
            feats = torch.tanh(trunk[1](trunk[0](tokens)))
            buf.backward(torch.stack([h(feats).pow(2).mean() for h in heads]))
        buf.apply_(UPGrad())
        return [p.grad.clone() for p in trunk.parameters() if p.grad is not None]

    for a, b in zip(step(True), step(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("where", ["shared", "head"])
@pytest.mark.parametrize("mode", ["matrix", "gramian", "auto", "features"])
def test_complex_parameters_are_refused_at_construction(where: str, mode: str) -> None:
    trunk = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    heads = nn.ModuleList([nn.Linear(2, 1), nn.Linear(2, 1, dtype=torch.complex64)])
    if where == "shared":
        trunk[0].weight = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))
        match = (r"shared_params\[0\] \('0.weight'\) \(shape \(4, 3\)\) is complex "
                 r"\(torch.complex64\).*torch.view_as_real")
    else:
        match = r"head_params\[2\] \(shape \(1, 2\)\) is complex \(torch.complex64\)"
    with pytest.raises(ValueError, match=match):
        TaskGradBuffer(trunk.parameters(), heads.parameters(), mode=mode, modules=trunk)
    assert all(not m._forward_hooks for m in trunk.modules())  # no gramian hook left behind
    if mode != "gramian":
        losses = [torch.zeros((), requires_grad=True)] * 2
        with pytest.raises(ValueError, match="is complex"):
            balanced_backward(losses, PCGrad(), shared_params=trunk.parameters(),
                              head_params=heads.parameters(), mode=mode)


def _no_grad_run(shape: tuple[int, int, int], seed: int, mode: str, route: str,
                 inside: bool) -> list[Tensor | None]:
    net = StepNet(*shape, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, shape[0], generator=g, dtype=torch.float64)
    y = torch.randn(5, shape[2], generator=g, dtype=torch.float64)
    buf = None if route == "balanced_backward" else TaskGradBuffer(
        net.trunk.parameters(), net.heads.parameters(), mode=mode, modules=net.trunk)
    feats = net.features(x)
    losses = net.task_losses(feats, y)
    extra: dict[str, Any] = {"features": feats} if mode == "features" else {}
    listed = list(losses.unbind()) if seed % 2 else losses  # a list of scalars, or a stack
    with torch.no_grad() if inside else torch.enable_grad():
        if buf is None:
            balanced_backward(listed, UPGrad(), shared_params=net.trunk.parameters(),
                              head_params=net.heads.parameters(), mode=mode, **extra)
        else:
            buf.backward(listed, **extra)
            buf.apply_(UPGrad())
    return [None if p.grad is None else p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize(("mode", "route"), [
    ("matrix", "buffer"), ("gramian", "buffer"), ("auto", "buffer"), ("features", "buffer"),
    ("matrix", "balanced_backward"), ("auto", "balanced_backward"),
    ("features", "balanced_backward")])
@pytest.mark.parametrize(("shape", "seed"), [((3, 4, 2), 0), ((5, 3, 3), 1), ((2, 6, 4), 2)])
def test_backward_under_no_grad_gives_the_update_of_the_call_outside_it(
        mode: str, route: str, shape: tuple[int, int, int], seed: int) -> None:
    outside = _no_grad_run(shape, seed, mode, route, inside=False)
    inside = _no_grad_run(shape, seed, mode, route, inside=True)
    assert all(g is not None for g in outside)
    for a, b in zip(inside, outside):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["matrix", "gramian", "auto"])
def test_losses_built_under_no_grad_are_refused_before_anything_moves(mode: str) -> None:
    net = StepNet(3, 4, 2, 0)
    buf = TaskGradBuffer(net.trunk.parameters(), net.heads.parameters(), mode=mode,
                         modules=net.trunk)
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    with torch.no_grad():
        losses = net.task_losses(net.features(x), y)
    with pytest.raises(ValueError, match=r"losses do not require grad.*torch.no_grad\(\)"):
        buf.backward(losses)
    assert all(p.grad is None for p in net.parameters())
    losses = net.task_losses(net.features(x), y)  # the same buffer then takes a step
    buf.backward(losses)
    buf.apply_(UPGrad())
    assert all(p.grad is not None for p in net.parameters())


@pytest.mark.parametrize("modules", [{"trunk": None}, "trunk", 5, [], [5]],
                         ids=["dict", "str", "int", "empty", "list-of-int"])
@pytest.mark.parametrize("mode", ["gramian", "auto", "per_sample"])
def test_modules_of_the_wrong_kind_are_refused_in_every_mode(modules: Any, mode: str) -> None:
    """``mode="auto"`` took a dict or a string as "no gramian route" and ran on the rows
    silently; an int raised torch's ``'int' object is not iterable``."""
    trunk = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
    if isinstance(modules, dict):
        modules = {"trunk": trunk}
    given: dict[str, Any] = {"batch_dim": 0} if mode == "per_sample" else {"mode": mode}
    with pytest.raises(ValueError, match=r"(?s)Invalid modules: .*expected an nn.Module or a list"):
        TaskGradBuffer(list(trunk.parameters()), modules=modules, **given)


def test_ghost_norms_refuses_a_module_of_the_wrong_kind() -> None:
    with pytest.raises(TypeError, match=r"Invalid module: a list \(expected the nn.Module"):
        GhostNorms([nn.Linear(2, 2)])  # type: ignore[arg-type]
