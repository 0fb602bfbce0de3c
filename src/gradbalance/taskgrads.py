"""Per-task gradients of the shared parameters, as one ``[K, P]`` matrix.

Two ways of running the passes compute the same matrix without touching any ``.grad``:

* ``"loop"``: one ``torch.autograd.grad(L_k, params, retain_graph=True)`` per task — K
  backward passes, the floor on a CPU.
* ``"batched"``: one ``torch.autograd.grad`` call with ``is_grads_batched=True`` (vmap over
  the K one-hot output gradients). It can win on a GPU; ops without a batching rule make it
  raise, and ``"auto"`` then falls back to the loop.

``"auto"`` uses the loop on CPU (the batched call measures up to 1.9× slower there and at
best 4% faster: ``benchmarks/results/passes_choice_cpu.md``); on other devices a buffer
measures both on its first step and keeps the faster (``"measure"`` forces that anywhere;
:mod:`gradbalance.modes._measure`). Both keep the fallback.

Each pass of the loop starts at the task's own loss (:class:`TaskRoots`): the scalar given
in a list, or, for ``torch.stack([L_1, ..., L_K])`` (also behind elementwise ops such as
``/ M``), the stack's k-th input edge. Starting at
``stacked[k]`` instead would send zeros back through every other task's head: K passes over
all K heads instead of one pass over each.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from ._checks import as_loss_vector, as_parameter_list, check_choice

__all__ = [
    "AUTO_PREFERENCE", "ParamLayout", "Passes", "TaskRoots", "compute_into", "task_gradients",
]

Passes = Literal["auto", "measure", "loop", "batched"]
_PASSES = ("auto", "measure", "loop", "batched")

#: What ``"auto"`` uses per device type without measuring (falling back to the loop if
#: batching fails); a device type not listed is measured by each buffer on its first step.
AUTO_PREFERENCE: dict[str, Literal["loop", "batched"]] = {"cpu": "loop"}


class ParamLayout:
    """Where each parameter sits in the flat ``P`` axis (concatenation in list order)."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)
        self.sizes = [p.numel() for p in self.params]
        self.offsets: list[int] = []
        total = 0
        for n in self.sizes:
            self.offsets.append(total)
            total += n
        self.numel = total
        first = self.params[0]
        self.dtype = first.dtype
        self.device = first.device

    def slices(self) -> Iterable[tuple[Tensor, int, int]]:
        """``(param, start, stop)`` for every parameter."""
        for p, off, n in zip(self.params, self.offsets, self.sizes):
            yield p, off, off + n


#: Autograd nodes of elementwise ops ``[K] -> [K]`` that may sit between a ``torch.stack`` of
#: the task losses and the vector given (``stacked / M``, ``stacked.float()``, ``w * stacked``
#: with a constant ``w``).
_ELEMENTWISE = frozenset({
    "MulBackward0", "DivBackward0", "AddBackward0", "SubBackward0", "NegBackward0",
    "ToCopyBackward0",
})


def _stack_inputs(vector: Tensor) -> tuple[list[GradientEdge], Tensor] | None:
    """The input edges of the ``torch.stack`` that ``vector`` is made from, and ``∂vₖ/∂cₖ``.

    Walks back through elementwise ops with one differentiable input (each node's backward,
    called on the running factor, gives the chain rule). None when the graph is anything
    else: then a task's pass must start at ``vector[k]``.
    """
    k = vector.shape[0]
    node = vector.grad_fn
    factor = torch.ones(k, dtype=vector.dtype, device=vector.device)
    while node is not None and node.name() in _ELEMENTWISE:
        live = [i for i, (child, _) in enumerate(node.next_functions) if child is not None]
        if len(live) != 1:
            return None
        grad = node(factor)  # type: ignore[operator]  # a grad_fn is callable; Node has no __call__
        factor = grad if isinstance(grad, Tensor) else grad[live[0]]
        if factor is None or factor.shape != (k,):
            return None
        node = node.next_functions[live[0]][0]
    if node is None or node.name() != "StackBackward0" or len(node.next_functions) != k:
        return None
    edges = []
    for child, nr in node.next_functions:
        if child is None or child.name() == "torch::autograd::AccumulateGrad":
            return None
        edges.append(GradientEdge(child, nr))
    return edges, factor.detach()


