"""Krum and Multi-Krum: pick the task gradients closest to their neighbours."""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_int, check_square
from ._base import Balancer

__all__ = ["Krum", "krum_weights"]


def krum_weights(gramian: Tensor, n_byzantine: int = 0, n_selected: int = 1) -> Tensor:
    """Multi-Krum weights ``[K]`` from the Gramian.

    Squared distances ``dᵢⱼ² = Gᵢᵢ + Gⱼⱼ − 2Gᵢⱼ``; score ``sᵢ`` = sum of the distances from
    ``gᵢ`` to its ``K − f − 2`` nearest other rows (``f = n_byzantine``). The ``m = n_selected``
    lowest scores get weight ``1/m`` (ties: the lower index; the distances symmetrised, so the
    tie of two mutual nearest rows is exact), the others 0. Needs
    ``K ≥ f + 3`` and ``K ≥ m``.

    Example:
        >>> import torch
        >>> from gradbalance.functional import krum_weights
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 1.0], [10.0, 10.0]], dtype=torch.float64)
        >>> krum_weights(g @ g.T, n_selected=2)
        tensor([0.5000, 0.5000, 0.0000], dtype=torch.float64)
    """
    check_square("gramian", gramian)
    check_int("n_byzantine", n_byzantine, 0)
    check_int("n_selected", n_selected, 1)
    k = gramian.shape[0]
    if k < n_byzantine + 3 or k < n_selected:
        raise ValueError(
            f"gramian has {k} tasks but Krum with n_byzantine={n_byzantine}, "
            f"n_selected={n_selected} needs at least {max(n_byzantine + 3, n_selected)}; "
            f"lower n_byzantine/n_selected"
        )
    diag = torch.diagonal(gramian)
    dist = (diag.unsqueeze(0) + diag.unsqueeze(1) - 2 * gramian).clamp_min(0).sqrt()
    # dᵢⱼ = dⱼᵢ exactly, whatever the product's rounding left in Gᵢⱼ − Gⱼᵢ: two rows that are
    # each other's nearest tie exactly, and the tie goes to the lower index on every machine
    dist = 0.5 * (dist + dist.T)
    dist = dist + torch.diag(torch.full_like(diag, float("inf")))  # exclude self
    n_closest = k - n_byzantine - 2
    nearest, _ = torch.sort(dist, dim=1)
    scores = nearest[:, :n_closest].sum(dim=1)
    order = torch.argsort(scores, stable=True)
    w = torch.zeros(k, dtype=gramian.dtype, device=gramian.device)
    w[order[:n_selected]] = 1.0 / n_selected
    return w


class Krum(Balancer):
    """``g`` = the mean of the ``n_selected`` most central task gradients (Multi-Krum).

    Cost in K: pairwise distances from the Gramian and a sort per task, ``O(K² log K)``, besides
    the Gramian ``O(K²P)``.

    Args:
        n_byzantine: ``f``, the number of rows that may be adversarial (default 0).
        n_selected: ``m``, how many rows are averaged (default 1: Krum).

    Reference: Blanchard et al., "Machine Learning with Adversaries: Byzantine Tolerant
    Gradient Descent", NeurIPS 2017.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import Krum
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 1.0], [10.0, 10.0]], dtype=torch.float64)
        >>> Krum(n_selected=2)(g)  # the mean of the two closest rows; the outlier is dropped
        tensor([0.5000, 0.5000], dtype=torch.float64)
    """

    name = "krum"
    _repr_args = ("num_tasks", "n_byzantine", "n_selected")
    from_gramian = True
    homogeneous = True
    weight_degree = 0.0  # the ranking of the scores is scale-free

    def __init__(self, num_tasks: int | None = None, n_byzantine: int = 0,
                 n_selected: int = 1) -> None:
        super().__init__(num_tasks)
        self.n_byzantine = check_int("n_byzantine", n_byzantine, 0)
        self.n_selected = check_int("n_selected", n_selected, 1)
        self.min_tasks = max(self.n_byzantine + 3, self.n_selected)
        if num_tasks is not None and num_tasks < self.min_tasks:
            raise ValueError(
                f"Invalid num_tasks: {num_tasks} (expected num_tasks >= n_byzantine + 3 = "
                f"{n_byzantine + 3} and >= n_selected = {n_selected})"
            )

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        return krum_weights(gramian, self.n_byzantine, self.n_selected)
