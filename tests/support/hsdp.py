"""Helpers of the HSDP tests: the FSDP2 cases (:mod:`support.fsdp`) on a 2-D
``(replicate, shard)`` mesh, and what a sharded trunk on another mesh is refused.

Every rank trains on its own quarter of each global batch; the trunk is sharded over the
mesh's shard dimension and replicated over its replicate dimension, so that the update must
equal the single-process full-batch one (docs/distributed.md, "HSDP").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradbalance import TaskGradBuffer
from support.fsdp import Case, _error, resume_run, run_jobs, train

MESH = (2, 2)  # (replicas, shards) over 4 ranks


def refusals() -> dict[str, str]:
    """A trunk of DTensors on placements the balanced step does not take, and a buffer whose
    process group is not the mesh's: each a message (or ``"no error"``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    world = dist.get_world_size()
    flat = init_device_mesh("cpu", (world,))
    three = init_device_mesh("cpu", (1, *MESH), mesh_dim_names=("a", "b", "c"))
    two = init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))
    head = list(nn.Linear(2, 1).parameters())

    def param(mesh: Any, placements: list[Any]) -> nn.Parameter:
        return nn.Parameter(distribute_tensor(torch.ones(8, 3), mesh, placements))

    out = {
        "replicated": _error(lambda: TaskGradBuffer([param(flat, [Replicate()])], head)),
        "tensor_parallel": _error(lambda: TaskGradBuffer([param(flat, [Shard(1)])], head)),
        "three_dims": _error(lambda: TaskGradBuffer(
            [param(three, [Replicate(), Replicate(), Shard(0)])], head)),
        "two_meshes": _error(lambda: TaskGradBuffer(
            [param(two, [Replicate(), Shard(0)]), param(flat, [Shard(0)])], head)),
    }
    return out


def group_mismatch() -> dict[str, str]:
    """A trunk sharded over each replica's 1-D shard submesh with the buffer on the world
    group, and one over the 2-D mesh with no reduction: refused when the buffer is built."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))
    sub, whole, head = nn.Linear(4, 6), nn.Linear(4, 6), list(nn.Linear(6, 2).parameters())
    fully_shard(sub, mesh=mesh["shard"])
    fully_shard(whole, mesh=mesh)
    return {
        "world_over_submesh": _error(lambda: TaskGradBuffer(list(sub.parameters()), head)),
        "local_over_mesh": _error(lambda: TaskGradBuffer(list(whole.parameters()), head,
                                                         process_group="local")),
        "submesh_group": _error(lambda: TaskGradBuffer(
            list(sub.parameters()), head, process_group=mesh["shard"].get_group())),
    }


def run_worker(rank: int, world: int, init_file: str, out_dir: str, cases: list[Case],
               resume: list[Case], submesh: list[Case]) -> None:
    """Every case on the 2-D mesh, every resume, every case on each replica's 1-D submesh
    (rank ``r`` is rank ``r % S`` of its replica), the refusals: ``out_dir/rank{r}.pt``."""
    jobs: list[tuple[str, Callable[[], Any]]] = [
        (case.name, functools.partial(train, case, rank, world)) for case in cases]
    jobs += [("resume_" + case.name, functools.partial(resume_run, case, rank, world, out_dir))
             for case in resume]
    jobs += [(case.name, functools.partial(train, case, rank % MESH[1], MESH[1]))
             for case in submesh]
    jobs += [("refusals", refusals), ("group_mismatch", group_mismatch)]
    run_jobs(rank, world, init_file, out_dir, jobs)
