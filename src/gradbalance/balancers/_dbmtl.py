"""DB-MTL, gradient part: EMA of each task gradient, rescaled to the largest norm."""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_bool, check_range
from .._shard import Shard, sharded_unit_rows
from ..gramian import unit_rows
from ._base import Balancer, Combination
from ._row_blocks import row_blocks

__all__ = ["DBMTL", "dbmtl_update"]


def dbmtl_update(ema: Tensor) -> Tensor:
    """``g = Σₖ (maxⱼ ‖ĝⱼ‖ / ‖ĝₖ‖) ĝₖ``: every (EMA) task gradient scaled to the largest norm.

    A zero row stays zero; scale-safe (docs/balancers.md, "Numerical range").

    Example:
        >>> import torch
        >>> from gradbalance.functional import dbmtl_update
        >>> dbmtl_update(torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64))
        tensor([2., 2.], dtype=torch.float64)
    """
    k, p = ema.shape
    sizes = torch.empty(k, dtype=torch.float64, device=ema.device)  # ‖ĝₖ‖
    total = torch.zeros(p, dtype=torch.float64, device=ema.device)  # Σₖ ĝₖ / ‖ĝₖ‖
    for rows in row_blocks(k, p, ema.device):  # each block's passes in the cache
        unit, scale = unit_rows(ema[rows])
        unit_norms: Tensor = torch.linalg.vector_norm(unit, dim=1)
        sizes[rows] = unit_norms.to(torch.float64) * scale
        safe = torch.where(unit_norms > 0, unit_norms, torch.ones_like(unit_norms))
        inv = torch.where(unit_norms > 0, 1.0 / safe, torch.zeros_like(unit_norms))
        total += (inv @ unit).to(torch.float64)
    return (total * sizes.max()).to(ema.dtype)


def _dbmtl_update_sharded(ema: Tensor, shard: Shard) -> Tensor:
    """This rank's columns of :func:`dbmtl_update`: the rows scaled by powers of two chosen
    from the full norms (:func:`~gradbalance._shard.sharded_unit_rows`)."""
    unit, scale, norms = sharded_unit_rows(ema, shard)
    top = norms.max()
    unit_norms = norms / scale
    safe = torch.where(norms > 0, unit_norms, torch.ones_like(unit_norms))
    inv = torch.where(norms > 0, 1.0 / safe, torch.zeros_like(safe)).to(unit.dtype)
    return ((inv @ unit).to(torch.float64) * top).to(ema.dtype)


class DBMTL(Balancer):
    """DB-MTL's gradient balancing: ``ĝₖ ← β_t ĝₖ + (1 − β_t) gₖ``, ``g = Σₖ (max‖ĝ‖/‖ĝₖ‖) ĝₖ``.

    ``β_t = β / t^σ`` at step ``t ≥ 1``; ``ĝ`` starts at 0. DB-MTL's loss-scale half
    (``log Lₖ`` instead of ``Lₖ``) is ``log_losses=True`` (``∇ log Lₖ = gₖ / Lₖ``); do not
    combine it with a log-loss weighting.

    Cost in K: ``O(KP)``: elementwise passes over the rows and its ``[K, P]`` averages,
    block by block of rows (:mod:`~._row_blocks`).

    Args:
        beta: EMA factor ``β ∈ [0, 1)`` (default 0.9, LibMTL's DB-MTL setting).
        beta_sigma: decay ``σ ≥ 0`` of ``β`` (default 0: a constant ``β``).
        log_losses: divide each row by its loss first (default False).
        eps: added to the losses when ``log_losses`` (default 1e-8, as ``log(L + ε)``).

    Reference: Lin et al., "Dual-Balancing for Multi-Task Learning", arXiv:2308.12029,
    Algorithm 1.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import DBMTL
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> DBMTL(beta=0.9)(g)  # EMA rows 0.1·g, each scaled to the largest norm 0.2
        tensor([0.2000, 0.2000], dtype=torch.float64)
    """

    _ema: Tensor | None
    _step: Tensor

    name = "dbmtl"
    _repr_args = ("num_tasks", "beta", "beta_sigma", "log_losses")
    from_gramian = False
    homogeneous = True

    def __init__(self, num_tasks: int | None = None, beta: float = 0.9, beta_sigma: float = 0.0,
                 log_losses: bool = False, eps: float = 1e-8) -> None:
        super().__init__(num_tasks)
        self.beta = check_range("beta", beta, 0.0, 1.0, high_open=True)
        self.beta_sigma = check_range("beta_sigma", beta_sigma, 0.0, None)
        self.eps = check_range("eps", eps, 0.0, None)
        self.log_losses = check_bool("log_losses", log_losses)
        self.needs_losses = self.log_losses
        self.register_state("_ema", None, optional=True, like_rows=True)
        self.register_state("_step", torch.zeros((), dtype=torch.int64))

    def _combine_matrix(self, matrix: Tensor, losses: Tensor | None) -> Combination:
        return self._combine_matrix_sharded(matrix, losses, None, None)

    def _combine_matrix_sharded(self, matrix: Tensor, losses: Tensor | None,
                                gramian: Tensor | None, shard: Shard | None) -> Combination:
        """The EMA is per column; the norms ``‖ĝₖ‖`` are summed over ranks (``shard=None``:
        every column, one process)."""
        ema, t = self._next_ema(matrix, losses)
        update = dbmtl_update(ema) if shard is None else _dbmtl_update_sharded(ema, shard)
        self._ema, self._step = ema, torch.tensor(t, dtype=torch.int64)
        return Combination(update)

    def _next_ema(self, matrix: Tensor, losses: Tensor | None) -> tuple[Tensor, int]:
        """``ĝ`` after this step and the step number ``t`` (the state is not changed)."""
        divisors = None
        if self.log_losses:
            assert losses is not None
            if not bool((losses + self.eps > 0).all()):
                raise ValueError(
                    f"losses must be positive for log_losses=True, got {losses.tolist()}; use "
                    f"positive losses (e.g. cross-entropy, MSE) or log_losses=False"
                )
            divisors = (losses + self.eps).to(dtype=matrix.dtype,
                                              device=matrix.device).unsqueeze(1)
        t = int(self._step) + 1
        beta_t = self.beta / t**self.beta_sigma
        past = None if self._ema is None else self._ema.to(matrix)
        ema = torch.empty(matrix.shape, dtype=matrix.dtype, device=matrix.device)
        k, p = matrix.shape
        for block in row_blocks(k, p, matrix.device):  # each block's passes in the cache
            rows, out = matrix[block], ema[block]
            if divisors is not None:
                rows = rows / divisors[block]
            if past is None:
                torch.mul(rows, 1.0 - beta_t, out=out)
            else:  # rows + β_t (ĝ − rows)
                torch.sub(past[block], rows, out=out).mul_(beta_t).add_(rows)
        return ema, t
