"""The declared-state rules of ``docs/ARCHITECTURE.md``, "Extension contract", as checks both
contract suites (balancers, loss weightings) run on every registered class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from gradbalance._module import StateModule

#: Where the rules are written down.
_RULES = 'docs/ARCHITECTURE.md, "Extension contract"'


def modules(obj: StateModule) -> list[tuple[str, StateModule]]:
    """The object and its stateful submodules, with their key prefixes."""
    return [(f"{name}." if name else "", m) for name, m in obj.named_modules()
            if isinstance(m, StateModule)]


def assert_every_tensor_declared(obj: StateModule) -> None:
    """Every tensor saved in ``state_dict`` (parameters, persistent buffers) comes from
    ``register_state`` (a non-persistent buffer may be a setting, moved by ``.to()``)."""
    for prefix, module in modules(obj):
        tensors = set(module._slots())
        undeclared = sorted(tensors - set(module.state_specs))
        assert not undeclared, (
            f"{type(module).__name__}: {prefix}{undeclared} not declared: register it with "
            f"register_state ({_RULES}, \"State is declared once\")")


def task_shapes(obj: StateModule) -> dict[str, tuple[int, ...]]:
    """The shapes of the declared state tensors set now, by key."""
    return {prefix + name: tuple(t.shape) for prefix, module in modules(obj)
            for name in module.state_specs
            if (t := getattr(module, name)) is not None}


def assert_task_sized_state_declared(obj: StateModule, shapes_k: dict[str, tuple[int, ...]],
                                     shapes_k1: dict[str, tuple[int, ...]], k: int) -> None:
    """A tensor whose shape changes with K (``shapes_k`` vs ``shapes_k1``, runs with K and
    K + 1 tasks) is declared per task, with its task dimension of size K."""
    specs = {prefix + name: spec for prefix, module in modules(obj)
             for name, spec in module.state_specs.items()}
    for key, shape in shapes_k.items():
        if key in shapes_k1 and shapes_k1[key] != shape:
            spec = specs[key]
            assert spec.task_dim is not None, (
                f"{key} {shape} depends on K: declare per_task=True (and task_dim) or "
                f"like_rows=True ({_RULES}, \"State is declared once\")")
            assert shape[spec.task_dim] == k, (
                f"{key} {shape}: its declared task_dim {spec.task_dim} is not of size K = {k} "
                f"({_RULES}, \"State is declared once\")")


def assert_replaced_not_edited(obj: StateModule, step: Callable[[], object]) -> None:
    """``step()`` replaces state tensors and never edits one in place (a rollback keeps
    references), except tensors an optimizer steps (parameters, ``requires_grad`` buffers)."""
    before: dict[str, tuple[Tensor, Tensor]] = {}
    for prefix, module in modules(obj):
        for name, t in module._buffers.items():
            if t is not None and not t.requires_grad:
                before[prefix + name] = (t, t.detach().clone())
    step()
    for key, (ref, copy) in before.items():
        assert torch.equal(ref, copy), (
            f"{key} was changed in place: assign a new tensor ({_RULES}, \"Replace a state "
            f"tensor, never edit it in place\")")


def resized(value: Tensor, dim: int, change: int) -> Tensor:
    """``value`` with ``change`` (±1) entries more along ``dim`` (a task more or fewer)."""
    if change < 0:
        return value.narrow(dim, 0, value.shape[dim] - 1).clone()
    return torch.cat([value, value.narrow(dim, 0, 1)], dim=dim)


def poisoned(value: Tensor, bad: float, seed: int) -> Tensor:
    """A copy of ``value`` with one entry, drawn with ``seed``, set to ``bad``."""
    flat = value.detach().clone().reshape(-1)
    flat[int(torch.randint(flat.numel(), (), generator=torch.Generator().manual_seed(seed)))] = bad
    return flat.reshape(value.shape)


def damaged_states(obj: StateModule, seed: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """Copies of ``obj.state_dict()`` with one declared tensor damaged: an inf or NaN entry
    (floating ones), a task more or fewer along the task dimension (per-task ones)."""
    state = obj.state_dict()
    for prefix, module in modules(obj):
        for name, spec in module.state_specs.items():
            key, value = prefix + name, state.get(prefix + name)
            if not isinstance(value, Tensor) or value.numel() == 0:
                continue
            if value.is_floating_point():
                for bad in (float("nan"), float("inf")):
                    yield f"{key} holds {bad}", {**state, key: poisoned(value, bad, seed)}
            if spec.task_dim is not None:
                for change in (-1, 1):
                    yield (f"{key} with {change:+d} task",
                           {**state, key: resized(value, spec.task_dim, change)})
