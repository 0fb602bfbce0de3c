"""``ddp_no_sync`` on a ``DistributedDataParallel`` model with a communication hook: the
buffer averages the task gradients with its own all-reduce, which the hook never sees, so
the user is told once per model, naming the hook (docs/distributed.md, "What
TaskGradBuffer does"); a model without one is not."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gradbalance import ddp_no_sync

pytestmark = pytest.mark.usefixtures("one_process_group")


def _ddp(hooked: bool) -> DistributedDataParallel:
    model = DistributedDataParallel(nn.Linear(3, 2))
    if hooked:
        model.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
    return model


def _warnings(model: nn.Module) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ddp_no_sync(model):
            model(torch.ones(1, 3)).sum().backward()
    return [str(w.message) for w in caught if "communication hook" in str(w.message)]


def test_a_communication_hook_is_named_once_per_model() -> None:
    model = _ddp(hooked=True)
    first = _warnings(model)
    assert len(first) == 1 and "fp16_compress_hook" in first[0]
    assert "does not run on the balanced step" in first[0]
    assert _warnings(model) == []  # once per model
    assert len(_warnings(_ddp(hooked=True))) == 1  # another model is told again


def test_a_model_without_a_hook_is_not_warned() -> None:
    assert _warnings(_ddp(hooked=False)) == []
    assert _warnings(nn.Linear(3, 2)) == []
