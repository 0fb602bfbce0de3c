"""The interface every gradient mode implements, and what the modes share: the heads' pass,
the update built in full, then written last (docs/ARCHITECTURE.md, "How to add a mode")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from .._amp import finite_update, nonfinite_error, poison_
from .._coverage import PlainGrads, in_param_layout
from .._shard import Shard
from .._sparse import dense
from ..balancers._base import Balancer, Combination
from ..clip._protocol import RowClipper
from ..stats import StepStats
from ..taskgrads import (
    Concrete,
    ParamLayout,
    Passes,
    TaskRoots,
    compute_into,
    kept_passes,
    needs_measuring,
)
from ._measure import measure_passes
from ._rollback import StateSnapshot

__all__ = ["Engine", "RowsEngine", "StepInput", "WriteBack", "commit", "settle"]


@dataclass
class StepInput:
    """What ``apply_`` hands a mode: the step's losses, scale and options.

    Example:
        >>> import torch
        >>> from gradbalance.modes import StepInput
        >>> StepInput(torch.tensor([1.0, 2.0]), scale=None, count=1, clip=None, group=None)
        StepInput(losses=tensor([1., 2.]), scale=None, count=1, clip=None, group=None, saved=None)
    """

    losses: Tensor  # [K], detached, summed over the micro-batches
    scale: Tensor | None  # the GradScaler's scale (0-d), None without one
    count: int  # backward() calls of the step
    clip: RowClipper | None
    group: Any  # resolved process group, None when not data-parallel
    #: the balancer's and the clipper's state before the step, put back on a skipped step
    saved: StateSnapshot | None = None


class Engine(Protocol):
    """A gradient mode: how the task gradients of one step are held and combined.

    ``backward`` per micro-batch, ``apply`` per step (``.grad`` written last), ``clear`` after
    a step or a failure; ``shardable = True`` also runs on a trunk under ``fully_shard``.

    Example:
        >>> import torch
        >>> from gradbalance.modes import make_engine
        >>> from gradbalance.taskgrads import ParamLayout
        >>> trunk = torch.nn.Linear(3, 2)
        >>> engine = make_engine("gramian", ParamLayout([*trunk.parameters()]), [], "loop", trunk)
        >>> engine.mode, engine.matrix  # only G Gᵀ: no [K, P] rows
        ('gramian', None)
    """

    #: The name users pass as ``mode=``.
    mode: ClassVar[str]
    #: Whether it hooks the forward of ``modules`` (the trunk); an integration passes the
    #: whole model as ``modules`` (for the coverage check) only to a mode that does not.
    hooks_forward: ClassVar[bool]
    #: The step's ``[K, ·]`` task-gradient rows, when the mode holds them.
    matrix: Tensor | None

    def __init__(self, layout: ParamLayout, head_params: list[Tensor], passes: Passes,
                 modules: Any = None) -> None:
        """``modules``: the trunk module(s), for modes that hook the forward."""

    def check_backward(self, features: Tensor | None, count: int, reused: bool) -> None:
        """Raise if this ``backward`` call cannot run (before anything moves)."""

    def backward(self, roots: TaskRoots, first: bool, features: Tensor | None) -> None: ...

    def check_apply(self, balancer: Balancer, clip: RowClipper | None) -> None:
        """Raise if this mode cannot run ``balancer`` with ``clip`` (before anything moves)."""

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
    """A mode that holds task-gradient rows ``[K, ·]`` (``matrix`` and ``features``).

    Example:
        >>> import torch
        >>> from gradbalance.modes import RowsEngine, make_engine
        >>> from gradbalance.taskgrads import ParamLayout
        >>> layout = ParamLayout([torch.zeros(3, requires_grad=True)])
        >>> engine = make_engine("matrix", layout, [], "loop")
        >>> isinstance(engine, RowsEngine), engine.passes, engine.matrix
        (True, 'loop', None)
    """

    mode: ClassVar[str] = ""
    hooks_forward: ClassVar[bool] = False

    def __init__(self, layout: ParamLayout, head_params: list[Tensor], passes: Passes,
                 modules: Any = None) -> None:
        self.layout = layout
        self.head_params = head_params
        self.passes: Passes = passes
        self.matrix: Tensor | None = None
        self.reached: list[bool] = []  # whether some task reached each parameter
        self.chosen: Concrete | None = None  # measured or fallen back to

    def compute(self, roots: TaskRoots, layout: ParamLayout, out: Tensor, accumulate: bool,
                retain_graph: bool = False, reached: list[bool] | None = None) -> None:
        """``out (+)= task gradients`` with the passes in force, measuring them first if due."""
        if self.chosen is None and not accumulate and needs_measuring(self.passes,
                                                                      layout.device):
            self.chosen = measure_passes(roots, layout, out, reached)
            return
        used = compute_into(roots, layout, out, passes=self.passes, accumulate=accumulate,
                            retain_graph=retain_graph, preferred=self.chosen, reached=reached)
        self.chosen = kept_passes(self.passes, layout.device, self.chosen, used)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.chosen is None else {"passes": self.chosen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        chosen = check_saved_passes(state_dict.get("passes"))
        if chosen is not None:
            self.chosen = chosen


def combine_or_skip(balancer: Balancer, matrix: Tensor, losses: Tensor, gram: Tensor,
                    finite: bool, scale: Tensor | None, shard: Shard | None = None
                    ) -> Combination:
    """The balancer's combination; on inf/NaN the plain sum with a scaler, else raise."""
    if finite:  # a subclass that overrides combine() without ``shard`` still runs unsharded
        if shard is None:
            return balancer.combine(matrix, losses, gramian=gram)
        return balancer.combine(matrix, losses, gramian=gram, shard=shard)
    if scale is not None:
        return Combination(matrix.sum(dim=0))
    raise nonfinite_error()


