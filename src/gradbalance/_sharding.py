"""Where each rank's columns of ``G`` lie under ``fully_shard`` (docs/distributed.md)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from ._shard import Shard
from .taskgrads import ParamLayout

__all__ = ["ShardedLayout", "is_dtensor", "is_sharded", "local_of"]


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (False where torch.distributed is unavailable)."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_of(tensor: Tensor) -> Tensor:
    """This rank's part of a ``DTensor`` (sharing its storage), or the tensor itself."""
    if is_dtensor(tensor):
        local: Tensor = tensor.to_local()  # type: ignore[attr-defined]
        return local
    return tensor


def is_sharded(params: Sequence[Tensor]) -> bool:
    """Whether the parameters are ``DTensor``s (a trunk under ``fully_shard``); a mix is refused."""
    flags = [is_dtensor(p) for p in params]
    if any(flags) and not all(flags):
        plain = [i for i, f in enumerate(flags) if not f]
        raise ValueError(
            f"shared_params mix DTensor (sharded) and plain parameters (plain at indices "
            f"{plain[:5]}{'...' if len(plain) > 5 else ''}); wrap the whole trunk with "
            f"fully_shard (fully_shard(trunk) after its layers) so that every shared parameter "
            f"is sharded"
        )
    return bool(flags) and all(flags)


def _sum_over(group: Any) -> Any:
    """``Shard.reduce``: the sum over ``group``'s ranks of a copy (identical on every rank)."""

    def reduce(value: Tensor) -> Tensor:
        out = value.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    return reduce


SUPPORTED = "Shard(0) on a 1-D mesh (fully_shard) or (Replicate(), Shard(0)) on a 2-D mesh (HSDP)"


def _placements_ok(mesh: Any, placements: tuple[Any, ...]) -> bool:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as ShardPlacement

    if mesh.ndim == 1:
        return placements == (ShardPlacement(0),)
    return mesh.ndim == 2 and placements == (Replicate(), ShardPlacement(0))


def _check_placements(params: Sequence[Tensor], mesh: Any) -> None:
    """Raise unless every parameter lies on ``mesh`` with :data:`SUPPORTED` placements."""
    for i, p in enumerate(params):
        found: Any = p.device_mesh  # type: ignore[attr-defined]
        placements = tuple(p.placements)  # type: ignore[attr-defined]
        if found != mesh:
            raise ValueError(
                f"shared_params[{i}] (shape {tuple(p.shape)}) lies on another device mesh "
                f"({found}) than shared_params[0] ({mesh}); shard the whole trunk over one "
                f"mesh (pass the same mesh= to every fully_shard call)"
            )
        if not _placements_ok(found, placements):
            raise ValueError(
                f"shared_params[{i}] (shape {tuple(p.shape)}) is a DTensor with placements "
                f"{placements} on a {found.ndim}-D mesh; the balanced step supports "
                f"{SUPPORTED}, as fully_shard(module, mesh=...) makes them. For tensor "
                f"parallelism or a mesh of more than 2 dims use fully_shard over a 1-D or "
                f"(replicate, shard) 2-D mesh for the trunk instead"
            )


class ShardedLayout(ParamLayout):
    """The local ``[K, P_local]`` columns of ``DTensor`` parameters sharded on dim 0 over a 1-D
    or HSDP 2-D mesh; :attr:`shard` sums over the shard dimension's ranks."""

    def __init__(self, params: Iterable[Tensor]) -> None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        self.params = list(params)
        first: Any = self.params[0]
        self.mesh = first.device_mesh
        _check_placements(self.params, self.mesh)
        self.group = self.mesh.get_group(self.mesh.ndim - 1)
        self.dtype = first.dtype
        self.device = local_of(first).device
        self.local_shapes: list[tuple[int, ...]] = []
        self.sizes: list[int] = []
        self.offsets: list[int] = []
        runs: list[tuple[int, int]] = []
        local_total, global_total = 0, 0
        for p in self.params:
            shape, offset = compute_local_shape_and_global_offset(
                p.shape, self.mesh, p.placements  # type: ignore[attr-defined]
            )
            numel = math.prod(int(n) for n in shape)
            per_row = math.prod(p.shape[1:])
            start = global_total + (int(offset[0]) * per_row if p.dim() else 0)
            runs.append((start if numel else global_total, numel))
            self.local_shapes.append(tuple(int(n) for n in shape))
            self.sizes.append(numel)
            self.offsets.append(local_total)
            local_total += numel
            global_total += p.numel()
        self.numel = local_total
        self.total = global_total
        self.shard = Shard(tuple(runs), global_total, _sum_over(self.group))
