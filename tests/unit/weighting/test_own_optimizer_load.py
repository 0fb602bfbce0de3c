"""FAMO and GradNorm loading a state saved with other hyperparameters of their own optimizer.

``torch.optim.Optimizer.load_state_dict`` restores the saved param groups, so the resumed
weighting steps with the saved ``lr`` (and FAMO's ``gamma`` as ``weight_decay``): the
attributes follow the loaded values, with a warning naming each that changed, pointing at the
caller's line. Expected values: an uninterrupted run with the saved hyperparameters.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

from gradbalance.weighting import FAMO, GradNorm

F64 = torch.float64


def _famo_steps(famo: FAMO, n: int, seed: int) -> list[Tensor]:
    """``n`` FAMO steps on random losses (``forward``, then ``update`` with 0.9 of them)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        losses = torch.rand(3, generator=gen, dtype=F64) + 0.5
        famo(losses)
        famo.update(losses * 0.9)
        out.append(famo.weights.detach().clone())
    return out


def test_famo_takes_the_saved_hyperparameters_and_says_so() -> None:
    saved = FAMO(3, lr=0.025, gamma=0.02)
    _famo_steps(saved, 2, 0)
    resumed = FAMO(3, lr=0.05)
    with pytest.warns(UserWarning, match=r"lr=0.05 -> 0.025, gamma=0.01 -> 0.02") as record:
        resumed.load_state_dict(saved.state_dict())
    assert record[0].filename == __file__  # the caller's line, not torch's or ours
    assert (resumed.lr, resumed.gamma) == (0.025, 0.02)
    for ours, theirs in zip(_famo_steps(resumed, 3, 1), _famo_steps(saved, 3, 1), strict=True):
        assert torch.equal(ours, theirs)
    again = resumed.optimizer.param_groups[0]
    resumed.reset()  # a reset rebuilds the optimizer from the attributes: the loaded values
    assert (resumed.optimizer.param_groups[0]["lr"], resumed.optimizer.param_groups[0][
        "weight_decay"]) == (again["lr"], again["weight_decay"])


def test_the_same_hyperparameters_load_silently() -> None:
    saved = FAMO(3, lr=0.05)
    _famo_steps(saved, 1, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FAMO(3, lr=0.05).load_state_dict(saved.state_dict())


def test_an_optimizer_of_the_users_keeps_the_attributes() -> None:
    # With a factory the constructor's lr is not the optimizer's: nothing to follow.
    def sgd(params: list[Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1)

    saved = FAMO(3, optimizer=sgd)
    _famo_steps(saved, 1, 0)
    resumed = FAMO(3, lr=0.05, optimizer=sgd)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(saved.state_dict())
    assert resumed.lr == 0.05


def test_gradnorm_takes_the_saved_lr() -> None:
    trunk = nn.Linear(4, 4)
    saved, resumed = GradNorm(3, trunk, lr=0.01), GradNorm(3, trunk, lr=0.1)
    with pytest.warns(UserWarning, match=r"lr=0.1 -> 0.01"):
        resumed.load_state_dict(saved.state_dict())
    assert resumed.lr == 0.01 and resumed.optimizer.param_groups[0]["lr"] == 0.01


def test_a_warning_made_an_error_loads_nothing() -> None:
    # The warning comes from the checks, before the load moves anything.
    saved = FAMO(3, lr=0.025)
    _famo_steps(saved, 2, 0)
    resumed = FAMO(3, lr=0.05)
    before = {key: value.clone() for key, value in resumed.state_dict().items()
              if isinstance(value, Tensor)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match=r"lr=0\.05 -> 0\.025"):
            resumed.load_state_dict(saved.state_dict())
    assert resumed.lr == 0.05 and resumed.optimizer.param_groups[0]["lr"] == 0.05
    assert not resumed.optimizer.state
    after = resumed.state_dict()
    assert all(torch.equal(after[key], value) for key, value in before.items())
