"""Objects holding a ``torch.Generator`` that survive ``torch.multiprocessing``.

``torch.multiprocessing`` (``mp.spawn``, Lightning's ``ddp_spawn``, DataLoader workers) sends
arguments through a pickler that moves tensor storages into shared memory and passes file
descriptors. A ``torch.Generator`` pickles its state as a temporary tensor, freed (and its
descriptor closed) before the child reads it, so the child fails with "unable to resize
file ... Invalid argument" and a balancer, weighting or clipper holding a generator would
never reach the worker. :class:`PicklableGenerators` pickles every generator attribute as
its device and its state as plain bytes, and rebuilds it on unpickling, so the random stream
continues exactly. The same pickler also leaves every CPU tensor in shared memory, so the
workers would update one state in place and race; unpickling gives the object's tensors
their own memory (:func:`unshare_tensors`).
"""

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
    """Give every CPU tensor reachable from ``root`` that lives in shared memory its own copy.

    ``torch.multiprocessing`` moves every CPU tensor it pickles into shared memory, so the
    worker processes of ``mp.spawn`` (Lightning's ``ddp_spawn``) would all update one balancer
    state, one weighting, one optimizer state in place, racing each other. Lightning unshares
    the modules' parameters and buffers only; this unshares the rest (``t.data`` replaced by a
    clone, the tensor objects kept). Returns the number of tensors copied.
    """
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
