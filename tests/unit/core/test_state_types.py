"""A state loads only into the class that saved it (every registered balancer and weighting).

Each state names its class under ``"_type"`` in its extra state; a state from another class,
or with a key the class does not know, raises ``ValueError`` and leaves the object unchanged.
A state that does not name its class (no ``"_type"``, or no extra state at all) is refused
too: only the class name tells two states with the same keys apart.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance import BALANCERS
from gradbalance.balancers import Shard
from gradbalance.weighting import WEIGHTINGS
from support.balancers import build_balancer
from support.loop_state import assert_same_state
from support.weighting import Tiny, data, make, train_step, user_optimizer

K, P = 3, 12
EXTRA_KEY = "_extra_state"  # nn.Module's key of a module's extra state
TYPE_KEY = "_type"  # the saving class's name in it (docs/balancers.md)
BALANCER_NAMES = sorted(BALANCERS)
WEIGHTING_NAMES = sorted(WEIGHTINGS)


def _matrix(seed: int) -> Tensor:
    return torch.randn(K, P, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _losses(seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(100 + seed)
    return torch.rand(K, generator=gen, dtype=torch.float64) + 0.5


def _stepped_balancer(name: str, seed: int = 0) -> Any:
    """A balancer after three calls, so that a stateful one holds non-trivial state."""
    balancer = build_balancer(name, K, seed)
    for step in range(3):
        balancer(_matrix(step), _losses(step))
    return balancer


def _stepped_weighting(name: str) -> Any:
    model = Tiny()
    weighting = make(name, model)
    opt = user_optimizer(weighting, model)
    x, y = data()
    for _ in range(3):
        train_step(weighting, model, opt, x, y)
    return weighting


@cache
def _balancer_state(name: str) -> dict[str, Any]:
    return _stepped_balancer(name).state_dict()


@cache
def _weighting_state(name: str) -> dict[str, Any]:
    return _stepped_weighting(name).state_dict()


def _fresh_weighting(name: str) -> Any:
    return make(name, Tiny(seed=1))


def _untagged(state: dict[str, Any]) -> dict[str, Any]:
    """The state with ``"_type"`` taken out of its extra state (nested ones included)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key.split(".")[-1] == EXTRA_KEY and isinstance(value, dict):
            value = {k: v for k, v in value.items() if k != TYPE_KEY}
        out[key] = value
    return out


def _assert_refused(target: Any, state: dict[str, Any], match: str | None = None) -> None:
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(copy.deepcopy(state))
    assert_same_state(target.state_dict(), before)


# -- every state names its class -----------------------------------------------------------


@pytest.mark.parametrize("name", BALANCER_NAMES)
def test_balancer_state_names_its_class(name: str) -> None:
    assert _balancer_state(name)[EXTRA_KEY][TYPE_KEY] == BALANCERS[name].__name__


@pytest.mark.parametrize("name", WEIGHTING_NAMES)
def test_weighting_state_names_its_class(name: str) -> None:
    assert _weighting_state(name)[EXTRA_KEY][TYPE_KEY] == WEIGHTINGS[name].__name__


# -- another class's state is refused, nothing changes -------------------------------------
# Not every ordered pair (N² cases of one check): each class against its neighbour in a ring
# (every class refuses once and is refused once), the pairs the keys cannot tell apart, and a
# property over pairs drawn from both registries.


def _distinct(registry: dict[str, type]) -> list[str]:
    """The sorted names, one per class (an alias of a class already listed is left out)."""
    first: dict[type, str] = {}
    for name in sorted(registry):
        first.setdefault(registry[name], name)
    return sorted(first.values())


def _ring(registry: dict[str, type]) -> list[tuple[str, str]]:
    """``(saved, target)``: each class's state into the next class (registry names sorted)."""
    names = _distinct(registry)
    return [(names[i - 1], name) for i, name in enumerate(names)]


