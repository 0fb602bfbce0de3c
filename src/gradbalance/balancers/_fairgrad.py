"""FairGrad: α-fair allocation of the update among the tasks."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .._checks import check_int, check_range, check_square
from ._base import Balancer
from ._solvers import cancellation, fair_newton

__all__ = ["FairGrad", "fairgrad_weights"]


def fairgrad_weights(gramian: Tensor, alpha: float = 1.0, max_iter: int = 100,
                     tol: float = 1e-10) -> Tensor:
    """FairGrad's weights ``[K]``: the positive solution of ``(G Gᵀ) w = w^{-1/α}``.

    Update ``g = Σₖ wₖ gₖ``. It maximises the α-fair utility ``Σₖ uₖ^{1−α}/(1−α)`` of the task
    improvements ``uₖ = gₖᵀ g``. ``α = 0`` is linear scalarisation (uniform ``1/K``), ``α = 1``
    proportional fairness (Nash-MTL's bargaining solution), ``α → ∞`` max-min fairness.

    Solved by the damped Newton shared with Nash-MTL (``fair_newton``, ``p = 1/α``) on
    ``G Gᵀ`` normalised by its trace. A zero row gets weight 0. No solution exists where a
    non-negative combination of the non-zero rows vanishes (0 in their convex hull): no ``g``
    improves every task, the utility has no maximiser; Newton stops within a few steps of its
    iterate ceasing to progress and a ``RuntimeWarning`` gives the residual and how far the
    weights' combination cancels; the weights are that iterate, finite and approximate.

    Example:
        >>> import torch
        >>> from gradbalance.functional import fairgrad_weights
        >>> fairgrad_weights(torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64)))
        tensor([1.0000, 0.5000], dtype=torch.float64)
    """
    k = check_square("gramian", gramian).shape[0]
    alpha = check_range("alpha", alpha, 0.0, None)
    a = gramian.to(torch.float64)
    if alpha == 0.0:
        return torch.full((k,), 1.0 / k, dtype=torch.float64, device=a.device)
    trace = float(torch.diagonal(a).sum())
    if not trace > 0.0:
        return torch.zeros(k, dtype=torch.float64, device=a.device)
    unit = a / trace
    w, residual, rounding = fair_newton(unit, 1.0 / alpha, None, tol, max_iter)
    if not residual <= max(1e-6, rounding):
        ratio = max(cancellation(unit, w), 0.0) ** 0.5
        warnings.warn(
            f"FairGrad's solver stopped at relative residual {residual:.2e} (max_iter="
            f"{max_iter}); the weights are approximate: no exact solution exists when a "
            f"non-negative combination of the task gradients (nearly) vanishes, 0 in their "
            f"convex hull (here ‖Σ wₖgₖ‖ = {ratio:.1e} Σ wₖ‖gₖ‖), else raise max_iter",
            RuntimeWarning,
            stacklevel=3,
        )
    scaled: Tensor = w * trace ** (-alpha / (1.0 + alpha))
    return scaled


class FairGrad(Balancer):
    """``g = Σₖ wₖ gₖ`` with ``(G Gᵀ) w = w^{-1/α}``, ``w > 0`` (α-fair update).

    Cost in K: damped Newton, ``O(K³)`` per step (at most 100 steps; from 512 tasks on the
    CPU a blocked Cholesky factorisation of the Hessian, else an LU solve), besides the
    Gramian ``O(K²P)``.

    Args:
        alpha: fairness ``α ≥ 0`` (default 1.0, proportional fairness; the paper sweeps
            α ∈ {0.5, 1, 2, 5, ...} per benchmark).
        max_iter: Newton iterations (default 100; it usually stops below 15).

    Reference: Ban & Ji, "Fair Resource Allocation in Multi-Task Learning", ICML 2024,
    arXiv:2402.15638, eq. 4.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import FairGrad
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> FairGrad(alpha=1.0)(g)  # w = (1, 1/2) solves diag(1, 4) w = 1/w
        tensor([1.0000, 1.0000], dtype=torch.float64)
    """

    name = "fairgrad"
    _repr_args = ("num_tasks", "alpha")
    from_gramian = True
    homogeneous = False  # B(sG) = s^{(1-α)/(1+α)} B(G)

    def __init__(self, num_tasks: int | None = None, alpha: float = 1.0,
                 max_iter: int = 100) -> None:
        super().__init__(num_tasks)
        self.alpha = check_range("alpha", alpha, 0.0, None)
        # (cA) w = w^{-1/α} is solved by c^{-α/(1+α)} w: the solve sees G / maxₖ Gₖₖ.
        self.weight_degree = -self.alpha / (1.0 + self.alpha)
        self.max_iter = check_int("max_iter", max_iter, 1)

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        return fairgrad_weights(gramian, self.alpha, self.max_iter)
