"""``auto`` mode: per batch shape, the faster exact route, ``matrix`` or ``gramian``: the cost
model where it decides, else timed trials (docs/performance.md, "``auto`` mode")."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast, get_args

import torch.distributed as dist
from torch import Tensor

from .._checks import check_choice, module_list
from .._statedict import as_lists, as_tuples
from ..balancers._base import Balancer
from ..clip._protocol import RowClipper
from ..distributed import RankAgreementError, _gather_ints
from ..stats import StepStats
from ..taskgrads import ParamLayout, Passes, TaskRoots
from ._costs import FLOPS_PER_BYTE, LinearShape, flops_per_byte, layer_costs, rows_cost
from ._engine import reject_features
from ._gramian import GramianMode, load_tasks
from ._matrix import MatrixMode
from ._measure import _synchronize
from ._routes import inexact, layer_shapes

__all__ = ["DECISIVE", "FLOPS_PER_BYTE", "TRIALS", "AutoMode", "LinearShape", "RouteCosts",
           "route_costs"]

Route = Literal["matrix", "gramian"]
ROUTES: tuple[str, ...] = get_args(Route)
#: A predicted cost ratio at least this large decides without measuring.
DECISIVE = 2.0
#: Timed steps per route when the model does not decide (the minimum of each counts).
TRIALS = 2


@dataclass(frozen=True)
class RouteCosts:
    """The modelled cost of a step's route-dependent work, in flop equivalents."""

    matrix: float
    gramian: float

    @property
    def ratio(self) -> float:
        """``gramian / matrix`` (inf when matrix costs nothing)."""
        return self.gramian / self.matrix if self.matrix > 0 else float("inf")


def route_costs(layers: Sequence[LinearShape], other_numel: int, k: int, micro: int = 1,
                element_size: int = 4, flops_per_byte: float = 8.0) -> RouteCosts:
    """What ``matrix`` and ``gramian`` cost differently in one step (``layers``: one
    micro-batch; the ``other_numel`` parameters take their rows in both)."""
    matrix = gramian = rows_cost(other_numel, k, micro, element_size * flops_per_byte)
    for layer in layers:
        costs = layer_costs(layer, k, micro, element_size, flops_per_byte)
        matrix += costs.rows
        gramian += costs.chosen
    return RouteCosts(matrix, gramian)


