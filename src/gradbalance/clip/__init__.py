"""Gradient clipping for the balanced step: per task on the rows of ``G`` (``RowClipper``
objects), on the parameters after ``apply_``, and per sample (DP-SGD); every clip works in
place and returns the pre-clip norm(s) (docs/loop.md, "Clipping")."""

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
