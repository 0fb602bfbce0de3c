"""Adaptive gradient clipping (AGC), unit-wise, from NFNets (docs/loop.md, "Clipping")."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from .._checks import check_bool, check_positive, tensor_list
from .._types import NonFiniteGradientError
from ._params import (
    check_leaves,
    factor_for,
    overflow_safe_norm,
    params_with_grads,
    total_and_overflow,
)
from ._task import _Stateless

__all__ = ["AGC", "adaptive_clip_grad_", "unitwise_norm"]

_DIV_GUARD = 1e-6


def unitwise_norm(x: Tensor, wide: bool = False) -> Tensor:
    """Per-unit 2-norm: over all dims but 0 (keepdim) for ``ndim >= 2``, whole tensor otherwise
    (``wide``: taken again in float64 where float32's powers overflow,
    :func:`~._params.overflow_safe_norm`; the caller knows from the total norm).

    Example:
        >>> import torch
        >>> from gradbalance.clip import unitwise_norm
        >>> unitwise_norm(torch.tensor([[3.0, 4.0], [0.0, 2.0]]))  # one norm per row
        tensor([[5.],
                [2.]])
    """
    norm = overflow_safe_norm if wide else _plain_norm
    if x.dim() <= 1:
        return norm(x)
    return norm(x, dim=tuple(range(1, x.dim())), keepdim=True)


def _plain_norm(x: Tensor, dim: tuple[int, ...] | None = None, keepdim: bool = False) -> Tensor:
    out: Tensor = torch.linalg.vector_norm(x, dim=dim, keepdim=keepdim)
    return out


def adaptive_clip_grad_(parameters: Iterable[Tensor] | Tensor, clip_factor: float = 0.01,
                        eps: float = 1e-3, exclude: Iterable[Tensor] = (),
                        error_if_nonfinite: bool = False) -> Tensor:
    """Unit-wise AGC of every ``.grad`` in ``parameters`` (in place); returns the pre-clip norm.

    Brock, De, Smith, Simonyan (2021), "High-Performance Large-Scale Image Recognition Without
    Normalization", ICML, arXiv:2102.06171, eq. 3. For every unit i (a row of a weight: one
    output unit of a linear or conv layer, norms over the other dimensions; a whole bias or
    gain vector)::

        ‖Wᵢ‖* = max(‖Wᵢ‖, eps),   Gᵢ ← λ · ‖Wᵢ‖* / ‖Gᵢ‖ · Gᵢ   if ‖Gᵢ‖ / ‖Wᵢ‖* > λ = clip_factor

    Returns the total 2-norm of all gradients given (excluded ones included), as
    ``clip_grad_norm_`` does.

    Example:
        >>> import torch
        >>> from gradbalance.clip import adaptive_clip_grad_
        >>> w = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))  # one unit, ‖W‖ = 5
        >>> w.grad = torch.tensor([[30.0, 40.0]])  # ‖G‖ = 50 > 0.1 · 5
        >>> adaptive_clip_grad_([w], clip_factor=0.1), w.grad  # G rescaled to norm 0.5
        (tensor(50.), tensor([[0.3000, 0.4000]]))
    """
    check_positive("clip_factor", clip_factor)
    eps = check_positive("eps", eps, allow_zero=True, hint=", e.g. 1e-3")
    excluded = tensor_list("exclude", exclude)
    check_leaves("exclude", excluded)
    skip = {id(p) for p in excluded}
    params = params_with_grads(parameters)
    grads = [p.grad for p in params if p.grad is not None]  # all of them: params_with_grads
    if not grads:
        return torch.zeros(())
    total, wide = total_and_overflow(grads)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise NonFiniteGradientError(
            f"pre-clip gradient norm is {total.item()}; nothing was clipped. Skip this step, or "
            f"pass error_if_nonfinite=False"
        )
    clipped = [p for p in params if id(p) not in skip]
    _refuse_sparse(params, clipped)
    with torch.no_grad():
        for p, weight_norm in zip(clipped, _weight_norms(clipped), strict=True):
            g = p.grad
            assert g is not None
            max_norm = factor_for(weight_norm, g).clamp(min=eps).mul(clip_factor)
            grad_norm = factor_for(unitwise_norm(g, wide), g)
            coef = max_norm / grad_norm.clamp(min=_DIV_GUARD)  # float32 up: no 16-bit underflow
            g.copy_(torch.where(grad_norm > max_norm, g * coef, g))
    return total


def _refuse_sparse(params: list[Tensor], clipped: list[Tensor]) -> None:
    """``ValueError`` before anything moves for a sparse ``.grad`` AGC would clip: its unit
    norms need the rows it does not store."""
    for i, p in enumerate(params):
        if p.grad is not None and p.grad.layout != torch.strided and any(
                p is c for c in clipped):
            raise ValueError(
                f"parameters[{i}] (shape {tuple(p.shape)}) has a sparse .grad "
                f"({p.grad.layout}, e.g. nn.Embedding(sparse=True)); AGC clips unit-wise "
                f"against the weight's rows: pass it in exclude=, or build the embedding "
                f"with sparse=False")


def _weight_norms(params: list[Tensor]) -> list[Tensor]:
    """Each parameter's unit norms (:func:`unitwise_norm`), taken again in float64 where a
    low-precision weight's came out infinite (its powers overflow from entries of about
    ``1.8e19`` in float32: the limit was inf and the unit never clipped); one host sync."""
    norms = [unitwise_norm(p.detach()) for p in params]
    low = [i for i, p in enumerate(params) if p.is_floating_point() and p.dtype != torch.float64]
    if not low:
        return norms
    flags = torch.stack([torch.isinf(norms[i]).any().to(norms[low[0]].device) for i in low])
    for i, overflowed in zip(low, flags.tolist(), strict=True):
        if overflowed:
            norms[i] = unitwise_norm(params[i].detach(), wide=True)
    return norms


class AGC(_Stateless):
    """Adaptive gradient clipping (:func:`adaptive_clip_grad_`, Brock et al. 2021) as an
    object: ``AGC(0.01, exclude=head)(model.parameters())``.

    Args:
        clip_factor: λ, the largest allowed ratio ‖Gᵢ‖ / max(‖Wᵢ‖, eps).
        eps: floor on the weight norm, so zero-initialised units can move (paper: 1e-3).
        exclude: parameters never clipped (the paper leaves the final linear layer alone).
        error_if_nonfinite: raise on a non-finite gradient norm.

    Example:
        >>> import torch
        >>> from gradbalance.clip import AGC
        >>> w = torch.nn.Parameter(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))  # unit norms 5, 1
        >>> w.grad = torch.tensor([[0.3, 0.4], [0.0, 2.0]])  # ratios 0.1 and 2
        >>> AGC(clip_factor=0.5)([w]), w.grad  # only unit 2 exceeds 0.5: scaled to 0.5 · 1
        (tensor(2.0616), tensor([[0.3000, 0.4000],
                [0.0000, 0.5000]]))
    """

    def __init__(self, clip_factor: float = 0.01, eps: float = 1e-3,
                 exclude: Iterable[Tensor] = (), error_if_nonfinite: bool = False) -> None:
        self.clip_factor = check_positive("clip_factor", clip_factor)
        self.eps = check_positive("eps", eps, allow_zero=True, hint=", e.g. 1e-3")
        self.exclude = tensor_list("exclude", exclude)
        check_leaves("exclude", self.exclude)
        self.error_if_nonfinite = check_bool("error_if_nonfinite", error_if_nonfinite)

    def __call__(self, parameters: Iterable[Tensor] | Tensor) -> Tensor:
        return adaptive_clip_grad_(parameters, self.clip_factor, self.eps, self.exclude,
                                   self.error_if_nonfinite)

    def __repr__(self) -> str:
        return (f"AGC(clip_factor={self.clip_factor}, eps={self.eps}, "
                f"exclude={len(self.exclude)} params)")
