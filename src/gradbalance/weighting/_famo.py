"""FAMO: Fast Adaptive Multitask Optimization (Liu et al., 2023)."""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import (
    as_task_vector,
    check_nonnegative_losses,
    check_positive,
    task_value_vectors,
)
from ._base import times_weights
from ._own_optimizer import OptimizerFactory, OwnOptimizerWeighting

__all__ = ["FAMO", "famo_weights"]


def famo_weights(losses: Tensor, logits: Tensor, min_losses: Tensor, eps: float = 1e-8) -> Tensor:
    """``wₖ = (zₖ/Dₖ) / Σᵢ zᵢ/Dᵢ`` with ``z = softmax(ξ)``, ``Dₖ = Lₖ − mₖ + eps``.

    ``Σₖ wₖ ∇Lₖ = ∇ Σₖ zₖ log Dₖ / c`` (``c = Σᵢ zᵢ/Dᵢ`` held constant): the gradient of the
    weighted log-losses, normalised so that the weights sum to 1.

    Example:
        >>> import torch
        >>> from gradbalance.functional import famo_weights
        >>> famo_weights(torch.tensor([1.0, 3.0]), torch.zeros(2), torch.zeros(2))  # ∝ (1, 1/3)
        tensor([0.7500, 0.2500], dtype=torch.float64)
    """
    losses, logits, min_losses = task_value_vectors(
        ("losses", losses), ("logits", logits), ("min_losses", min_losses))
    check_positive("eps", eps)
    check_nonnegative_losses("losses - min_losses", losses - min_losses, "famo_weights")
    z = torch.softmax(logits, dim=0)
    d = losses - min_losses + eps
    ratio = z / d
    return ratio / ratio.sum()


class FAMO(OwnOptimizerWeighting):
    """Fast Adaptive Multitask Optimization: learn task logits ``ξ`` so losses fall evenly.

    Step ``t`` (one forward, one backward; no task gradients):

    1. ``weighting(losses)`` returns ``wₖ Lₖ`` with :func:`famo_weights` (detached), so the
       model moves along ``Σₖ zₖ ∇log Dₖ / c``.
    2. After ``optimizer.step()``, evaluate the **same batch** again (``torch.no_grad()``) and
       call ``update(losses_after)``. With ``δₖ = log Dₖ(before) − log Dₖ(after)``,
       ``ξ`` takes one step of its own Adam (``lr``, ``weight_decay=gamma``) along
       ``∇_ξ softmax(ξ)·δ``: tasks whose loss fell less get more weight.

    Args:
        lr: learning rate of ``ξ`` (paper: 0.025).
        gamma: weight decay of ``ξ`` (reference implementation default 0.01).
        min_losses: ``m`` ``[K]``, lower bounds of the losses (default 0).
        optimizer: factory ``params -> torch.optim.Optimizer`` replacing the default Adam.

    Reference: Liu, Liu, Jin, Stone & Liu, "FAMO: Fast Adaptive Multitask Optimization",
    NeurIPS 2023.

    Example:
        >>> import torch
        >>> from gradbalance.weighting import FAMO
        >>> famo = FAMO(2)  # uniform logits at first: wₖ ∝ 1/Lₖ, summing to 1
        >>> famo(torch.tensor([1.0, 3.0])), famo.weights
        (tensor([0.7500, 0.7500]), tensor([0.7500, 0.2500], dtype=torch.float64))
    """

    name = "famo"
    reads_losses = True
    needs_losses_after = True
    _weights_state = "_last"
    logits: Tensor
    min_losses: Tensor
    _last: Tensor

    def __init__(self, num_tasks: int, *, lr: float = 0.025, gamma: float = 0.01,
                 min_losses: Tensor | list[float] | None = None, eps: float = 1e-8,
                 optimizer: OptimizerFactory | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__(num_tasks, device=device)
        self.lr = check_positive("lr", lr)
        self.gamma = check_positive("gamma", gamma, allow_zero=True)
        self.eps = check_positive("eps", eps)
        k = num_tasks
        m = as_task_vector("min_losses", torch.zeros(k) if min_losses is None else min_losses, k)
        self.register_state("min_losses", m.to(self.device), per_task=True)
        self._register_trained("logits", torch.zeros(k, dtype=torch.float64,
                                                     device=self.device), optimizer)
        self.register_state("_last", torch.full((k,), 1.0 / k, dtype=torch.float64,
                                                device=self.device), per_task=True,
                            persistent=False)

    _group_attributes = (("lr", "lr"), ("gamma", "weight_decay"))

    def _default_optimizer(self, params: list[Tensor]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=self.lr, weight_decay=self.gamma)

    def _check_above_min(self, losses: Tensor, argname: str) -> None:
        above = losses.detach().double().to(self.device) - self.min_losses
        check_nonnegative_losses("losses", above, f"FAMO ({argname} minus min_losses)")

    def _weighted(self, losses: Tensor) -> Tensor:
        self._check_above_min(losses, "losses")
        w = famo_weights(losses.to(self.device), self.logits, self.min_losses, self.eps)
        self._last = w
        return times_weights(w, losses)

    def _check_update(self, losses_after: Tensor | None) -> None:
        if losses_after is None:
            raise ValueError(
                "FAMO.update() needs losses_after: the same batch's task losses after the "
                "optimizer step, e.g. with torch.no_grad(): famo.update(task_losses(batch))"
            )
        self._check_above_min(losses_after, "losses_after")

    def _apply_update(self, losses: Tensor, losses_after: Tensor | None) -> None:
        assert losses_after is not None  # _check_update
        delta = torch.log(losses - self.min_losses + self.eps) - torch.log(
            losses_after - self.min_losses + self.eps)
        z = torch.softmax(self.logits.detach(), dim=0)
        # ∇_ξ (softmax(ξ) · δ) = z ⊙ (δ − z·δ)
        self.logits.grad = z * (delta - (z * delta).sum())
        self.optimizer.step()
        self.logits.grad = None

    @property
    def task_probabilities(self) -> Tensor:
        """``softmax(ξ)`` ``[K]``."""
        return torch.softmax(self.logits.detach(), dim=0)
