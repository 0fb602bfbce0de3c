"""What a failed or skipped step puts back: the heads' ``.grad``, the balancer, the row clipper
and the global CPU generator. A balancer's state is saved by reference (docs/ARCHITECTURE.md,
extension contract)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..balancers._base import Balancer

__all__ = ["GradSnapshot", "StateSnapshot"]

Restore = Callable[[], None]


class GradSnapshot:
    """The ``.grad`` of ``params`` as they are now; :meth:`restore` puts them back."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self._saved = [
            (p, p.grad, None if p.grad is None else p.grad.detach().clone()) for p in params
        ]

    def restore(self) -> None:
        for p, grad, saved in self._saved:
            if saved is None:
                p.grad = None
            elif grad is not None and p.grad is grad:  # the same tensor, written in place
                grad.copy_(saved)
            else:
                p.grad = saved


class StateSnapshot:
    """The state of ``objects`` (None entries skipped) and of torch's global CPU generator."""

    def __init__(self, *objects: object) -> None:
        self._restores: list[Restore] = [_capture(o) for o in objects if o is not None]
        self._restores.append(_capture_generator(torch.default_generator))

    def restore(self) -> None:
        for restore in self._restores:
            restore()


def _capture(obj: object) -> Restore:
    if isinstance(obj, Balancer):
        return _capture_attributes(obj)
    state_dict = getattr(obj, "state_dict", None)
    load = getattr(obj, "load_state_dict", None)
    if callable(state_dict) and callable(load):
        saved = copy.deepcopy(state_dict())
        return lambda: load(saved)
    return _capture_attributes(obj)


def _capture_attributes(obj: object) -> Restore:
    """The attributes (buffers, parameters) by reference; balancers and generators by state."""
    attributes: dict[str, Any] | None = getattr(obj, "__dict__", None)
    if attributes is None:
        return lambda: None
    saved = dict(attributes)
    tables = [(table, dict(table)) for key in ("_buffers", "_parameters")
              if isinstance(table := attributes.get(key), dict)]
    modules = attributes.get("_modules")
    children = list(modules.values()) if isinstance(modules, dict) else []
    inner: list[Restore] = []
    for value in [*saved.values(), *children]:
        if isinstance(value, torch.Generator):
            inner.append(_capture_generator(value))
        elif isinstance(value, Balancer):
            inner.append(_capture_attributes(value))

    def restore() -> None:
        attributes.clear()
        attributes.update(saved)
        for table, entries in tables:
            table.clear()
            table.update(entries)
        for restore_inner in inner:
            restore_inner()

    return restore


def _capture_generator(generator: torch.Generator) -> Restore:
    state = generator.get_state()

    def restore() -> None:
        generator.set_state(state)

    return restore
