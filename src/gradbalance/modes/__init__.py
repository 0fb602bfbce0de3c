"""Gradient modes of :class:`~gradbalance.TaskGradBuffer`.

* ``"matrix"`` (default): the ``[K, P]`` task gradients of the shared parameters in one
  persistent buffer; every balancer works. Cost: one forward + K backward passes.
* ``"gramian"``: only ``G Gᵀ`` ``[K, K]``, accumulated block by block, never ``[K, P]``; then
  one weighted write-back. Weighted balancers only (``from_gramian = True``); same update as
  ``matrix``, over any number of micro-batches and under data parallelism (linear layers'
  inputs and output gradients gathered), with 2-norm row clipping applied to ``G Gᵀ``. Pays
  off when K·P dwarfs the activations (large layers, small batches).
* ``"features"``: task gradients w.r.t. the shared representation (the trunk's output) instead
  of its parameters, combined there and backpropagated once through the trunk. A different,
  cheaper, approximate method (e.g. MGDA-UB, Sener & Koltun 2018, §3.3), not the same update.

``update_every=T`` (any mode, weighted balancers) reuses the weights for T - 1 steps.
"""

from __future__ import annotations

from typing import Literal

from ._amortize import WeightCache as WeightCache
from ._amortize import check_update_every as check_update_every
from ._gramian import GramianRecorder as GramianRecorder

__all__ = ["MODES", "Mode"]

Mode = Literal["matrix", "gramian", "features"]

#: The gradient modes a :class:`~gradbalance.TaskGradBuffer` accepts.
MODES: tuple[str, ...] = ("matrix", "gramian", "features")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"Invalid mode: {mode!r} (expected one of {', '.join(MODES)})")
    return mode
