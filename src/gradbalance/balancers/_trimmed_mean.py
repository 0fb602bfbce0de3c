"""TrimmedMean: coordinate-wise trimmed mean of the task gradients.

Yin et al. (2018), *Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates*,
ICML, arXiv:1803.01498 (the coordinate-wise trimmed mean; TorchJD's ``TrimmedMean``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_int
from .._shard import Shard
from ._base import Balancer, Combination

__all__ = ["TrimmedMean", "trimmed_mean_update"]


#: Up to this many tasks the columns are sorted (TorchJD's summation order, bit for bit).
SORT_UP_TO = 32


def trimmed_mean_update(matrix: Tensor, trim_number: int) -> Tensor:
    """Per coordinate, drop the ``trim_number`` largest and smallest entries, average the rest.

    ``gⱼ = mean(sort(G[:, j])[t : K − t])``; needs ``K ≥ 2t + 1``. Above ``SORT_UP_TO`` tasks
    no column is sorted: the ``t`` largest, then the ``t`` smallest of the rest, are found
    with ``topk`` and zeroed, and the kept entries summed in row order (``O(K P)`` passes
    over the rows instead of a ``[K, P]`` sort; the same values, summed in another order).

    Example:
        >>> import torch
        >>> trimmed_mean_update(torch.tensor([[1.0], [100.0], [2.0], [-5.0], [3.0]]), 1)
        tensor([2.])
    """
    k = matrix.shape[0]
    t = trim_number
    if k < 2 * t + 1:
        raise ValueError(
            f"matrix has {k} task rows but trim_number={t} removes {2 * t}; "
            f"pass at least {2 * t + 1} tasks or lower trim_number"
        )
    if k <= SORT_UP_TO or t == 0:
        ordered, _ = torch.sort(matrix, dim=0)
        return ordered[t : k - t].mean(dim=0)
    high = matrix.topk(t, dim=0).indices
    rest = matrix.scatter(0, high, float("inf"))
    low = rest.topk(t, dim=0, largest=False).indices
    return rest.scatter_(0, high, 0.0).scatter_(0, low, 0.0).sum(dim=0) / (k - 2 * t)


class TrimmedMean(Balancer):
    """Coordinate-wise trimmed mean (a robust aggregator; a matrix method).

    ``O(K P log K)`` (a sort per coordinate) up to 32 tasks, ``O(t K P)`` above (``topk``).

    Cost in K: ``O(KP log K)`` (a sort per coordinate) up to 32 tasks, ``O(tKP)`` above
    (``topk``).

    Args:
        num_tasks: K (optional).
        trim_number: ``t``, the number of largest and of smallest values removed per
            coordinate (default 1); needs ``K ≥ 2t + 1``.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import TrimmedMean
        >>> g = torch.tensor([[1.0, 5.0], [2.0, -4.0], [9.0, 0.0]], dtype=torch.float64)
        >>> TrimmedMean(trim_number=1)(g)  # K = 3, t = 1: the median of each column
        tensor([2., 0.], dtype=torch.float64)
    """

    name = "trimmedmean"
    from_gramian = False
    homogeneous = True

    def __init__(self, num_tasks: int | None = None, trim_number: int = 1) -> None:
        super().__init__(num_tasks)
        self.trim_number = check_int("trim_number", trim_number, 0)
        self.min_tasks = 2 * self.trim_number + 1
        if num_tasks is not None and num_tasks < 2 * trim_number + 1:
            raise ValueError(
                f"Invalid trim_number: {trim_number} (expected 2 * trim_number + 1 <= "
                f"num_tasks = {num_tasks})"
            )

    def _combine_matrix(self, matrix: Tensor, losses: Tensor | None) -> Combination:
        return Combination(trimmed_mean_update(matrix, self.trim_number))

    def _combine_matrix_sharded(self, matrix: Tensor, losses: Tensor | None, gramian: Tensor,
                                shard: Shard) -> Combination:
        """Per coordinate: each rank trims its own columns, no collective."""
        return self._combine_matrix(matrix, losses)

    def __repr__(self) -> str:
        return f"TrimmedMean(num_tasks={self.num_tasks}, trim_number={self.trim_number})"
