"""FairGrad: α-fair allocation of the update among the tasks."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .._checks import check_int, check_range
from ._base import Balancer

__all__ = ["FairGrad", "fairgrad_weights"]

_ZERO_ROW = 1e-24  # a row with ‖gₖ‖² below this fraction of the largest counts as zero


def _newton(a: Tensor, p: float, max_iter: int, tol: float) -> tuple[Tensor, float]:
    """Minimise ``½ wᵀAw − Σ φ(wₖ)`` (``φ' = w^{-p}``) over ``w > 0``; returns (w, residual).

    The objective is strictly convex on ``w > 0``; its stationary point solves ``A w = w^{-p}``.
    Damped Newton with a positivity-keeping step, backtracked until it satisfies Armijo or
    lowers the residual; started from the orthogonal-gradient solution.
    """

    def phi(w: Tensor) -> Tensor:
        return torch.log(w).sum() if p == 1.0 else (w.pow(1.0 - p) / (1.0 - p)).sum()

    def objective(w: Tensor) -> Tensor:
        return 0.5 * w @ (a @ w) - phi(w)

    # Start at the solution for orthogonal gradients, wₖ = Aₖₖ^{-1/(1+p)}, times its best
    # multiple: d/ds f(s·w) = 0 at s^{1+p} = Σ wₖ^{1−p} / wᵀAw (when wᵀAw > 0).
    w = torch.diagonal(a).pow(-1.0 / (1.0 + p))
    quad = float(w @ a @ w)
    if quad > 0.0:
        w = w * (float(w.pow(1.0 - p).sum()) / quad) ** (1.0 / (1.0 + p))
    residual = float("inf")
    inf = torch.tensor(float("inf"), dtype=a.dtype, device=a.device)
    for _ in range(max_iter):
        wp = w.pow(-p)
        grad = a @ w - wp
        hess = a + torch.diag(p * wp / w)
        neg_step, info = torch.linalg.solve_ex(hess, grad)
        step = -neg_step
        ratio = torch.where(step < 0, -w / step, inf).min()
        # One host sync for every scalar the iteration needs.
        residual, ratio_v, slope, f0, bad = torch.stack([
            grad.abs().max() / wp.abs().max(), ratio, grad @ step, objective(w),
            (info != 0).to(a.dtype) + (~torch.isfinite(step)).sum()]).tolist()
        if residual <= tol or bad != 0:
            break  # converged, or w diverges (no solution): the caller warns on the residual
        t = min(1.0, 0.99 * ratio_v)
        while t > 1e-12:
            cand = w + t * step
            cand_p = cand.pow(-p)
            cand_f, cand_res = torch.stack([
                objective(cand), (a @ cand - cand_p).abs().max() / cand_p.abs().max()]).tolist()
            # Near the optimum f changes by O(residual²), below float64 resolution of f, so
            # Armijo alone stalls there; a step that lowers the residual is accepted too.
            if cand_f <= f0 + 1e-4 * t * slope or cand_res < residual:
                break
            t *= 0.5
        w = w + t * step
    return w, residual


def fairgrad_weights(gramian: Tensor, alpha: float = 1.0, max_iter: int = 100,
                     tol: float = 1e-10) -> Tensor:
    """FairGrad's weights ``[K]``: the positive solution of ``(G Gᵀ) w = w^{-1/α}``.

    Update ``g = Σₖ wₖ gₖ``. It maximises the α-fair utility ``Σₖ uₖ^{1−α}/(1−α)`` of the task
    improvements ``uₖ = gₖᵀ g``. ``α = 0`` is linear scalarisation (uniform ``1/K``), ``α = 1``
    proportional fairness (Nash-MTL's bargaining solution), ``α → ∞`` max-min fairness.

    Solved as the minimiser of the strictly convex ``½ wᵀAw − Σₖ φ(wₖ)``,
    ``φ'(w) = w^{-1/α}``, on ``A`` normalised to unit mean diagonal. A zero row gets weight 0.

    Example:
        >>> import torch
        >>> from gradbalance.functional import fairgrad_weights
        >>> fairgrad_weights(torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64)))
        tensor([1.0000, 0.5000], dtype=torch.float64)
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

    Cost in K: damped Newton, ``O(K³)`` per step (at most 100 steps), besides the Gramian
    ``O(K²P)``.

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
        tensor([1., 1.], dtype=torch.float64)
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
