"""One ``batch_dim=0`` step's update from its objectives: weights, clipping, ranks.

A refresh step takes the weights ``w`` from the per-sample Gramian ``G`` ``[N, N]``; a
2-norm row clipper's factors ``dᵢ = min(1, τ/‖gᵢ‖)`` (``D`` diagonal, ``‖gᵢ‖² = Gᵢᵢ``) act
exactly as ``D G D``, and the update is ``∇ Σᵢ wᵢ dᵢ ℓᵢ``: from the layers' kept operands
where the step has them (:mod:`._per_sample_update`), else one weighted backward per
micro-batch. A step between refreshes (``update_every``) reuses the last ``w`` and computes
no Gramian. Under a process group each rank balances its own objectives and the written
gradients are the ranks' mean (docs/per_sample.md, "Data parallelism").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ._amp import all_finite, finite_step, losses_finite, nonfinite_error, unscaled_gramian
from .balancers._base import Balancer
from .clip._checks import check_row_clipper
from .clip._protocol import scales_whole_rows
from .distributed import RankAgreementError, all_ranks_true, all_reduce_mean_
from .gramian import products_rounding
from .modes._amortize import WeightCache
from .stats import StepStats, build_stats, summed_tasks

__all__ = ["PerSampleStep", "Update", "check_gramian_clip", "check_reused_count",
           "refreshed_update", "reused_update"]


@dataclass(frozen=True)
class PerSampleStep:
    """A step's micro-batches (losses with their graphs), the heads' plain gradients, the
    parameters, the loss scale, the number of task columns K and, where the layers' operands
    were kept, the trunk's weighted update from them (``w ↦ s·∇ Σ wᵢₖ ℓᵢₖ``, no backward)."""

    losses: list[Tensor]
    heads: list[Tensor | None]
    shared: list[Tensor]
    head_params: list[Tensor]
    scale: Tensor | None
    tasks: int
    direct: Callable[[Tensor], list[Tensor | None]] | None = None

    @property
    def flat(self) -> Tensor:
        return torch.cat([v.detach().reshape(-1) for v in self.losses])


@dataclass(frozen=True)
class Update:
    """What a step writes (the ranks' mean under a process group) and its statistics."""

    trunk: list[Tensor | None]  # None: a parameter no loss reached (its .grad untouched)
    heads: list[Tensor | None]
    finite: bool
    stats: StepStats
    #: The trunk's tensors are the step's own (from the kept operands): ``.grad`` may take
    #: them without a copy, as a plain backward's accumulation takes its result.
    owned: bool = False


def check_gramian_clip(clip: Any) -> None:
    """None, or a row clipper that scales whole rows by 2-norm (else ``ValueError`` naming
    the ones that work and the alternatives)."""
    if clip is not None and not scales_whole_rows(clip):
        raise ValueError(
            f"clip={clip!r} is not available with batch_dim=0: only a 2-norm clipper that "
            f"scales whole rows (TaskClip, TaskAutoClip with norm_type=2) acts through the "
            f"per-sample Gramian (as D G D); clip the update with "
            f"torch.nn.utils.clip_grad_norm_ after apply_(), or the per-sample gradients "
            f"before the mean with gradbalance.clip.PerSampleClip"
        )
    check_row_clipper("clip", clip)


def check_reused_count(cache: WeightCache, count: int) -> None:
    """A reused step has as many objectives as the cached weights (else ``ValueError``)."""
    assert cache.weights is not None
    if cache.weights.shape[0] != count:
        raise ValueError(
            f"update_every={cache.update_every} reuses the {cache.weights.shape[0]} weights "
            f"of the last refresh step, but this step has {count} objectives (B x K): keep "
            f"the batch size fixed (drop_last=True), or call reset() and run the step again "
            f"(it then recomputes the weights)"
        )


def refreshed_update(step: PerSampleStep, scaled_gram: Tensor, balancer: Balancer,
                     clip: Any, group: Any) -> Update:
    """A refresh step: the Gramian (unscaled, clipped), the weights, the update."""
    gram = unscaled_gramian(step.scale, gramian=scaled_gram)
    flat = step.flat
    finite = finite_step(gram, step.scale, [], group, step.flat)
    pre_clip = coef = weights = None
    if finite and clip is not None:  # row i scaled by dᵢ: G by dᵢ dⱼ
        pre_clip = torch.diagonal(gram).clamp_min(0).sqrt()
        coef = clip.coefficients(pre_clip).to(torch.float64)
        gram = gram * coef[:, None] * coef[None, :]
    trunk: list[Tensor | None]
    if finite:
        weights = _agreed_weights(lambda: balancer.compute_weights(
            gram, flat, rounding=products_rounding(step.shared)), group)
        applied = weights if coef is None else weights * coef
        trunk = weighted_grads(step, applied)
    else:  # a skipped step (found_inf): zeros
        trunk = [torch.zeros_like(p) for p in step.shared]
    trunk, heads, finite = _mean_over_ranks(step, trunk, finite, group)
    if not finite and step.scale is None:
        raise nonfinite_error()
    stats = build_stats(gram, flat, finite, weights=weights, scale=step.scale,
                        pre_clip_norms=pre_clip, mode="per_sample",
                        num_backward=len(step.losses))
    stats.per_task = summed_tasks(stats, gram, step.tasks)
    return Update(trunk, heads, finite, stats, owned=step.direct is not None)