class TaskRoots:
    """Where each task's backward pass starts, and the output gradient it starts with.

    Args:
        given: the losses as the user passed them (a list of scalars or a ``[K]`` tensor).
        vector: the same losses as one ``[K]`` tensor (:func:`~gradbalance._checks.as_loss_vector`).
        scale: the loss scale ``s`` (0-d), or None.

    ``scaled`` is ``s·vector`` (the batched call and one-pass backwards use it). ``outputs[k]``
    reaches task k's graph only: the k-th scalar of a list, or the k-th input edge of the
    ``torch.stack`` the vector is made from (through elementwise ops, whose derivative goes
    into ``grad_outputs[k]``). Otherwise ``outputs`` is None and ``scaled[k]`` is
    backpropagated, through every head.
    """

    def __init__(self, given: Tensor | Sequence[Tensor], vector: Tensor,
                 scale: Tensor | None) -> None:
        if not vector.requires_grad:
            raise ValueError(
                "losses do not require grad; compute them from the model's outputs with grad "
                "enabled (not under torch.no_grad() or from detached tensors)"
            )
        self.scaled = vector if scale is None else vector * scale.to(vector.dtype)
        self.num_tasks = vector.shape[0]
        self.outputs: list[Tensor | GradientEdge | None] | None = None
        factor: Tensor | None = None
        if isinstance(given, (list, tuple)):
            self.outputs = [t.reshape(()) if t.requires_grad else None for t in given]
        else:
            found = _stack_inputs(vector)
            if found is not None:
                edges, factor = found
                self.outputs = list(edges)
        if factor is None:
            factor = torch.ones(self.num_tasks, dtype=vector.dtype, device=vector.device)
        factor = factor.to(vector.dtype)  # a float16 factor times the scale could overflow
        self.grad_outputs = factor if scale is None else factor * scale.to(vector.dtype)

    def grad(self, k: int, inputs: Sequence[Tensor], retain_graph: bool
             ) -> tuple[Tensor | None, ...]:
        """``∂(s·Lₖ)/∂x`` for every ``x`` in ``inputs`` (None where ``Lₖ`` does not reach it)."""
        if self.outputs is None:
            return torch.autograd.grad(self.scaled[k], inputs, retain_graph=retain_graph,
                                       allow_unused=True)
        root = self.outputs[k]
        if root is None:  # a constant loss: no gradient anywhere
            return (None,) * len(inputs)
        return torch.autograd.grad(root, inputs, grad_outputs=[self.grad_outputs[k]],
                                   retain_graph=retain_graph, allow_unused=True)


def resolve_passes(passes: Passes, device: torch.device) -> Literal["loop", "batched"]:
    """The concrete passes ``"auto"`` (and ``"measure"``) stand for without measuring.

    The ``AUTO_PREFERENCE`` entry of the device type, else the batched call. The row modes
    measure instead where due (:meth:`gradbalance.modes._engine.RowsEngine.compute`); the
    ``gramian`` mode does not measure and takes this.
    """
    check_choice("passes", passes, _PASSES)
    if passes == "auto" or passes == "measure":
        return AUTO_PREFERENCE.get(device.type, "batched")
    return passes


def needs_measuring(passes: Passes, device: torch.device) -> bool:
    """Whether a buffer should time both ways of running the passes once before choosing one."""
    check_choice("passes", passes, _PASSES)
    return passes == "measure" or (passes == "auto" and device.type not in AUTO_PREFERENCE)


def _write_part(part: Tensor, g: Tensor | None, accumulate: bool) -> None:
    if g is None:
        if not accumulate:
            part.zero_()
    elif accumulate:
        part.add_(g.reshape(part.shape))
    else:
        part.copy_(g.reshape(part.shape))


