"""Loads that were accepted and broke later, or changed the object before they raised.

Each case built from the objects' own ``state_dict()`` with one entry damaged; the refusal
must name the entry and leave the object's state as it was (compared entry by entry).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer, capture_state, restore_state
from gradbalance.balancers import PCD, GradVac, MoCo, NashMTL, UPGrad
from gradbalance.checkpoint import CheckpointError
from gradbalance.clip import AutoClip
from gradbalance.weighting import DWA


def _rows(seed: int, k: int = 3) -> Tensor:
    return torch.randn(k, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _moco() -> MoCo:
    bal = MoCo(num_tasks=3)
    for s in range(3):
        bal(_rows(s), torch.rand(3, generator=torch.Generator().manual_seed(s)) + 0.5)
    return bal


def _nash() -> NashMTL:
    bal = NashMTL()
    for s in range(2):
        bal(_rows(s))
    return bal


def _pcd() -> PCD:
    bal = PCD(num_tasks=3)
    for s in range(2):
        bal(_rows(s))
    return bal


_CASES: list[tuple[Any, str, Any, str]] = [
    (_nash, "alpha", lambda v: v[:, None].repeat(1, 2), r"'alpha'\] has shape \(3, 2\)"),
    (_moco, "_lambda", lambda v: v[None], r"'_lambda'\] has shape \(1, 3\)"),
    (_moco, "_y", lambda v: v[..., None], r"'_y'\] has shape \(3, 8, 1\)"),
    (_moco, "_y", lambda v: v.to(torch.complex128), "'_y'] has dtype torch.complex128"),
    (_nash, "alpha", lambda v: v.to(torch.int64), "'alpha'] has dtype torch.int64"),
    (_pcd, "_ema", lambda v: v > 0, "'_ema'] has dtype torch.bool"),
    (_moco, "_step", lambda v: torch.tensor(-1), "'_step'] is -1, a step counter below 0"),
    (_pcd, "_step", lambda v: torch.tensor(True), "'_step'] has dtype torch.bool"),
    (_moco, "_step", lambda v: torch.tensor(2.5), "'_step'] has dtype torch.float32"),
]


@pytest.mark.parametrize(("build", "key", "damage", "text"), _CASES,
                         ids=[f"{i}-{k}" for i, (_, k, _, _) in enumerate(_CASES)])
def test_a_damaged_state_entry_is_refused_by_name(build: Any, key: str, damage: Any,
                                                  text: str) -> None:
    """Before: accepted, then a broadcast error, a wrong K or silently other results."""
    source, target = build(), build()
    target(_rows(9)) if not target.needs_losses else target(_rows(9), torch.ones(3))
    before = target.state_dict()
    state = source.state_dict()
    state[key] = damage(state[key])
    with pytest.raises(ValueError, match=text):
        target.load_state_dict(state)
    assert _same(target.state_dict(), before)


def test_an_optional_state_loads_in_float64() -> None:
    """A float32 copy of a per-task state loads as the float64 the method keeps."""
    source = _nash()
    state = source.state_dict()
    state["alpha"] = state["alpha"].float()
    target = NashMTL()
    target.load_state_dict(state)
    assert target.alpha is not None and target.alpha.dtype == torch.float64
    assert torch.equal(target.alpha, source.alpha.float().double())


@pytest.mark.parametrize("cls", [NashMTL, GradVac])
def test_a_k_learned_from_calls_goes_with_reset_and_a_rolled_back_load(cls: type) -> None:
    """NashMTL and GradVac fix K at their first call; ``reset()`` kept it (a fresh object
    takes any K), and so did a checkpoint rolled back after a later entry failed."""
    bal = cls()
    bal(_rows(0))
    bal.reset()
    assert bal.num_tasks is None
    bal(_rows(1, k=2))  # another K after reset, as a fresh object
    fresh, source = cls(), cls()
    source(_rows(2))
    checkpoint = capture_state(balancer=source, clipper=AutoClip())
    checkpoint["objects"]["clipper"]["count"] = -1
    with pytest.raises(CheckpointError):
        restore_state(checkpoint, balancer=fresh, clipper=AutoClip())
    assert fresh.num_tasks is None
    fresh(_rows(3, k=4))


def _auto_buffer() -> tuple[TaskGradBuffer, nn.Module, nn.ModuleList]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5)).double()
    heads = nn.ModuleList(nn.Linear(5, 1) for _ in range(3)).double()
    buf = TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()), mode="auto",
                         modules=trunk, update_every=2)
    x = torch.randn(6, 4, dtype=torch.float64)
    for _ in range(3):
        feats = trunk(x)
        buf.backward(torch.stack([h(feats).pow(2).mean() for h in heads]))
        buf.apply_(UPGrad())
    return buf, trunk, heads


@pytest.mark.parametrize(("damage", "text"), [
    (lambda s: {**s, "auto_route": {**s["auto_route"], "gramian_ok": "yes"}},
     "Invalid state_dict\\['auto_route'\\]"),
    (lambda s: {**s, "auto_route": {}}, "Invalid state_dict\\[.auto_route.\\]"),
    (lambda s: {**s, "stepz": 3}, "unknown keys \\['stepz'\\]"),
], ids=["gramian_ok", "empty-route", "unknown-key"])
def test_a_buffer_load_that_fails_changes_nothing(damage: Any, text: str) -> None:
    """``mode="auto"`` loaded ``update_every``'s counter and weights before it checked the
    route; unknown keys were ignored."""
    buf, _, _ = _auto_buffer()
    before = buf.state_dict()
    state = {**before, "step": 7, "weights": torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64)}
    with pytest.raises(ValueError, match=text):
        buf.load_state_dict(damage(state))
    assert _same(buf.state_dict(), before)


def test_a_counter_below_zero_is_refused_by_a_weighting() -> None:
    dwa = DWA(3, period=1)
    state = dwa.state_dict()
    key = next(k for k, v in state.items() if isinstance(v, Tensor) and v.dim() == 0
               and not v.is_floating_point())
    state[key] = torch.tensor(-2)
    with pytest.raises(ValueError, match="a step counter below 0"):
        dwa.load_state_dict(state)


def _famo_state() -> dict[str, Any]:
    from gradbalance.weighting import FAMO

    famo = FAMO(3)
    for s in range(3):
        losses = torch.rand(3, generator=torch.Generator().manual_seed(s)) + 0.5
        famo(losses)
        famo.update(losses * 0.9)
    return famo.state_dict()


def _optimizer_entry(state: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = state["_extra_state"]["optimizer"]["state"][0]
    return entry


@pytest.mark.parametrize(("damage", "text"), [
    (lambda s: _optimizer_entry(s).pop("exp_avg"), "keys \\['exp_avg_sq', 'step'\\]"),
    (lambda s: s["_extra_state"]["optimizer"].__setitem__("state", None), "does not load"),
    (lambda s: _optimizer_entry(s).__setitem__("step", torch.tensor(-1.0)), "'step' of dtype"),
    (lambda s: _optimizer_entry(s).__setitem__("step", torch.tensor(True)), "torch.bool"),
    (lambda s: _optimizer_entry(s).__setitem__("exp_avg_sq", -torch.ones(3, dtype=torch.float64)),
     "'exp_avg_sq' of dtype"),
    (lambda s: _optimizer_entry(s).__setitem__("exp_avg", _optimizer_entry(s)["exp_avg"]
                                               .tolist()), "'exp_avg' as a list"),
    (lambda s: _optimizer_entry(s).__setitem__("exp_avg_sq", 0.5), "'exp_avg_sq' as a float"),
], ids=["no-moment", "state-none", "negative-step", "bool-step", "negative-second-moment",
        "list-moment", "number-moment"])
def test_a_damaged_own_optimizer_state_is_refused(damage: Any, text: str) -> None:
    """FAMO's Adam state: accepted, then a KeyError, a ZeroDivisionError or NaN weights at
    the next ``update()`` (an AttributeError at load for ``state=None``)."""
    from gradbalance.weighting import FAMO

    state = _famo_state()
    damage(state)
    famo = FAMO(3)
    before = famo.state_dict()
    with pytest.raises(ValueError, match=text):
        famo.load_state_dict(state)
    assert _same(famo.state_dict(), before)


def test_auto_clip_history_loads_in_float64_and_refuses_negative_norms() -> None:
    """A float16 history raised inside ``torch.quantile`` at the next call; negative norms
    were kept."""
    weight = nn.Parameter(torch.ones(4))
    clip = AutoClip(history_size=4)
    for s in range(3):
        weight.grad = torch.randn(4, generator=torch.Generator().manual_seed(s))
        clip([weight])
    state = clip.state_dict()
    half = {**state, "history": state["history"].half(), "threshold": state["threshold"].half()}
    other = AutoClip(history_size=4)
    other.load_state_dict(half)
    assert other.state_dict()["history"].dtype == torch.float64
    weight.grad = torch.ones(4)
    other([weight])  # no error from the quantile
    negative = {**state, "history": -state["history"]}
    with pytest.raises(ValueError, match="negative norms"):
        AutoClip(history_size=4).load_state_dict(negative)


@pytest.mark.parametrize(("state", "text"), [
    (None, "expects the dict returned by state_dict"),
    ({"values": {"loss": [float("nan"), 1.0]}}, "finite numbers"),
    ({"values": {"loss": "123"}}, "not a list of numbers"),
    ({"values": {"loss": [1.0, 2.0, 3.0, 4.0]}}, "holds 4 values"),
], ids=["none", "nan", "string", "longer-than-window"])
def test_running_stats_refuses_what_update_never_keeps(state: Any, text: str) -> None:
    from gradbalance import RunningStats

    stats = RunningStats(window=3)
    stats.update({"loss": 2.0})
    before = stats.state_dict()
    with pytest.raises(ValueError, match=text):
        stats.load_state_dict(state)
    assert stats.state_dict() == before


def test_gradvac_names_its_targets_and_their_shape() -> None:
    """The refusal blamed ``groups`` for targets of the wrong rank."""
    source = GradVac()
    source(_rows(0))
    state = source.state_dict()
    state["targets"] = state["targets"][None]
    with pytest.raises(ValueError, match=r"state_dict\['targets'\] has shape \(1, 3, 3\), "
                                         r"expected \[K, K\]"):
        GradVac().load_state_dict(state)

