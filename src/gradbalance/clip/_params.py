"""The parameter list a gradient clipper acts on, checked against a silent no-op."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

__all__ = ["params_with_grads"]


def params_with_grads(parameters: Iterable[Tensor] | Tensor) -> list[Tensor]:
    """The parameters whose ``.grad`` is set, in order.

    A tensor that neither has a ``.grad`` nor requires grad is not a parameter: typically the
    gradients themselves were passed, and clipping would silently do nothing (a known failure
    of ``clip_grads_with_norm_``-style helpers). That raises instead.
    """
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    params = list(parameters)
    for i, p in enumerate(params):
        if p.grad is None and not p.requires_grad:
            raise ValueError(
                f"parameters[{i}] (shape {tuple(p.shape)}) has no .grad and does not require "
                f"grad, so clipping it would do nothing; pass the parameters whose .grad holds "
                f"the gradient (e.g. model.parameters()), not the gradient tensors"
            )
    return [p for p in params if p.grad is not None]
