"""CR-MOGM: a moving average of another weighted balancer's weights."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .._checks import as_task_vector, check_range
from ._base import Balancer
from ._denoise import KeptSpectrum
from ._mgda import MGDA

__all__ = ["CRMOGM"]


class CRMOGM(Balancer):
    """``g = λₜᵀ G`` with ``λₜ = β λₜ₋₁ + (1 − β) λ̂ₜ``, ``λ̂ₜ`` the inner balancer's weights.

    Averaging the weights of a stochastic gradient manipulation over steps reduces their
    correlation with one batch's gradients. ``λ₀`` is ``initial_weights`` if given, else
    ``λ̂₁``. The paper's Corollary 1 grows ``β`` towards 1 as the learning rate decays: assign
    ``balancer.beta`` between steps, e.g. ``1 - lr / lr0``.

    Cost in K: its inner balancer's, plus ``O(K)``.

    Args:
        inner: a weighted balancer (``from_gramian``) that keeps its own state; default
            ``MGDA(num_tasks)``.
        num_tasks: K (optional; must agree with ``inner.num_tasks`` when both are given).
        beta: weight ``β ∈ [0, 1]`` of the previous average (default 0.9, TorchJD's ``alpha``).
        initial_weights: ``λ₀`` ``[K]`` (default: the first inner weights).

    Reads the losses and is homogeneous when the inner balancer is.

    Reference: Zhou et al., "On the Convergence of Stochastic Multi-Objective Gradient
    Manipulation and Beyond", NeurIPS 2022.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import CRMOGM
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> CRMOGM()(g)  # first step: MGDA's min-norm point, weights (0.8, 0.2)
        tensor([0.8000, 0.4000], dtype=torch.float64)
    """

    _lambda: Tensor | None

    name = "crmogm"
    _repr_args = ("inner", "beta")
    from_gramian = True
    homogeneous = True

    def __init__(self, inner: Balancer | None = None, *, num_tasks: int | None = None,
                 beta: float = 0.9,
                 initial_weights: Sequence[float] | Tensor | None = None) -> None:
        super().__init__(num_tasks)
        if inner is None:
            inner = MGDA(num_tasks)
        if not isinstance(inner, Balancer) or not inner.from_gramian:
            found = type(inner).__name__
            raise ValueError(
                f"Invalid inner: {found} (expected a weighted balancer, one with from_gramian "
                f"True, e.g. gradbalance.MGDA())"
            )
        if num_tasks is not None and inner.num_tasks not in (None, num_tasks):
            raise ValueError(
                f"Invalid num_tasks: {num_tasks} (expected inner.num_tasks = "
                f"{inner.num_tasks}, or leave it out)"
            )
        if self.num_tasks is None:
            self.num_tasks = inner.num_tasks
        self.inner = inner
        self.beta = beta
        self.initial_weights = None if initial_weights is None else as_task_vector(
            "initial_weights", initial_weights, self.num_tasks)
        # Instance values of the class flags: they are the inner balancer's.
        self.homogeneous = inner.homogeneous
        self.needs_losses = inner.needs_losses
        self.inverts_gramian = inner.inverts_gramian
        self.register_state("_lambda", None, optional=True, per_task=True)

    @property
    def beta(self) -> float:
        """Weight of the previous average; may be changed between steps (a schedule)."""
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = check_range("beta", value, 0.0, 1.0)

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        return self._rounded_weights(gramian, losses, 0.0)

    def _rounded_weights(self, gramian: Tensor, losses: Tensor | None, rounding: float,
                         spectrum: KeptSpectrum | None = None) -> Tensor:
        k = gramian.shape[0]
        if self._lambda is None and self.initial_weights is not None \
                and self.initial_weights.numel() != k:
            raise ValueError(f"got {k} tasks but {type(self).__name__} has initial_weights for "
                             f"{self.initial_weights.numel()} tasks; pass one weight per task")
        hat = self.inner._rounded_weights(gramian, losses, rounding, spectrum)
        hat = hat.to(torch.float64)
        if self._lambda is not None:
            prev = self._lambda.to(hat.device)
        elif self.initial_weights is not None:
            prev = self.initial_weights.to(hat.device)
        else:
            prev = hat
        self._lambda = self._beta * prev + (1.0 - self._beta) * hat
        return self._lambda
