"""Contract of every loss weighting: shapes, errors, state round trip, skipped steps."""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import gradbalance
from gradbalance import NonFiniteGradientError
from gradbalance.weighting import WEIGHTINGS, LossWeighting, get_weighting
from support.declared_state import (
    assert_every_tensor_declared,
    assert_replaced_not_edited,
    assert_task_sized_state_declared,
    damaged_states,
    poisoned,
    resized,
    task_shapes,
)
from support.weighting import K, Tiny, assert_states_equal, data, make, train_step, user_optimizer

NAMES = sorted(WEIGHTINGS)


def test_registry_holds_every_method() -> None:
    expected = {"gradnorm", "uncertainty", "dwa", "rlw", "gls", "famo", "imtl_l", "stch", "si"}
    assert expected <= set(WEIGHTINGS)
    assert all(issubclass(c, LossWeighting) for c in WEIGHTINGS.values())
    assert gradbalance.get_weighting is get_weighting
    assert isinstance(get_weighting("IMTL-L", num_tasks=2), WEIGHTINGS["imtl_l"])
    with pytest.raises(ValueError, match=r"valid names: .*dwa"):
        get_weighting("nope", num_tasks=2)


@pytest.mark.parametrize("name", NAMES)
def test_shapes_and_one_backward(name: str) -> None:
    model = Tiny()
    x, y = data()
    w = make(name, model)
    losses = model.losses(x, y)
    out = w(losses)
    assert out.shape == (K,) and out.dtype == losses.dtype and out.requires_grad
    assert w.weights.shape == (K,)
    assert bool(torch.isfinite(out).all())
    out.sum().backward()
    assert all(p.grad is not None for p in model.trunk.parameters())
    assert w.update(*([model.losses(x, y).detach()] if name == "famo" else [])) is True


@pytest.mark.parametrize("name", NAMES)
def test_wrong_number_of_tasks(name: str) -> None:
    model = Tiny()
    w = make(name, model)
    with pytest.raises(ValueError, match="3 were expected"):
        w(torch.ones(K + 1, requires_grad=True))
    with pytest.raises(ValueError, match="num_tasks"):
        WEIGHTINGS[name](0) if name != "gradnorm" else WEIGHTINGS[name](0, model.trunk)
    saved = w.state_dict()
    other = make(name, Tiny(k=K + 1), k=K + 1)
    with pytest.raises(ValueError, match="num_tasks=3"):
        other.load_state_dict(saved)


@pytest.mark.parametrize(("name", "kwargs", "argname"), [
    ("dwa", {"temperature": 0.0}, "temperature"),
    ("dwa", {"temperature": -2.0}, "temperature"),
    ("dwa", {"period": 0}, "period"),
    ("stch", {"mu": 0.0}, "mu"),
    ("stch", {"mu": -1.0}, "mu"),
    ("stch", {"warmup_steps": -1}, "warmup_steps"),
    ("stch", {"nadir": [1.0, 0.0, 1.0]}, "nadir"),
    ("famo", {"lr": 0.0}, "lr"),
    ("famo", {"gamma": -0.1}, "gamma"),
    ("rlw", {"distribution": "cauchy"}, "distribution"),
    ("uncertainty", {"task_types": "ranking"}, "task_types"),
    ("uncertainty", {"task_types": ["regression"] * 2}, "task_types"),
    ("gls", {"eps": 0.0}, "eps"),
])
def test_invalid_settings(name: str, kwargs: dict, argname: str) -> None:
    with pytest.raises(ValueError, match=f"Invalid {argname}"):
        WEIGHTINGS[name](K, **kwargs)


@pytest.mark.parametrize("bad", [42, "0", 1.5, None.__class__], ids=["int", "str", "float", "type"])
@pytest.mark.parametrize("name", [n for n in NAMES
                                  if "generator" in inspect.signature(WEIGHTINGS[n]).parameters])
def test_generator_must_be_a_torch_generator(name: str, bad: object) -> None:
    """A seed or another object given as the generator is refused at construction."""
    seed = bad if isinstance(bad, int) else 0
    with pytest.raises(ValueError, match=(
            rf"Invalid generator: {type(bad).__name__} {re.escape(repr(bad))} \(expected a "
            rf"torch\.Generator or None; .*generator=torch\.Generator\(\)\.manual_seed\({seed}\)")):
        WEIGHTINGS[name](K, generator=bad)


