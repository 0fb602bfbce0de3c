"""gradbalance: balance the task gradients of a multitask PyTorch model in your own loop.

The public names of the feature modules listed in ``_FEATURE_MODULES`` (their ``__all__``)
are re-exported here, so ``gradbalance.PCGrad`` or ``gradbalance.log_stats`` work directly.
"""

from __future__ import annotations

import importlib

from ._types import NonFiniteGradientError
from .gramian import compute_gramian, cosine_matrix
from .stats import StepStats
from .step import TaskGradBuffer, balanced_backward
from .taskgrads import task_gradients

__version__ = "0.1.0"

__all__ = [
    "NonFiniteGradientError",
    "StepStats",
    "TaskGradBuffer",
    "__version__",
    "balanced_backward",
    "compute_gramian",
    "cosine_matrix",
    "task_gradients",
]

#: Feature modules whose ``__all__`` is re-exported at the top level (skipped if absent).
_FEATURE_MODULES = (
    "balancers",
    "weighting",
    "clip",
    "amp",
    "microbatch",
    "monitor",
    "checkpoint",
    "modes",
    "distributed",
)

for _module_name in _FEATURE_MODULES:
    try:
        _module = importlib.import_module(f"{__name__}.{_module_name}")
    except ModuleNotFoundError as _error:
        if _error.name != f"{__name__}.{_module_name}":
            raise
        continue
    for _name in getattr(_module, "__all__", ()):
        globals()[_name] = getattr(_module, _name)
        if _name not in __all__:
            __all__.append(_name)
