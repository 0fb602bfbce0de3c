"""Objects holding a ``torch.Generator`` that survive ``torch.multiprocessing``: generators
pickle as bytes, and each worker owns its tensors instead of sharing the parent's memory."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["PicklableGenerators", "unshare_tensors"]

_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType,
           types.BuiltinFunctionType)


@dataclass(frozen=True)
class _GeneratorState:
    device: str
    state: bytes

    @classmethod
    def of(cls, generator: torch.Generator) -> _GeneratorState:
        return cls(str(generator.device), bytes(generator.get_state().tolist()))

    def rebuild(self) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.set_state(torch.tensor(list(self.state), dtype=torch.uint8))
        return generator


class PicklableGenerators:
    """Mixin: ``__getstate__``/``__setstate__`` that carry ``torch.Generator`` attributes."""

    def __getstate__(self) -> dict[str, Any]:
        parent = getattr(super(), "__getstate__", None)
        state = parent() if parent is not None else None
        state = dict(self.__dict__ if state is None else state)
        for key, value in state.items():
            if isinstance(value, torch.Generator):
                state[key] = _GeneratorState.of(value)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = {key: value.rebuild() if isinstance(value, _GeneratorState) else value
                 for key, value in state.items()}
        parent = getattr(super(), "__setstate__", None)
        if parent is not None:
            parent(state)
        else:
            self.__dict__.update(state)
        unshare_tensors(self)  # a worker of mp.spawn owns its copy of the state


def unshare_tensors(root: Any) -> int:
    """Give every shared-memory CPU tensor reachable from ``root`` its own copy (``t.data``
    replaced); returns how many were copied."""
    seen: set[int] = set()
    stack = [root]
    copied = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            if obj.device.type == "cpu" and obj.is_shared():  # type: ignore[no-untyped-call]
                with torch.no_grad():
                    obj.data = obj.data.clone()
                copied += 1
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return copied
