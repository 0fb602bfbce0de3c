"""The random source of the stochastic balancers and its place in ``state_dict``.

Not a balancer module (no ``__all__``). Two conventions, both resumable bit-identically:

* an *owned* generator (PCGrad, GradVac): always present, a private CPU generator seeded from
  the global RNG when none is given; ``state_dict`` always holds ``"generator"``;
* an *optional* generator (GradDrop, Random): None draws from torch's global RNG, which the
  balancer does not own, so ``state_dict`` holds ``"generator"`` only for a given generator.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._statedict import check_keys


def private_generator() -> torch.Generator:
    """A CPU generator seeded from the global RNG (``torch.manual_seed`` makes it repeatable)."""
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    return torch.Generator().manual_seed(seed)


def load_generator_state(balancer: Any, state_dict: dict[str, Any]) -> None:
    """Owned generator: restore ``balancer.generator`` from the required ``"generator"``."""
    if "generator" not in state_dict:
        raise ValueError(
            f"{type(balancer).__name__} state_dict has keys {sorted(state_dict)} but needs "
            f"'generator'; was it saved from another balancer?"
        )
    balancer.generator.set_state(state_dict["generator"])


def generator_state(generator: torch.Generator | None) -> dict[str, Tensor]:
    """Optional generator: ``{"generator": state}`` for a held generator, else empty."""
    return {} if generator is None else {"generator": generator.get_state().clone()}


def restore_generator(generator: torch.Generator | None, state: dict[str, Any],
                      owner: str) -> None:
    """Optional generator: restore a state saved by :func:`generator_state`."""
    if "generator" not in state:
        return
    if generator is None:
        raise ValueError(
            f"state_dict holds a generator state but this {owner} has no generator; build it "
            f"with generator=torch.Generator() to resume the same random stream"
        )
    generator.set_state(state["generator"].clone())


class OptionalGeneratorState:
    """``state_dict``/``load_state_dict`` of a balancer whose only state is its generator."""

    generator: torch.Generator | None

    def state_dict(self) -> dict[str, Tensor]:
        return generator_state(self.generator)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_keys(type(self).__name__, state_dict, ["generator"])
        restore_generator(self.generator, state_dict, type(self).__name__)
