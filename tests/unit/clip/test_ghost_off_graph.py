"""``GhostNorms`` with a bounded layer called under grad whose output the losses do not read
(an auxiliary head): its calls count for nothing, as in plain backward, against a loop of
one-sample gradients; the records are dropped after each call, used or failed."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gradbalance.clip import GhostNorms


class _WithAux(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.aux = nn.Linear(3, 2)  # called every forward, read by no loss below
        self.out = nn.Linear(3, 2)
        self.last_aux: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.body(x))
        self.last_aux = self.aux(h)
        out: Tensor = self.out(h)
        return out


def _loop_norms(losses: Tensor, params: list[nn.Parameter], p: float) -> Tensor:
    """``[B, K]``: each sample's, each task's gradient norm, one backward per entry."""
    rows = []
    for i in range(losses.shape[0]):
        per_task = []
        for k in range(losses.shape[1]):
            grads = torch.autograd.grad(losses[i, k], params, retain_graph=True,
                                        allow_unused=True)
            flat = torch.cat([(torch.zeros_like(q) if g is None else g).reshape(-1)
                              for g, q in zip(grads, params)])
            per_task.append(torch.linalg.vector_norm(flat, p))
        rows.append(torch.stack(per_task))
    return torch.stack(rows)


@pytest.mark.parametrize("norm_type", [2.0, 1.5])
@pytest.mark.parametrize("per_task", [False, True])
def test_a_bounded_layer_off_the_losses_graph_counts_for_nothing(norm_type: float,
                                                                 per_task: bool) -> None:
    torch.manual_seed(0)
    model = _WithAux().double()
    params = list(model.parameters())
    ghost = GhostNorms(model, norm_type=norm_type, per_task=per_task)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # the first call's records dropped: the second forward alone
        x = torch.randn(5, 4, generator=gen, dtype=torch.float64)
        y = torch.randn(5, 2, generator=gen, dtype=torch.float64)
        losses = (model(x) - y) ** 2  # [B, K]
        got = ghost.norms(losses)
        ref = _loop_norms(losses, params, norm_type)
        expected = ref if per_task else _loop_norms(losses.sum(1, keepdim=True), params,
                                                    norm_type)[:, 0]
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
