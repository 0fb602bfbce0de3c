"""UPGrad: project each task gradient onto the dual cone of all of them, then combine.

Quinton & Rey (2024), *Jacobian Descent for Multi-Objective Optimization*, arXiv:2406.16232,
eq. 5 and Proposition 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_pref, check_square
from ._pref import PreferenceBalancer
from ._solvers import project_dual_cone, trace_normalized

__all__ = ["UPGrad", "upgrad_weights"]


def upgrad_weights(gramian: Tensor, pref: Tensor | None = None) -> Tensor:
    """Weights ``[K]`` (float64, CPU): ``w = Σᵢ vᵢ`` with ``vᵢ = argmin_{v ≥ pᵢ eᵢ} vᵀGv``.

    ``Jᵀvᵢ`` is the projection of ``pᵢ gᵢ`` onto the dual cone ``{x : J x ≥ 0}``, so the
    update ``Σᵢ Jᵀvᵢ`` has a non-negative inner product with every task gradient. ``pref``
    defaults to ``1/K`` (the paper's mean). The K projections share the Gramian and are
    solved together (one batched solve); ``K = 2`` has a closed form.

    Example:
        >>> import torch
        >>> from gradbalance.functional import upgrad_weights
        >>> g = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
        >>> upgrad_weights(g @ g.T)  # 1·g₁ + ¾·g₂ = (¼, ¾), as in UPGrad's example
        tensor([1.0000, 0.7500], dtype=torch.float64)
    """
    check_square("gramian", gramian)
    k = gramian.shape[0]
    gram, _ = trace_normalized(gramian)
    p = check_pref("pref", pref, k, 1.0 / k)
    return project_dual_cone(gram, torch.diag(p)).sum(dim=0)


class UPGrad(PreferenceBalancer):
    """UPGrad (Quinton & Rey 2024): ``g = Σᵢ π(pᵢ gᵢ)``, ``π`` the dual-cone projection.

    Each (preference-weighted) task gradient is projected onto the dual cone of the rows
    ``{x : gₖ·x ≥ 0 ∀k}`` and the projections are summed: the update conflicts with no task.
    Each projection is a K-dimensional QP on the Gramian, solved exactly (one batched active
    set for all K), where TorchJD adds ``1e-4`` to the diagonal of the trace-normalised
    Gramian. Cost in K: ``O(K⁴)`` per pivoting iteration below 64 tasks (K batched
    factorisations), ``O(K³)`` per conjugate-gradient step from 64 on (two ``[K, K]``
    products for all K projections; a singular or badly conditioned Gramian too, first,
    preconditioned through ``(Q + δI)⁻¹``); where the Gramian's bulk is well conditioned,
    eight FISTA steps then mixed-precision refinement: about twelve ``[K, K]`` products in
    float32 or bfloat16 and two in float64 for all K projections (one thread, K = 1,024,
    P = 20,000: about 1.8 Gramians); a Gramian of numerical rank ``r ≤ K/4`` (``≤ √(2²⁰/K)``;
    low up to its rounding counts: float32 products) in ``r`` dimensions, ``O(rK + r²)`` per
    addition; up to rank ``K/2``, rows whose conic hull is their span (every projection zero)
    certified on the eigen-factor, ``O(K³)`` once and ``O(Kr)`` per alternating projection
    (one NNLS in ``r`` dimensions where those stall, ``K/r`` near 2); a singular Gramian of
    rank up to ``0.65K`` (a thin dual cone) from a float32 FISTA start, ``O(K³)`` per step
    for all K projections (500–2,000 steps), then factorisations of the free blocks,
    ``O(K r³)`` per pivoting iteration, first from ADMM's free sets (``O(K³)`` per step for
    all K, 100–600 steps); a positive definite Gramian whose small eigenvalues form a
    cluster (rows of low rank plus noise) from ADMM's too (up to 2,000 steps), then the
    same factorisations; groups of parallel rows collapsed (``O(K²)`` to find them,
    ``O(K³)`` to check the answers); the Gramian ``O(K² P)`` besides.

    Args:
        num_tasks: K (optional).
        pref: preference vector ``[K]`` (non-negative); default ``1/K`` each (the paper's).

    Example:
        >>> import torch
        >>> from gradbalance.balancers import UPGrad
        >>> g = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
        >>> UPGrad()(g)  # ½g₁ → (¼, ¼) onto g₂·x = 0, ½g₂ → (0, ½) onto g₁·x = 0
        tensor([0.2500, 0.7500], dtype=torch.float64)
    """

    name = "upgrad"
    rule = staticmethod(upgrad_weights)
