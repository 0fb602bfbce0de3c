"""An accelerated projected-gradient start of the box pivoting, where ``Q`` is well conditioned.

Not a balancer module (no ``__all__``). The float32 pivoting of :mod:`._pcg` (UPGrad's K
projections at K ≥ 64) starts from :func:`~._pcg.opposite_start`, about 50 indices per
problem away from the optimal free set at K = 1,024, and pivots five to seven times, each
pivot a preconditioned conjugate-gradient restart. Where ``Q`` has no outlying eigenvalue and
a small condition number (rows with no shared direction: ``torch.randn`` rows at K = 1,024,
P = 20,000 give ``κ = 2.5``), FISTA (Beck & Teboulle 2009) with the gradient-mapping restart
(O'Donoghue & Candès 2015) reaches the optimal free sets in about ten products of
``[B, K] × [K, K]``, one per step: after ten steps 0.1 indices per problem differ, and the
pivoting confirms them in one solve. Only a start: the float32 and float64 pivotings decide.

Example:
    >>> import torch
    >>> q = torch.tensor([[2.0, -1.0], [-1.0, 2.0]])
    >>> free, y, yq = projected_start(q, torch.tensor([[1.0, -2.0]]), 3.0, steps=40)
    >>> free.tolist(), torch.allclose(y, torch.tensor([[0.0, 1.0]]), atol=1e-5)
    ([[False, True]], True)
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Steps of :func:`projected_start` (ten: 0.1 indices per problem from the optimal free sets
#: on ``torch.randn`` rows at K = 1,024; fourteen take 40 % more time for the same start).
PROJECTED_STEPS = 10
#: The start is taken where ``λ₁ ‖Q⁻¹‖_∞`` (an upper estimate of the condition number: the
#: power steps' ``λ₁`` and Gershgorin's bound on ``1/λ_min``) is at most this: FISTA's error
#: falls by about ``1 − 1/√κ`` per step, the pivoting's does not depend on ``κ``.
PROJECTED_MAX_KAPPA = 32.0
#: The step is ``1/(LIPSCHITZ_MARGIN λ₁)``: ``λ₁`` from a few power steps is below the
#: largest eigenvalue.
LIPSCHITZ_MARGIN = 1.1


def projected_start(q: Tensor, shift: Tensor, top: float,
                    steps: int = PROJECTED_STEPS) -> tuple[Tensor, Tensor, Tensor]:
    """``(free, y, yQ)`` ``[B, K]``: ``steps`` FISTA steps on ``min ½ yᵀQy + shiftᵀy``,
    ``y ≥ 0`` per row, from ``y = 0``, in the dtype of ``q``; ``top``: ``λ₁(Q)`` (estimated).

    ``y ← max(0, z − (zQ + shift)/L)``, ``z ← y + ((tₖ − 1)/tₖ₊₁)(y − y_prev)``, a row's
    momentum reset (``t = 1``) where ``(z − y)ᵀ(y − y_prev) > 0`` (the step went uphill);
    ``free = {y > 0}``, ``yQ`` one more product.
    """
    step = 1.0 / (LIPSCHITZ_MARGIN * top)
    y = (shift * -step).clamp_min_(0.0)  # the first step from z = 0: no product
    z = y
    t = torch.ones(shift.shape[0], dtype=q.dtype)
    for _ in range(steps - 1):
        new = (z @ q).add_(shift).mul_(-step).add_(z).clamp_min_(0.0)
        moved = new - y
        uphill = ((z - new) * moved).sum(dim=1) > 0.0
        t_next = (1.0 + (1.0 + 4.0 * t * t).sqrt()) / 2.0
        momentum = torch.where(uphill, 0.0, (t - 1.0) / t_next)
        t = torch.where(uphill, 1.0, t_next)
        z = moved.mul_(momentum[:, None]).add_(new)
        y = new
    return y > 0.0, y, y @ q


def pays(top: float, inverse_norm: float, has_outliers: bool) -> bool:
    """Whether :func:`projected_start` is taken: no deflated outlier and ``λ₁ ‖Q⁻¹‖_∞`` at
    most ``PROJECTED_MAX_KAPPA``."""
    return not has_outliers and top * inverse_norm <= PROJECTED_MAX_KAPPA
