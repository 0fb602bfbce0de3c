"""ConFIG: the conflict-free direction with equal cosine to every task gradient."""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_pref, check_square
from ._boxqp import ROUNDING_MULTIPLE
from ._denoise import KeptSpectrum
from ._pref import PreferenceBalancer
from ._solvers import trace_normalized

__all__ = ["ConFIG", "config_weights"]


def config_weights(gramian: Tensor, pref: Tensor | None = None, rtol: float = 1e-12,
                   rounding: float = 0.0) -> Tensor:
    """Weights ``[K]`` (float64, CPU) of ConFIG's update, from the Gramian only.

    Update rule: ``g_u = U⁺ p`` with ``U`` the unit task gradients (rows ``uₖ = gₖ/‖gₖ‖``,
    zero for a zero gradient), ``ĝ = g_u/‖g_u‖``, ``g = (Σₖ gₖ·ĝ) ĝ``. Since
    ``U⁺ = Uᵀ(UUᵀ)⁺`` and ``UUᵀ = C`` (the cosine matrix), ``g_u = Σₖ (C⁺p)ₖ uₖ``,
    ``‖g_u‖² = pᵀC⁺p``: the weights on the raw rows are ``vₖ = (C⁺p)ₖ/‖gₖ‖`` times
    ``1ᵀGv / pᵀC⁺p``. ``p`` defaults to ones (the paper). ``C⁺`` drops the eigenvalues of
    ``C`` at or below ``rtol`` times the largest, and where the Gramian carries ``rounding``
    (relative to ``‖gᵢ‖‖gⱼ‖``, :func:`~gradbalance.gramian.products_rounding`) those at or
    below ``max(rounding, 2|λ_min|)``: directions the rounding cannot tell from zero (the
    cut :class:`~gradbalance.balancers.Balancer` makes for the rules that invert the
    Gramian, here on the one eigen-decomposition ``C⁺`` needs). Where ``p``'s part in
    ``C``'s kept range is at most ``max(rtol, rounding)·‖p‖`` (``Uᵀp = 0``: every task with
    a negative of it) ``g_u`` is zero and so are the weights.

    Example:
        >>> import torch
        >>> from gradbalance.functional import config_weights
        >>> config_weights(torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64)))
        tensor([1.5000, 0.7500], dtype=torch.float64)
    """
    check_square("gramian", gramian)
    k = gramian.shape[0]
    gram, _ = trace_normalized(gramian)
    p = check_pref("pref", pref, k, 1.0)
    norms = torch.diagonal(gram).clamp_min(0).sqrt()
    inv = torch.where(norms > 0, 1.0 / torch.where(norms > 0, norms, 1.0), 0.0)
    cos = gram * torch.outer(inv, inv)
    if k == 0:
        return torch.zeros(0, dtype=torch.float64)
    lam, vec = torch.linalg.eigh(cos)
    cut = rtol * lam.abs().max()
    if rounding > 0.0:
        kept = lam > torch.maximum(cut, (-ROUNDING_MULTIPLE * lam[0]).clamp_min(rounding))
    else:
        kept = lam.abs() > cut  # torch.linalg.pinv's rule
    inverse = torch.where(kept, lam.reciprocal(), torch.zeros_like(lam))
    coef = vec.T @ p
    a: Tensor = vec @ (inverse * coef)
    v = a * inv
    norm_sq = a @ cos @ a
    length = (gram @ v).sum()
    # p in C's null space up to the rounding (every task with its negative: Uᵀp = 0): no
    # direction, not one the rounding draws (its length then set by 1/‖g_u‖²)
    size = torch.linalg.vector_norm(p)
    within = torch.linalg.vector_norm(coef[kept]) <= max(rtol, rounding) * size
    if float(norm_sq) <= 0.0 or bool(within):
        return torch.zeros(k, dtype=torch.float64)
    return v * (length / norm_sq)


class ConFIG(PreferenceBalancer):
    """ConFIG (Liu et al. 2024): ``g = (Σₖ gₖ·ĝ) ĝ``, ``ĝ ∝ U⁺p``.

    The direction ``ĝ`` has the same cosine with every (linearly independent) task gradient;
    its length is the sum of the task gradients' projections on it.

    Cost in K: one pseudo-inverse, ``O(K³)``, besides the Gramian ``O(K²P)``.

    Args:
        pref: ``[K]`` non-negative; default ones (the paper).

    Reference: Liu et al., "ConFIG: Towards Conflict-free Training of Physics Informed Neural
    Networks", arXiv:2408.11104, eq. 2 (without the momentum variant).

    Example:
        >>> import torch
        >>> from gradbalance.balancers import ConFIG
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> ConFIG()(g)  # along (1, 1)/√2, length (1 + 2)/√2
        tensor([1.5000, 1.5000], dtype=torch.float64)
    """

    name = "config"
    rule = staticmethod(config_weights)

    def _rounded_weights(self, gramian: Tensor, losses: Tensor | None, rounding: float,
                         spectrum: KeptSpectrum | None = None) -> Tensor:
        return config_weights(gramian, self.pref, rounding=rounding).to(gramian.device)