def heads_backward_(roots: TaskRoots, head_params: Sequence[Tensor]) -> PlainGrads:
    """The heads' gradients of the step's losses (:class:`~.._coverage.PlainGrads`):
    ``accumulate_()`` them once the task passes are done."""
    return PlainGrads(roots.scaled.sum(), head_params)


def owned_grads(grads: Sequence[Tensor | None]) -> list[bool]:
    """Whether each gradient may become a ``.grad`` as it is: no view, contiguous, once."""
    seen: set[int] = set()
    owned = []
    for g in grads:
        ok = g is not None and g._base is None and g.is_contiguous() and id(g) not in seen
        if g is not None:
            seen.add(id(g))
        owned.append(ok)
    return owned


class WriteBack:
    """A step's update ``s·parts[i]`` (None: ``.grad`` left as is), allocated in full here so
    that :meth:`commit_` only assigns and adds: it cannot fail half-way."""

    def __init__(self, params: Sequence[Tensor], parts: Sequence[Tensor | None],
                 scale: Tensor | None = None, owned: Sequence[bool] | None = None,
                 flat: Tensor | None = None) -> None:
        self.scale = scale
        self.flat = flat
        self.dtype = params[0].dtype if params else torch.float32
        self.assign: list[tuple[Tensor, Tensor]] = []  # (param, its new .grad)
        self.add: list[tuple[Tensor, Tensor]] = []  # (param, part to add into its .grad)
        self._factor: Tensor | None = None
        self._parts: list[Tensor] = []  # before the scale, for bound()
        for i, (p, part) in enumerate(zip(params, parts)):
            if part is None:
                continue
            part = part.reshape(p.shape)
            self._parts.append(part)
            if p.grad is None:
                if scale is not None:
                    new = part * scale.to(part.dtype)
                elif owned is not None and owned[i]:
                    new = part
                else:
                    new = part.clone()
                self.assign.append((p, in_param_layout(p, new.to(p.dtype))))
            elif p.grad.layout != torch.strided:  # a sparse .grad left by a plain backward
                scaled = part if scale is None else part * scale.to(part.dtype)
                self.assign.append((p, dense(p.grad) + scaled.to(p.dtype)))
            else:
                self.add.append((p, part.to(p.dtype)))
                if scale is not None and self._factor is None:
                    self._factor = scale.to(device=p.device, dtype=p.dtype)

    @classmethod
    def from_flat(cls, layout: ParamLayout, vector: Tensor, scale: Tensor | None,
                  reached: Sequence[bool] | None = None) -> WriteBack:
        """The update ``s·g`` from the flat ``g`` ``[P]`` (``reached``: None for all)."""
        parts = [None if reached is not None and not reached[i] else vector[start:stop]
                 for i, (_, start, stop) in enumerate(layout.slices())]
        return cls(layout.params, parts, scale, flat=vector)

    @property
    def params(self) -> list[Tensor]:
        """The parameters whose ``.grad`` the commit writes."""
        return [p for p, _ in self.assign] + [p for p, _ in self.add]

    def bound(self) -> Tensor:
        """The largest magnitude before the scale (0-d float64; NaN if any), by ``aminmax``."""
        parts = [self.flat] if self.flat is not None else self._parts
        parts = [part for part in parts if part.numel() > 0]
        if not parts:
            return torch.zeros((), dtype=torch.float64)
        tops = []
        for part in parts:
            low, high = torch.aminmax(part)
            tops.append(torch.maximum(high, -low).to(torch.float64).reshape(1))
        device = tops[0].device
        top: Tensor = torch.cat([t.to(device) for t in tops]).max()
        return top

    def commit_(self) -> None:
        """Write the update: ``.grad = s·g`` where there was none, ``.grad += s·g`` elsewhere."""
        for p, new in self.assign:
            p.grad = new
        for p, part in self.add:
            grad = p.grad
            assert grad is not None
            target = self.local(grad)
            if self._factor is None:
                target.add_(part)
            else:
                target.addcmul_(part, self._factor)

    @staticmethod
    def local(grad: Tensor) -> Tensor:
        """The part of ``grad`` this process adds into (a sharded update: its local shard)."""
        return grad


def settle(update: WriteBack, step: StepInput, finite: bool) -> bool:
    """Whether the update is written as balanced; one that overflows once scaled puts the
    balancer and clipper back, or raises without a scaler (one host sync)."""
    if finite:
        finite = finite_update(update.bound(), update.scale, update.dtype, step.group)
        if not finite and step.saved is not None:
            step.saved.restore()
    if not finite and step.scale is None:
        raise nonfinite_error()
    return finite


def commit(update: WriteBack, head_params: Sequence[Tensor], finite: bool) -> None:
    """Write the update, last; a non-finite step's ``.grad`` are poisoned for the scaler."""
    update.commit_()
    if not finite:
        poison_([p.grad for p in update.params] + [h.grad for h in head_params])


def add_flat_(layout: ParamLayout, vector: Tensor, scale: Tensor | None) -> None:
    """``.grad += s·g`` for the flat update ``g`` ``[P]`` at once (a mode outside the package)."""
    WriteBack.from_flat(layout, vector, scale).commit_()