#: Pairs whose tagged states hold the same keys: only ``"_type"`` tells them apart.
SAME_KEYS = [("pcgrad", "graddrop"), ("graddrop", "random"), ("random", "pcgrad"),
             ("dbmtl", "pcd"), ("pcd", "dbmtl"), ("mean", "sum"), ("upgrad", "dualproj"),
             ("mgda", "imtlg"), ("constant", "trimmedmean")]
#: Pairs of classes built on one base (its state handling shared, the keys not).
SIBLINGS = [("gradvac", "pcgrad"), ("pcgrad", "gradvac"), ("config", "upgrad"),
            ("dualproj", "config")]
WEIGHTING_SAME_KEYS = [("gls", "si"), ("si", "gls")]  # ScaleInvariant is a GLS subclass
WEIGHTING_SIBLINGS = [("famo", "gradnorm"), ("gradnorm", "famo")]


def _keys(state: dict[str, Any]) -> set[str]:
    """Every key of a state, those of its extra state included (as ``"extra:<key>"``)."""
    extra = {f"extra:{key}" for key in state.get(EXTRA_KEY, {})}
    return {*state, *extra}


def test_the_rings_hold_every_class_once_each_way() -> None:
    for registry in (BALANCERS, WEIGHTINGS):
        ring = _ring(registry)
        classes = set(registry.values())
        assert {registry[saved] for saved, _ in ring} == classes
        assert {registry[target] for _, target in ring} == classes
        assert all(registry[saved] is not registry[target] for saved, target in ring)


@pytest.mark.parametrize(("saved", "target"), _ring(BALANCERS) + SAME_KEYS + SIBLINGS)
def test_balancer_refuses_another_balancers_state(saved: str, target: str) -> None:
    _assert_refused(build_balancer(target, K, seed=1), _balancer_state(saved),
                    match=f"saved by a {BALANCERS[saved].__name__}, not a "
                          f"{BALANCERS[target].__name__}")


@pytest.mark.parametrize(("saved", "target"),
                         _ring(WEIGHTINGS) + WEIGHTING_SAME_KEYS + WEIGHTING_SIBLINGS)
def test_weighting_refuses_another_weightings_state(saved: str, target: str) -> None:
    _assert_refused(_fresh_weighting(target), _weighting_state(saved),
                    match=f"saved by a {WEIGHTINGS[saved].__name__}, not a "
                          f"{WEIGHTINGS[target].__name__}")


@pytest.mark.parametrize(("saved", "target"), SAME_KEYS)
def test_the_same_key_balancer_pairs_hold_the_same_keys(saved: str, target: str) -> None:
    """The pairs above are hard ones: the keys alone would let the state load."""
    assert _keys(_balancer_state(saved)) == _keys(_balancer_state(target))


@pytest.mark.parametrize(("saved", "target"), WEIGHTING_SAME_KEYS)
def test_the_same_key_weighting_pairs_hold_the_same_keys(saved: str, target: str) -> None:
    assert _keys(_weighting_state(saved)) == _keys(_weighting_state(target))


#: Every class of both registries, as (kind, name).
REGISTRY = ([("balancer", name) for name in _distinct(BALANCERS)]
            + [("weighting", name) for name in _distinct(WEIGHTINGS)])


def _class_of(entry: tuple[str, str]) -> type:
    kind, name = entry
    return BALANCERS[name] if kind == "balancer" else WEIGHTINGS[name]


def _state_of(entry: tuple[str, str]) -> dict[str, Any]:
    kind, name = entry
    return _balancer_state(name) if kind == "balancer" else _weighting_state(name)


def _fresh(entry: tuple[str, str]) -> Any:
    kind, name = entry
    return build_balancer(name, K, seed=1) if kind == "balancer" else _fresh_weighting(name)


_pairs = st.tuples(st.sampled_from(REGISTRY), st.sampled_from(REGISTRY)).filter(
    lambda pair: _class_of(pair[0]) is not _class_of(pair[1]))


