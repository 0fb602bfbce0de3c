"""gradbalance: balance the task gradients of a multitask PyTorch model in your own loop."""

from __future__ import annotations

from ._types import NonFiniteGradientError
from .balancers import (
    BALANCERS,
    Balancer,
    Combination,
    Constant,
    Mean,
    Sum,
    combine_rows,
    get_balancer,
)
from .gramian import compute_gramian, cosine_matrix
from .stats import StepStats
from .step import TaskGradBuffer, balanced_backward
from .taskgrads import task_gradients

__version__ = "0.1.0"

__all__ = [
    "BALANCERS",
    "Balancer",
    "Combination",
    "Constant",
    "Mean",
    "NonFiniteGradientError",
    "StepStats",
    "Sum",
    "TaskGradBuffer",
    "__version__",
    "balanced_backward",
    "combine_rows",
    "compute_gramian",
    "cosine_matrix",
    "get_balancer",
    "task_gradients",
]
