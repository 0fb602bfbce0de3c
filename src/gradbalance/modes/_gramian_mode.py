"""``gramian`` mode in the step: ``G Gᵀ`` from the recorder, weights, one weighted write-back.

The same update as ``matrix`` mode for every weighted balancer, without ever holding
``[K, P]`` (see :mod:`gradbalance.modes._gramian` for the block-wise engine). With a loss
scale ``s`` the Gramian of the scaled losses is divided by ``s²``; the write-back stays
scaled, as ``scaler.unscale_`` expects, and an overflow in a head alone also skips the
balancer. Under data parallelism the heads' ``.grad`` and the losses are averaged and the
recorder gives every rank the full batch's operands, so every rank writes the full-batch
update. A row clipper with a ``coefficients(norms)`` rule on 2-norms (``TaskClip``,
``TaskAutoClip``) acts on the Gramian: ``cᵢ cⱼ (G Gᵀ)ᵢⱼ`` for the balancer, ``w ⊙ c`` for the
write-back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..balancers._base import Balancer
from ..distributed import all_reduce_grads_and_losses_
from ..gramian import is_finite_gramian
from ..stats import StepStats, build_stats
from ..taskgrads import TaskRoots
from ._common import StepInput, grads_finite, heads_backward_, nonfinite_error
from ._gramian import GramianRecorder

__all__ = ["GramianMode"]


class GramianMode:
    """Forward hooks on the trunk (from construction on); one backward per step."""

    matrix: Tensor | None = None  # never a [K, P] matrix

    def __init__(self, modules: Any, shared: list[Tensor], head_params: list[Tensor],
                 batched: bool) -> None:
        if modules is None:
            raise ValueError(
                "mode='gramian' needs modules=...: the module(s) owning shared_params, "
                "e.g. TaskGradBuffer(..., mode='gramian', modules=model.trunk)"
            )
        self.recorder = GramianRecorder(modules, shared)
        self.head_params = head_params
        self.batched = batched

    def backward(self, roots: TaskRoots) -> None:
        heads_backward_(roots, self.head_params)
        self.recorder.task_passes(roots, self.batched)

    def apply(self, balancer: Balancer, step: StepInput) -> StepStats:
        if not balancer.from_gramian:
            self.recorder.clear()
            raise TypeError(
                f"{type(balancer).__name__} needs the task-gradient rows, not only the "
                f"Gramian; use mode='matrix' (or 'features')"
            )
        losses, scale = step.losses, step.scale
        try:
            if step.group is not None:
                losses = all_reduce_grads_and_losses_(self.head_params, losses, step.group)
                self.recorder.reduce_over_ranks(losses.shape[0], step.group)
            gram = self.recorder.gramian(losses.shape[0], losses.device)
            flag = is_finite_gramian(gram)
            if scale is not None:
                gram = gram / scale.double() ** 2
                if self.head_params:  # the scaler skips a step where a head overflowed
                    flag = flag & grads_finite(self.head_params)
            finite = bool(flag)  # host sync: the balancer must not see NaN
            pre_clip = coef = None
            if finite and step.clip is not None:  # row k scaled by cₖ: G Gᵀ by cᵢ cⱼ
                pre_clip = torch.diagonal(gram).clamp_min(0).sqrt()
                coef = step.clip.coefficients(pre_clip).to(torch.float64)  # type: ignore[attr-defined]
                gram = gram * coef[:, None] * coef[None, :]
            if finite:
                weights = balancer.weights_checked(gram, losses)
            elif scale is not None:  # the plain sum, non-finite: the scaler skips the step
                weights = torch.ones_like(losses, dtype=torch.float64)
            else:
                raise nonfinite_error()
            self.recorder.write_weighted_(weights if coef is None else weights * coef)
        finally:
            self.recorder.clear()
        return build_stats(gram, losses, finite, weights=weights, scale=scale,
                           pre_clip_norms=pre_clip, num_backward=step.count, mode="gramian")

    def clear(self) -> None:
        self.recorder.clear()