@settings(max_examples=60, deadline=None)
@given(pair=_pairs)
def test_any_other_class_refuses_the_state(pair: tuple[tuple[str, str], tuple[str, str]]) -> None:
    """Balancers and weightings alike: the message names both classes; nothing moved."""
    saved, target = pair
    _assert_refused(_fresh(target), _state_of(saved),
                    match=f"saved by a {_class_of(saved).__name__}, not a "
                          f"{_class_of(target).__name__}")


@pytest.mark.parametrize("name", ["pcgrad", "gradvac", "dbmtl", "sum"])
def test_weighting_refuses_a_balancers_state(name: str) -> None:
    state = {**_balancer_state(name), "num_tasks": K}
    _assert_refused(_fresh_weighting("uncertainty"), state, match="not a Uncertainty")


@pytest.mark.parametrize("name", ["uncertainty", "rlw", "dwa"])
def test_balancer_refuses_a_weightings_state(name: str) -> None:
    _assert_refused(build_balancer("pcgrad", K, seed=1), _weighting_state(name),
                    match="not a PCGrad")


def test_the_cases_of_the_issue() -> None:
    """GradVac's targets into PCGrad, and PCGrad's generator into GradDrop (same keys)."""
    pcgrad = build_balancer("pcgrad", K, seed=1)
    _assert_refused(pcgrad, _balancer_state("gradvac"), match="saved by a GradVac")
    graddrop = build_balancer("graddrop", K, seed=1)
    assert set(_balancer_state("pcgrad")) == set(graddrop.state_dict())
    _assert_refused(graddrop, _balancer_state("pcgrad"), match="saved by a PCGrad")


# -- unknown keys ------------------------------------------------------------------------


@pytest.mark.parametrize("name", BALANCER_NAMES)
def test_balancer_refuses_an_unknown_key(name: str) -> None:
    state = {**_balancer_state(name), "bogus": torch.zeros(2)}
    _assert_refused(build_balancer(name, K, seed=1), state, match="bogus")


@pytest.mark.parametrize("name", WEIGHTING_NAMES)
def test_weighting_refuses_an_unknown_key(name: str) -> None:
    state = {**_weighting_state(name), "bogus": torch.zeros(2)}
    _assert_refused(_fresh_weighting(name), state, match="bogus")


@pytest.mark.parametrize("name", WEIGHTING_NAMES)
def test_weighting_refuses_a_bad_value_and_changes_nothing(name: str) -> None:
    """A state of the right class with one damaged tensor: the load is all or nothing."""
    state = copy.deepcopy(_weighting_state(name))
    tensors = [key for key, value in state.items() if isinstance(value, Tensor)]
    if not tensors:
        pytest.skip("no tensor state")
    state[tensors[-1]] = torch.zeros(K + 2)
    _assert_refused(_fresh_weighting(name), state)


@pytest.mark.parametrize("state", [None, [1, 2], "PCGrad"], ids=["none", "list", "str"])
def test_a_state_that_is_not_a_dict_is_refused(state: Any) -> None:
    _assert_refused(build_balancer("pcgrad", K, seed=1), state, match="expects the dict")
    _assert_refused(_fresh_weighting("uncertainty"), state, match="expects the dict")


# -- a state that does not name its class --------------------------------------------------


@pytest.mark.parametrize("name", _distinct(BALANCERS))
def test_balancer_refuses_its_own_state_without_the_class_name(name: str) -> None:
    _assert_refused(build_balancer(name, K, seed=1), _untagged(_balancer_state(name)))


@pytest.mark.parametrize("name", _distinct(WEIGHTINGS))
def test_weighting_refuses_its_own_state_without_the_class_name(name: str) -> None:
    _assert_refused(_fresh_weighting(name), _untagged(_weighting_state(name)))


