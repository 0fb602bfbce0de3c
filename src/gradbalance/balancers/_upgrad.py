"""UPGrad: project each task gradient onto the dual cone of all of them, then combine.

Quinton & Rey (2024), *Jacobian Descent for Multi-Objective Optimization*, arXiv:2406.16232,
eq. 5 and Proposition 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._base import Balancer
from ._solvers import as_pref, check_pref, project_dual_cone, trace_normalized

__all__ = ["UPGrad", "upgrad_weights"]


def upgrad_weights(gramian: Tensor, pref: Tensor | None = None) -> Tensor:
    """Weights ``[K]`` (float64, CPU): ``w = Σᵢ vᵢ`` with ``vᵢ = argmin_{v ≥ pᵢ eᵢ} vᵀGv``.

    ``Jᵀvᵢ`` is the projection of ``pᵢ gᵢ`` onto the dual cone ``{x : J x ≥ 0}``, so the
    update ``Σᵢ Jᵀvᵢ`` has a non-negative inner product with every task gradient. ``pref``
    defaults to ``1/K`` (the paper's mean).
    """
    k = gramian.shape[0]
    gram, _ = trace_normalized(gramian)
    p = check_pref(pref, k, 1.0 / k)
    w = torch.zeros(k, dtype=torch.float64)
    for i in range(k):
        u = torch.zeros(k, dtype=torch.float64)
        u[i] = p[i]
        w += project_dual_cone(gram, u)
    return w


class UPGrad(Balancer):
    """UPGrad (Quinton & Rey 2024): ``g = Σᵢ π(pᵢ gᵢ)``, ``π`` the dual-cone projection.

    Each (preference-weighted) task gradient is projected onto the dual cone of the rows
    ``{x : gₖ·x ≥ 0 ∀k}`` and the projections are summed: the update conflicts with no task.
    Each projection is a K-dimensional QP on the Gramian, solved exactly (active set), where
    TorchJD adds ``1e-4`` to the diagonal of the trace-normalised Gramian.

    Args:
        num_tasks: K (optional).
        pref: preference vector ``[K]`` (non-negative); default ``1/K`` each (the paper's).
    """

    name = "upgrad"
    from_gramian = True
    homogeneous = True

    def __init__(
        self, num_tasks: int | None = None, *, pref: Sequence[float] | Tensor | None = None
    ) -> None:
        super().__init__(num_tasks)
        self.pref = as_pref(pref)

    def weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        return upgrad_weights(gramian, self.pref).to(gramian.device)

    def __repr__(self) -> str:
        pref = None if self.pref is None else self.pref.tolist()
        return f"UPGrad(num_tasks={self.num_tasks}, pref={pref})"
