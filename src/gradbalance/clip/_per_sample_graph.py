"""Per-sample gradient norms from any graph: batched backwards of one-hot cotangent rows,
one per (sample, task), with a loop fallback; the cost grows with B² (docs/loop.md,
"Per-sample clipping")."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._batching import raised_by_model
from .._checks import (
    as_parameter_list,
    check_bool,
    check_loss_scale,
    check_norm_type,
    check_optional_int,
)

__all__ = ["batched_norms", "per_sample_grad_norms"]

#: Default memory budget of one batched backward: rows x (parameters + losses), 2^26 entries
#: (≈ 256 MiB in fp32).
_CHUNK_ELEMENTS = 1 << 26


def _check_losses(per_sample_losses: Any) -> Tensor:
    if not isinstance(per_sample_losses, Tensor) or per_sample_losses.dim() not in (1, 2):
        found = (tuple(per_sample_losses.shape) if isinstance(per_sample_losses, Tensor)
                 else type(per_sample_losses).__name__)
        raise ValueError(
            f"per_sample_losses must be a [B] or [B, K] tensor of per-sample losses, got "
            f"{found}; compute the loss with reduction='none' (and torch.stack the K tasks "
            f"along dim 1)"
        )
    if per_sample_losses.numel() == 0:
        raise ValueError("per_sample_losses is empty; pass at least one sample")
    if not per_sample_losses.requires_grad:
        raise ValueError(
            "per_sample_losses does not require grad; compute it from the model's output in "
            "this step (not under torch.no_grad() and not detached)"
        )
    return per_sample_losses


def _cotangents(rows: range, shape: torch.Size, joint: bool, value: float | Tensor,
                like: Tensor) -> Tensor:
    """One cotangent per row: a one at ``(i, k)``, or ones on sample i's tasks (``joint``)."""
    out = torch.zeros(len(rows), *shape, dtype=like.dtype, device=like.device)
    flat = out.view(len(rows), shape[0], -1)
    index = torch.arange(len(rows), device=like.device)
    picks = torch.tensor(list(rows), device=like.device)
    if joint:
        flat[index, picks] = 1.0
    else:
        flat.view(len(rows), -1)[index, picks] = 1.0
    return out * value


def batched_norms(grads: Sequence[Tensor | None], rows: int, norm_type: float,
                  like: Tensor) -> Tensor:
    """Norm of each row's gradient over all parameters ``[rows, ...]`` each (None: unused), in
    float32 at least (fp16 overflows)."""
    parts = [torch.linalg.vector_norm(g.reshape(rows, -1), norm_type, dim=1,
                                      dtype=torch.promote_types(g.dtype, torch.float32))
             for g in grads if g is not None]
    if not parts:
        return torch.zeros(rows, dtype=torch.promote_types(like.dtype, torch.float32),
                           device=like.device)
    norms: Tensor = torch.linalg.vector_norm(torch.stack(parts, dim=1), norm_type, dim=1)
    return norms


def _norms_of_rows(losses: Tensor, params: list[Tensor], rows: range, joint: bool,
                   norm_type: float, scale: float | Tensor) -> Tensor:
    cot = _cotangents(rows, losses.shape, joint, scale, losses)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*performance drop.*")
            grads = torch.autograd.grad(losses, params, cot, retain_graph=True,
                                        is_grads_batched=True, allow_unused=True)
        return batched_norms(grads, len(rows), norm_type, losses)
    except RuntimeError as error:  # no batching rule: the loop; a hook's own error raises
        if raised_by_model(error):
            raise
        warnings.warn(
            f"batched per-sample gradients unsupported by this model ({str(error)[:120]}); "
            f"falling back to one autograd.grad per sample",
            RuntimeWarning,
            stacklevel=4,
        )
    return torch.cat([
        batched_norms([None if g is None else g.unsqueeze(0) for g in torch.autograd.grad(
            losses, params, cot[r], retain_graph=True, allow_unused=True)], 1, norm_type, losses)
        for r in range(len(rows))
    ])


def per_sample_grad_norms(
    per_sample_losses: Tensor,
    params: Iterable[Tensor],
    *,
    norm_type: float = 2.0,
    per_task: bool = True,
    chunk_size: int | None = None,
    scale: float | Tensor = 1.0,
) -> Tensor:
    """Norms of the per-sample gradients over ``params``, leaving ``.grad`` alone.

    ``per_sample_losses`` ``[B]`` or ``[B, K]`` (``reduction='none'``). Returns ``‖∇ℓᵢₖ‖``
    with the losses' shape (``per_task=True``) or ``‖∇Σₖ ℓᵢₖ‖`` ``[B]`` (``per_task=False``).
    The graph is kept. ``chunk_size`` rows per batched backward (default: as many as fit
    2^26 entries of gradients and cotangents); ``scale``: differentiate ``scale·ℓ`` and
    divide the norms by it (a loss scale keeps fp16 backward from underflowing).

    Example:
        >>> import torch
        >>> from gradbalance.clip import per_sample_grad_norms
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> x = torch.tensor([[3.0, 4.0], [0.0, 2.0]])  # sample i's loss x_i · w, gradient x_i
        >>> per_sample_grad_norms(x @ w, [w])
        tensor([5., 2.])
    """
    losses = _check_losses(per_sample_losses)
    plist = as_parameter_list("params", params)
    scale = check_loss_scale("scale", scale)
    norm_type = check_norm_type("norm_type", norm_type)
    chunk_size = check_optional_int("chunk_size", chunk_size, 1)
    joint = not check_bool("per_task", per_task) and losses.dim() == 2
    total = losses.shape[0] if joint else losses.numel()
    if chunk_size is None:  # a row costs its gradients (P) and its cotangent (B·K)
        per_row = sum(p.numel() for p in plist) + losses.numel()
        chunk_size = max(1, min(total, _CHUNK_ELEMENTS // per_row))
    norms = torch.cat([
        _norms_of_rows(losses, plist, range(start, min(start + chunk_size, total)), joint,
                       norm_type, scale)
        for start in range(0, total, chunk_size)
    ])
    norms = norms / (scale.detach().to(norms.dtype) if isinstance(scale, Tensor) else scale)
    return norms if joint else norms.view(losses.shape)
