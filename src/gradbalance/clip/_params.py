"""The parameter list a gradient clipper acts on, checked against a silent no-op."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from .._checks import tensor_list

__all__ = ["check_leaves", "params_with_grads", "total_grad_norm"]


def check_leaves(name: str, params: list[Tensor]) -> None:
    """Every tensor of ``params`` is a leaf: a parameter, whose ``.grad`` autograd fills."""
    for i, p in enumerate(params):
        if not p.is_leaf:
            raise ValueError(
                f"{name}[{i}] (shape {tuple(p.shape)}) is not a leaf tensor: it is computed "
                f"from other tensors (e.g. w * 2, w.to(...), w[0]), so it has no .grad to "
                f"clip; pass the parameters themselves, e.g. model.parameters()"
            )


def params_with_grads(parameters: Iterable[Tensor] | Tensor) -> list[Tensor]:
    """The parameters whose ``.grad`` is set, in order; ``ValueError`` for a non-leaf tensor
    or one with neither ``.grad`` nor ``requires_grad`` (typically the gradients themselves),
    which clipping would silently skip."""
    params = tensor_list("parameters", parameters)
    check_leaves("parameters", params)
    for i, p in enumerate(params):
        if p.grad is None and not p.requires_grad:
            raise ValueError(
                f"parameters[{i}] (shape {tuple(p.shape)}) has no .grad and does not require "
                f"grad, so clipping it would do nothing; pass the parameters whose .grad holds "
                f"the gradient (e.g. model.parameters()), not the gradient tensors"
            )
    return [p for p in params if p.grad is not None]


def total_grad_norm(grads: list[Tensor], norm_type: float = 2.0) -> Tensor:
    """The ``norm_type``-norm of all ``grads`` together (``clip_grad_norm_``'s total norm), on
    the first gradient's device."""
    device = grads[0].device
    norms = [torch.linalg.vector_norm(g.detach(), norm_type).to(device) for g in grads]
    total: Tensor = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    return total
