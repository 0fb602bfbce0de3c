"""The distributed helpers on one process: no-ops without a process group, clear errors."""

from __future__ import annotations

import pytest
import torch

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Sum
from gradbalance.distributed import (
    all_reduce_grads_,
    all_reduce_mean_,
    assert_same_across_ranks,
    broadcast_parameters_,
    resolve_process_group,
)


def test_no_process_group_is_a_no_op() -> None:
    assert resolve_process_group(None) is None
    assert resolve_process_group("local") is None
    g = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    h = g.clone()
    all_reduce_mean_([h])
    assert torch.equal(h, g)
    w = torch.ones(2, requires_grad=True)
    all_reduce_grads_([w])  # a missing gradient becomes zeros: same layout on every rank
    assert torch.equal(w.grad, torch.zeros(2))
    broadcast_parameters_([w])
    assert_same_across_ranks([w])
    assert torch.equal(w.detach(), torch.ones(2))


def test_invalid_process_group() -> None:
    with pytest.raises(ValueError, match=r"Invalid process_group: 'world' \(expected"):
        resolve_process_group("world")
    with pytest.raises(ValueError, match=r"torch\.distributed is not initialised"):
        resolve_process_group(object())


def test_local_buffer_equals_plain_step() -> None:
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    buf = TaskGradBuffer([w], process_group="local")
    buf.backward([(3 * w).sum(), (w**2).sum()])
    buf.apply_(Sum())
    assert torch.equal(w.grad, torch.tensor([3.0 + 2.0, 3.0 - 4.0]))


def test_state_digest_reads_zero_dim_tensors_of_any_dtype() -> None:
    """A state holding a 0-d int64 step counter (DB-MTL's, MoCo's) is digested by value."""
    from gradbalance.distributed import _digest

    assert _digest([torch.tensor(3)]) == _digest([torch.tensor(3)])
    assert _digest([torch.tensor(3)]) != _digest([torch.tensor(4)])
    assert _digest([torch.tensor(3)]) != _digest([torch.tensor([3])])  # the shape counts
