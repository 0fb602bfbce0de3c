"""Objects holding a ``torch.Generator`` that survive ``torch.multiprocessing``.

``torch.multiprocessing`` (``mp.spawn``, Lightning's ``ddp_spawn``, DataLoader workers) sends
arguments through a pickler that moves tensor storages into shared memory and passes file
descriptors. A ``torch.Generator`` pickles its state as a temporary tensor, freed (and its
descriptor closed) before the child reads it, so the child fails with "unable to resize
file ... Invalid argument" and a balancer, weighting or clipper holding a generator would
never reach the worker. :class:`PicklableGenerators` pickles every generator attribute as
its device and its state as plain bytes, and rebuilds it on unpickling, so the random stream
continues exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PicklableGenerators"]


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
