"""Gradient clipping for the balanced step (``docs/loop.md``, "Clipping").

* Per task, on the rows of ``G`` before the combine (``RowClipper`` objects for
  ``TaskGradBuffer.apply_(clip=...)``): :class:`TaskClip`, :class:`TaskValueClip`,
  :class:`TaskAutoClip`.
* On parameters, after ``apply_`` (and ``scaler.unscale_``): :class:`AutoClip`, :class:`AGC`;
  global clipping stays ``torch.nn.utils.clip_grad_norm_``.
* Per sample, before the batch mean (DP-SGD): :class:`PerSampleClip`, with the per-sample
  norms of :func:`per_sample_grad_norms`, :func:`per_sample_grad_norms_of_model` or
  :class:`GhostNorms`.
* :func:`suggest_max_norm`: a limit from logged pre-clip norms.

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
