"""Shape conventions and the one place that checks user input.

Shapes used throughout the library:

* ``K``: number of tasks; ``P``: number of shared (trunk) parameters, flattened.
* task-gradient matrix ``G``: ``[K, P]``, row ``k`` is task ``k``'s gradient.
* Gramian ``G Gᵀ``: ``[K, K]``, kept in float64.
* weights: ``[K]``; combined gradient: ``[P]``.

Every message names the argument, shows what was found and says how to fix it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = [
    "NonFiniteGradientError",
    "as_loss_vector",
    "as_parameter_list",
    "check_matrix",
    "check_num_tasks",
]


class NonFiniteGradientError(ValueError):
    """A task gradient (or Gramian) holds inf or NaN; no state was changed."""


def check_num_tasks(num_tasks: int | None, argname: str = "num_tasks") -> int | None:
    """Validate an optional task count given at construction."""
    if num_tasks is None:
        return None
    if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1:
        raise ValueError(
            f"Invalid {argname}: {num_tasks!r} (expected a positive int, the number of tasks K)"
        )
    return num_tasks


def as_loss_vector(
    losses: Tensor | Sequence[Tensor], num_tasks: int | None = None, argname: str = "losses"
) -> Tensor:
    """Return the task losses as a 1-D tensor ``[K]`` that keeps the autograd graph.

    Accepts a 1-D tensor or a list/tuple of scalar tensors (batch means).
    """
    if isinstance(losses, Tensor):
        if losses.dim() != 1 or losses.numel() == 0:
            raise ValueError(
                f"{argname} must be a 1-D tensor of K task losses, got shape "
                f"{tuple(losses.shape)}; reduce each task loss to a scalar (e.g. the batch mean) "
                f"and pass torch.stack([loss_1, ..., loss_K])"
            )
        vector = losses
    elif isinstance(losses, (list, tuple)):
        if len(losses) == 0:
            raise ValueError(f"{argname} is empty; pass one scalar loss per task")
        for k, loss in enumerate(losses):
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                found = type(loss).__name__ if not isinstance(loss, Tensor) else tuple(loss.shape)
                raise ValueError(
                    f"{argname}[{k}] must be a scalar tensor, got {found}; reduce each task "
                    f"loss to a scalar (e.g. reduction='mean')"
                )
        vector = torch.stack([loss.reshape(()) for loss in losses])
    else:
        raise ValueError(
            f"{argname} must be a 1-D tensor or a list of scalar tensors, got "
            f"{type(losses).__name__}"
        )
    if num_tasks is not None and vector.numel() != num_tasks:
        raise ValueError(
            f"{argname} has {vector.numel()} tasks but {num_tasks} were expected "
            f"(num_tasks or an earlier call); pass one loss per task, in the same order every call"
        )
    return vector


def as_parameter_list(
    params: Iterable[Tensor] | Tensor | None, argname: str, allow_empty: bool = False
) -> list[Tensor]:
    """Materialise a parameter iterable, rejecting tensors that require no grad."""
    if params is None:
        params = []
    if isinstance(params, Tensor):
        params = [params]
    result = list(params)
    if not result and not allow_empty:
        raise ValueError(
            f"{argname} is empty; pass the parameters, e.g. {argname}=model.trunk.parameters() "
            f"(a generator can be consumed only once: pass a list if you reuse it)"
        )
    seen: set[int] = set()
    for i, p in enumerate(result):
        if not isinstance(p, Tensor):
            raise ValueError(f"{argname}[{i}] is a {type(p).__name__}, expected a torch.Tensor")
        if not p.requires_grad:
            raise ValueError(
                f"{argname}[{i}] (shape {tuple(p.shape)}) does not require grad; leave frozen "
                f"parameters out of {argname}, e.g. [p for p in params if p.requires_grad]"
            )
        if id(p) in seen:
            raise ValueError(f"{argname}[{i}] appears twice in {argname}; list each parameter once")
        seen.add(id(p))
    return result


def check_matrix(matrix: Tensor, num_tasks: int | None = None, argname: str = "matrix") -> None:
    """Validate a task-gradient matrix ``[K, P]`` (shape only; finiteness is checked apart)."""
    if not isinstance(matrix, Tensor) or matrix.dim() != 2:
        found = tuple(matrix.shape) if isinstance(matrix, Tensor) else type(matrix).__name__
        raise ValueError(
            f"{argname} must be a 2-D tensor [K, P] of task gradients, got {found}; "
            f"stack one flattened gradient per task"
        )
    if matrix.shape[0] == 0:
        raise ValueError(f"{argname} has no rows; pass at least one task gradient")
    if num_tasks is not None and matrix.shape[0] != num_tasks:
        raise ValueError(
            f"{argname} has {matrix.shape[0]} task rows but the balancer was built with "
            f"num_tasks={num_tasks}; build it with the model's number of tasks"
        )
    if not matrix.is_floating_point():
        raise ValueError(f"{argname} must be floating point, got dtype {matrix.dtype}")
