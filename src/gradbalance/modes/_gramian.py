"""``gramian`` mode: ``G Gᵀ = Σ_b G_b G_bᵀ`` block by block, each linear layer by its cheaper
route (activations or rows), then one weighted write-back (docs/performance.md, "Modes").

Reference: Quinton & Rey, "Jacobian Descent for Multi-Objective Optimization" (2024), §6.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from .._amp import finite_step, nonfinite_error, unscaled_gramian
from .._checks import check_int
from ..balancers._base import Balancer
from ..clip._protocol import RowClipper, scales_whole_rows
from ..distributed import all_reduce_grads_and_losses_
from ..gramian import products_rounding
from ..stats import StepStats, build_stats
from ..taskgrads import Concrete, ParamLayout, Passes, TaskRoots, kept_passes
from ._engine import StepInput, commit, heads_backward_, reject_features, settle
from ._recorder import GramianRecorder

__all__ = ["GramianMode"]


class GramianMode:
    """``matrix`` mode's update for weighted balancers from ``G Gᵀ``; a 2-norm row clipper
    acts as ``cᵢ cⱼ (G Gᵀ)ᵢⱼ`` and ``w ⊙ c``."""

    mode: ClassVar[str] = "gramian"
    hooks_forward: ClassVar[bool] = True
    matrix: Tensor | None = None  # never a [K, P] matrix

    def __init__(self, layout: ParamLayout, head_params: list[Tensor], passes: Passes,
                 modules: Any = None) -> None:
        if modules is None:
            raise ValueError(
                "mode='gramian' needs modules=...: the module(s) owning shared_params, "
                "e.g. TaskGradBuffer(..., mode='gramian', modules=model.trunk)"
            )
        self.recorder = GramianRecorder(modules, layout.params)
        self.head_params = head_params
        self.passes: Passes = passes  # resolved by device, not measured
        self.chosen: Concrete | None = None
        self._micro = 0  # micro-batches of the step so far
        # Batched passes asked for by name are contracted inside the backward (the forwards
        # keep every call); ``auto`` contracts where its rule says so (``_routes.py``,
        # docs/performance.md, "Modes"); the loop never.
        self.recorder.contract = passes != "loop"
        self.recorder.by_name = passes == "batched"

    @property
    def layer_routes(self) -> dict[str, str]:
        """Each linear layer's route in the current (or last) step, by module name."""
        return self.recorder.routes

    def check_backward(self, features: Tensor | None, count: int, reused: bool) -> None:
        reject_features(self.mode, features)
        if count > 0 and not reused:  # the routes are the step's first micro-batch's
            self.recorder.check_later_micro_batch()

    def backward(self, roots: TaskRoots, first: bool, features: Tensor | None = None) -> None:
        heads = heads_backward_(roots, self.head_params)
        self._micro = 1 if first else self._micro + 1
        used = self.recorder.task_passes(roots, self.passes, first, self._micro, self.chosen)
        heads.accumulate_()
        if self.recorder.contracted is None:  # a contracted step leaves the choice as it was
            self.chosen = kept_passes(self.passes, self.recorder.device, self.chosen, used)

    def check_apply(self, balancer: Balancer, clip: RowClipper | None) -> None:
        if not balancer.from_gramian:
            raise TypeError(
                f"{type(balancer).__name__} needs the task-gradient rows, not only the "
                f"Gramian; use mode='matrix' (or 'features')"
            )
        if clip is not None and not scales_whole_rows(clip):
            raise ValueError(
                f"clip={clip!r} needs the task-gradient rows; mode='gramian' applies only "
                f"2-norm clipping that scales whole rows (TaskClip, TaskAutoClip with "
                f"norm_type=2) to the Gramian; use one of those or mode='matrix'"
            )

    def apply(self, balancer: Balancer, step: StepInput) -> StepStats:
        losses, scale = step.losses, step.scale
        try:
            if step.group is not None:
                losses = all_reduce_grads_and_losses_(self.head_params, losses, step.group)
                self.recorder.reduce_over_ranks(losses.shape[0], step.group)
            gram = unscaled_gramian(scale, gramian=self.recorder.gramian(losses.shape[0],
                                                                         losses.device))
            finite = finite_step(gram, scale, self.head_params, step.group, losses)
            pre_clip = coef = None
            if finite and step.clip is not None:  # row k scaled by cₖ: G Gᵀ by cᵢ cⱼ
                pre_clip = torch.diagonal(gram).clamp_min(0).sqrt()
                # coefficients() is optional on RowClipper; check_apply made sure it is here
                coef = step.clip.coefficients(  # type: ignore[attr-defined]  # optional method
                    pre_clip).to(torch.float64)
                gram = gram * coef[:, None] * coef[None, :]
            if finite:
                weights = balancer.compute_weights(
                    gram, losses, rounding=products_rounding(self.recorder.params))
            elif scale is not None:  # the plain sum, non-finite: the scaler skips the step
                weights = torch.ones_like(losses, dtype=torch.float64)
            else:
                raise nonfinite_error()
            update = self.recorder.weighted_update(weights if coef is None else weights * coef)
            finite = settle(update, step, finite)
            stats = build_stats(gram, losses, finite, weights=weights, scale=scale,
                                pre_clip_norms=pre_clip, num_backward=step.count,
                                mode=self.mode)
        finally:
            self.recorder.clear()
        commit(update, self.head_params, finite)
        return stats

    def clear(self) -> None:
        self.recorder.clear()

    def state_dict(self) -> dict[str, Any]:
        """The last step's K (``"gramian_tasks"``), which the next forwards use."""
        tasks = self.recorder.num_tasks
        return {} if tasks is None else {"gramian_tasks": tasks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a saved ``passes`` choice is ignored)."""
        self.recorder.num_tasks = load_tasks(state_dict)


def load_tasks(state_dict: dict[str, Any]) -> int | None:
    """The saved ``"gramian_tasks"`` (None where absent), checked."""
    tasks = state_dict.get("gramian_tasks")
    if tasks is not None:
        check_int("state_dict['gramian_tasks']", tasks, 1,
                  "; pass the output of TaskGradBuffer.state_dict()")
    return tasks
