"""Per-task clipping of the rows of ``G`` before the combine (docs/loop.md, "Clipping"):
by norm (a factor of each row's norm alone, so ``gramian`` mode can scale ``G Gᵀ`` instead)
or by value."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._checks import check_bool, check_norm_type, check_positive, check_writable_rows
from .._statedict import check_dict, reject_state
from .._types import NonFiniteGradientError
from ._params import factor_for, overflow_safe_norm

__all__ = ["TaskClip", "TaskValueClip", "clip_task_norms_", "clip_task_values_", "row_norms"]

_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard


def row_norms(matrix: Tensor, norm_type: float = 2.0) -> Tensor:
    """Norm of every row of ``matrix`` ``[K, P]`` -> ``[K]`` (in the matrix's dtype; a finite
    row's norm is finite up to the dtype's largest number, float64 taken where float32's
    powers overflow).

    Example:
        >>> import torch
        >>> from gradbalance.functional import row_norms
        >>> G = torch.tensor([[3.0, 4.0], [0.0, -2.0]])
        >>> row_norms(G), row_norms(G, norm_type=float("inf"))
        (tensor([5., 2.]), tensor([4., 2.]))
    """
    if not isinstance(matrix, Tensor) or matrix.dim() != 2:
        found = tuple(matrix.shape) if isinstance(matrix, Tensor) else type(matrix).__name__
        raise ValueError(f"matrix must be [K, P] (one task gradient per row), got {found}")
    return overflow_safe_norm(matrix, norm_type, dim=1)


def clip_task_norms_(matrix: Tensor, max_norm: float | Tensor, norm_type: float = 2.0,
                     error_if_nonfinite: bool = False) -> Tensor:
    """Clip every row of ``matrix`` ``[K, P]`` in place to norm ``max_norm``; return pre-clip norms.

    ``gₖ ← gₖ · min(1, max_norm / (‖gₖ‖ + 1e-6))``. ``max_norm`` may be a float or a ``[K]``
    tensor (one limit per task). Rows with a non-finite norm are left as they are (the step
    is skipped anyway) unless ``error_if_nonfinite`` raises.

    Example:
        >>> import torch
        >>> from gradbalance.functional import clip_task_norms_
        >>> G = torch.tensor([[30.0, 40.0], [0.3, 0.4]])
        >>> clip_task_norms_(G, max_norm=1.0)
        tensor([50.0000,  0.5000])
        >>> G
        tensor([[0.6000, 0.8000],
                [0.3000, 0.4000]])
    """
    check_writable_rows("matrix", matrix)
    if isinstance(max_norm, Tensor):
        _check_limits(max_norm, matrix.shape[0])
    else:
        check_positive("max_norm", max_norm)
    norm_type = check_norm_type("norm_type", norm_type)
    norms = row_norms(matrix, norm_type)
    coef = norm_clip_coefficients(norms, max_norm, error_if_nonfinite)
    matrix.mul_(factor_for(coef.unsqueeze(1), matrix))
    return norms


def _check_limits(max_norm: Tensor, k: int) -> None:
    """A tensor ``max_norm``: one finite limit ``> 0``, or one per row (``[K]``)."""
    if max_norm.dim() > 1 or (max_norm.dim() == 1 and max_norm.numel() != k):
        raise ValueError(f"Invalid max_norm: shape {tuple(max_norm.shape)} (expected a number "
                         f"or one limit per task row, [K] = [{k}])")
    if max_norm.is_complex() or not bool((torch.isfinite(max_norm) & (max_norm > 0)).all()):
        raise ValueError(f"Invalid max_norm: {max_norm.tolist()} (expected finite limits > 0)")


def norm_clip_coefficients(norms: Tensor, max_norm: float | Tensor,
                           error_if_nonfinite: bool = False) -> Tensor:
    """``min(1, max_norm / (‖gₖ‖ + 1e-6))`` per row ``[K]`` (float32 at least); 1 where a norm
    is not finite."""
    finite = torch.isfinite(norms)
    if error_if_nonfinite and not bool(finite.all()):
        raise NonFiniteGradientError(
            f"matrix holds inf or NaN (pre-clip norms {norms.tolist()}); nothing was clipped. "
            f"Skip this step, or pass error_if_nonfinite=False to return the norms instead"
        )
    norms = norms.to(torch.promote_types(norms.dtype, torch.float32))  # 16-bit: no underflow
    limit = max_norm.to(norms) if isinstance(max_norm, Tensor) else max_norm
    coef = (limit / (norms + _EPS)).clamp(max=1.0)
    return torch.where(finite, coef, torch.ones_like(coef))


def clip_task_values_(matrix: Tensor, clip_value: float) -> Tensor:
    """Clamp every entry of ``matrix`` ``[K, P]`` to ``[-clip_value, clip_value]`` in place.

    Returns the pre-clip 2-norms of the rows ``[K]``; unlike norm clipping, it can turn a row.

    Example:
        >>> import torch
        >>> from gradbalance.functional import clip_task_values_
        >>> G = torch.tensor([[30.0, 40.0], [0.3, -0.4]])
        >>> clip_task_values_(G, clip_value=5.0), G  # row 0 turns to [5, 5]
        (tensor([50.0000,  0.5000]), tensor([[ 5.0000,  5.0000],
                [ 0.3000, -0.4000]]))
    """
    check_writable_rows("matrix", matrix)
    check_positive("clip_value", clip_value)
    norms = row_norms(matrix)
    matrix.clamp_(-clip_value, clip_value)
    return norms


class _Stateless:
    """state_dict/load_state_dict/reset for a clipper whose settings are all it holds."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_dict(type(self).__name__, state_dict)
        reject_state(type(self).__name__, state_dict, "clipper")

    def reset(self) -> None:
        """Nothing to forget."""


