"""DualProj: project the (preference-weighted) mean gradient onto the dual cone of the rows.

Lopez-Paz & Ranzato (2017), *Gradient Episodic Memory for Continual Learning*, NeurIPS,
eq. 11 (the GEM projection), as an aggregator in Quinton & Rey (2024), arXiv:2406.16232.
"""

from __future__ import annotations

from torch import Tensor

from .._checks import check_pref, check_square
from ._pref import PreferenceBalancer
from ._solvers import project_dual_cone, trace_normalized

__all__ = ["DualProj", "dualproj_weights"]


def dualproj_weights(gramian: Tensor, pref: Tensor | None = None) -> Tensor:
    """Weights ``[K]`` (float64, CPU): ``w = argmin_{v ≥ p} vᵀGv``.

    ``Jᵀw`` is the projection of ``Jᵀp`` (default ``p = 1/K``: the mean gradient) onto the
    dual cone ``{x : J x ≥ 0}``: the closest vector to the mean that conflicts with no task.

    Example:
        >>> import torch
        >>> from gradbalance.functional import dualproj_weights
        >>> g = torch.tensor([[1.0, 0.0], [-2.0, 1.0]], dtype=torch.float64)
        >>> dualproj_weights(g @ g.T)  # 1·g₁ + ½·g₂ = (0, ½), as in DualProj's example
        tensor([1.0000, 0.5000], dtype=torch.float64)
    """
    check_square("gramian", gramian)
    k = gramian.shape[0]
    gram, _ = trace_normalized(gramian)
    return project_dual_cone(gram, check_pref("pref", pref, k, 1.0 / k))


class DualProj(PreferenceBalancer):
    """DualProj: ``g = π(Σₖ pₖ gₖ)``, ``π`` the projection onto ``{x : gₖ·x ≥ 0 ∀k}``.

    One K-dimensional QP on the Gramian, solved exactly (active set): ``O(|F|³)`` per
    pivoting iteration for ``|F|`` free indices, ``O(K³)`` at most (the Gramian ``O(K² P)``).

    Cost in K: one box QP on the Gramian, ``O(|F|³)`` per pivoting iteration for ``|F|`` free
    indices (``O(K³)`` at most); where the pivoting leaves it open on a Gramian whose small
    eigenvalues form a cluster, ADMM's free sets first (``O(K³)`` once, ``O(K²)`` per step),
    besides the Gramian ``O(K²P)``.

    Args:
        num_tasks: K (optional).
        pref: preference vector ``[K]`` (non-negative); default ``1/K`` each (TorchJD's).

    Example:
        >>> import torch
        >>> from gradbalance.balancers import DualProj
        >>> g = torch.tensor([[1.0, 0.0], [-2.0, 1.0]], dtype=torch.float64)
        >>> DualProj()(g)  # the mean (-½, ½) conflicts with g₁: projected onto x₁ = 0
        tensor([0.0000, 0.5000], dtype=torch.float64)
    """

    name = "dualproj"
    rule = staticmethod(dualproj_weights)
