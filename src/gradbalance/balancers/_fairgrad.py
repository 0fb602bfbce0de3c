"""FairGrad: α-fair allocation of the update among the tasks.

Ban & Ji (2024), *Fair Resource Allocation in Multi-Task Learning*, ICML, arXiv:2402.15638
(Algorithm 1, Equation 4).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ._base import Balancer
from ._extra_utils import check_int, check_range

__all__ = ["FairGrad", "fairgrad_weights"]

_ZERO_ROW = 1e-24  # a row with ‖gₖ‖² below this fraction of the largest counts as zero


def _newton(a: Tensor, p: float, max_iter: int, tol: float) -> tuple[Tensor, float]:
    """Minimise ``½ wᵀAw − Σ φ(wₖ)`` (``φ' = w^{-p}``) over ``w > 0``; returns (w, residual).

    The objective is strictly convex on ``w > 0``; its stationary point solves ``A w = w^{-p}``.
    Damped Newton with a positivity-keeping, Armijo-backtracked step.
    """

    def phi(w: Tensor) -> Tensor:
        return torch.log(w).sum() if p == 1.0 else (w.pow(1.0 - p) / (1.0 - p)).sum()

    def objective(w: Tensor) -> Tensor:
        return 0.5 * w @ (a @ w) - phi(w)

    k = a.shape[0]
    w = torch.ones(k, dtype=a.dtype, device=a.device)
    residual = float("inf")
    for _ in range(max_iter):
        grad = a @ w - w.pow(-p)
        residual = float(grad.abs().max() / w.pow(-p).abs().max())
        if residual <= tol:
            break
        hess = a + torch.diag(p * w.pow(-p - 1.0))
        step = -torch.linalg.solve(hess, grad)
        neg = step < 0
        t = 1.0
        if bool(neg.any()):
            t = min(1.0, 0.99 * float((-w[neg] / step[neg]).min()))
        f0 = objective(w)
        slope = float(grad @ step)
        while t > 1e-12 and float(objective(w + t * step)) > float(f0) + 1e-4 * t * slope:
            t *= 0.5
        w = w + t * step
    return w, residual


def fairgrad_weights(gramian: Tensor, alpha: float = 1.0, max_iter: int = 100,
                     tol: float = 1e-10) -> Tensor:
    """FairGrad's weights ``[K]``: the positive solution of ``(G Gᵀ) w = w^{-1/α}``.

    Update ``g = Σₖ wₖ gₖ``. It maximises the α-fair utility ``Σₖ uₖ^{1−α}/(1−α)`` of the task
    improvements ``uₖ = gₖᵀ g``. ``α = 0`` is linear scalarisation (uniform ``1/K``), ``α = 1``
    proportional fairness (Nash-MTL's bargaining solution), ``α → ∞`` max-min fairness.

    Solved in torch (no scipy) as the minimiser of the strictly convex
    ``½ wᵀAw − Σₖ φ(wₖ)``, ``φ'(w) = w^{-1/α}``, after normalising ``A`` to unit mean diagonal
    (the solution then rescales by ``s^{-α/(1+α)}``). A task with a zero gradient would need an
    infinite weight; it gets weight 0 (its row contributes nothing either way).
    """
    k = gramian.shape[0]
    a = gramian.to(torch.float64)
    if alpha == 0.0:
        return torch.full((k,), 1.0 / k, dtype=torch.float64, device=a.device)
    diag = torch.diagonal(a)
    top = float(diag.max())
    w = torch.zeros(k, dtype=torch.float64, device=a.device)
    if top <= 0.0:
        return w
    active = diag > _ZERO_ROW * top
    sub = a[active][:, active]
    scale = float(torch.diagonal(sub).mean())
    sol, residual = _newton(sub / scale, 1.0 / alpha, max_iter, tol)
    if not residual <= 1e-6:
        warnings.warn(
            f"FairGrad's solver stopped at relative residual {residual:.2e} after {max_iter} "
            f"iterations; the weights are approximate (raise max_iter)",
            RuntimeWarning,
            stacklevel=3,
        )
    w[active] = sol * scale ** (-alpha / (1.0 + alpha))
    return w


class FairGrad(Balancer):
    """``g = Σₖ wₖ gₖ`` with ``(G Gᵀ) w = w^{-1/α}``, ``w > 0`` (α-fair update).

    Args:
        num_tasks: K (optional).
        alpha: fairness ``α ≥ 0`` (default 1.0, proportional fairness; the paper sweeps
            α ∈ {0.5, 1, 2, 5, ...} per benchmark).
        max_iter: Newton iterations (default 100; it usually stops below 15).
    """

    name = "fairgrad"
    from_gramian = True
    homogeneous = False  # B(sG) = s^{(1-α)/(1+α)} B(G)

    def __init__(self, num_tasks: int | None = None, alpha: float = 1.0,
                 max_iter: int = 100) -> None:
        super().__init__(num_tasks)
        self.alpha = check_range("alpha", alpha, 0.0, None)
        self.max_iter = check_int("max_iter", max_iter, 1)

    def weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        return fairgrad_weights(gramian, self.alpha, self.max_iter)

    def __repr__(self) -> str:
        return f"FairGrad(num_tasks={self.num_tasks}, alpha={self.alpha})"