class AutoMode:
    """The faster exact route per batch shape; ``StepStats.route`` says which one ran."""

    mode: ClassVar[str] = "auto"
    hooks_forward: ClassVar[bool] = True

    def __init__(self, layout: ParamLayout, head_params: list[Tensor], passes: Passes,
                 modules: Any = None) -> None:
        self.layout = layout
        self._matrix = MatrixMode(layout, head_params, passes)
        self._gramian: GramianMode | None = None
        if modules is not None:
            module_list(modules)  # a wrong kind of argument is refused, not taken as "matrix"
            try:
                self._gramian = GramianMode(layout, head_params, passes, modules)
            except (ValueError, RuntimeError):  # modules miss a shared parameter, or are
                self._gramian = None  # a torch.compile'd trunk: matrix only
        self.clock: Callable[[], float] = time.perf_counter  # the trials' clock (seconds)
        self.route: Route = "matrix"  # the current step's
        self.gramian_ok: bool | None = None  # the last balancer and clip allowed gramian
        self.costs: RouteCosts | None = None  # the model's, of the last shape key decided
        self._decided: dict[Any, Route] = {}
        self._samples: dict[Any, dict[str, list[float]]] = {}
        self._counts: dict[Any, int] = {}
        self._base: Any = None
        self._key: Any = None
        self._timing = False
        self._elapsed = 0.0
        self.matrix: Tensor | None = None  # the rows on a ``matrix`` step

    def _decide(self, roots: TaskRoots) -> Route:
        """The route of a step, from its first micro-batch (before any pass runs)."""
        self._key = self._base = None
        self._timing = False
        if self._gramian is None or not self.gramian_ok:
            return "matrix"
        shapes = layer_shapes(self._gramian.recorder.linear)
        self._base = (roots.num_tasks, shapes)
        key = self._key = (self._base, self._counts.get(self._base, 1))
        if key not in self._decided and (not shapes or not self._safe(roots)):
            self._decided[key] = "matrix"
        route = self._decided.get(key)
        return self._by_model(key, shapes) if route is None else route

    def _by_model(self, key: Any, shapes: Sequence[tuple[int, int, int, bool, bool]]) -> Route:
        """The cost model's route for a new shape key, else the next timed trial's."""
        assert self._gramian is not None
        k, micro = key[0][0], key[1]
        other = sum(p.numel() for b in self._gramian.recorder.other for p in b.params)
        costs = self.costs = route_costs(
            [LinearShape(*s) for s in shapes], other, k, micro,
            self.layout.params[0].element_size(), flops_per_byte(self.layout.device.type))
        ratio = costs.ratio
        # no layer gains, or a decisive gain; under torch.distributed the model alone decides
        if ratio >= 1 or ratio <= 1 / DECISIVE or (dist.is_available() and dist.is_initialized()):
            self._decided[key] = "gramian" if ratio < 1 else "matrix"
            return self._decided[key]
        samples = self._samples.setdefault(key, {"matrix": [], "gramian": []})
        self._timing = True
        return "gramian" if len(samples["gramian"]) <= len(samples["matrix"]) else "matrix"

    def _safe(self, roots: TaskRoots) -> bool:
        """Whether every linear layer's recorded calls are its parameters' only uses, with no
        tensor hook or in-place edit."""
        assert self._gramian is not None
        recorder = self._gramian.recorder
        try:
            recorder._check_recorded(roots, every=True)
        except RuntimeError:
            return False
        return not inexact(recorder.linear, roots.scaled)

    def _record(self, count: int) -> None:
        """After a timed step: its time, and the route once both have their trials."""
        if not self._timing or self._key is None or count != self._key[1]:
            return
        samples = self._samples[self._key]
        samples[self.route].append(self._elapsed)
        if all(len(s) >= TRIALS for s in samples.values()):
            faster = min(samples["gramian"]) < min(samples["matrix"])
            self._decided[self._key] = "gramian" if faster else "matrix"
            del self._samples[self._key]

    def _tick(self) -> float:
        if not self._timing:
            return 0.0
        _synchronize(self.layout.device)
        return self.clock()

    def check_backward(self, features: Tensor | None, count: int, reused: bool) -> None:
        reject_features(self.mode, features)
        if self.route == "gramian" and self._gramian is not None:  # a later micro-batch's
            self._gramian.check_backward(features, count, reused)  # check as gramian's

    def backward(self, roots: TaskRoots, first: bool, features: Tensor | None = None) -> None:
        if first:
            self.route = self._decide(roots)
            self._elapsed = 0.0
            self.matrix = None
        start = self._tick()
        if self.route == "gramian":
            assert self._gramian is not None
            self._gramian.backward(roots, first)
        else:
            self._matrix.backward(roots, first)
            self.matrix = self._matrix.matrix
            if self._gramian is not None:
                recorder = self._gramian.recorder
                recorder.clear()  # the forward's records are not needed
                recorder.num_tasks = roots.num_tasks  # later forwards keep only what they may
        self._elapsed += self._tick() - start

    def check_apply(self, balancer: Balancer, clip: RowClipper | None) -> None:
        """A ``gramian`` step needs what ``gramian`` mode needs."""
        error = self._refusal(balancer, clip) if self.route == "gramian" else None
        if error is not None:
            self.gramian_ok = False  # the next steps take the matrix route
            raise type(error)(
                f"mode='auto' took the gramian route for this step, after a step whose "
                f"balancer and clip allowed it; {error}. Call buf.reset() and repeat the "
                f"step: the next steps take the matrix route"
            ) from error

    def _refusal(self, balancer: Balancer, clip: RowClipper | None) -> Exception | None:
        """Why ``gramian`` mode refuses ``balancer`` with ``clip`` (None: it takes them)."""
        assert self._gramian is not None
        try:
            self._gramian.check_apply(balancer, clip)
        except (TypeError, ValueError) as error:
            return error
        return None

    @property
    def layer_routes(self) -> dict[str, str] | None:
        """Each trunk layer's route on a ``gramian`` step; None on a ``matrix`` step."""
        if self.route != "gramian" or self._gramian is None:
            return None
        return self._gramian.layer_routes

    def apply(self, balancer: Balancer, step: Any) -> StepStats:
        if step.group is not None:
            _agree_route(self.route, step.group)
        start = self._tick()
        engine = self._gramian if self.route == "gramian" else self._matrix
        assert engine is not None
        stats = engine.apply(balancer, step)
        self._elapsed += self._tick() - start
        stats.mode, stats.route = self.mode, self.route
        self.gramian_ok = self._gramian is not None and self._refusal(balancer, step.clip) is None
        if self._base is not None:
            self._record(step.count)
            self._counts[self._base] = step.count
        return stats

    def clear(self) -> None:
        self._matrix.clear()
        if self._gramian is not None:
            self._gramian.clear()

    def state_dict(self) -> dict[str, Any]:
        gramian = {} if self._gramian is None else self._gramian.state_dict()
        return {**self._matrix.state_dict(), **gramian, "auto_route": {
            "gramian_ok": self.gramian_ok,
            "decided": [[as_lists(key), route] for key, route in self._decided.items()],
            "samples": [[as_lists(key), {r: list(t) for r, t in s.items()}]
                        for key, s in self._samples.items()],
            "counts": [[as_lists(base), count] for base, count in self._counts.items()],
        }}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; without ``auto_route`` only the passes."""
        saved = state_dict.get("auto_route")
        if saved is not None:
            try:
                ok = saved["gramian_ok"]
                if ok not in (None, True, False):
                    raise ValueError(f"gramian_ok={ok!r}")
                decided = {as_tuples(key): cast(Route, check_choice("route", route, ROUTES))
                           for key, route in saved["decided"]}
                samples = {as_tuples(key): {r: [float(t) for t in s[r]]
                                            for r in ("matrix", "gramian")}
                           for key, s in saved["samples"]}
                counts = {as_tuples(base): int(count) for base, count in saved["counts"]}
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(
                    f"Invalid state_dict['auto_route']: {error}; pass the output of "
                    f"TaskGradBuffer.state_dict() of a mode='auto' buffer"
                ) from error
        tasks = load_tasks(state_dict)
        self._matrix.load_state_dict(state_dict)
        if self._gramian is not None:
            self._gramian.recorder.num_tasks = tasks
        if saved is not None:
            self.gramian_ok, self._decided, self._samples, self._counts = (
                ok, decided, samples, counts)


def _agree_route(route: Route, group: Any) -> None:
    """Raise :class:`RankAgreementError` unless all ranks took ``route`` (one all-gather)."""
    taken = [row[0] for row in _gather_ints([int(route == "gramian")], group,
                                            "TaskGradBuffer.apply_()")]
    if len(set(taken)) > 1:
        ranks = ", ".join(f"rank {r}: {'gramian' if t else 'matrix'}"
                          for r, t in enumerate(taken))
        raise RankAgreementError(
            f"mode='auto': the ranks took different routes for this step ({ranks}), "
            f"decided from their own batch shapes; nothing was reduced or written. Give every "
            f"rank the same batch shape (DistributedSampler(drop_last=True)) or use "
            f"mode='matrix'"
        )
