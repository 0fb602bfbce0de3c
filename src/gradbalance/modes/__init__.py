"""Gradient modes of :class:`~gradbalance.TaskGradBuffer`: what a step holds of the task
gradients. Each mode is an :class:`Engine`; the buffer builds one with :func:`make_engine`.

* ``"matrix"`` (default): the ``[K, P]`` task gradients in one persistent buffer; every
  balancer and every row clipper works. Cost: one forward + K backward passes.
* ``"gramian"``: only ``G Gᵀ`` ``[K, K]``, block by block, each ``nn.Linear`` by the cheaper
  of two exact routes (its activations and output gradients, or its per-task rows), then one
  weighted write-back: ``matrix``'s update for weighted balancers (``from_gramian = True``),
  micro-batches, data parallelism and 2-norm row clipping included. Pays off when K·P
  dwarfs the activations (large layers, small batches).
* ``"auto"``: per batch shape, the faster of ``matrix`` and ``gramian`` (a cost model, steps
  of each timed where it does not decide); ``StepStats.route`` says which route ran.
* ``"features"``: task gradients w.r.t. the trunk's output, combined there and backpropagated
  once through the trunk: a cheaper, approximate method (MGDA-UB, Sener & Koltun 2018, §3.3).

``passes`` (loop or batched, :mod:`gradbalance.taskgrads`) and ``update_every=T`` (the weights
reused for T - 1 steps) are separate choices (docs/performance.md, "Modes").
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

#: Mode name -> engine class: the one table of mode names (the buffer, the ranks' agreement
#: check in :mod:`gradbalance.distributed` and every error naming the modes read it); a new
#: mode is one :class:`Engine` class and one entry here. An engine class declaring
#: ``shardable = True`` also runs on a trunk sharded with ``fully_shard`` (its columns are a
#: :class:`~gradbalance.modes._layout.Columns`).
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
