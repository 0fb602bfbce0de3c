"""``StepStats``: what one balanced step is worth logging, returned, never printed.

Fields are tensors on the gradients' device (no host sync until read), except flags and counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ._shard import Shard
from .gramian import cosine_matrix

__all__ = ["StepStats", "build_stats", "stats_from_gramian", "summed_tasks"]


@dataclass
class StepStats:
    """Per-step diagnostics of a balanced step (docs/loop.md, "Logging").

    In ``features`` mode the norms and cosines are those of the gradients w.r.t. the shared
    representation; on a step that reuses cached weights (``update_every``) ``task_norms``,
    ``cosine``, ``cosine_to_update`` and ``update_norm`` are None.

    Attributes:
        losses: raw, unweighted task losses ``[K]`` (summed over the micro-batches).
        task_norms: true (unscaled) task-gradient norms ``[K]`` over the shared parameters.
        cosine: pairwise cosine similarities of the task gradients ``[K, K]``.
        cosine_to_update: cosine of each task gradient with the combined gradient ``[K]``.
        update_norm: norm of the combined gradient written into the trunk (0-d).
        weights: the balancer's task weights ``[K]`` when it is a weighted method, else None.
        found_inf: the task gradients held inf/NaN; the balancer was not called and a
            ``GradScaler`` will skip the optimizer step.
        loss_scale_tensor: the ``GradScaler`` scale used for the step (0-d), None without one;
            :attr:`loss_scale` is its value as a float.
        pre_clip_norms: per-task norms before per-task clipping ``[K]``, when a clip ran.
        num_backward: number of ``backward`` calls (micro-batches) accumulated.
        mode: the gradient mode that produced the step (``"matrix"``, ``"gramian"``,
            ``"features"``).
        weights_reused: the step reused the cached weights of ``update_every``.
        route: in ``auto`` mode, the exact route the step took (``"matrix"`` or
            ``"gramian"``); None in the other modes and on reused-weight steps.
        per_task: with ``batch_dim=0`` (``mode="per_sample"``; docs/per_sample.md), the
            same statistics of the K summed tasks ``Lₖ = Σᵢ ℓᵢₖ`` (K = 1 for ``[B]``
            losses): ``losses`` the ``Lₖ``, ``task_norms`` ``‖∇Lₖ‖``, ``cosine`` and
            ``cosine_to_update`` of the ``∇Lₖ``, ``weights`` the weight sums ``Σᵢ wᵢₖ``;
            what the loggers write for such a step. None on the other routes.

    Example:
        >>> import torch
        >>> from gradbalance import balanced_backward
        >>> from gradbalance.balancers import Sum
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> losses = [w @ torch.tensor([3.0, 4.0]), w @ torch.tensor([0.0, 2.0])]
        >>> stats = balanced_backward(losses, Sum(), shared_params=[w])
        >>> stats.num_tasks, stats.task_norms, stats.cosine[0, 1]  # cosine 8 / (5 * 2)
        (2, tensor([5., 2.], dtype=torch.float64), tensor(0.8000, dtype=torch.float64))
    """

    losses: Tensor
    task_norms: Tensor | None
    cosine: Tensor | None
    cosine_to_update: Tensor | None
    update_norm: Tensor | None
    weights: Tensor | None = None
    found_inf: bool = False
    loss_scale_tensor: Tensor | None = None
    pre_clip_norms: Tensor | None = None
    num_backward: int = 1
    mode: str = "matrix"
    weights_reused: bool = False
    route: str | None = None
    per_task: StepStats | None = None

    @property
    def num_tasks(self) -> int:
        return int(self.losses.shape[0])

    @property
    def loss_scale(self) -> float | None:
        """The ``GradScaler`` scale used for the step, or None without one (reads the tensor)."""
        return None if self.loss_scale_tensor is None else float(self.loss_scale_tensor)


def stats_from_gramian(
    gram: Tensor,
    matrix: Tensor | None,
    update: Tensor | None,
    weights: Tensor | None,
    shard: Shard | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(task_norms, cosine, cosine_to_update, update_norm)`` in float64: O(K²) from weights
    (``G g = (G Gᵀ) w``), else one ``G g`` over the matrix (a rank's columns, summed, with
    ``shard``)."""
    norms = torch.diagonal(gram).clamp_min(0).sqrt()
    cosine = cosine_matrix(gram)
    if weights is not None:
        w = weights.to(dtype=gram.dtype, device=gram.device)
        dots = gram @ w
        update_norm = (w @ dots).clamp_min(0).sqrt()
    elif shard is None:
        assert matrix is not None and update is not None
        dots = (matrix @ update).to(torch.float64)
        update_norm = update.to(torch.float64).norm()
    else:
        assert matrix is not None and update is not None
        total = shard.sum(torch.cat([(matrix @ update).to(torch.float64),
                                     update.to(torch.float64).pow(2).sum().reshape(1)]))
        dots, update_norm = total[:-1], total[-1].clamp_min(0).sqrt()
    denom = norms * update_norm
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    cos_update = torch.where(denom > 0, dots / safe, torch.zeros_like(dots))
    return norms, cosine, cos_update, update_norm


