"""gradbalance: balance the task gradients of a multitask PyTorch model in your own loop.

The top level holds what a training loop uses (the step, the base classes, the registries,
the everyday clippers, logging, checkpoints, the data-parallel helpers); the methods live in
:mod:`gradbalance.balancers` and :mod:`gradbalance.weighting`, every clipper in
:mod:`gradbalance.clip`, the pure kernels in :mod:`gradbalance.functional`.

Example:
    >>> import torch
    >>> import gradbalance
    >>> from gradbalance.balancers import PCGrad
    >>> trunk, heads = torch.nn.Linear(4, 3), torch.nn.ModuleList(
    ...     [torch.nn.Linear(3, 1) for _ in range(2)])
    >>> x, y = torch.randn(8, 4), torch.randn(8, 2)
    >>> feats = trunk(x)
    >>> losses = torch.stack([((h(feats)[:, 0] - y[:, k]) ** 2).mean()
    ...                       for k, h in enumerate(heads)])
    >>> stats = gradbalance.balanced_backward(
    ...     losses, PCGrad(), shared_params=trunk.parameters(), head_params=heads.parameters())
    >>> tuple(stats.task_norms.shape), trunk.weight.grad is not None
    ((2,), True)
"""

from __future__ import annotations

from . import balancers, clip, distributed, functional, modes, weighting
from ._types import NonFiniteGradientError
from ._version import __version__
from .balancers import BALANCERS, Balancer, Combination, SolverError, get_balancer
from .checkpoint import capture_state, load_checkpoint, restore_state, save_checkpoint
from .clip import AGC, AutoClip, RowClipper, TaskAutoClip, TaskClip, TaskValueClip
from .distributed import (
    assert_same_across_ranks,
    broadcast_generator_,
    broadcast_parameters_,
    ddp_no_sync,
    sync_weighting_,
)
from .monitor import CSVLogger, RunningStats, log_stats, stats_to_dict, summary_writer
from .stats import StepStats
from .step import TaskGradBuffer, balanced_backward
from .taskgrads import task_gradients
from .weighting import WEIGHTINGS, LossWeighting, get_weighting

__all__ = [
    "AGC", "BALANCERS", "WEIGHTINGS", "AutoClip", "Balancer", "CSVLogger", "Combination",
    "LossWeighting", "NonFiniteGradientError", "RowClipper", "RunningStats", "SolverError",
    "StepStats", "TaskAutoClip", "TaskClip", "TaskGradBuffer", "TaskValueClip", "__version__",
    "assert_same_across_ranks", "balanced_backward", "balancers", "broadcast_generator_",
    "broadcast_parameters_", "capture_state", "clip", "ddp_no_sync", "distributed", "functional",
    "get_balancer", "get_weighting", "load_checkpoint", "log_stats", "modes", "restore_state",
    "save_checkpoint", "stats_to_dict", "summary_writer", "sync_weighting_", "task_gradients",
    "weighting",
]