def _agreed_weights(compute: Callable[[], Tensor], group: Any) -> Tensor:
    """``compute()``'s weights, its success agreed over ``group`` first (one all-reduce): each
    rank balances its own samples, so a solver may fail on one rank only; the others then
    raise :class:`~gradbalance.distributed.RankAgreementError` at once instead of waiting for
    its update in the reduction until the group's timeout."""
    if group is None:
        return compute()
    try:
        weights = compute()
    except BaseException:
        all_ranks_true(torch.zeros((), dtype=torch.bool), group)  # tell the others, then raise
        raise
    if not bool(all_ranks_true(torch.ones((), dtype=torch.bool), group)):
        raise RankAgreementError(
            "TaskGradBuffer.apply_(): the balancer raised on another rank (each rank balances "
            "its own samples with batch_dim=0); the step was dropped on every rank, nothing "
            "was reduced or written: drop the batch on every rank, as that rank does")
    return weights


def reused_update(step: PerSampleStep, cache: WeightCache, balancer: Balancer,
                  group: Any) -> Update:
    """A step between refreshes: the cached weights, one weighted backward, no Gramian."""
    assert cache.weights is not None
    trunk = weighted_grads(step, cache.weights)
    trunk, heads, finite = _mean_over_ranks(step, trunk, losses_finite(step.flat, group), group)
    if not finite and step.scale is None:
        raise nonfinite_error()
    stats = StepStats(losses=step.flat, task_norms=None, cosine=None, cosine_to_update=None,
                      update_norm=None, weights=cache.weights, found_inf=not finite,
                      loss_scale_tensor=step.scale, num_backward=len(step.losses),
                      mode="per_sample", weights_reused=True)
    stats.per_task = summed_tasks(stats, None, step.tasks)
    return Update(trunk, heads, finite, stats, owned=step.direct is not None)


def weighted_grads(step: PerSampleStep, weights: Tensor) -> list[Tensor | None]:
    """``s·∇ Σ wᵢₖ ℓᵢₖ`` of the trunk (``s`` the loss scale, 1 without): from the layers'
    kept operands where ``step.direct`` is set, else one backward per micro-batch (its graph
    freed); None for a parameter no loss reaches, whose ``.grad`` a plain backward leaves
    alone too."""
    if step.direct is not None:
        return step.direct(weights)
    w = weights if step.scale is None else weights * step.scale.double()
    total: list[Tensor | None] = [None] * len(step.shared)
    at = 0
    for losses in step.losses:
        part = w[at: at + losses.numel()].reshape(losses.shape).to(losses)
        at += losses.numel()
        grads = torch.autograd.grad(losses, step.shared, part, allow_unused=True)
        total = [t if g is None else g if t is None else t + g for t, g in zip(total, grads)]
    return total


def _mean_over_ranks(step: PerSampleStep, trunk: list[Tensor | None], finite: bool,
                     group: Any) -> tuple[list[Tensor | None], list[Tensor | None], bool]:
    """The trunk's update and the heads' gradients averaged over ``group``'s ranks (every
    trunk parameter and head written, zeros where this rank's losses did not reach it), and
    whether the step is finite (the trunk's update and the heads' gradients): on every rank
    alike, since the mean of a non-finite entry is not finite. A step all ranks skip
    (``finite`` False, agreed) is not reduced."""
    heads = list(step.heads)
    if group is not None and finite:
        trunk, heads = _zeros_for_none(step.shared, trunk), _zeros_for_none(step.head_params,
                                                                             heads)
        all_reduce_mean_([g for g in [*trunk, *heads] if g is not None], group)
    if finite:  # the heads' too: an overflow in a head alone is a skipped step
        finite = all_finite([g for g in [*trunk, *heads] if g is not None])
    return trunk, heads, finite


def _zeros_for_none(params: list[Tensor], grads: list[Tensor | None]) -> list[Tensor | None]:
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
