"""Every registered balancer is an ``nn.Module`` whose state travels with its parent module.

A balancer attached to a model is in ``model.state_dict()`` (through ``torch.save`` and
``torch.load(weights_only=True)``), moves with ``model.to()`` / ``.double()``, adds no
parameter to ``model.parameters()``, and loads all or nothing. The expected next steps come
from an uninterrupted run of the same balancer.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import Tensor, nn

from gradbalance import BALANCERS
from gradbalance.balancers import CRMOGM, MGDA, AlignedMTL, Balancer, MoCo, MoDo, PCGrad
from gradbalance.weighting import DWA
from support.balancers import build_balancer
from support.loop_state import assert_same_state
from support.saved import through_a_file

K, P = 3, 12
NAMES = sorted(BALANCERS)


def _matrix(seed: int, dtype: torch.dtype = torch.float64, p: int = P) -> Tensor:
    return torch.randn(K, p, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _losses(seed: int) -> Tensor:
    return torch.rand(K, generator=torch.Generator().manual_seed(100 + seed),
                      dtype=torch.float64) + 0.5


class Model(nn.Module):
    """A model with a layer and a balancer attached as a submodule."""

    def __init__(self, balancer: Balancer) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.balancer = balancer


def _stepped(name: str, seed: int = 0, steps: int = 3) -> Balancer:
    balancer = build_balancer(name, K, seed)
    for step in range(steps):
        balancer(_matrix(step), _losses(step))
    return balancer


def _next_steps(balancer: Balancer, first: int = 3, count: int = 3) -> list[Tensor]:
    return [balancer(_matrix(s), _losses(s)) for s in range(first, first + count)]


@pytest.mark.parametrize("name", NAMES)
def test_is_a_module_without_parameters(name: str) -> None:
    balancer = _stepped(name)
    assert isinstance(balancer, nn.Module)
    model = Model(balancer)
    assert list(balancer.parameters()) == []
    assert [id(p) for p in model.parameters()] == [id(p) for p in model.layer.parameters()]
    assert "balancer._extra_state" in model.state_dict()


@pytest.mark.parametrize("name", NAMES)
def test_parent_state_dict_through_a_file_resumes_bit_identically(name: str) -> None:
    model = Model(_stepped(name))
    saved = through_a_file(model.state_dict())
    fresh = Model(build_balancer(name, K, seed=99))  # another seed: the state must travel
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.layer.weight, model.layer.weight)
    for ours, theirs in zip(_next_steps(fresh.balancer), _next_steps(model.balancer)):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", NAMES)
def test_double_moves_the_floating_state(name: str) -> None:
    balancer = build_balancer(name, K, seed=0)
    for step in range(3):
        balancer(_matrix(step, torch.float32), _losses(step))
    integers = {key: b.dtype for key, b in balancer.named_buffers() if not b.is_floating_point()}
    assert balancer.double() is balancer
    for key, b in balancer.named_buffers():
        assert b.dtype == (torch.float64 if b.is_floating_point() else integers[key]), key
    balancer.float()
    assert all(b.dtype == torch.float32 for b in balancer.buffers() if b.is_floating_point())
    out = balancer(_matrix(3, torch.float32), _losses(3))
    assert out.dtype == torch.float32 and bool(torch.isfinite(out).all())


def test_a_float32_state_cast_to_float64_continues_in_float64() -> None:
    """DB-MTL's EMA in the gradients' dtype: cast once, the next steps follow float64 rows."""
    a = build_balancer("dbmtl", K)
    for step in range(3):
        a(_matrix(step, torch.float32))
    reference = build_balancer("dbmtl", K)
    reference.load_state_dict(a.state_dict())
    a.to(torch.float64)
    assert a._ema is not None and a._ema.dtype == torch.float64
    ema = reference._ema
    assert ema is not None
    expected = reference._ema = ema.double()  # the cast by hand
    assert torch.equal(a._ema, expected)
    assert torch.equal(a(_matrix(3)), reference(_matrix(3)))


def test_another_class_in_the_parent_state_is_refused_and_changes_nothing() -> None:
    model = Model(_stepped("gradvac"))
    target = Model(_stepped("pcgrad", seed=5))
    before = copy.deepcopy(target.balancer.state_dict())
    with pytest.raises(RuntimeError, match="saved by a GradVac, not a PCGrad"):
        target.load_state_dict(model.state_dict())
    assert_same_state(target.balancer.state_dict(), before)
    with pytest.raises(ValueError, match="saved by a GradVac, not a PCGrad"):
        target.balancer.load_state_dict(model.balancer.state_dict())
    assert_same_state(target.balancer.state_dict(), before)


def test_crmogm_loads_with_its_inner_balancer_or_not_at_all() -> None:
    """A damaged inner state inside a parent's load: neither CR-MOGM nor its inner moves."""
    saver = Model(CRMOGM(MoDo(num_tasks=K, gamma=0.01), beta=0.5))
    for step in range(3):
        saver.balancer(_matrix(step))
    state = saver.state_dict()
    assert {"balancer._lambda", "balancer.inner._lambda"} <= set(state)
    target = Model(CRMOGM(MoDo(num_tasks=K, gamma=0.01), beta=0.5))
    target.balancer(_matrix(7))
    before = copy.deepcopy(target.balancer.state_dict())
    damaged = {**state, "balancer.inner._extra_state": {"_type": "MGDA"}}
    with pytest.raises(RuntimeError, match="saved by a MGDA, not a MoDo"):
        target.load_state_dict(damaged)
    assert_same_state(target.balancer.state_dict(), before)
    damaged = {**state, "balancer._extra_state": {"_type": "MGDA"}}  # the outer one this time
    with pytest.raises(RuntimeError, match="saved by a MGDA, not a CRMOGM"):
        target.load_state_dict(damaged)
    assert_same_state(target.balancer.state_dict(), before)
    target.load_state_dict(state)
    assert torch.equal(target.balancer(_matrix(3)), saver.balancer(_matrix(3)))
    assert isinstance(CRMOGM(MGDA()).inner, nn.Module)


