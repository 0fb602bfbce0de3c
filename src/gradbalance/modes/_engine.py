"""The interface every gradient mode implements, and what the modes share.

:class:`~gradbalance.TaskGradBuffer` owns one :class:`Engine` and delegates to it; it never
asks which mode it holds. A mode says what it supports through :meth:`Engine.check_backward`
and :meth:`Engine.check_apply`, which raise before anything the user owns has moved.
Unscaling and the finiteness decision live in :mod:`gradbalance._amp`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import Tensor

from .._amp import nonfinite_error
from ..balancers._base import Balancer, Combination
from ..clip._protocol import RowClipper
from ..stats import StepStats
from ..taskgrads import (
    ParamLayout,
    Passes,
    TaskRoots,
    compute_into,
    needs_measuring,
    resolve_passes,
)
from ._measure import measure_passes

__all__ = ["Engine", "RowsEngine", "StepInput"]

Concrete = Literal["loop", "batched"]


@dataclass
class StepInput:
    """What ``apply_`` hands a mode: the step's losses, scale and options."""

    losses: Tensor  # [K], detached, summed over the micro-batches
    scale: Tensor | None  # the GradScaler's scale (0-d), None without one
    count: int  # backward() calls of the step
    clip: RowClipper | None
    group: Any  # resolved process group, None when not data-parallel


class Engine(Protocol):
    """A gradient mode: how the task gradients of one step are held and combined.

    ``backward`` runs once per micro-batch (the heads' ``.grad +=`` their plain gradient, the
    task gradients kept); ``apply`` once per step (reduce over ranks, unscale, check, clip,
    balance, write ``.grad``); ``clear`` drops what a step holds. ``state_dict`` holds what a
    resumed run needs to compute the same way (the measured passes).
    """

    #: The name users pass as ``mode=``.
    mode: ClassVar[str]
    #: The step's ``[K, ·]`` task-gradient rows, when the mode holds them.
    matrix: Tensor | None

    def __init__(self, layout: ParamLayout, head_params: list[Tensor], passes: Passes,
                 modules: Any = None) -> None:
        """``layout``: the shared parameters; ``passes``: loop or batched (or how to choose);
        ``modules``: the trunk module(s), for modes that hook the forward."""
        ...

    def check_backward(self, features: Tensor | None, count: int, reused: bool) -> None:
        """Raise if this ``backward`` call cannot run (before anything moves)."""
        ...

    def backward(self, roots: TaskRoots, first: bool, features: Tensor | None) -> None: ...

    def check_apply(self, balancer: Balancer, clip: RowClipper | None) -> None:
        """Raise if this mode cannot run ``balancer`` with ``clip`` (before anything moves)."""
        ...

    def apply(self, balancer: Balancer, step: StepInput) -> StepStats: ...

    def clear(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def check_saved_passes(passes: Any) -> Concrete | None:
    """A ``passes`` value from a ``state_dict``: the concrete choice a buffer measured, or None."""
    if passes not in (None, "loop", "batched"):
        raise ValueError(
            f"Invalid state_dict: passes={passes!r} (expected 'loop', 'batched' or None)"
        )
    chosen: Concrete | None = passes
    return chosen


def reject_features(mode: str, features: Tensor | None) -> None:
    if features is not None:
        raise ValueError(
            f"features is only used with mode='features' (this buffer has mode={mode!r}); "
            f"drop the argument or build the buffer with that mode"
        )


class RowsEngine:
    """A mode that holds task-gradient rows ``[K, ·]`` (``matrix`` and ``features``) and
    computes them with the K backward passes run as a loop or batched (``passes``)."""

    mode: ClassVar[str] = ""

    def __init__(self, layout: ParamLayout, head_params: list[Tensor], passes: Passes,
                 modules: Any = None) -> None:
        self.layout = layout
        self.head_params = head_params
        self.passes: Passes = passes
        self.matrix: Tensor | None = None
        #: the passes measured (or fallen back to) for ``"auto"``/``"measure"``.
        self.chosen: Concrete | None = None

    def compute(self, roots: TaskRoots, layout: ParamLayout, out: Tensor, accumulate: bool,
                retain_graph: bool = False) -> None:
        """``out (+)= task gradients`` with the passes in force, measuring them first if due."""
        if self.chosen is None and not accumulate and needs_measuring(self.passes,
                                                                      layout.device):
            self.chosen = measure_passes(roots, layout, out)
            return
        used = compute_into(roots, layout, out, passes=self.passes, accumulate=accumulate,
                            retain_graph=retain_graph, preferred=self.chosen)
        expected = self.chosen or resolve_passes(self.passes, layout.device)
        if self.passes in ("auto", "measure") and used != expected:
            self.chosen = used  # a fallback sticks: no failing batched call every step

    def state_dict(self) -> dict[str, Any]:
        return {} if self.chosen is None else {"passes": self.chosen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        chosen = check_saved_passes(state_dict.get("passes"))
        if chosen is not None:
            self.chosen = chosen


def combine_or_skip(balancer: Balancer, matrix: Tensor, losses: Tensor, gram: Tensor,
                    finite: bool, scale: Tensor | None) -> Combination:
    """The balancer's combination, or on inf/NaN: the plain (non-finite) sum with a scaler,
    so that it skips the step without the balancer seeing it; without one, raise."""
    if finite:
        return balancer.combine(matrix, losses, gramian=gram)
    if scale is not None:
        return Combination(matrix.sum(dim=0))
    raise nonfinite_error()


def heads_backward_(roots: TaskRoots, head_params: Sequence[Tensor]) -> None:
    """Heads' ``.grad += ∂(Σₖ s·Lₖ)/∂h``: one pass over the heads, the graph kept for the rest.

    (Collecting ``∂Lₖ/∂h`` from the K task passes instead saves this pass but measured no
    faster, within ±2 %, on the benchmark trunks; see docs/performance.md.)
    """
    if head_params:
        torch.autograd.backward(roots.scaled.sum(), inputs=list(head_params), retain_graph=True)


def add_flat_(layout: ParamLayout, vector: Tensor, scale: Tensor | None) -> None:
    """``.grad += s·g`` for the flat update ``g`` ``[P]`` (``s``: the loss scale, or 1)."""
    for p, start, stop in layout.slices():
        part = vector[start:stop].view_as(p)
        if scale is None:
            if p.grad is None:
                p.grad = part.clone()
            else:
                p.grad.add_(part)
        elif p.grad is None:
            p.grad = part * scale.to(part.dtype)
        else:
            p.grad.addcmul_(part, scale.to(part.dtype))
