"""``steps_begun``, which ``apply_`` compares across the data-parallel ranks: ranks that drop
the same batch, each wherever it failed, must stay equal. A rank whose batch failed in its
forward (no ``backward``) and one whose batch failed in a backward hook both recover with
``reset(keep_weights=True)``; they were one apart (the second counted nothing, the first
one step), and every later ``apply_`` raised ``RankAgreementError`` (docs/distributed.md).
A step counts when its first backward begins, and a reset with no step begun counts the
batch it abandons."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import UPGrad


def _boom(grad: Tensor) -> Tensor:
    raise RuntimeError("injected")


def _buffer(per_sample: bool) -> tuple[TaskGradBuffer, nn.Module, nn.Module]:
    torch.manual_seed(0)
    trunk, head = nn.Linear(3, 4), nn.Linear(4, 2)
    kw = {"modules": trunk, "batch_dim": 0} if per_sample else {}
    return TaskGradBuffer(trunk.parameters(), head.parameters(), **kw), trunk, head


def _losses(trunk: nn.Module, head: nn.Module, per_sample: bool, fail: bool) -> Tensor:
    f = trunk(torch.randn(4, 3))
    if fail:
        f.register_hook(_boom)
    out = head(f).pow(2)
    return out.sum(dim=1) if per_sample else out.mean(dim=0)


@pytest.mark.parametrize("per_sample", [False, True], ids=["tasks", "batch_dim=0"])
@pytest.mark.parametrize("where", ["forward", "backward", "apply"])
def test_a_batch_dropped_anywhere_counts_once(per_sample: bool, where: str) -> None:
    buf, trunk, head = _buffer(per_sample)
    for _ in range(2):  # two steps that finish
        buf.backward(_losses(trunk, head, per_sample, False))
        buf.apply_(UPGrad())
    assert buf.state_dict()["steps_begun"] == 2
    try:  # the third batch fails, then the documented recovery
        if where == "forward":
            raise RuntimeError("injected")
        buf.backward(_losses(trunk, head, per_sample, where == "backward"))
        if where == "apply":
            class Failing(UPGrad):
                def _compute_weights(self, gramian: Tensor,
                                     losses: Tensor | None = None) -> Tensor:
                    raise RuntimeError("injected")
            buf.apply_(Failing())
    except RuntimeError as error:
        assert "injected" in str(error)
    buf.reset(keep_weights=True)
    assert buf.state_dict()["steps_begun"] == 3
    buf.reset(keep_weights=True)  # a second reset abandons one more batch
    assert buf.state_dict()["steps_begun"] == 4


def test_a_batch_skipped_without_reset_puts_its_rank_one_ahead() -> None:
    """A rank that drops a batch in its backward and goes on to the next one without a
    reset is one ahead of ranks that took the batch: their next ``apply_`` compares."""
    buf, trunk, head = _buffer(False)
    with pytest.raises(RuntimeError, match="injected"):
        buf.backward(_losses(trunk, head, False, True))
    buf.backward(_losses(trunk, head, False, False))
    buf.apply_(UPGrad())
    assert buf.state_dict()["steps_begun"] == 2
