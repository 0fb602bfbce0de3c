"""Micro-batches: the two orders of balancing (`docs/figures.md`, §12).

A batch split into M micro-batches can be balanced in two orders:

* **accumulate, then balance** (the default, :class:`~gradbalance.TaskGradBuffer`): the
  micro-batch task gradients are averaged into one ``G`` and balanced once,
  ``g = B((1/M) Σₘ Gₘ)``. The balancer sees the gradients a full batch would give.
* **balance each, then average** (:class:`BalanceEach`, for comparison):
  ``g = (1/M) Σₘ B(Gₘ)``. Balancing is not linear, so with noisy micro-batches the two differ
  (a median 7° apart for PCGrad and 19° for MGDA in the two-bowl example, `docs/figures.md` §12).

:func:`two_orders` computes both from a list of ``[K, P]`` matrices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from gradbalance import RowClipper, TaskGradBuffer
from gradbalance._checks import as_loss_vector, as_parameter_list, check_matrix
from gradbalance.balancers import Shard
from gradbalance.balancers._base import Balancer, Combination
from gradbalance.stats import StepStats
from gradbalance.taskgrads import Passes

__all__ = ["BalanceEach", "two_orders"]


def two_orders(bal: Callable[[Tensor], Tensor], parts: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """``(B(mean of parts), mean of B(part))`` for the ``[K, P]`` task-gradient ``parts``.

    ``bal`` is any map from a ``[K, P]`` matrix to one ``[P]`` vector (a :class:`Balancer`
    works). A stateful balancer is called ``len(parts) + 1`` times: pass a fresh one, or copy
    it, if its state matters.
    """
    if len(parts) == 0:
        raise ValueError("parts is empty; pass one [K, P] task-gradient matrix per micro-batch")
    for i, part in enumerate(parts):
        check_matrix(f"parts[{i}]", part)
        if part.shape != parts[0].shape:
            raise ValueError(
                f"parts[{i}] has shape {tuple(part.shape)} but parts[0] has "
                f"{tuple(parts[0].shape)}; every micro-batch needs the same K and P"
            )
    stack = torch.stack(list(parts))
    g_once = bal(stack.mean(0))
    g_each = torch.stack([bal(part) for part in parts]).mean(0)
    return g_once, g_each


class _Averaged(Balancer):
    """Delegates to ``inner`` and divides its output by ``count`` (one micro-batch's share)."""

    def __init__(self, inner: Balancer, count: int) -> None:
        super().__init__(inner.num_tasks)
        self.inner = inner
        self.count = count

    def combine(self, matrix: Tensor, losses: Tensor | None = None,
                gramian: Tensor | None = None, shard: Shard | None = None) -> Combination:
        result = self.inner.combine(matrix, losses, gramian=gramian, shard=shard)
        weights = None if result.weights is None else result.weights / self.count
        return Combination(result.vector / self.count, weights)


class BalanceEach:
    """The other order: balance every micro-batch on its own and average the results.

    Each :meth:`backward` call takes one micro-batch's task losses (batch means, not divided
    by M), balances its own ``Gₘ`` at once, and adds ``B(Gₘ) / M`` into the trunk's ``.grad``;
    the heads get ``.grad +=`` their plain gradient of ``Σₖ Lₖ / M``. After M calls ``.grad``
    holds ``(1/M) Σₘ B(Gₘ)`` on the trunk, the second output of :func:`two_orders`.

    A stateful balancer is updated once per micro-batch in this order; with a ``GradScaler``,
    a micro-batch that overflows writes a non-finite gradient so the scaler skips the step.

    Args:
        shared_params, head_params, num_tasks, passes: as for
            :class:`~gradbalance.TaskGradBuffer`.
        num_microbatches: M, the number of ``backward`` calls per optimizer step.

    Example:
        >>> each = BalanceEach(model.shared_parameters(), model.head_parameters(),
        ...                    num_microbatches=4)
        >>> for xs, ys in zip(x.chunk(4), y.chunk(4)):
        ...     stats = each.backward(task_losses(xs, ys), balancer)
    """

    def __init__(
        self,
        shared_params: Iterable[Tensor],
        head_params: Iterable[Tensor] | None = None,
        *,
        num_microbatches: int,
        num_tasks: int | None = None,
        passes: Passes = "auto",
    ) -> None:
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or (
            num_microbatches < 1
        ):
            raise ValueError(
                f"Invalid num_microbatches: {num_microbatches!r} (expected a positive int, "
                f"the number of backward() calls per optimizer step)"
            )
        self.num_microbatches = num_microbatches
        self.head_params = as_parameter_list("head_params", head_params, allow_empty=True)
        # the heads get their 1/M share from backward()'s own pass, beside the buffer
        self._buffer = TaskGradBuffer(shared_params, num_tasks=num_tasks, passes=passes,
                                      other_params="ignore")
        shared_ids = {id(p) for p in self._buffer.layout.params}
        for i, p in enumerate(self.head_params):
            if id(p) in shared_ids:
                raise ValueError(
                    f"head_params[{i}] (shape {tuple(p.shape)}) is also in shared_params; a "
                    f"parameter is either shared (balanced) or a head's (plain gradient)"
                )

    def backward(
        self,
        losses: Tensor | Sequence[Tensor],
        balancer: Balancer,
        scaler: Any = None,
        clip: RowClipper | None = None,
    ) -> StepStats:
        """Balance this micro-batch's task gradients and add ``B(Gₘ) / M`` into ``.grad``.

        Returns this micro-batch's :class:`~gradbalance.StepStats` (its ``update_norm`` and
        weights are those of the ``1/M`` share written back).
        """
        vector = as_loss_vector("losses", losses, self._buffer.num_tasks)
        m = self.num_microbatches
        if self.head_params:
            total = vector.sum() / m
            if scaler is not None and scaler.is_enabled():
                total = scaler.scale(total)
            torch.autograd.backward(total, inputs=self.head_params, retain_graph=True)
        self._buffer.backward(vector, scaler=scaler)
        return self._buffer.apply_(_Averaged(balancer, m), scaler=scaler, clip=clip)
