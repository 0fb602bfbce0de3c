"""Per-task gradients of the shared parameters, as one ``[K, P]`` matrix, ``.grad`` untouched:
a loop of ``autograd.grad`` or one batched call (docs/performance.md, "Modes")."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

from ._batching import raised_by_model
from ._checks import as_loss_vector, as_parameter_list, check_bool, check_choice
from ._recompute import passes_on
from ._roots import TaskRoots
from ._sinks import PassSink, RowsSink

__all__ = [
    "AUTO_PREFERENCE", "ParamLayout", "Passes", "TaskRoots", "compute_into", "task_gradients",
]

Passes = Literal["auto", "measure", "loop", "batched"]
Concrete = Literal["loop", "batched"]
_PASSES = get_args(Passes)

#: What ``"auto"`` uses per device type without measuring; other types are measured.
AUTO_PREFERENCE: dict[str, Concrete] = {"cpu": "loop"}


class ParamLayout:
    """Where each parameter sits in the flat ``P`` axis (concatenation in list order)."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)
        self.sizes = [p.numel() for p in self.params]
        self.offsets = list(itertools.accumulate(self.sizes, initial=0))[:-1]
        self.numel = sum(self.sizes)
        self.dtype, self.device = self.params[0].dtype, self.params[0].device

    def slices(self) -> Iterable[tuple[Tensor, int, int]]:
        """``(param, start, stop)`` for every parameter."""
        for p, off, n in zip(self.params, self.offsets, self.sizes):
            yield p, off, off + n


def resolve_passes(passes: Passes, device: torch.device,
                   preferred: Concrete | None = None) -> Concrete:
    """The passes a call runs first: ``preferred``, else ``AUTO_PREFERENCE``, else batched."""
    check_choice("passes", passes, _PASSES)
    if passes == "auto" or passes == "measure":
        return preferred or AUTO_PREFERENCE.get(device.type, "batched")
    return passes


def needs_measuring(passes: Passes, device: torch.device) -> bool:
    """Whether a buffer should time both ways of running the passes once before choosing one."""
    check_choice("passes", passes, _PASSES)
    return passes == "measure" or (passes == "auto" and device.type not in AUTO_PREFERENCE)


def kept_passes(passes: Passes, device: torch.device, preferred: Concrete | None,
                used: Concrete) -> Concrete | None:
    """The choice a buffer keeps after a call that ran ``used`` (a fallback sticks)."""
    if passes in ("auto", "measure") and used != resolve_passes(passes, device, preferred):
        return used
    return preferred


def _split(sinks: Sequence[PassSink], grads: Sequence[Tensor | None]
           ) -> Iterator[tuple[PassSink, Sequence[Tensor | None]]]:
    """Each sink with its share of ``grads`` (the sinks' inputs, concatenated in order)."""
    if len(sinks) == 1:
        yield sinks[0], grads
        return
    at = 0
    for sink in sinks:
        n = len(sink.inputs)
        yield sink, grads[at : at + n]
        at += n


def _loop(roots: TaskRoots, inputs: list[Tensor], sinks: Sequence[PassSink],
          retain_graph: bool, by_backward: bool) -> None:
    k_total = roots.num_tasks
    previous: tuple[Tensor | None, ...] = ()
    for k in range(k_total):
        keep = retain_graph or k < k_total - 1
        if by_backward:
            roots.backward(k, keep)
            grads: tuple[Tensor | None, ...] = ()
        else:
            grads = roots.grad(k, inputs, keep)
        for sink, part in _split(sinks, grads):
            sink.write_pass(k, part)
        previous = grads  # noqa: F841  # freed after the next pass allocates: no page faults


