"""The backward of one method on a batch's K task losses, as a user's loop writes it.

* ``plain``: ``losses.sum().backward()``, the step without the library (the time reference);
* a loss weighting: ``weighting(losses).sum().backward()``, its one-pass path (docs/weighting.md);
  its learnable parameters (Uncertainty's log-variances) are stepped by the run's optimizer;
* a balancer: :class:`~gradbalance.TaskGradBuffer`'s ``backward`` and ``apply_``;
* a per-sample balancer (``gradbalance compare --per-sample``): the same over the ``[B, K]``
  per-sample losses, ``TaskGradBuffer(shared, heads, modules=trunk, batch_dim=0)``.

The loss weighting's ``update`` runs after ``optimizer.step()`` (:meth:`MethodStep.after_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradbalance import StepStats
from gradbalance.step import TaskGradBuffer
from gradbalance_lab._mtl_methods import Method, build_balancer
from gradbalance_lab._per_sample_methods import PER_SAMPLE, build_per_sample_balancer

__all__ = ["MethodStep"]


class MethodStep:
    """One method's backward over ``shared`` and ``heads`` for ``num_tasks`` losses.

    ``make_weighting(key)`` builds a loss weighting by registry name (it knows the model's
    layers and task types); ``after_losses`` gives the batch's losses after the optimizer
    step, for the weightings that learn from them (FAMO). A per-sample balancer needs the
    ``trunk`` (the modules the per-sample route hooks, before the first forward).
    """

    def __init__(self, method: Method, shared: Sequence[Tensor], heads: Sequence[Tensor],
                 num_tasks: int, seed: int, make_weighting: Callable[[str], Any],
                 trunk: nn.Module | None = None) -> None:
        if method.kind not in ("plain", "balancer", "weighting", PER_SAMPLE):
            raise ValueError(f"Invalid method kind: {method.kind!r} (expected 'plain', "
                             f"'balancer', 'weighting' or {PER_SAMPLE!r})")
        self.method = method
        self.weighting: Any = None
        self.buf: TaskGradBuffer | None = None
        if method.kind == "weighting":
            self.weighting = make_weighting(method.key)
        self.extra_params: list[Tensor] = (
            [] if self.weighting is None
            else [p for p in self.weighting.parameters() if p.requires_grad])
        if method.kind == "balancer":
            self.balancer = build_balancer(method.key, num_tasks, seed)
            self.buf = TaskGradBuffer(list(shared), list(heads), num_tasks=num_tasks)
        if method.kind == PER_SAMPLE:
            if trunk is None:
                raise ValueError(f"a {PER_SAMPLE} method needs the trunk (its modules)")
            self.balancer = build_per_sample_balancer(method.key, seed)
            self.buf = TaskGradBuffer(list(shared), list(heads), modules=trunk, batch_dim=0)
        self.wants_after = method.key == "famo" or bool(
            getattr(self.weighting, "needs_losses_after", False))

    def backward(self, losses: Tensor) -> StepStats | None:
        """The method's backward of ``losses`` (``[K]``; ``[B, K]`` for a per-sample balancer);
        a balancer's StepStats, else None."""
        if self.buf is not None:
            self.buf.backward(losses)
            return self.buf.apply_(self.balancer)
        total = losses if self.weighting is None else self.weighting(losses)
        total.sum().backward()
        return None

    @property
    def weights(self) -> Tensor | None:
        """The loss weighting's current weights (None for the other methods)."""
        return None if self.weighting is None else self.weighting.weights

    def after_step(self, after_losses: Callable[[], Tensor]) -> None:
        """The loss weighting's update, after ``optimizer.step()`` and before ``zero_grad``."""
        if self.weighting is None:
            return
        after = None
        if self.wants_after:
            with torch.no_grad():
                after = after_losses()
        self.weighting.update(after)