@pytest.mark.parametrize("name", ["pcgrad", "uncertainty"])
def test_a_state_without_extra_state_is_refused(name: str) -> None:
    """The flat states of unreleased versions: no ``_extra_state``, so no class name."""
    target = build_balancer(name, K, seed=1) if name in BALANCERS else _fresh_weighting(name)
    saved = _balancer_state(name) if name in BALANCERS else _weighting_state(name)
    flat = {key: value for key, value in saved.items() if key != EXTRA_KEY}
    _assert_refused(target, flat, match=EXTRA_KEY)


@settings(max_examples=60, deadline=None)
@given(pair=_pairs)
def test_no_state_without_the_class_name_loads_into_another_class(
        pair: tuple[tuple[str, str], tuple[str, str]]) -> None:
    saved, target = pair
    _assert_refused(_fresh(target), _untagged(_state_of(saved)))


# -- a subclass is another class --------------------------------------------------------------


def test_a_subclass_and_its_parent_refuse_each_others_state() -> None:
    class MyPCGrad(BALANCERS["pcgrad"]):  # type: ignore[misc,valid-type]
        pass

    mine = MyPCGrad(num_tasks=K, generator=torch.Generator().manual_seed(0))
    assert mine.state_dict()[EXTRA_KEY][TYPE_KEY] == "MyPCGrad"
    twin = MyPCGrad(num_tasks=K, generator=torch.Generator().manual_seed(5))
    twin.load_state_dict(mine.state_dict())
    assert torch.equal(twin(_matrix(0)), mine(_matrix(0)))
    _assert_refused(twin, _balancer_state("pcgrad"), match="saved by a PCGrad, not a MyPCGrad")
    _assert_refused(build_balancer("pcgrad", K, seed=1), mine.state_dict(),
                    match="saved by a MyPCGrad, not a PCGrad")


def test_a_weighting_subclass_and_its_parent_refuse_each_others_state() -> None:
    class MyUncertainty(WEIGHTINGS["uncertainty"]):  # type: ignore[misc,valid-type]
        pass

    mine = MyUncertainty(K)
    assert mine.state_dict()[EXTRA_KEY][TYPE_KEY] == "MyUncertainty"
    _assert_refused(mine, _weighting_state("uncertainty"),
                    match="saved by a UncertaintyWeighting, not a MyUncertainty")
    _assert_refused(_fresh_weighting("uncertainty"), mine.state_dict(),
                    match="saved by a MyUncertainty, not a UncertaintyWeighting")


# -- a rank's state under a sharded trunk -------------------------------------------------------


def _stepped_sharded(name: str) -> Any:
    """A balancer after three ``combine_sharded`` calls on columns 4..9 of the matrices."""
    balancer = build_balancer(name, K, seed=0)
    shard = Shard(((4, 6),), P)
    for step in range(3):
        balancer.combine_sharded(_matrix(step)[:, 4:10], shard, _losses(step))
    return balancer


@pytest.mark.parametrize(("name", "other"), [("dbmtl", "pcd"), ("moco", "modo"),
                                             ("gradvac", "pcgrad")])
def test_a_sharded_state_names_the_same_class_as_its_unsharded_twin(name: str,
                                                                    other: str) -> None:
    """Its tensors may hold this rank's columns only, but the class and keys are the twin's:
    another class refuses it, its own class loads it."""
    state = _stepped_sharded(name).state_dict()
    assert state[EXTRA_KEY][TYPE_KEY] == BALANCERS[name].__name__
    assert _keys(state) == _keys(_balancer_state(name))
    _assert_refused(build_balancer(other, K, seed=1), state,
                    match=f"saved by a {BALANCERS[name].__name__}, not a "
                          f"{BALANCERS[other].__name__}")
    fresh = build_balancer(name, K, seed=1)
    fresh.load_state_dict(copy.deepcopy(state))
    assert_same_state(fresh.state_dict(), state)
