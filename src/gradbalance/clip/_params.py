"""The parameter list a gradient clipper acts on, checked against a silent no-op."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from .._checks import tensor_list

__all__ = ["check_leaves", "factor_for", "overflow_safe_norm", "params_with_grads", "stored",
           "total_grad_norm"]


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
    seen: dict[int, int] = {}
    for i, p in enumerate(params):
        if id(p) in seen:  # its norm counted twice and the factor applied twice
            raise ValueError(
                f"parameters[{i}] (shape {tuple(p.shape)}) is parameters[{seen[id(p)]}] again; "
                f"pass each parameter once (e.g. list(dict.fromkeys(params)))")
        seen[id(p)] = i
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
    the first gradient's device (:func:`total_and_overflow`)."""
    return total_and_overflow(grads, norm_type)[0]


def total_and_overflow(grads: list[Tensor], norm_type: float = 2.0) -> tuple[Tensor, bool]:
    """:func:`total_grad_norm` and whether its powers overflowed the gradients' dtype: the
    norms in the gradients' dtype, taken again in float64 only where the total came out
    infinite (one host sync, for float32, float16 or bfloat16 gradients), not one check per
    gradient."""
    device = grads[0].device
    grads = [stored(g) for g in grads]
    norms = [torch.linalg.vector_norm(g.detach(), norm_type).to(device) for g in grads]
    total: Tensor = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    low = any(g.is_floating_point() and g.dtype != torch.float64 for g in grads)
    if not low or norm_type in (math.inf, -math.inf, 0) or not bool(torch.isinf(total)):
        return total, False
    norms = [overflow_safe_norm(g.detach(), norm_type).to(device) for g in grads]
    return overflow_safe_norm(torch.stack(norms), norm_type), True


def overflow_safe_norm(x: Tensor, ord: float = 2.0, dim: int | tuple[int, ...] | None = None,
                       keepdim: bool = False) -> Tensor:
    """:func:`torch.linalg.vector_norm` in ``x``'s dtype, taken again in float64 where a norm
    of a float32, float16 or bfloat16 ``x`` came out infinite (its powers overflow from
    entries of about ``1.8e19`` in float32, the norm itself does not): a finite gradient is
    clipped whatever its size (one host sync then).

    Example:
        >>> import torch
        >>> from gradbalance.clip._params import overflow_safe_norm
        >>> overflow_safe_norm(torch.tensor([3e20, 4e20]))  # float32's own: inf
        tensor(5.0000e+20)
    """
    norm: Tensor = torch.linalg.vector_norm(x, ord, dim=dim, keepdim=keepdim)
    if x.dtype == torch.float64 or not x.is_floating_point() or ord in (math.inf, -math.inf, 0):
        return norm
    if not bool(torch.isinf(norm).any()):
        return norm
    wide: Tensor = torch.linalg.vector_norm(x, ord, dim=dim, keepdim=keepdim,
                                            dtype=torch.float64)
    return wide.to(norm.dtype)


def factor_for(coef: Tensor, like: Tensor) -> Tensor:
    """A clipping factor to multiply ``like`` by: on its device, in its dtype from float32 up,
    in float32 for a 16-bit ``like`` (the product rounded once to 16 bits: a factor of
    ``2e-8`` cast to float16 first was 0, and a row of norm 5e4 clipped to ``1e-3`` became
    zero).

    Example:
        >>> import torch
        >>> from gradbalance.clip._params import factor_for
        >>> g = torch.tensor([3e4, 4e4], dtype=torch.float16)
        >>> g.mul_(factor_for(torch.tensor(2e-8, dtype=torch.float64), g))
        tensor([0.0006, 0.0008], dtype=torch.float16)
    """
    dtype = like.dtype if torch.finfo(like.dtype).bits >= 32 else torch.float32
    return coef.to(device=like.device, dtype=dtype)


def stored(g: Tensor) -> Tensor:
    """``g``'s entries for a norm: a sparse gradient's coalesced values (the entries a dense
    copy would hold, each index once; ``nn.Embedding(sparse=True)``), a dense one itself."""
    return g.detach().coalesce().values() if g.layout == torch.sparse_coo else g