class TaskClip(_Stateless):
    """Per-task norm clipping of the rows of ``G``: a ``RowClipper`` for ``apply_(clip=...)``.

    Args:
        max_norm: the cap on each task gradient's norm (true, unscaled units under AMP).
        norm_type: the p of the p-norm (``float('inf')`` allowed).
        error_if_nonfinite: raise instead of leaving a non-finite row unclipped.

    Example:
        >>> import torch
        >>> from gradbalance import TaskClip, balanced_backward
        >>> from gradbalance.balancers import Sum
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> losses = [w @ torch.tensor([30.0, 40.0]), w @ torch.tensor([0.3, 0.4])]
        >>> stats = balanced_backward(losses, Sum(), shared_params=[w], clip=TaskClip(max_norm=1.0))
        >>> stats.pre_clip_norms  # per-task norms before clipping
        tensor([50.0000,  0.5000])
        >>> w.grad  # the clipped rows [0.6, 0.8] and [0.3, 0.4], summed
        tensor([0.9000, 1.2000])
    """

    def __init__(self, max_norm: float, norm_type: float = 2.0,
                 error_if_nonfinite: bool = False) -> None:
        self.max_norm = check_positive("max_norm", max_norm)
        self.norm_type = check_norm_type("norm_type", norm_type)
        self.error_if_nonfinite = check_bool("error_if_nonfinite", error_if_nonfinite)

    def __call__(self, matrix: Tensor) -> Tensor:
        return clip_task_norms_(matrix, self.max_norm, self.norm_type, self.error_if_nonfinite)

    def coefficients(self, norms: Tensor) -> Tensor:
        """The factor ``cₖ`` each row is multiplied by, from its pre-clip norm ``[K]``."""
        return norm_clip_coefficients(norms, self.max_norm, self.error_if_nonfinite)

    def __repr__(self) -> str:
        return f"TaskClip(max_norm={self.max_norm}, norm_type={self.norm_type})"


class TaskValueClip(_Stateless):
    """Per-value clipping of the rows of ``G`` (a ``RowClipper``); returns pre-clip row norms.

    Example:
        >>> import torch
        >>> from gradbalance import TaskValueClip, balanced_backward
        >>> from gradbalance.balancers import Sum
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> losses = [w @ torch.tensor([30.0, -40.0]), w @ torch.tensor([0.3, 0.4])]
        >>> _ = balanced_backward(losses, Sum(), shared_params=[w], clip=TaskValueClip(5.0))
        >>> w.grad  # the clamped rows [5, -5] and [0.3, 0.4], summed
        tensor([ 5.3000, -4.6000])
    """

    def __init__(self, clip_value: float) -> None:
        self.clip_value = check_positive("clip_value", clip_value)

    def __call__(self, matrix: Tensor) -> Tensor:
        return clip_task_values_(matrix, self.clip_value)

    def __repr__(self) -> str:
        return f"TaskValueClip(clip_value={self.clip_value})"