def build_stats(
    gram: Tensor,
    losses: Tensor,
    finite: bool,
    *,
    matrix: Tensor | None = None,
    update: Tensor | None = None,
    weights: Tensor | None = None,
    scale: Tensor | None = None,
    shard: Shard | None = None,
    **fields: Any,
) -> StepStats:
    """The :class:`StepStats` of a refresh step from its Gramian ``[K, K]`` (float64); on a
    non-finite step the norms are the Gramian's, the cosines and update norm NaN, no weights."""
    if finite:
        norms, cosine, cos_update, update_norm = stats_from_gramian(
            gram, matrix, update, weights, shard
        )
    else:
        k = gram.shape[0]
        nan = torch.full((k,), float("nan"), dtype=torch.float64, device=gram.device)
        norms = torch.diagonal(gram).sqrt()
        cosine, cos_update, update_norm, weights = nan[:, None] * nan, nan, nan[0], None
    return StepStats(
        losses=losses, task_norms=norms, cosine=cosine, cosine_to_update=cos_update,
        update_norm=update_norm, weights=weights, found_inf=not finite,
        loss_scale_tensor=scale, **fields,
    )


def summed_tasks(stats: StepStats, gram: Tensor | None, tasks: int) -> StepStats:
    """The statistics of the ``tasks`` summed tasks ``Lₖ = Σᵢ ℓᵢₖ`` of a per-sample step
    whose objective ``j`` belongs to task ``j mod tasks``, from its Gramian ``[N, N]``
    (float64; None on a step that reused its weights: losses and weights only).
    ``∇Lₖ = Σᵢ ∇ℓᵢₖ``, so their Gramian is ``Sᵀ G S`` and their dots with the update
    ``Sᵀ G w`` (``S`` the ``[N, K]`` indicator of the tasks)."""
    n = stats.losses.shape[0]
    owner = torch.arange(n, device=stats.losses.device) % tasks
    select = (owner[:, None] == torch.arange(tasks, device=owner.device)).to(torch.float64)
    weights = None if stats.weights is None else (
        stats.weights.to(select) @ select).to(stats.weights.dtype)
    summary = StepStats(
        losses=stats.losses.reshape(-1, tasks).sum(0), task_norms=None, cosine=None,
        cosine_to_update=None, update_norm=stats.update_norm, weights=weights,
        found_inf=stats.found_inf, loss_scale_tensor=stats.loss_scale_tensor,
        num_backward=stats.num_backward, mode=stats.mode, weights_reused=stats.weights_reused,
    )
    if gram is None:
        return summary
    select = select.to(gram.device)
    task_gram = select.T @ gram @ select
    summary.task_norms = torch.diagonal(task_gram).clamp_min(0).sqrt()
    summary.cosine = cosine_matrix(task_gram)
    if stats.weights is not None and stats.update_norm is not None:
        dots = select.T @ (gram @ stats.weights.to(gram))
        denom = summary.task_norms * stats.update_norm.to(gram)
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        summary.cosine_to_update = torch.where(denom > 0, dots / safe, torch.zeros_like(dots))
    return summary
