"""MoDo: multi-objective gradient with double sampling."""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_range, check_square
from ._base import Balancer
from ._mean import mean_weights
from ._solvers import project_simplex

__all__ = ["MoDo", "modo_step"]


def modo_step(lam: Tensor, gramian: Tensor, gamma: float, rho: float) -> Tensor:
    """``λ ← Π_Δ(λ − γ (A λ + ρ λ))`` with ``A`` the (cross-)Gramian ``[K, K]``.

    The step is shifted by its largest entry before the projection (``Π_Δ(v) = Π_Δ(v − c·1)``),
    so a step far outside the simplex (``γ‖gₖ‖² ≫ 1``) still projects exactly.

    Example:
        >>> import torch
        >>> from gradbalance.functional import modo_step
        >>> lam = torch.tensor([0.5, 0.5], dtype=torch.float64)
        >>> a = torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64))
        >>> modo_step(lam, a, gamma=0.1, rho=0.0)  # Π_Δ((0.45, 0.30))
        tensor([0.5750, 0.4250], dtype=torch.float64)
    """
    check_square("gramian", gramian)
    step = lam - gamma * (gramian @ lam + rho * lam)
    return project_simplex(step - step.max())


class MoDo(Balancer):
    """``g = Σₖ λₖ gₖ`` with simplex weights ``λ`` moved by one projected step per call.

    With one ``G`` per step ``A = G Gᵀ`` (the paper's two batches are one); for the
    double-sampled variant call :func:`modo_step` with your own ``G₁ G₂ᵀ``.

    Cost in K: Gramian–vector products ``O(K²)`` per inner step and a simplex projection ``O(K
    log K)``, besides the Gramian ``O(K²P)``.

    Args:
        gamma: step size ``γ > 0`` of ``λ`` (default 1e-3, LibMTL's MoDo setting; it multiplies
            squared gradient norms, so tune it to your gradient scale).
        rho: ℓ₂ regularisation ``ρ ≥ 0`` (default 0.1).

    Reference: Chen et al., "Three-Way Trade-Off in Multi-Objective Learning: Optimization,
    Generalization and Conflict-Avoidance", NeurIPS 2023, arXiv:2305.20057, Algorithm 1.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import MoDo
        >>> MoDo()(torch.eye(2, dtype=torch.float64))  # λ stays uniform by symmetry
        tensor([0.5000, 0.5000], dtype=torch.float64)
    """

    _lambda: Tensor | None

    name = "modo"
    _repr_args = ("num_tasks", "gamma", "rho")
    from_gramian = True
    homogeneous = False
    weight_degree = None  # γ multiplies squared norms: λ sees the raw Gramian

    def __init__(self, num_tasks: int | None = None, gamma: float = 1e-3,
                 rho: float = 0.1) -> None:
        super().__init__(num_tasks)
        self.gamma = check_range("gamma", gamma, 0.0, None, low_open=True)
        self.rho = check_range("rho", rho, 0.0, None)
        self.register_state("_lambda", None, optional=True, per_task=True)

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        gram = gramian.to(torch.float64)
        lam = mean_weights(gram) if self._lambda is None else self._lambda.to(torch.float64)
        lam = modo_step(lam, gram, self.gamma, self.rho)
        self._lambda = lam
        return lam