#: The most of a torch error a message of the step quotes (a dispatcher error lists every
#: backend, about 60 lines: :func:`first_line`).
QUOTED_CHARS = 160


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, at most ``QUOTED_CHARS`` characters."""
    line = str(error).strip().split("\n", 1)[0]
    return line if len(line) <= QUOTED_CHARS else line[: QUOTED_CHARS - 3] + "..."


def batched_grads(roots: TaskRoots, inputs: Sequence[Tensor], passes: Passes,
                  retain_graph: bool, start: tuple[Sequence[Tensor], Sequence[Tensor]] | None
                  = None) -> tuple[Tensor | None, ...] | None:
    """The batched call's gradients, from the losses (or from ``start``: tensors and their
    ``[K, *shape]`` gradients); None where it failed and ``passes`` allows the loop."""
    losses = roots.scaled
    outputs, grad_outputs = start if start is not None else (
        [losses], [torch.eye(losses.shape[0], dtype=losses.dtype, device=losses.device)])
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*performance drop.*")
            # Unless forced, keep the graph so that a failure can still fall back.
            return torch.autograd.grad(
                outputs, inputs, grad_outputs=grad_outputs, is_grads_batched=True,
                retain_graph=True if passes != "batched" else retain_graph, allow_unused=True,
            )
    except RuntimeError as error:
        if raised_by_model(error):  # a hook's own error: plain backward raises it too
            raise
        if passes == "batched":
            raise RuntimeError(
                f"passes='batched' failed: some op in the model has no batching rule "
                f"(torch: {first_line(error)}); use passes='loop' or 'auto' (the full "
                f"error is chained above)"
            ) from error
        warnings.warn(
            f"batched task gradients unsupported by this model ({first_line(error)}); "
            f"falling back to the loop of K autograd.grad calls",
            RuntimeWarning,
            stacklevel=5,
        )
    return None


def run_passes(
    roots: TaskRoots,
    sinks: Sequence[PassSink],
    device: torch.device,
    *,
    passes: Passes = "auto",
    retain_graph: bool = False,
    preferred: Concrete | None = None,
) -> Concrete:
    """The K task passes, as a loop or one batched call, into ``sinks``; a failed batched call
    writes nothing and falls back to the loop unless ``passes="batched"``. Returns the passes
    used."""
    by_backward = any(sink.by_backward for sink in sinks)
    if by_backward and not all(sink.by_backward for sink in sinks):
        raise ValueError("run_passes: sinks mix by_backward and autograd.grad inputs")
    inputs = [x for sink in sinks for x in sink.inputs]
    with passes_on(roots.graph):  # a checkpoint's recomputation counted once per graph
        if not by_backward and resolve_passes(passes, device, preferred) == "batched":
            grads = batched_grads(roots, inputs, passes, retain_graph)
            if grads is not None:
                for sink, part in _split(sinks, grads):
                    sink.write_batched(part)
                return "batched"
        _loop(roots, inputs, sinks, retain_graph, by_backward)
    return "loop"


def compute_into(
    roots: TaskRoots,
    layout: ParamLayout,
    out: Tensor,
    *,
    passes: Passes = "auto",
    accumulate: bool = False,
    retain_graph: bool = False,
    preferred: Concrete | None = None,
    reached: list[bool] | None = None,
) -> Concrete:
    """Write (or add) the task gradients into ``out`` ``[K, P]``; ``reached[i]`` True where
    some task reaches ``layout.params[i]``. Returns the passes used."""
    sink = RowsSink(layout, out, accumulate, reached)
    return run_passes(roots, [sink], layout.device, passes=passes, retain_graph=retain_graph,
                      preferred=preferred)


def task_gradients(
    losses: Tensor | Sequence[Tensor],
    params: Iterable[Tensor],
    *,
    passes: Passes = "auto",
    retain_graph: bool = False,
) -> Tensor:
    """The ``[K, P]`` matrix of per-task gradients over ``params``, leaving ``.grad`` alone.

    Row ``k`` is ``∂L_k/∂θ`` flattened and concatenated in ``params`` order; parameters a task
    does not reach get zeros. dtype and device are those of the first parameter.

    Example:
        >>> import torch
        >>> from gradbalance import task_gradients
        >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> task_gradients([w.sum(), (w ** 2).sum()], [w])
        tensor([[1., 1.],
                [2., 4.]])
    """
    return task_gradients_reached(losses, params, passes=passes, retain_graph=retain_graph)[0]


def task_gradients_reached(
    losses: Tensor | Sequence[Tensor],
    params: Iterable[Tensor],
    *,
    passes: Passes = "auto",
    retain_graph: bool = False,
) -> tuple[Tensor, list[bool]]:
    """:func:`task_gradients` and, per parameter, whether some task's graph reaches it (a
    parameter no task reaches gets zeros there: its rows say nothing about it)."""
    vector = as_loss_vector("losses", losses)
    check_bool("retain_graph", retain_graph)
    layout = ParamLayout(as_parameter_list("params", params, leaf=False))
    out = torch.empty(vector.shape[0], layout.numel, dtype=layout.dtype, device=layout.device)
    reached = [False] * len(layout.params)
    compute_into(TaskRoots(losses, vector, None), layout, out, passes=passes,
                 retain_graph=retain_graph, reached=reached)
    return out, reached
