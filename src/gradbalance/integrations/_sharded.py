"""The integrations under a framework that shards the model (docs/integrations.md, "Hugging
Face" and "Accelerate"; docs/distributed.md, "Sharded trunks (FSDP2)").

FSDP2 (``fully_shard``) is supported: the buffer takes the sharded trunk's ``DTensor``
parameters, FSDP2's gradient sync stays on during its passes, and a matrix balancer's per-rank
state is saved per rank. FSDP1 and DeepSpeed are refused with the reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from .._sharding import is_dtensor
from ..checkpoint import CheckpointError

__all__ = ["ALTERNATIVE", "fsdp2_sync_on", "gather_rank_states", "own_rank_state",
           "require_sharded", "sharding_refusal"]

#: What to use instead of a refused set-up.
ALTERNATIVE = ("Use FSDP2 (fsdp_version=2) or DDP (torchrun / accelerate launch), or FSDP2 in "
               "your own loop: fully_shard the trunk and call TaskGradBuffer's backward and "
               "apply_ (docs/distributed.md, 'Sharded trunks (FSDP2)')")

_DEEPSPEED = ("DeepSpeed's ZeRO owns the gradient partitions (it reduces and partitions each "
              "backward's gradient itself, so the K task gradients never reach the buffer)")
_FSDP1 = ("FSDP1 (fsdp_version=1) flattens each wrapped module's parameters into one "
          "FlatParameter and reduce-scatters its gradient itself: the trunk's parameters are "
          "no longer the model's and the buffer cannot read one task's shard per pass")


def sharding_refusal(distributed_type: Any, fsdp_version: Any) -> str | None:
    """The reason a framework's sharding is refused (DeepSpeed, FSDP1), or None (none, FSDP2).

    Example:
        >>> from gradbalance.integrations._sharded import sharding_refusal
        >>> sharding_refusal("FSDP", 2) is None, sharding_refusal("MULTI_CPU", None) is None
        (True, True)
        >>> sharding_refusal("FSDP", 1).split(" (")[0]
        'FSDP1'
    """
    name = str(getattr(distributed_type, "value", distributed_type))
    if name == "DEEPSPEED":
        return _DEEPSPEED
    if name == "FSDP" and fsdp_version != 2:
        return _FSDP1
    return None


def require_sharded(name: str, params: Sequence[Tensor], who: str) -> None:
    """Under FSDP2: refuse parameters that are not the sharded model's (``DTensor``), i.e.
    read before the framework ran ``fully_shard``, which replaced them."""
    plain = [i for i, p in enumerate(params) if not is_dtensor(p)]
    if plain:
        raise ValueError(
            f"Invalid {name}: under FSDP2 {len(plain)} of its {len(params)} parameters "
            f"(positions {plain[:5]}) are not DTensors: they were read before fully_shard "
            f"replaced the model's parameters. {who}")


@contextlib.contextmanager
def fsdp2_sync_on(model: nn.Module) -> Iterator[None]:
    """FSDP2's gradient sync on for the buffer's K passes: each pass must reduce-scatter its
    task's gradient, even on a micro-batch the framework marks as accumulating (the buffer
    accumulates the micro-batches itself). The framework's ``no_sync`` turns it back on at
    its own exit; a model not under ``fully_shard`` is left as it is."""
    if dist.is_available():
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(True)
    yield


def gather_rank_states(state: dict[str, Any], group: Any) -> dict[str, Any]:
    """Every rank's ``state`` in one dict (a collective: every rank of ``group`` calls it),
    for a checkpoint one process writes: ``{"ranks": [state of rank 0, ...]}``."""
    states: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, state, group=group)
    return {"ranks": states}


def own_rank_state(saved: dict[str, Any], group: Any) -> dict[str, Any]:
    """This rank's entry of :func:`gather_rank_states` output; ``CheckpointError`` for a
    checkpoint of another world size or one saved without the ranks' states."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    states = saved.get("ranks") if isinstance(saved, dict) else None
    if not isinstance(states, list):
        found = f"keys {sorted(saved)}" if isinstance(saved, dict) else type(saved).__name__
        raise CheckpointError(
            f"the saved state has no per-rank states ({found}): it was saved "
            f"without a sharded trunk; resume a sharded run from a sharded run's checkpoint")
    if len(states) != world:
        raise CheckpointError(
            f"the saved state holds {len(states)} ranks' states, this run has {world} "
            f"processes: a sharded trunk's per-rank state (a matrix balancer's columns) "
            f"resumes on as many processes as saved it")
    own: dict[str, Any] = states[rank]
    return own
