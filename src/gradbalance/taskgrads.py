"""Per-task gradients of the shared parameters, as one ``[K, P]`` matrix.

Two strategies compute the same matrix without touching any ``.grad``:

* ``"loop"``: one ``torch.autograd.grad(L_k, params, retain_graph=True)`` per task — K
  backward passes, the floor on a CPU.
* ``"batched"``: one ``torch.autograd.grad`` call with ``is_grads_batched=True`` (vmap over
  the K one-hot output gradients). It can win on a GPU; ops without a batching rule make it
  raise, and ``"auto"`` then falls back to the loop.

``"auto"`` uses the loop on CPU and the batched call elsewhere, with the fallback.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from torch import Tensor

from ._types import as_loss_vector, as_parameter_list

__all__ = ["AUTO_PREFERENCE", "ParamLayout", "Strategy", "task_gradients"]

Strategy = Literal["auto", "loop", "batched"]
_STRATEGIES = ("auto", "loop", "batched")

#: What ``"auto"`` tries first per device type (falling back to the loop if batching fails).
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


def _check_strategy(strategy: str) -> None:
    if strategy not in _STRATEGIES:
        raise ValueError(
            f"Invalid strategy: {strategy!r} (expected one of {', '.join(_STRATEGIES)})"
        )


def resolve_strategy(strategy: Strategy, device: torch.device) -> Literal["loop", "batched"]:
    """The concrete strategy ``"auto"`` stands for on ``device``."""
    _check_strategy(strategy)
    if strategy == "auto":
        return AUTO_PREFERENCE.get(device.type, "batched")
    return strategy


def _write_row(out: Tensor, k: int, grads: Sequence[Tensor | None], layout: ParamLayout,
               accumulate: bool) -> None:
    row = out[k]
    for g, (_, start, stop) in zip(grads, layout.slices()):
        part = row[start:stop]
        if g is None:
            if not accumulate:
                part.zero_()
        elif accumulate:
            part.add_(g.reshape(-1))
        else:
            part.copy_(g.reshape(-1))


def _loop(losses: Tensor, layout: ParamLayout, out: Tensor, accumulate: bool,
          retain_graph: bool) -> None:
    k_total = losses.shape[0]
    for k in range(k_total):
        keep = retain_graph or k < k_total - 1
        grads = torch.autograd.grad(
            losses[k], layout.params, retain_graph=keep, allow_unused=True
        )
        _write_row(out, k, grads, layout, accumulate)


def _batched(losses: Tensor, layout: ParamLayout, out: Tensor, accumulate: bool,
             retain_graph: bool) -> None:
    k_total = losses.shape[0]
    eye = torch.eye(k_total, dtype=losses.dtype, device=losses.device)
    grads = torch.autograd.grad(
        losses, layout.params, grad_outputs=eye, is_grads_batched=True,
        retain_graph=retain_graph, allow_unused=True,
    )
    for g, (_, start, stop) in zip(grads, layout.slices()):
        part = out[:, start:stop]
        if g is None:
            if not accumulate:
                part.zero_()
        elif accumulate:
            part.add_(g.reshape(k_total, -1))
        else:
            part.copy_(g.reshape(k_total, -1))


def compute_into(
    losses: Tensor,
    layout: ParamLayout,
    out: Tensor,
    *,
    strategy: Strategy = "auto",
    accumulate: bool = False,
    retain_graph: bool = False,
) -> Literal["loop", "batched"]:
    """Write (or add, with ``accumulate``) the task gradients into ``out`` ``[K, P]``.

    Returns the strategy actually used (``"loop"`` after a batched fallback).
    """
    chosen = resolve_strategy(strategy, layout.device)
    if chosen == "batched":
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*performance drop.*")
                # A failed batched call can leave a partial sum behind when accumulating:
                # compute into a scratch matrix first.
                scratch = torch.zeros_like(out) if accumulate else out
                # Under "auto" keep the graph so that a failure can still fall back.
                keep = True if strategy == "auto" else retain_graph
                _batched(losses, layout, scratch, False, keep)
            if accumulate:
                out.add_(scratch)
            return "batched"
        except RuntimeError as error:
            if strategy == "batched":
                raise RuntimeError(
                    f"strategy='batched' failed ({error}); some op in the model has no "
                    f"batching rule: use strategy='loop' or 'auto'"
                ) from error
            warnings.warn(
                f"batched task gradients unsupported by this model ({str(error)[:120]}); "
                f"falling back to the loop of K autograd.grad calls",
                RuntimeWarning,
                stacklevel=3,
            )
    _loop(losses, layout, out, accumulate, retain_graph)
    return "loop"


def task_gradients(
    losses: Tensor | Sequence[Tensor],
    params: Iterable[Tensor],
    *,
    strategy: Strategy = "auto",
    retain_graph: bool = False,
) -> Tensor:
    """The ``[K, P]`` matrix of per-task gradients over ``params``, leaving ``.grad`` alone.

    Row ``k`` is ``∂L_k/∂θ`` flattened and concatenated in ``params`` order; parameters a task
    does not reach get zeros. dtype and device are those of the first parameter.

    Example:
        >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> task_gradients([w.sum(), (w ** 2).sum()], [w])
        tensor([[1., 1.],
                [2., 4.]])
    """
    vector = as_loss_vector(losses)
    layout = ParamLayout(as_parameter_list(params, "params"))
    out = torch.empty(vector.shape[0], layout.numel, dtype=layout.dtype, device=layout.device)
    compute_into(vector, layout, out, strategy=strategy, retain_graph=retain_graph)
    return out
