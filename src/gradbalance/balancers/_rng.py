"""The random source of the stochastic balancers and its place in ``state_dict``.

An *owned* generator (PCGrad, GradVac) is always present and saved; an *optional* one
(GradDrop, Random: None draws from torch's global RNG) is saved only when given
(docs/balancers.md). Its state is a uint8 tensor under the extra state's ``"generator"``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._checks import check_generator_state as check_state_value
from ._base import Balancer


def private_generator() -> torch.Generator:
    """A CPU generator seeded from the global RNG (``torch.manual_seed`` makes it repeatable)."""
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    return torch.Generator().manual_seed(seed)


def check_generator_state(owner: str, state_dict: dict[str, Any]) -> None:
    """``state_dict`` must hold ``"generator"``, a state a CPU generator takes."""
    if "generator" not in state_dict:
        raise ValueError(
            f"{owner} state_dict has keys {sorted(state_dict, key=str)} but needs "
            f"'generator'; was it saved from another balancer?"
        )
    check_state_value(owner, state_dict["generator"])


class OptionalGeneratorState(Balancer):
    """A balancer whose only state is an optional generator (in its extra state)."""

    generator: torch.Generator | None
    _extra_keys = ("generator",)

    def _extra_state(self) -> dict[str, Any]:
        return {} if self.generator is None else {"generator": self.generator.get_state()}

    def _check_state(self, tensors: dict[str, Tensor | None], extra: dict[str, Any]) -> None:
        super()._check_state(tensors, extra)
        if "generator" in extra:
            check_generator_state(type(self).__name__, extra)
            if self.generator is None:
                raise ValueError(
                    f"state_dict holds a generator state but this {type(self).__name__} has no "
                    f"generator; build it with generator=torch.Generator() to resume the same "
                    f"random stream"
                )

    def _load_extra(self, extra: dict[str, Any]) -> None:
        if "generator" in extra:
            assert self.generator is not None  # _check_state refused it otherwise
            self.generator.set_state(extra["generator"].clone())


class OwnedGeneratorState(Balancer):
    """The extra state of a balancer that always holds a generator (PCGrad, GradVac)."""

    generator: torch.Generator
    _extra_keys = ("generator",)

    def _extra_state(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def _check_state(self, tensors: dict[str, Tensor | None], extra: dict[str, Any]) -> None:
        check_generator_state(type(self).__name__, extra)
        super()._check_state(tensors, extra)

    def _load_extra(self, extra: dict[str, Any]) -> None:
        self.generator.set_state(extra["generator"].clone())
