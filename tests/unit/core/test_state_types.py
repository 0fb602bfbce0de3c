"""A state loads only into the class that saved it (every registered balancer and weighting).

Each state names its class under ``"_type"`` in its extra state; a state from another class,
or with a key the class does not know, raises ``ValueError`` and leaves the object unchanged.
States in the flat format of 0.2 (``"_type"`` at the top) and of 0.1 (no ``"_type"``) still
load into their own class (``support.legacy_state`` writes them).
"""

from __future__ import annotations

import copy
import itertools
from functools import cache
from typing import Any

import pytest
import torch
from torch import Tensor

from gradbalance import BALANCERS
from gradbalance._module import EXTRA_KEY
from gradbalance._statedict import TYPE_KEY
from gradbalance.weighting import WEIGHTINGS
from support.balancers import build_balancer
from support.legacy_state import to_legacy
from support.loop_state import assert_same_state
from support.weighting import Tiny, data, make, train_step, user_optimizer

K, P = 3, 12
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
    """The state as 0.1 wrote it: flat, no ``"_type"`` (nested ones included, e.g. CRMOGM's)."""
    return to_legacy(state, tagged=False)


def _assert_refused(target: Any, state: dict[str, Any], match: str | None = None) -> None:
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(copy.deepcopy(state))
    assert_same_state(target.state_dict(), before)


# -- every state names its class -----------------------------------------------------------


@pytest.mark.parametrize("name", BALANCER_NAMES)
def test_balancer_state_names_its_class(name: str) -> None:
    balancer = _stepped_balancer(name)
    assert balancer.state_dict()[EXTRA_KEY][TYPE_KEY] == type(balancer).__name__


@pytest.mark.parametrize("name", WEIGHTING_NAMES)
def test_weighting_state_names_its_class(name: str) -> None:
    weighting = _stepped_weighting(name)
    assert weighting.state_dict()[EXTRA_KEY][TYPE_KEY] == type(weighting).__name__


# -- another class's state is refused, nothing changes -------------------------------------


@pytest.mark.parametrize(("saved", "target"), [
    pair for pair in itertools.permutations(BALANCER_NAMES, 2)
    if BALANCERS[pair[0]] is not BALANCERS[pair[1]]
])
def test_balancer_refuses_another_balancers_state(saved: str, target: str) -> None:
    fresh = build_balancer(target, K, seed=1)
    _assert_refused(fresh, _balancer_state(saved),
                    match=f"saved by a {BALANCERS[saved].__name__}, not a "
                          f"{BALANCERS[target].__name__}")


@pytest.mark.parametrize(("saved", "target"), list(itertools.permutations(WEIGHTING_NAMES, 2)))
def test_weighting_refuses_another_weightings_state(saved: str, target: str) -> None:
    _assert_refused(_fresh_weighting(target), _weighting_state(saved),
                    match=f"saved by a {WEIGHTINGS[saved].__name__}")


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
    assert set(_untagged(_balancer_state("pcgrad"))) == set(_untagged(graddrop.state_dict()))
    _assert_refused(graddrop, _balancer_state("pcgrad"), match="saved by a PCGrad")


# -- unknown keys ------------------------------------------------------------------------


@pytest.mark.parametrize("untag", [False, True], ids=["tagged", "untagged"])
@pytest.mark.parametrize("name", BALANCER_NAMES)
def test_balancer_refuses_an_unknown_key(name: str, untag: bool) -> None:
    state = _balancer_state(name)
    state = {**(_untagged(state) if untag else state), "bogus": torch.zeros(2)}
    _assert_refused(build_balancer(name, K, seed=1), state, match="bogus")


@pytest.mark.parametrize("untag", [False, True], ids=["tagged", "untagged"])
@pytest.mark.parametrize("name", WEIGHTING_NAMES)
def test_weighting_refuses_an_unknown_key(name: str, untag: bool) -> None:
    state = _weighting_state(name)
    state = {**(_untagged(state) if untag else state), "bogus": torch.zeros(2)}
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


# -- states written before "_type" ------------------------------------------------------------


@pytest.mark.parametrize("name", BALANCER_NAMES)
def test_untagged_balancer_state_still_resumes(name: str) -> None:
    a = _stepped_balancer(name)
    b = build_balancer(name, K, seed=99)
    b.load_state_dict(_untagged(a.state_dict()))
    for step in range(3, 6):
        assert torch.equal(b(_matrix(step), _losses(step)), a(_matrix(step), _losses(step)))


@pytest.mark.parametrize("name", WEIGHTING_NAMES)
def test_untagged_weighting_state_still_loads(name: str) -> None:
    saved = _weighting_state(name)
    fresh = _fresh_weighting(name)
    fresh.load_state_dict(_untagged(saved))
    assert_same_state(fresh.state_dict(), saved)


@pytest.mark.parametrize(("saved", "target"), [
    pair for pair in itertools.permutations(BALANCER_NAMES, 2)
    if BALANCERS[pair[0]] is not BALANCERS[pair[1]]
])
def test_untagged_state_of_another_balancer_never_loses_a_key(saved: str, target: str) -> None:
    """Without the class name only the keys can tell: a load that passes drops nothing."""
    state = _untagged(_balancer_state(saved))
    fresh = build_balancer(target, K, seed=1)
    own_keys = set(_untagged(fresh.state_dict()))
    try:
        fresh.load_state_dict(copy.deepcopy(state))
    except ValueError:
        return
    assert set(state) <= own_keys, (
        f"{target} accepted keys {sorted(set(state) - own_keys)} it does not keep")


# -- a subclass is another class --------------------------------------------------------------


def test_a_subclass_names_itself() -> None:
    class MyPCGrad(BALANCERS["pcgrad"]):  # type: ignore[misc,valid-type]
        pass

    mine = MyPCGrad(num_tasks=K, generator=torch.Generator().manual_seed(0))
    assert mine.state_dict()[EXTRA_KEY][TYPE_KEY] == "MyPCGrad"
    twin = MyPCGrad(num_tasks=K, generator=torch.Generator().manual_seed(5))
    twin.load_state_dict(mine.state_dict())
    assert torch.equal(twin(_matrix(0)), mine(_matrix(0)))
    _assert_refused(twin, _balancer_state("pcgrad"), match="saved by a PCGrad, not a MyPCGrad")
