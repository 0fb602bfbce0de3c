"""Parameter coverage (docs/loop.md, "Parameter coverage").

Reference: plain ``sum(losses).backward()`` fills the ``.grad`` of every trainable leaf the
losses reach. The balanced step either does the same for a leaf in neither list
(``other_params="sum"``) or refuses before anything moves, naming it; a reentrant checkpoint
is refused; trunk post-accumulate-grad hooks run once their balanced ``.grad`` is written.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gradbalance import TaskGradBuffer, balanced_backward
from gradbalance.balancers import Mean, Sum

SHAPES = [(2, 5, 3), (3, 4, 6), (4, 7, 2)]  # (K, input width, feature width)
SEEDS = [0, 1]


class Net(nn.Module):
    """A trunk of two linear layers, a learnable feature scale, and K linear heads."""

    def __init__(self, k: int, d: int, h: int) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, h))
        self.scale = nn.Parameter(torch.ones(h))
        self.heads = nn.ModuleList([nn.Linear(h, 1) for _ in range(k)])

    def losses(self, x: Tensor, y: Tensor, reentrant: bool | None = None) -> Tensor:
        if reentrant is None:
            feats = self.trunk(x)
        else:
            # the checkpointed layers' input requires grad, as inside a deeper trunk
            feats = checkpoint(self.trunk[1:], self.trunk[0](x), use_reentrant=reentrant)
        feats = feats * self.scale
        return torch.stack([((head(feats)[:, 0] - y[:, k]) ** 2).mean()
                            for k, head in enumerate(self.heads)])


def _setup(shape: tuple[int, int, int], seed: int) -> tuple[Net, Tensor, Tensor]:
    k, d, h = shape
    torch.manual_seed(seed)
    net = Net(k, d, h).double()
    return net, torch.randn(8, d, dtype=torch.float64), torch.randn(8, k, dtype=torch.float64)


def _grads(params: list[Tensor]) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in params]


def _same(a: list[Tensor | None], b: list[Tensor | None]) -> bool:
    return all((u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
               for u, v in zip(a, b))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_left_out_leaves_are_refused_before_anything_moves(shape: tuple[int, int, int],
                                                           seed: int) -> None:
    net, x, y = _setup(shape, seed)
    trunk, heads = list(net.trunk.parameters()), list(net.heads.parameters())
    for p in net.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = _grads(list(net.parameters()))
    cases = {  # (shared, heads, the parameter named in the error)
        "scale": (trunk, heads, "scale"),
        "a head": ([*trunk, net.scale], heads[2:], "heads.0.weight"),
        "a trunk layer": ([*trunk[2:], net.scale], heads, "trunk.0.weight"),
    }
    for shared, listed, name in cases.values():
        buf = TaskGradBuffer(shared, listed, modules=net)
        with pytest.raises(ValueError, match=f"neither shared_params nor head_params: .*'{name}'"):
            buf.backward(net.losses(x, y))
        assert _same(_grads(list(net.parameters())), before)
        assert buf.matrix is None
    # without the module, the error names the shape and the op that reads the tensor
    buf = TaskGradBuffer(trunk, heads)
    with pytest.raises(ValueError, match=rf"shape \({shape[2]},\), read by MulBackward0.*"
                                         r"other_params='sum'"):
        buf.backward(net.losses(x, y))


@pytest.mark.parametrize("mode", ["matrix", "features", "auto", "gramian"])
def test_every_mode_refuses(mode: str) -> None:
    net, x, y = _setup(SHAPES[0], 3)
    buf = TaskGradBuffer(list(net.trunk.parameters()), list(net.heads.parameters()),
                         mode=mode, modules=net.trunk)  # type: ignore[arg-type]
    feats = net.trunk(x)
    losses = torch.stack([((head(feats * net.scale)[:, 0] - y[:, k]) ** 2).mean()
                          for k, head in enumerate(net.heads)])
    with pytest.raises(ValueError, match="neither shared_params nor head_params"):
        buf.backward(losses, features=feats if mode == "features" else None)
    assert net.scale.grad is None


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("update_every", [1, 2])
def test_sum_gives_the_plain_gradient(shape: tuple[int, int, int], update_every: int) -> None:
    net, x, y = _setup(shape, 4)
    ref, _, _ = _setup(shape, 4)
    buf = TaskGradBuffer(list(net.trunk.parameters()), list(net.heads.parameters()),
                         other_params="sum", update_every=update_every)
    for step in range(3):
        xs, ys = x + step, y - step
        for micro in range(2):
            buf.backward(net.losses(xs[micro::2], ys[micro::2]))
            ref.losses(xs[micro::2], ys[micro::2]).sum().backward()
        buf.apply_(Mean())
        assert net.scale.grad is not None and ref.scale.grad is not None
        torch.testing.assert_close(net.scale.grad, ref.scale.grad)
        for p, q in zip(net.heads.parameters(), ref.heads.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        net.zero_grad()
        ref.zero_grad()


def test_sum_through_balanced_backward_and_ignore() -> None:
    net, x, y = _setup(SHAPES[1], 5)
    ref, _, _ = _setup(SHAPES[1], 5)
    balanced_backward(net.losses(x, y), Sum(), shared_params=net.trunk.parameters(),
                      head_params=net.heads.parameters(), other_params="sum")
    ref.losses(x, y).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):  # Sum: every leaf as plain
        torch.testing.assert_close(p.grad, q.grad)
    net.zero_grad(set_to_none=True)
    balanced_backward(net.losses(x, y), Sum(), shared_params=net.trunk.parameters(),
                      head_params=net.heads.parameters(), other_params="ignore")
    assert net.scale.grad is None
    with pytest.raises(ValueError, match="other_params must be 'raise', 'sum' or 'ignore', "
                                         "got 'plain'"):
        TaskGradBuffer(net.trunk.parameters(), other_params="plain")  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", SEEDS)
def test_unfrozen_after_build_is_refused_then_trains_in_a_new_buffer(seed: int) -> None:
    net, x, y = _setup(SHAPES[2], seed)
    ref, _, _ = _setup(SHAPES[2], seed)
    first = net.trunk[0]
    for p in first.parameters():
        p.requires_grad_(False)
    rest = [p for p in net.parameters() if p.requires_grad and p is not net.scale]
    heads = list(net.heads.parameters())
    shared = [p for p in rest if all(p is not h for h in heads)] + [net.scale]
    buf = TaskGradBuffer(shared, heads, modules=net)
    buf.backward(net.losses(x, y))  # frozen: not on the graph, not refused
    buf.apply_(Sum())
    net.zero_grad(set_to_none=True)
    for p in first.parameters():  # progressive unfreezing
        p.requires_grad_(True)
    with pytest.raises(ValueError, match=r"'trunk\.0\.weight'.*unfrozen after the TaskGradBuffer"):
        buf.backward(net.losses(x, y))
    assert all(p.grad is None for p in net.parameters())
    buf = TaskGradBuffer([*first.parameters(), *shared], heads, modules=net)
    buf.backward(net.losses(x, y))
    buf.apply_(Sum())
    ref.losses(x, y).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):  # Sum: the plain gradient
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("shape", SHAPES)
def test_reentrant_checkpoint_is_refused_and_the_other_works(shape: tuple[int, int, int]
                                                              ) -> None:
    net, x, y = _setup(shape, 6)
    ref, _, _ = _setup(shape, 6)
    shared = [*net.trunk.parameters(), net.scale]
    buf = TaskGradBuffer(shared, list(net.heads.parameters()))
    with pytest.raises(ValueError, match=r"use_reentrant=True.*pass use_reentrant=False"):
        buf.backward(net.losses(x, y, reentrant=True))
    assert all(p.grad is None for p in net.parameters())
    buf.backward(net.losses(x, y, reentrant=False))
    buf.apply_(Sum())
    ref.losses(x, y).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("mode", ["matrix", "features", "gramian"])
@pytest.mark.parametrize("update_every", [1, 2])
def test_post_accumulate_grad_hooks_fire_after_the_write(mode: str, update_every: int) -> None:
    net, x, y = _setup(SHAPES[1], 7)
    ref, _, _ = _setup(SHAPES[1], 7)
    shared = list(net.trunk.parameters())
    seen: list[tuple[int, Tensor]] = []
    for i, p in enumerate(shared):
        p.register_post_accumulate_grad_hook(
            lambda q, i=i: seen.append((i, q.grad.clone())))  # type: ignore[union-attr]
    buf = TaskGradBuffer(shared, [net.scale, *net.heads.parameters()], mode=mode,
                         modules=net.trunk, update_every=update_every)  # type: ignore[arg-type]
    for step in range(3):
        seen.clear()
        feats = net.trunk(x)
        losses = torch.stack([((head(feats * net.scale)[:, 0] - y[:, k]) ** 2).mean()
                              for k, head in enumerate(net.heads)])
        buf.backward(losses, features=feats if mode == "features" else None)
        assert seen == []  # nothing written yet
        buf.apply_(Sum())
        ref.losses(x, y).sum().backward()
        assert [i for i, _ in seen] == list(range(len(shared)))  # each once, after its write
        for (_, g), q in zip(seen, ref.trunk.parameters()):
            torch.testing.assert_close(g, q.grad)
        net.zero_grad()
        ref.zero_grad()
        x = x + step


class _PickledNet(torch.nn.Module):
    """A model that holds its own buffer, as Lightning's module holds the step."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(3, 4)
        self.heads = torch.nn.ModuleList([torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)])
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.buf = TaskGradBuffer(list(self.trunk.parameters()), list(self.heads.parameters()))


@pytest.mark.parametrize("copy_with", ["pickle", "deepcopy"])
def test_the_check_survives_a_pickle_or_a_copy(copy_with: str) -> None:
    """Ids do not survive ``mp.spawn`` (Lightning's ``ddp_spawn``) or a copy: the copied
    buffer must still accept its own parameters and still refuse a leaf in neither list."""
    import copy as copy_module
    import pickle

    net = _PickledNet()
    net = (pickle.loads(pickle.dumps(net)) if copy_with == "pickle"
           else copy_module.deepcopy(net))
    x = torch.randn(5, 3)
    feats = net.trunk(x)
    net.buf.backward(torch.stack([h(feats).pow(2).mean() for h in net.heads]))
    net.buf.apply_(Sum())
    assert net.trunk.weight.grad is not None
    feats = net.trunk(x) * net.scale  # a leaf in neither list
    with pytest.raises(ValueError, match="neither shared_params nor head_params"):
        net.buf.backward(torch.stack([h(feats).pow(2).mean() for h in net.heads]))
