"""Gradient clipping for the balanced step (``docs/loop.md``, clipping).

* Per task, on the rows of ``G`` before the combine (``RowClipper`` objects for
  ``TaskGradBuffer.apply_(clip=...)``): :class:`TaskClip` (norm), :class:`TaskValueClip`
  (value), :class:`TaskAutoClip` (adaptive percentile); functional :func:`clip_task_norms_`,
  :func:`clip_task_values_`.
* On parameters, in the user's loop after ``apply_`` (and ``scaler.unscale_``):
  :class:`AutoClip` (adaptive percentile, Seetharaman et al. 2020), :class:`AGC` /
  :func:`adaptive_clip_grad_` (unit-wise, Brock et al. 2021). Global clipping stays
  ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``.
* Per sample, before the batch mean (DP-SGD's clip, Abadi et al. 2016):
  :class:`PerSampleClip` turns ``[B, K]`` per-sample losses into task losses whose gradient
  is the per-sample-clipped mean, for the ordinary step; :func:`per_sample_grad_norms` (any
  graph), :func:`per_sample_grad_norms_of_model` (from the model via torch.func, linear in
  the batch) and :class:`GhostNorms` (ghost norms of linear, conv, LayerNorm and embedding layers).
* :func:`suggest_max_norm`: a limit from logged pre-clip norms (90th–95th percentile rule).

Every clip works in place and returns the pre-clip norm(s) for logging.
"""

from __future__ import annotations

from ._agc import AGC, adaptive_clip_grad_, unitwise_norm
from ._auto import AutoClip, TaskAutoClip, suggest_max_norm
from ._per_sample import PerSampleClip
from ._per_sample_func import per_sample_grad_norms_of_model
from ._per_sample_ghost import GhostNorms
from ._per_sample_graph import per_sample_grad_norms
from ._protocol import RowClipper
from ._task import TaskClip, TaskValueClip, clip_task_norms_, clip_task_values_, row_norms

__all__ = [
    "AGC",
    "AutoClip",
    "GhostNorms",
    "PerSampleClip",
    "RowClipper",
    "TaskAutoClip",
    "TaskClip",
    "TaskValueClip",
    "adaptive_clip_grad_",
    "clip_task_norms_",
    "clip_task_values_",
    "per_sample_grad_norms",
    "per_sample_grad_norms_of_model",
    "row_norms",
    "suggest_max_norm",
    "unitwise_norm",
]
