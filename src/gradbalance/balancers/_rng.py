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

from .._statedict import check_keys, tag_state, untag_state


def private_generator() -> torch.Generator:
    """A CPU generator seeded from the global RNG (``torch.manual_seed`` makes it repeatable)."""
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    return torch.Generator().manual_seed(seed)


def check_generator_state(owner: str, state_dict: dict[str, Any]) -> None:
    """Owned generator: ``state_dict`` must hold ``"generator"``, a ``uint8`` state tensor."""
    if "generator" not in state_dict:
        raise ValueError(
            f"{owner} state_dict has keys {sorted(state_dict, key=str)} but needs "
            f"'generator'; was it saved from another balancer?"
        )
    state = state_dict["generator"]
    if not isinstance(state, Tensor) or state.dtype != torch.uint8:
        found = state.dtype if isinstance(state, Tensor) else type(state).__name__
        raise ValueError(
            f"{owner} state_dict['generator'] must be a uint8 tensor from "
            f"torch.Generator.get_state(), got {found}"
        )


def load_generator_state(balancer: Any, state_dict: dict[str, Any]) -> None:
    """Owned generator: restore ``balancer.generator`` from the required ``"generator"``."""
    check_generator_state(type(balancer).__name__, state_dict)
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

    def state_dict(self) -> dict[str, Any]:
        return tag_state(self, generator_state(self.generator))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = untag_state(self, state_dict, "balancer")
        check_keys(type(self).__name__, state, ["generator"])
        restore_generator(self.generator, state, type(self).__name__)
