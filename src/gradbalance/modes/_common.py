"""What every gradient mode shares: autocast off, the loss scale, finiteness, ``.grad += g``.

Host syncs of a balanced step (everything else stays on the device):

* ``bool(finite)`` once per refresh step: whether the balancer may run (a balancer with state
  must not see inf/NaN) is a Python decision. With data parallelism the flag is agreed over
  the ranks first, so every rank takes the same branch.
* the balancer's own (solvers iterate on the host; weighted balancers re-check finiteness).

``StepStats.loss_scale`` is read lazily: the step stores the scale as a 0-d tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from .._types import NonFiniteGradientError
from ..balancers._base import Balancer, Combination
from ..gramian import compute_gramian, is_finite_gramian
from ..taskgrads import (
    ParamLayout,
    Strategy,
    TaskRoots,
    compute_into,
    needs_measuring,
    resolve_strategy,
)
from ._measure import measure_strategy

__all__ = ["RowClipper", "StepInput"]


class RowClipper(Protocol):
    """Clips the rows of ``G`` in place before the combine and returns their pre-clip norms."""

    def __call__(self, matrix: Tensor) -> Tensor: ...


@dataclass
class StepInput:
    """What ``apply_`` hands a mode: the step's losses, scale and options."""

    losses: Tensor  # [K], detached, summed over the micro-batches
    scale: Tensor | None  # the GradScaler's scale (0-d), None without one
    count: int  # backward() calls of the step
    clip: RowClipper | None
    group: Any  # resolved process group, None when not data-parallel


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast off on ``device``: gradient arithmetic stays in the gradients' dtype.

    Under autocast a GEMM on float32 gradients would run in float16/bfloat16 (losing the
    Gramian's precision) and its result could not be written into a float32 ``.grad``.
    """
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def scale_of(scaler: Any, device: torch.device) -> Tensor | None:
    """The scaler's current scale as a 0-d tensor (no host sync), or None when disabled."""
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler.scale(torch.ones((), dtype=torch.float32, device=device))


def grads_finite(params: Sequence[Tensor]) -> Tensor:
    """True (0-d bool tensor) when every existing ``.grad`` of ``params`` is finite."""
    flags = [torch.isfinite(p.grad).all() for p in params if p.grad is not None]
    if not flags:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([f.to(flags[0].device) for f in flags]).all()


def unscaled_gramian(matrix: Tensor, scale: Tensor | None,
                     head_params: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """``G /= s`` in place; the Gramian of ``G`` (float64) and the 0-d finiteness flag.

    Under a scaler the flag also covers the heads' ``.grad``: the scaler will skip a step on
    which any of them overflowed, so the balancer must not update its state then either.
    """
    if scale is not None:
        matrix.div_(scale.to(matrix.dtype))
    gram = compute_gramian(matrix)
    flag = is_finite_gramian(gram)
    if scale is not None and head_params:
        flag = flag & grads_finite(head_params)
    return gram, flag


def nonfinite_error() -> NonFiniteGradientError:
    return NonFiniteGradientError(
        "task gradients hold inf or NaN (no GradScaler given); the trunk's .grad and the "
        "balancer's state are unchanged. Skip this optimizer step (optimizer.zero_grad()) or "
        "find the source of the overflow"
    )


class RowsMode:
    """A mode that holds task-gradient rows ``[K, ·]``: ``matrix`` and ``features``."""

    def __init__(self, layout: ParamLayout, head_params: list[Tensor], strategy: Strategy) -> None:
        self.layout = layout
        self.head_params = head_params
        self.strategy: Strategy = strategy
        self.matrix: Tensor | None = None
        #: the strategy measured (or fallen back to) for ``"auto"``/``"measure"``; kept in the
        #: buffer's ``state_dict``.
        self.chosen: Literal["loop", "batched"] | None = None

    def compute(self, roots: TaskRoots, layout: ParamLayout, out: Tensor, accumulate: bool,
                retain_graph: bool = False) -> None:
        """``out (+)= task gradients`` with the strategy in force, measuring it first if due."""
        if self.chosen is None and not accumulate and needs_measuring(self.strategy,
                                                                      layout.device):
            self.chosen = measure_strategy(roots, layout, out)
            return
        used = compute_into(roots, layout, out, strategy=self.strategy, accumulate=accumulate,
                            retain_graph=retain_graph, preferred=self.chosen)
        expected = self.chosen or resolve_strategy(self.strategy, layout.device)
        if self.strategy in ("auto", "measure") and used != expected:
            self.chosen = used  # a fallback sticks: no failing batched call every step


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
