"""Gradient modes of :class:`~gradbalance.TaskGradBuffer`: what a step holds of the task
gradients. Each mode is an :class:`Engine`; the buffer builds one with :func:`make_engine`.

* ``"matrix"`` (default): the ``[K, P]`` task gradients of the shared parameters in one
  persistent buffer; every balancer and every row clipper works. Cost: one forward + K
  backward passes.
* ``"gramian"``: only ``G Gᵀ`` ``[K, K]``, accumulated block by block; each ``nn.Linear``
  takes the cheaper of two exact routes by a cost model of its shapes (its activations and
  output gradients, nothing weight-sized; or its per-task rows, as ``matrix`` mode), then
  one weighted write-back. Weighted balancers only (``from_gramian = True``); same update as
  ``matrix``, over any number of micro-batches and under data parallelism, with 2-norm row
  clipping applied to ``G Gᵀ``. Pays off when K·P dwarfs the activations (large layers,
  small batches); elsewhere its layers take the rows, ``matrix`` mode's work.
* ``"auto"``: per batch shape, the faster of the two exact routes, ``matrix`` or ``gramian``
  (a cost model from the linear layers' shapes, K and the batch, confirmed by timing a few
  steps of each where the model does not decide; re-decided when the batch shape changes);
  ``matrix``'s update, to rounding. ``gramian`` is taken only where it can run (a weighted
  balancer, 2-norm clipping, ``modules=``); ``StepStats.route`` says which route ran.
* ``"features"``: task gradients w.r.t. the shared representation (the trunk's output)
  instead of its parameters, combined there and backpropagated once through the trunk. A
  different, cheaper, approximate method (e.g. MGDA-UB, Sener & Koltun 2018, §3.3).

How the K backward passes run is a separate choice, ``passes`` (``"loop"`` or ``"batched"``,
see :mod:`gradbalance.taskgrads`). ``update_every=T`` (any mode, weighted balancers) reuses
the weights for T - 1 steps.
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
    """The modes of :data:`ENGINES` that run on a trunk sharded with ``fully_shard``."""
    return [name for name, engine in ENGINES.items() if getattr(engine, "shardable", False)]


def make_engine(mode: str, layout: ParamLayout, head_params: list[Tensor], passes: Passes,
                modules: Any = None) -> Engine:
    """The engine of ``mode`` over the shared parameters ``layout`` and the heads."""
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
