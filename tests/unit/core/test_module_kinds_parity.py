"""Every route on trunks of module kinds the other parity suites do not build (docs/loop.md,
"One update whatever the route"; docs/per_sample.md, "Layers").

References, independent of the route under test: plain ``sum(losses).backward()`` on an
identical model (``Sum`` gives the plain update on every route), and the matrix route
(autograd's per-task gradients, one backward per objective) for UPGrad. The task routes
(matrix, gramian with loop and batched passes, auto) and the per-sample route
(``batch_dim=0``: every sample × task an objective) are checked on recurrent, attention,
transposed and 3-D convolution, bilinear, normalisation, bag-of-embedding and parametrized
trunks, float64, to 1e-9 (``Sum``) and 1e-7 (UPGrad) of the largest gradient entry.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrizations

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Balancer, Sum, UPGrad

BATCH, TASKS = 5, 2
TASK_ROUTES = [("matrix", "loop"), ("gramian", "loop"), ("gramian", "batched"),
               ("auto", "loop")]


class _Recurrent(nn.Module):
    """The last step of a batch-first recurrent layer."""

    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        self.rnn = cell(6, 7, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.rnn(x)[0][:, -1]


class _Bilinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bilinear = nn.Bilinear(6, 6, 7)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.bilinear(x, torch.tanh(x)))


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x, x).mean(1)


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag, self.out = nn.EmbeddingBag(20, 6, mode="sum"), nn.Linear(6, 7)

    def forward(self, ids: Tensor) -> Tensor:
        h = torch.tanh(self.bag(ids))
        return self.out(h) * torch.sigmoid(h.sum(1, keepdim=True))


def _vectors(*shape: int) -> Callable[[torch.Generator], Tensor]:
    return lambda gen: torch.randn(BATCH, *shape, generator=gen)


def _ids(gen: torch.Generator) -> Tensor:
    return torch.randint(0, 20, (BATCH, 4), generator=gen)


#: name: (the trunk, its inputs of a batch).
KINDS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], Tensor]]] = {
    "gru": (lambda: _Recurrent(nn.GRU), _vectors(4, 6)),
    "lstm": (lambda: _Recurrent(nn.LSTM), _vectors(4, 6)),
    "encoder": (lambda: nn.Sequential(
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), nn.Flatten()),
        _vectors(3, 8)),
    "decoder": (_Decoder, _vectors(3, 8)),
    "conv_transpose2d": (lambda: nn.Sequential(nn.ConvTranspose2d(3, 2, 2, stride=2),
                                               nn.Tanh(), nn.Flatten()), _vectors(3, 3, 3)),
    "conv3d": (lambda: nn.Sequential(nn.Conv3d(2, 3, 2), nn.Tanh(), nn.Flatten()),
               _vectors(2, 3, 3, 3)),
    "bilinear": (_Bilinear, _vectors(6)),
    "rms_norm": (lambda: nn.Sequential(nn.Linear(6, 8), nn.RMSNorm(8), nn.Tanh()),
                 _vectors(6)),
    "instance_norm": (lambda: nn.Sequential(nn.Conv1d(3, 4, 3), nn.InstanceNorm1d(4, affine=True),
                                            nn.Tanh(), nn.Flatten()), _vectors(3, 6)),
    "group_norm_conv": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3, groups=1), nn.GroupNorm(2, 4),
                                              nn.Tanh(), nn.Flatten()), _vectors(3, 5, 5)),
    "spectral_norm": (lambda: nn.Sequential(
        parametrizations.spectral_norm(nn.Linear(6, 6)), nn.Tanh()), _vectors(6)),
    "embedding_bag": (_Bag, _ids),
}


def _build(kind: str) -> tuple[nn.Module, nn.ModuleList, Tensor, Tensor]:
    """The trunk, K heads, a batch and its targets (the same for every call)."""
    make, inputs = KINDS[kind]
    torch.manual_seed(3)
    trunk = make().double()
    gen = torch.Generator().manual_seed(7)
    x = inputs(gen)
    x = x.double() if x.is_floating_point() else x
    with torch.no_grad():
        width = trunk(x).reshape(BATCH, -1).shape[1]  # the same power step in every copy
    heads = nn.ModuleList([nn.Linear(width, 1) for _ in range(TASKS)]).double()
    return trunk, heads, x, torch.randn(BATCH, TASKS, generator=gen, dtype=torch.float64)


def _losses(trunk: nn.Module, heads: nn.ModuleList, x: Tensor, y: Tensor) -> Tensor:
    """``[B, K]`` squared errors."""
    f = trunk(x).reshape(BATCH, -1)
    return torch.stack([(h(f)[:, 0] - y[:, k]) ** 2 for k, h in enumerate(heads)], dim=1)


def _update(trunk: nn.Module, heads: nn.ModuleList) -> Tensor:
    params = [*trunk.parameters(), *heads.parameters()]
    return torch.cat([torch.zeros(p.numel(), dtype=p.dtype) if p.grad is None
                      else p.grad.flatten() for p in params])


def _plain(kind: str) -> Tensor:
    trunk, heads, x, y = _build(kind)
    _losses(trunk, heads, x, y).sum().backward()
    return _update(trunk, heads)


def _task_route(kind: str, mode: str, passes: str, balancer: Balancer) -> Tensor:
    """The K tasks (each summed over the batch) on ``mode`` and ``passes``."""
    trunk, heads, x, y = _build(kind)
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), mode=mode, passes=passes,
                         modules=None if mode == "matrix" else trunk)
    buf.backward(list(_losses(trunk, heads, x, y).sum(0).unbind()))
    buf.apply_(balancer)
    return _update(trunk, heads)


def _per_sample(kind: str, balancer: Balancer) -> tuple[Tensor, Tensor]:
    """The trunk's update on the per-sample route and on the matrix route over the same
    ``B·K`` objectives."""
    trunk, heads, x, y = _build(kind)
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    buf.backward(_losses(trunk, heads, x, y))
    buf.apply_(balancer)
    got = _update(trunk, nn.ModuleList())
    trunk, heads, x, y = _build(kind)
    ref = TaskGradBuffer(trunk.parameters(), heads.parameters(), mode="matrix")
    ref.backward(list(_losses(trunk, heads, x, y).reshape(-1).unbind()))
    ref.apply_(type(balancer)())
    return got, _update(trunk, nn.ModuleList())


def _assert_close(got: Tensor, want: Tensor, rtol: float) -> None:
    torch.testing.assert_close(got, want, rtol=0.0, atol=rtol * float(want.abs().max()))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_task_routes_give_the_plain_and_matrix_updates(kind: str) -> None:
    plain = _plain(kind)
    upgrad = _task_route(kind, "matrix", "loop", UPGrad())
    for mode, passes in TASK_ROUTES:
        _assert_close(_task_route(kind, mode, passes, Sum()), plain, 1e-9)
        _assert_close(_task_route(kind, mode, passes, UPGrad()), upgrad, 1e-7)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_per_sample_route_gives_the_plain_and_matrix_updates(kind: str) -> None:
    trunk_size = sum(p.numel() for p in _build(kind)[0].parameters())
    got, _ = _per_sample(kind, Sum())
    _assert_close(got, _plain(kind)[:trunk_size], 1e-9)
    got, want = _per_sample(kind, UPGrad())
    _assert_close(got, want, 1e-7)