def test_some_weighting_takes_a_generator() -> None:
    assert "generator" in inspect.signature(WEIGHTINGS["rlw"]).parameters


@pytest.mark.parametrize(("kwargs", "argname"), [
    ({"alpha": -1.0}, "alpha"), ({"lr": 0.0}, "lr"), ({"min_weight": 0.0}, "min_weight"),
])
def test_invalid_gradnorm_settings(kwargs: dict, argname: str) -> None:
    with pytest.raises(ValueError, match=f"Invalid {argname}"):
        WEIGHTINGS["gradnorm"](K, Tiny().trunk, **kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_resume_is_bit_identical(name: str) -> None:
    x, y = data()
    model_a = Tiny()
    wa = make(name, model_a)
    opt_a = user_optimizer(wa, model_a)
    for _ in range(3):
        train_step(wa, model_a, opt_a, x, y)
    saved_model = copy.deepcopy(model_a.state_dict())
    saved_opt = copy.deepcopy(opt_a.state_dict())
    saved_weighting = wa.state_dict()
    weights_at_save = wa.weights
    ref = [train_step(wa, model_a, opt_a, x, y) for _ in range(4)]
    final = wa.state_dict()

    model_b = Tiny(seed=1)
    wb = make(name, model_b)
    opt_b = user_optimizer(wb, model_b)
    model_b.load_state_dict(saved_model)
    wb.load_state_dict(saved_weighting)          # no warm-up call
    opt_b.load_state_dict(saved_opt)
    if name not in ("gls", "si", "stch", "famo"):  # these report the last call's weights
        assert torch.equal(wb.weights, weights_at_save), (
            f"{name}: weights after load_state_dict {wb.weights} differ from those saved "
            f"{weights_at_save}; weights come from the saved state, or the weighting reports the "
            f"last call's and is named in this test's list (docs/ARCHITECTURE.md, \"How to add "
            f"a loss weighting\")")
    got = [train_step(wb, model_b, opt_b, x, y) for _ in range(4)]
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert_states_equal(final, wb.state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_skipped_step_and_nonfinite_losses_leave_state_unchanged(name: str) -> None:
    x, y = data()
    model = Tiny()
    w = make(name, model)
    opt = user_optimizer(w, model)
    train_step(w, model, opt, x, y)
    before = w.state_dict()
    # a step the scaler skipped
    w(model.losses(x, y))
    assert w.update(model.losses(x, y).detach(), found_inf=torch.tensor(1.0)) is False
    assert_states_equal(before, w.state_dict())
    # non-finite losses on a step said to be fine: error, no change
    bad = model.losses(x, y) * torch.tensor([1.0, float("nan"), 1.0])
    w(bad)
    with pytest.raises(NonFiniteGradientError, match="unchanged"):
        w.update(bad.detach())
    assert_states_equal(before, w.state_dict())
    # the pending observation was dropped: the next step is clean
    train_step(w, model, opt, x, y)


@pytest.mark.parametrize("name", NAMES)
def test_reset_restores_construction_state(name: str) -> None:
    x, y = data()
    model = Tiny()
    w = make(name, model)
    fresh = w.state_dict()
    opt = user_optimizer(w, model)
    for _ in range(3):
        train_step(w, model, opt, x, y)
    w.reset()
    assert_states_equal(fresh, w.state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_training_after_reset_repeats_a_fresh_run(name: str) -> None:
    """reset() also rebuilds what a tensor cannot hold (an own optimizer's moments, RLW's
    generator) and the step counters: the steps after it are a fresh object's, bit for bit."""
    x, y = data()
    used_model, fresh_model = Tiny(), Tiny()
    used, fresh = make(name, used_model), make(name, fresh_model)
    opt = user_optimizer(used, used_model)
    for _ in range(3):
        train_step(used, used_model, opt, x, y)
    used.reset()
    used_model.load_state_dict(fresh_model.state_dict())
    runs = []
    for w, model in ((used, used_model), (fresh, fresh_model)):
        opt = user_optimizer(w, model)
        runs.append([train_step(w, model, opt, x, y) for _ in range(4)])
    for after_reset, from_fresh in zip(*runs):
        assert torch.equal(after_reset, from_fresh)


def _stepper(name: str, k: int = K) -> tuple[LossWeighting, Callable[[], Tensor]]:
    """A weighting and one training step of it on a fixed batch."""
    model = Tiny(k=k)
    w = make(name, model, k=k)
    opt = user_optimizer(w, model)
    x, y = data(k=k)
    return w, lambda: train_step(w, model, opt, x, y)


@pytest.mark.parametrize("name", NAMES)
def test_every_state_tensor_is_declared(name: str) -> None:
    w, step = _stepper(name)
    step()
    assert_every_tensor_declared(w)


@pytest.mark.parametrize("name", NAMES)
def test_state_whose_size_is_k_is_declared_per_task(name: str) -> None:
    (a, step_a), (b, step_b) = _stepper(name), _stepper(name, K + 1)
    step_a()
    step_b()
    assert_task_sized_state_declared(a, task_shapes(a), task_shapes(b), K)


@pytest.mark.parametrize("name", NAMES)
def test_state_is_replaced_never_edited_in_place(name: str) -> None:
    w, step = _stepper(name)
    step()
    assert_replaced_not_edited(w, lambda: [step() for _ in range(3)])


def test_update_without_call_is_an_error() -> None:
    w = get_weighting("dwa", num_tasks=2)
    with pytest.raises(RuntimeError, match="without a weighting call"):
        w.update()


def test_learnable_parameters_without_gradient_warn() -> None:
    w = get_weighting("uncertainty", num_tasks=2)
    w(torch.tensor([1.0, 2.0]))  # parameters never reached by a backward
    with pytest.warns(RuntimeWarning, match="parameters"):
        w.update()


@pytest.mark.parametrize("name", NAMES)
def test_pending_tensors_hold_all_that_update_reads(name: str) -> None:
    """Overwriting b's pending tensors with a's (as an all-reduce does) makes b learn as a."""
    model_a, model_b = Tiny(), Tiny()
    wa, wb = make(name, model_a), make(name, model_b)
    assert wa.pending_tensors() == []
    (x1, y1), (x2, y2), (x3, y3) = data(seed=0), data(seed=1), data(seed=2)
    la1, la2 = model_a.losses(x1, y1), model_a.losses(x2, y2)   # two micro-batches
    for w, losses in ((wa, la1), (wa, la2), (wb, model_b.losses(x3, y3))):
        w(losses).sum().backward()
    pending_a, pending_b = wa.pending_tensors(), wb.pending_tensors()
    assert len(pending_a) == len(pending_b) >= 1
    torch.testing.assert_close(pending_a[0], (la1.double() + la2.double()).detach(), rtol=0, atol=0)
    for source, target in zip(pending_a, pending_b):
        assert source.shape == target.shape
        target.copy_(source)
    after = [model_a.losses(x1, y1).detach()] if name == "famo" else []
    assert wa.update(*after) and wb.update(*after)
    assert_states_equal(wa.state_dict(), wb.state_dict())
    assert wa.pending_tensors() == []


def _damaged_moments(w: LossWeighting, seed: int) -> list[tuple[str, dict]]:
    """Copies of ``w.state_dict()`` with one moment of its own optimizer damaged (inf/NaN, a
    task more or fewer)."""
    state = w.state_dict()
    extra = state["_extra_state"]
    moments = extra.get("optimizer", {"state": {}})["state"]
    out = []
    for index, entries in moments.items():
        for key, value in entries.items():
            if not isinstance(value, Tensor) or value.dim() == 0:
                continue
            for label, bad in (("nan", poisoned(value, float("nan"), seed)),
                               ("K+1", resized(value, 0, 1)), ("K-1", resized(value, 0, -1))):
                opt = copy.deepcopy(extra["optimizer"])
                opt["state"][index][key] = bad
                out.append((f"optimizer {key} {label}",
                            {**state, "_extra_state": {**extra, "optimizer": opt}}))
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1])
def test_damaged_state_is_refused_and_nothing_moves(name: str, seed: int) -> None:
    """A state tensor (or an optimizer moment) with inf/NaN or another number of tasks is
    refused by the load; the weighting keeps its state."""
    w, step = _stepper(name)
    for _ in range(2 + seed):
        step()
    before = w.state_dict()
    damages = [*damaged_states(w, seed), *_damaged_moments(w, seed)]
    if not damages:
        pytest.skip("no state tensor")
    for _, state in damages:
        with pytest.raises(ValueError, match=r"inf/NaN|task|shape"):
            w.load_state_dict(state)
        assert_states_equal(before, w.state_dict())
