"""Activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=False)``) under the
per-sample records: the recomputation inside the backward calls the layers again, and those
calls are not new ones (docs/per_sample.md, "Layers").

References are second implementations: the matrix route over the same objectives (each
sample × task loss a task of its own), and B separate ``autograd.grad`` calls for the norms.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, UPGrad
from gradbalance.clip import GhostNorms


class _Checkpointed(nn.Module):
    """A checkpointed block (a covered Linear pair and a GroupNorm fallback), then a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.GroupNorm(2, 8),
                                   nn.Linear(8, 8))
        self.last = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.last(checkpoint(self.block, x, use_reentrant=False)))


def _update(per_sample: bool, balancer: type[MGDA] | type[UPGrad], tasks: int,
            micro: int) -> Tensor:
    torch.manual_seed(5)
    trunk, heads = _Checkpointed(), nn.Linear(8, tasks)
    x, y = torch.randn(6, 4), torch.randn(6, tasks)
    kwargs = {"modules": trunk, "batch_dim": 0} if per_sample else {}
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), **kwargs)  # type: ignore[arg-type]
    for part in torch.arange(6).chunk(micro):
        losses = (heads(trunk(x[part])) - y[part]) ** 2
        if per_sample:
            buf.backward(losses[:, 0] if tasks == 1 else losses)
        else:
            buf.backward(losses.reshape(-1))
    buf.apply_(balancer())
    return torch.cat([p.grad.flatten() for p in [*trunk.parameters(), *heads.parameters()]
                      if p.grad is not None])


@pytest.mark.parametrize(("balancer", "tasks", "micro"), [(MGDA, 1, 1), (UPGrad, 2, 1),
                                                          (UPGrad, 2, 2)])
def test_checkpointed_trunk_equals_matrix_route(balancer: type[MGDA] | type[UPGrad],
                                                tasks: int, micro: int) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        got = _update(True, balancer, tasks, micro)
        # the matrix route over every sample × task of the whole batch, in one backward
        want = _update(False, balancer, tasks, 1)
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.allclose(got, want, rtol=1e-8, atol=1e-10 * float(want.abs().max()))


def test_ghost_norms_of_a_checkpointed_trunk() -> None:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(6)
        model = _Checkpointed()
        model.block[2] = nn.Identity()  # GhostNorms covers the Linear layers alone
        ghost = GhostNorms(model)
        losses = model(torch.randn(5, 4)).pow(2).sum(1)
        norms = ghost.norms(losses)
        params = list(model.parameters())
        want = torch.stack([torch.cat([g.flatten() for g in torch.autograd.grad(
            losses[i], params, retain_graph=True)]).norm() for i in range(5)])
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.allclose(norms.reshape(-1), want, rtol=1e-10)
