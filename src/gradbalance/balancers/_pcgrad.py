"""PCGrad: project each task gradient off the gradients it conflicts with.

Yu et al. (2020), *Gradient Surgery for Multi-Task Learning*, NeurIPS, arXiv:2001.06782,
Algorithm 1.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from .._checks import check_generator, check_square
from ._pairwise import Visit, column_sums, pairwise_pass, pass_weights
from ._rng import OwnedGeneratorState, private_generator
from ._solvers import trace_normalized

__all__ = ["PCGrad", "pcgrad_coefficients", "pcgrad_orders"]

Reduction = Literal["sum", "mean"]


def pcgrad_orders(k: int, generator: torch.Generator | None = None) -> Tensor:
    """``[K, K]`` int64: row ``i`` is the random order in which task ``i`` visits the others.

    One ``torch.randperm(K)`` per task, in task order (the entry equal to ``i`` is skipped
    when used), so a generator seeded like ``torch.manual_seed`` reproduces TorchJD's order.

    Example:
        >>> from gradbalance.functional import pcgrad_orders
        >>> pcgrad_orders(3).sort(dim=1).values  # each row a permutation of the tasks
        tensor([[0, 1, 2],
                [0, 1, 2],
                [0, 1, 2]])
    """
    return torch.stack([torch.randperm(k, generator=generator) for _ in range(k)])


def pcgrad_coefficients(gramian: Tensor, orders: Tensor) -> Tensor:
    """Coefficients ``C`` ``[K, K]`` with ``g_i^PC = Σⱼ C[i, j] gⱼ``, from the Gramian only.

    Update rule, for each task ``i`` and each ``j ≠ i`` in ``orders[i]``: if
    ``g_i^PC·gⱼ < 0`` then ``g_i^PC ← g_i^PC − (g_i^PC·gⱼ / ‖gⱼ‖²) gⱼ``. With
    ``g_i^PC = C[i] J``, ``g_i^PC·gⱼ = (C G)[i, j]`` and the projection is
    ``C[i, j] −= (C G)[i, j] / G[j, j]`` (the blocked pass of
    :func:`~gradbalance.balancers._pairwise.pairwise_pass`, vectorised over ``i``: ``O(K³)``
    work). A zero gradient ``gⱼ`` is never projected on.

    Example:
        >>> import torch
        >>> from gradbalance.functional import pcgrad_coefficients, pcgrad_orders
        >>> g = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
        >>> pcgrad_coefficients(g @ g.T, pcgrad_orders(2))  # g₁ + ½g₂ and g₂ + g₁
        tensor([[1.0000, 0.5000],
                [1.0000, 1.0000]], dtype=torch.float64)
    """
    check_square("gramian", gramian)
    gram = gramian.to(torch.float64)
    orders = orders.to(gram.device)
    return pairwise_pass(gram, orders, _projections(gram, orders))


def _projections(gram: Tensor, orders: Tensor) -> Visit:
    """PCGrad's visit: ``w = −min(d, 0) / G[j, j]`` (``gram`` float64)."""
    diag = torch.diagonal(gram)
    rows = torch.arange(gram.shape[0], device=gram.device)[:, None]
    # w = −d / G[j, j] where d < 0; a division by inf (j = i, or gⱼ = 0) gives w = 0.
    den = torch.where((orders != rows) & (diag[orders] > 0), -diag[orders], float("inf"))
    den = den.T.contiguous()  # [step, task]

    def visit(t: int, dots: Tensor, out: Tensor) -> Tensor:
        return torch.clamp(dots, max=0.0, out=out).div_(den[t])

    return visit


class PCGrad(OwnedGeneratorState):
    """PCGrad (Yu et al. 2020): ``g = Σᵢ g_i^PC`` (paper) or their mean.

    Each ``g_i^PC`` starts at ``gᵢ`` and is projected onto the normal plane of every ``gⱼ`` it
    conflicts with (``g_i^PC·gⱼ < 0``), visiting the other tasks in a random order drawn per
    task. Runs on the Gramian: the weights are ``w = 1ᵀC`` (see :func:`pcgrad_coefficients`),
    ``O(K³)`` in K (the Gramian ``O(K² P)``); the orders are one ``randperm(K)`` per task.

    Cost in K: ``O(K³)``: the blocked pass (``C G`` refreshed every 16–32 visits, by sparse
    or dense products, ``O(K³)`` in all, plus ``O(K² b)`` gathered pairs for blocks of
    ``b`` visits), besides the Gramian ``O(K²P)``.

    Args:
        num_tasks: K (optional, checked on every call).
        reduction: ``"sum"`` (the paper's Algorithm 1, LibMTL, TorchJD) or ``"mean"`` (some
            re-implementations; the sum divided by K).
        generator: source of the task orders. If None, a private CPU generator is created,
            seeded from the global RNG (so ``torch.manual_seed`` makes runs repeatable). Its
            state is in :meth:`state_dict` (the extra state), so a resumed run draws the same
            orders.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import PCGrad
        >>> g = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
        >>> PCGrad()(g)  # g₁ − (−1/2) g₂ = (½, ½) plus g₂ − (−1/1) g₁ = (0, 1)
        tensor([0.5000, 1.5000], dtype=torch.float64)
    """

    name = "pcgrad"
    from_gramian = True
    homogeneous = True
    weight_degree = 0.0  # the weights see only G / tr G

    def __init__(
        self,
        num_tasks: int | None = None,
        *,
        reduction: Reduction = "sum",
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(num_tasks)
        if reduction not in ("sum", "mean"):
            raise ValueError(f"Invalid reduction: {reduction!r} (expected 'sum' or 'mean')")
        self.reduction: Reduction = reduction
        self.generator = check_generator("generator", generator) or private_generator()

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        k = gramian.shape[0]
        gram, _ = trace_normalized(gramian)
        gram = gram.to(torch.float64)
        orders = pcgrad_orders(k, self.generator).to(gram.device)
        w = column_sums(orders, pass_weights(gram, orders, _projections(gram, orders)))
        if self.reduction == "mean":
            w = w / k
        return w.to(gramian.device)

    def __repr__(self) -> str:
        return f"PCGrad(num_tasks={self.num_tasks}, reduction={self.reduction!r})"