def _mark_reached(reached: list[bool] | None, grads: Sequence[Tensor | None]) -> None:
    """``reached[i] = True`` where ``grads[i]`` exists (some task reaches parameter i)."""
    if reached is not None:
        for i, g in enumerate(grads):
            if g is not None:
                reached[i] = True


def _write_row(row: Tensor, grads: Sequence[Tensor | None], layout: ParamLayout,
               accumulate: bool) -> None:
    if not accumulate and all(g is not None for g in grads):
        torch.cat([g.reshape(-1) for g in grads if g is not None], out=row)
        return
    for g, (_, start, stop) in zip(grads, layout.slices()):
        _write_part(row[start:stop], g, accumulate)


def _loop(roots: TaskRoots, layout: ParamLayout, out: Tensor, accumulate: bool,
          retain_graph: bool, reached: list[bool] | None = None) -> None:
    k_total = roots.num_tasks
    previous: tuple[Tensor | None, ...] = ()
    for k in range(k_total):
        keep = retain_graph or k < k_total - 1
        grads = roots.grad(k, layout.params, keep)
        _write_row(out[k], grads, layout, accumulate)
        _mark_reached(reached, grads)
        # Freed only once the next pass has allocated its own: freeing first lets the
        # allocator hand the memory back to the OS, and every pass page-faults it in again.
        previous = grads  # noqa: F841


def _batched(roots: TaskRoots, layout: ParamLayout, out: Tensor, accumulate: bool,
             retain_graph: bool, reached: list[bool] | None = None) -> None:
    losses = roots.scaled
    k_total = losses.shape[0]
    eye = torch.eye(k_total, dtype=losses.dtype, device=losses.device)
    grads = torch.autograd.grad(
        losses, layout.params, grad_outputs=eye, is_grads_batched=True,
        retain_graph=retain_graph, allow_unused=True,
    )
    # Nothing is written before the call returns, so a failed call leaves ``out`` intact.
    for g, (_, start, stop) in zip(grads, layout.slices()):
        _write_part(out[:, start:stop], g, accumulate)
    _mark_reached(reached, grads)


def compute_into(
    roots: TaskRoots,
    layout: ParamLayout,
    out: Tensor,
    *,
    passes: Passes = "auto",
    accumulate: bool = False,
    retain_graph: bool = False,
    preferred: Literal["loop", "batched"] | None = None,
    reached: list[bool] | None = None,
) -> Literal["loop", "batched"]:
    """Write (or add, with ``accumulate``) the task gradients into ``out`` ``[K, P]``.

    ``preferred`` replaces what ``"auto"``/``"measure"`` resolve to (a measured choice); the
    fallback stays. ``reached[i]`` is set True when some task's loss reaches
    ``layout.params[i]`` (its column is zeros otherwise). Returns the passes actually used
    (``"loop"`` after a batched fallback).
    """
    chosen = resolve_passes(passes, layout.device)
    if preferred is not None and passes in ("auto", "measure"):
        chosen = preferred
    if chosen == "batched":
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*performance drop.*")
                # Unless forced, keep the graph so that a failure can still fall back.
                keep = True if passes != "batched" else retain_graph
                _batched(roots, layout, out, accumulate, keep, reached)
            return "batched"
        except RuntimeError as error:
            if passes == "batched":
                raise RuntimeError(
                    f"passes='batched' failed ({error}); some op in the model has no "
                    f"batching rule: use passes='loop' or 'auto'"
                ) from error
            warnings.warn(
                f"batched task gradients unsupported by this model ({str(error)[:120]}); "
                f"falling back to the loop of K autograd.grad calls",
                RuntimeWarning,
                stacklevel=3,
            )
    _loop(roots, layout, out, accumulate, retain_graph, reached)
    return "loop"


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
    vector = as_loss_vector("losses", losses)
    layout = ParamLayout(as_parameter_list("params", params, leaf=False))
    out = torch.empty(vector.shape[0], layout.numel, dtype=layout.dtype, device=layout.device)
    compute_into(TaskRoots(losses, vector, None), layout, out, passes=passes,
                 retain_graph=retain_graph)
    return out
