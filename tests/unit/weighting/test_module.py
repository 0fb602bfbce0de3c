"""Every registered loss weighting is an ``nn.Module`` whose state travels with its model.

Attached to a model, a weighting is in ``model.state_dict()`` (through ``torch.save`` and
``torch.load(weights_only=True)``) and moves with ``.double()``; the weights the user's
optimizer trains (Uncertainty Weighting, IMTL-L) are in ``model.parameters()``, the weights a
method steps itself (GradNorm, FAMO) are not. Expected values come from an uninterrupted run
or from the closed-form optimum.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import Tensor, nn

from gradbalance.weighting import (
    FAMO,
    IMTLL,
    RLW,
    WEIGHTINGS,
    GradNorm,
    LossWeighting,
    UncertaintyWeighting,
)
from support.loop_state import assert_same_state
from support.saved import through_a_file
from support.weighting import K, Tiny, data, make, train_step

NAMES = sorted(WEIGHTINGS)
#: The weightings whose weights the user's optimizer trains, and the weights' attribute.
LEARNABLE = {"uncertainty": "log_vars", "imtl_l": "log_scales"}
#: The weightings that step their own weights (an own optimizer), and the weights' attribute.
SELF_TRAINED = {"gradnorm": "task_weights", "famo": "logits"}
#: Where these rules are written down.
RULES = 'docs/ARCHITECTURE.md, "How to add a loss weighting"'


class Model(nn.Module):
    """The tiny multitask model with its loss weighting attached as a submodule."""

    def __init__(self, name: str, seed: int = 0) -> None:
        super().__init__()
        self.net = Tiny(seed=seed)
        self.weighting = make(name, self.net)


def _optimizer(model: Model) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.05)  # the weighting's parameters included


def _steps(model: Model, opt: torch.optim.Optimizer, count: int) -> list[Tensor]:
    x, y = data()
    out = []
    for _ in range(count):
        out.append(train_step(model.weighting, model.net, opt, x, y))
        out.append(model.weighting.weights)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_parameters_are_exactly_the_weights_the_user_trains(name: str) -> None:
    model = Model(name)
    weighting = model.weighting
    assert isinstance(weighting, nn.Module) and isinstance(weighting, LossWeighting)
    own = [id(p) for p in weighting.parameters()]
    if name in LEARNABLE:
        assert own == [id(getattr(weighting, LEARNABLE[name]))]
        assert weighting.learnable
    else:
        assert own == [] and not weighting.learnable, (
            f"{name}: learnable={weighting.learnable}, {len(own)} parameters; a weighting with "
            f"weights the user's optimizer trains declares learnable = True, holds them as its "
            f"only nn.Parameters and is named in LEARNABLE here ({RULES})")
    assert [id(p) for p in model.parameters()] == [id(p) for p in model.net.parameters()] + own
    trained = [key for key, b in weighting.named_buffers() if b.requires_grad]
    assert trained == ([SELF_TRAINED[name]] if name in SELF_TRAINED else []), (
        f"{name}: buffers with requires_grad {trained}; the weights a method steps itself are "
        f"such a buffer, named in SELF_TRAINED here ({RULES})")
    if name in SELF_TRAINED:
        hidden = getattr(weighting, SELF_TRAINED[name])
        assert hidden.requires_grad and id(hidden) not in {id(p) for p in model.parameters()}


@pytest.mark.parametrize("name", NAMES)
def test_model_state_dict_through_a_file_resumes_bit_identically(name: str) -> None:
    model = Model(name)
    opt = _optimizer(model)
    _steps(model, opt, 3)
    saved = through_a_file({"model": model.state_dict(), "opt": opt.state_dict()})
    assert f"weighting.{'_extra_state'}" in saved["model"]
    fresh = Model(name, seed=5)
    fresh_opt = _optimizer(fresh)
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    for ours, theirs in zip(_steps(fresh, fresh_opt, 3), _steps(model, opt, 3)):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", NAMES)
def test_double_moves_the_state_and_training_continues(name: str) -> None:
    model = Model(name)
    opt = torch.optim.SGD(model.net.parameters(), lr=0.01)
    _steps(model, opt, 2)
    weighting = model.weighting
    if name in SELF_TRAINED:
        before = getattr(weighting, SELF_TRAINED[name]).detach().clone()
    state = [*weighting.named_buffers(), *weighting.named_parameters()]
    kept = {key: t.dtype for key, t in state if not t.is_floating_point()}
    weighting.double()
    for key, tensor in [*weighting.named_buffers(), *weighting.named_parameters()]:
        # floating state is cast; counters and flags keep their dtype, as torch casts them
        assert tensor.dtype == kept.get(key, torch.float64), (
            f"{name}.{key}: {tensor.dtype} after .double(); floating state is float64, an "
            f"integer or bool state keeps its dtype ({RULES})")
    if name in LEARNABLE:
        assert isinstance(getattr(weighting, LEARNABLE[name]), nn.Parameter)
    x, y = data()
    weighted = weighting(model.net.losses(x, y).double())
    weighted.sum().backward()
    if name == "famo":
        weighting.update(model.net.losses(x, y).detach() * 0.9)
    else:
        weighting.update()
    assert bool(torch.isfinite(weighting.weights).all())
    if name in SELF_TRAINED:  # still a leaf, stepped by the rebuilt own optimizer
        moved = getattr(weighting, SELF_TRAINED[name])
        assert moved.is_leaf and moved.requires_grad and moved.dtype == torch.float64
        assert weighting.optimizer.param_groups[0]["params"][0] is moved
        assert not torch.equal(moved.detach(), before.double())


@pytest.mark.parametrize("name", ["gradnorm", "famo"])
def test_own_optimizer_keeps_its_state_across_a_cast(name: str) -> None:
    model = Model(name)
    _steps(model, torch.optim.SGD(model.net.parameters(), lr=0.01), 2)
    weighting = model.weighting
    state = copy.deepcopy(weighting.optimizer.state_dict()["state"])
    weighting.float()
    moved = weighting.optimizer.state_dict()["state"]
    assert moved.keys() == state.keys()
    for key in state:
        for entry, value in state[key].items():
            if value.is_floating_point() and entry != "step":
                assert moved[key][entry].dtype == torch.float32
                assert torch.equal(moved[key][entry], value.float())


@pytest.mark.parametrize(("cls", "optimum"), [
    (UncertaintyWeighting, lambda losses: losses.log()),  # σ² = L (regression): s = log L
    (IMTLL, lambda losses: -losses.log()),  # e^s = 1/L
])
def test_the_models_optimizer_trains_the_learnable_weights(cls: type[LossWeighting],
                                                           optimum: Any) -> None:
    losses = torch.tensor([0.1, 1.0, 30.0])
    model = nn.Module()
    model.weighting = cls(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(400):
        opt.zero_grad()
        model.weighting(losses).sum().backward()
        opt.step()
        model.weighting.update()
    (param,) = model.weighting.parameters()
    torch.testing.assert_close(param.detach(), optimum(losses), rtol=1e-4, atol=1e-4)


def test_the_models_optimizer_never_steps_gradnorms_weights() -> None:
    model = Model("gradnorm")
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.5)
    reference = Model("gradnorm")  # the weights stepped by GradNorm alone
    ref_opt = torch.optim.AdamW(reference.net.parameters(), lr=0.5, weight_decay=0.5)
    for ours, theirs in zip(_steps(model, opt, 3), _steps(reference, ref_opt, 3)):
        assert torch.equal(ours, theirs)


def test_another_class_in_the_model_state_is_refused_and_changes_nothing() -> None:
    saver, target = Model("dwa"), Model("stch")
    _steps(target, _optimizer(target), 2)
    before = copy.deepcopy(target.weighting.state_dict())
    with pytest.raises(RuntimeError, match="saved by a DWA, not a STCH"):
        target.load_state_dict(saver.state_dict())
    assert_same_state(target.weighting.state_dict(), before)


def test_a_damaged_optimizer_state_is_refused_before_anything_moves() -> None:
    model = Model("famo")
    _steps(model, _optimizer(model), 2)
    state = model.weighting.state_dict()
    target = Model("famo", seed=3)
    before = copy.deepcopy(target.weighting.state_dict())
    state["_extra_state"]["optimizer"]["param_groups"].append(
        copy.deepcopy(state["_extra_state"]["optimizer"]["param_groups"][0]))
    with pytest.raises(ValueError, match="optimizer"):
        target.weighting.load_state_dict(state)
    assert_same_state(target.weighting.state_dict(), before)


def test_a_generator_state_of_the_wrong_size_is_refused_before_anything_moves() -> None:
    state = RLW(K, seed=0).state_dict()
    state["_weights"] = torch.full((K,), 1.0 / K, dtype=torch.float64)
    state["_extra_state"]["rng_state"] = torch.zeros(7, dtype=torch.uint8)  # too short
    target = RLW(K, seed=3)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match="rng_state"):
        target.load_state_dict(state)
    assert_same_state(target.state_dict(), before)


def test_a_loaded_state_lands_on_the_weightings_device() -> None:
    weighting = GradNorm(K, Tiny().trunk, device="meta")
    saved = GradNorm(K, Tiny().trunk).state_dict()
    saved["_initial"] = torch.ones(K, dtype=torch.float64)
    weighting.load_state_dict(saved)
    assert weighting._initial is not None and weighting._initial.device.type == "meta"
    assert weighting.device.type == "meta"
    assert FAMO(K).to("meta").device.type == "meta"


def _child(rank: int, model: nn.Module, out: str) -> None:
    rlw = model.weighting  # type: ignore[union-attr]
    draws = []
    for _ in range(3):
        rlw(torch.ones(K))
        rlw.update()
        draws.append(rlw.weights)
    torch.save(draws, out)


def test_a_model_with_a_weighting_reaches_a_spawned_process(tmp_path: Path) -> None:
    model = nn.Module()
    model.weighting = RLW(K, seed=4)
    out = tmp_path / "draws.pt"
    mp.spawn(_child, args=(model, str(out)), nprocs=1, join=True)
    _child(0, model, str(tmp_path / "here.pt"))
    for a, b in zip(torch.load(out), torch.load(tmp_path / "here.pt")):
        assert torch.equal(a, b)
