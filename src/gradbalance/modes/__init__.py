"""Gradient modes of :class:`~gradbalance.TaskGradBuffer`: what a step holds of the task
gradients. Each mode is an :class:`Engine`; the buffer builds one with :func:`make_engine`.

``"matrix"`` (default, ``[K, P]``), ``"gramian"`` (``G Gᵀ`` only, weighted balancers),
``"auto"`` (the faster of the two) and ``"features"`` (gradients of the trunk's output, an
approximation: MGDA-UB, Sener & Koltun 2018, §3.3); docs/performance.md, "Modes".
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from torch import Tensor

from .._sharding import is_sharded
from ..taskgrads import ParamLayout, Passes
from ._auto import AutoMode
from ._engine import Engine, RowsEngine, StepInput
from ._features import FeaturesMode
from ._gramian import GramianMode
from ._matrix import MatrixMode

__all__ = [
    "ENGINES", "MODES", "Engine", "Mode", "RowsEngine", "StepInput", "make_engine",
    "sharded_modes",
]

Mode = Literal["matrix", "gramian", "auto", "features"]

#: The gradient modes the library ships (the values ``mode=`` accepts out of the box).
MODES: tuple[str, ...] = get_args(Mode)

#: Mode name -> engine class: the one table of mode names (docs/ARCHITECTURE.md, "Modules").
ENGINES: dict[str, type[Engine]] = {
    "matrix": MatrixMode,
    "gramian": GramianMode,
    "auto": AutoMode,
    "features": FeaturesMode,
}


def sharded_modes() -> list[str]:
    """The modes of :data:`ENGINES` that run on a trunk sharded with ``fully_shard``.

    Example:
        >>> from gradbalance.modes import sharded_modes
        >>> sharded_modes()
        ['matrix', 'features']
    """
    return [name for name, engine in ENGINES.items() if getattr(engine, "shardable", False)]


def make_engine(mode: str, layout: ParamLayout, head_params: list[Tensor], passes: Passes,
                modules: Any = None) -> Engine:
    """The engine of ``mode`` over the shared parameters ``layout`` and the heads.

    Example:
        >>> import torch
        >>> from gradbalance.modes import make_engine
        >>> from gradbalance.taskgrads import ParamLayout
        >>> layout = ParamLayout(list(torch.nn.Linear(3, 2).parameters()))
        >>> engine = make_engine("matrix", layout, [], "loop")
        >>> engine.mode, engine.layout.numel  # 3·2 weights + 2 biases
        ('matrix', 8)
    """
    if not isinstance(mode, str) or mode not in ENGINES:
        raise ValueError(f"Invalid mode: {mode!r} (expected one of {', '.join(ENGINES)})")
    if is_sharded(layout.params) and mode not in sharded_modes():
        runs = " or ".join(f"mode={name!r}" for name in sharded_modes())
        raise ValueError(
            f"mode={mode!r} cannot run on a trunk sharded with fully_shard: its Gramian is "
            f"built from each layer's full weight gradients, which FSDP2 never holds. Use "
            f"{runs} (docs/distributed.md, \"Sharded trunks (FSDP2)\")"
        )
    return ENGINES[mode](layout, head_params, passes, modules)