def test_a_lazily_shaped_state_of_another_shape_loads() -> None:
    """MoCo's tracked gradients take their shape from the input: a state of another P loads."""
    saver = MoCo()
    for step in range(3):
        saver(_matrix(step, p=20))
    target = MoCo()
    target(_matrix(0))
    assert target._y is not None and target._y.shape == (K, P)
    target.load_state_dict(saver.state_dict())
    assert target._y is not None and target._y.shape == (K, 20)
    assert torch.equal(target(_matrix(5, p=20)), saver(_matrix(5, p=20)))


def test_a_none_state_loads_as_none_into_a_stepped_balancer() -> None:
    fresh, stepped = MoDo(), _stepped("modo")
    assert "_lambda" not in fresh.state_dict()
    stepped.load_state_dict(fresh.state_dict())
    assert stepped._lambda is None
    assert torch.equal(stepped(_matrix(0)), MoDo()(_matrix(0)))


def test_a_missing_balancer_in_a_non_strict_load_is_left_alone() -> None:
    model = Model(_stepped("gradvac"))
    before = copy.deepcopy(model.balancer.state_dict())
    layer_only = {key: v for key, v in Model(PCGrad()).state_dict().items()
                  if key.startswith("layer.")}
    result = model.load_state_dict(layer_only, strict=False)
    assert "balancer._extra_state" in result.missing_keys
    assert_same_state(model.balancer.state_dict(), before)


def test_state_dict_holds_copies() -> None:
    balancer = _stepped("gradvac")
    state = balancer.state_dict()
    assert balancer.targets is not None and state["targets"] is not balancer.targets
    assert state["targets"].data_ptr() != balancer.targets.data_ptr()
    kept = balancer.state_dict(keep_vars=True)
    assert kept["targets"] is balancer.targets


def test_extra_state_alone_round_trips_and_is_checked() -> None:
    saver, target = _stepped("pcgrad"), build_balancer("pcgrad", K, seed=42)
    target.set_extra_state(saver.get_extra_state())
    assert torch.equal(target(_matrix(3)), saver(_matrix(3)))
    with pytest.raises(ValueError, match="saved by a GradVac, not a PCGrad"):
        target.set_extra_state(_stepped("gradvac").get_extra_state())


def _child(rank: int, model: Model, out: str) -> None:
    torch.save([model.balancer(_matrix(s)) for s in range(3, 6)], out)


def test_a_model_with_a_balancer_reaches_a_spawned_process(tmp_path: Path) -> None:
    model = Model(_stepped("pcgrad"))
    out = tmp_path / "steps.pt"
    mp.spawn(_child, args=(model, str(out)), nprocs=1, join=True)
    theirs = torch.load(out)
    for a, b in zip(theirs, [model.balancer(_matrix(s)) for s in range(3, 6)]):
        assert torch.equal(a, b)


def test_repr_shows_the_declared_settings() -> None:
    """``_repr_args`` generates the repr the classes wrote by hand before."""
    assert repr(MGDA(normalization="l2")) == \
        "MGDA(num_tasks=None, normalization='l2', apply_to='normalized')"
    assert repr(CRMOGM(MGDA(3), beta=0.5)) == \
        "CRMOGM(inner=MGDA(num_tasks=3, normalization='none', apply_to='normalized'), beta=0.5)"
    assert repr(AlignedMTL(pref=[1.0, 2.0])) == \
        "AlignedMTL(num_tasks=None, pref=[1.0, 2.0], scale_mode='min')"
    assert repr(DWA(3, period=None)) == "DWA(num_tasks=3, temperature=2.0, period=None)"
