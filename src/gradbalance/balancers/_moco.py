"""MoCo: multi-objective gradient correction with tracked task gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from .._checks import check_bool, check_choice, check_range
from .._shard import Shard, sharded_unit_rows
from ..gramian import compute_gramian, unit_rows
from ._base import Balancer, Combination
from ._modo import modo_step
from ._row_blocks import row_blocks

__all__ = ["MoCo", "moco_step"]

LambdaUpdate = Literal["projection", "softmax"]


def moco_step(y: Tensor, lam: Tensor, h: Tensor, beta_t: float, gamma_t: float, rho: float,
              lambda_update: LambdaUpdate = "projection",
              reduce: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """One MoCo step; returns the new tracked gradients ``y`` ``[K, P]`` and weights ``λ``.

    * ``y ← y − β_t (y − h)`` (tracking of the task gradients ``h``);
    * ``λ ← Π_Δ(λ − γ_t (Y Yᵀ + ρ I) λ)`` (the paper); ``"softmax"`` replaces ``Π_Δ`` by a
      softmax (LibMTL's variant);
    * the update is ``d = Yᵀ λ`` (computed by the caller).

    ``reduce`` (sharded trunks): ``y`` and ``h`` hold some columns and ``reduce`` sums the
    partial Gramians over ranks.

    Example:
        >>> import torch
        >>> from gradbalance.functional import moco_step
        >>> h = torch.diag(torch.tensor([1.0, 2.0], dtype=torch.float64))
        >>> lam = torch.tensor([0.5, 0.5], dtype=torch.float64)
        >>> y, lam = moco_step(torch.zeros_like(h), lam, h, beta_t=1.0, gamma_t=0.5, rho=0.0)
        >>> torch.equal(y, h), lam  # Π_Δ((0.5, 0.5) − 0.5·(0.5, 2)) = Π_Δ((0.25, −0.5))
        (True, tensor([0.8750, 0.1250], dtype=torch.float64))
    """
    tracked = torch.empty(h.shape, dtype=y.dtype, device=y.device)
    for rows in row_blocks(h.shape[0], h.shape[1], h.device):  # each block's passes in the cache
        out = tracked[rows]
        torch.sub(y[rows], h[rows], out=out).mul_(beta_t)
        torch.sub(y[rows], out, out=out)  # y − β_t (y − h)
    y = tracked
    gram = compute_gramian(y)
    if reduce is not None:
        gram = reduce(gram)
    weights = lam.to(gram.dtype)  # the Gramian is float64 whatever the rows' dtype
    if lambda_update == "projection":
        return y, modo_step(weights, gram, gamma_t, rho).to(lam.dtype)
    return y, torch.softmax(weights - gamma_t * (gram @ weights + rho * weights),
                            dim=0).to(lam.dtype)


def _loss_scaled_directions(matrix: Tensor, losses: Tensor, shard: Shard | None = None
                            ) -> Tensor:
    """``Lₖ gₖ / ‖gₖ‖`` (0 for a zero row) from the power-of-two scaled rows (with ``shard``:
    this rank's columns, the norms of the full rows)."""
    if shard is None:
        unit, _ = unit_rows(matrix)
        norms = torch.linalg.vector_norm(unit, dim=1, keepdim=True)
    else:
        unit, scale, full = sharded_unit_rows(matrix, shard)
        norms = (full / scale).to(unit.dtype).unsqueeze(1)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    scale = losses.to(dtype=unit.dtype, device=unit.device).unsqueeze(1)
    # unit entries are at most 1: only a (finite, checked) loss past the rows' dtype
    # overflows, possible only where the losses' dtype is wider (one host sync, there only)
    narrower = (losses.is_floating_point()
                and torch.finfo(matrix.dtype).max < torch.finfo(losses.dtype).max)
    if narrower and not bool(torch.isfinite(scale.to(matrix.dtype)).all()):
        raise ValueError(
            f"Invalid losses: MoCo(normalize_grads=True) scales each unit gradient by its "
            f"loss, and a loss of {float(losses.abs().max()):.3g} overflows "
            f"{matrix.dtype}; scale the losses down or use normalize_grads=False")
    return torch.where(norms > 0, unit / safe * scale, torch.zeros_like(unit)).to(matrix.dtype)


class MoCo(Balancer):
    """Tracked task gradients ``y`` and simplex weights ``λ``; output ``d = Σₖ λₖ yₖ``.

    Step sizes decay as ``β_t = β / t^{σ_β}``, ``γ_t = γ / t^{σ_γ}`` (step ``t ≥ 1``). ``y``
    starts at 0 and ``λ`` at ``1/K`` (the paper's projection of ``y`` is omitted).

    Cost in K: its tracked ``[K, P]`` gradients ``O(KP)``, their Gramian ``O(K²P)`` and one
    projected step ``O(K²)``.

    Args:
        beta: tracking rate of ``y`` (default 0.5).
        beta_sigma: decay of the tracking rate (default 0.5).
        gamma: step of ``λ`` (default 0.1).
        gamma_sigma: decay of the step of ``λ`` (default 0.5).
        rho: ℓ₂ regularisation of the ``λ`` step (default 0).
        lambda_update: ``"projection"`` (the paper, default) or ``"softmax"`` (LibMTL).
        normalize_grads: track ``Lₖ gₖ / ‖gₖ‖`` instead of ``gₖ`` (LibMTL's practice; reads the
            losses). Default False (the paper's algorithm).

    Defaults follow LibMTL's MoCo settings.

    Reference: Fernando et al., "Mitigating Gradient Bias in Multi-objective Learning: A
    Provably Convergent Approach", ICLR 2023, Algorithm 1.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import MoCo
        >>> MoCo(beta=0.5)(torch.eye(2, dtype=torch.float64))  # y = β·G, λ uniform by symmetry
        tensor([0.2500, 0.2500], dtype=torch.float64)
    """

    _y: Tensor | None
    _lambda: Tensor | None
    _step: Tensor

    name = "moco"
    _repr_args = ("num_tasks", "beta", "gamma", "rho", "lambda_update")
    from_gramian = False
    homogeneous = False

    def __init__(self, num_tasks: int | None = None, beta: float = 0.5, beta_sigma: float = 0.5,
                 gamma: float = 0.1, gamma_sigma: float = 0.5, rho: float = 0.0,
                 lambda_update: LambdaUpdate = "projection",
                 normalize_grads: bool = False) -> None:
        super().__init__(num_tasks)
        self.beta = check_range("beta", beta, 0.0, 1.0, low_open=True)
        self.beta_sigma = check_range("beta_sigma", beta_sigma, 0.0, None)
        self.gamma = check_range("gamma", gamma, 0.0, None, low_open=True)
        self.gamma_sigma = check_range("gamma_sigma", gamma_sigma, 0.0, None)
        self.rho = check_range("rho", rho, 0.0, None)
        check_choice("lambda_update", lambda_update, ("projection", "softmax"))
        self.lambda_update: LambdaUpdate = lambda_update
        self.normalize_grads = check_bool("normalize_grads", normalize_grads)
        self.needs_losses = self.normalize_grads
        self.register_state("_y", None, optional=True, like_rows=True)
        self.register_state("_lambda", None, optional=True, per_task=True)
        self.register_state("_step", torch.zeros((), dtype=torch.int64))

    def _combine_matrix(self, matrix: Tensor, losses: Tensor | None) -> Combination:
        return self._combine_matrix_sharded(matrix, losses, None, None)

    def _combine_matrix_sharded(self, matrix: Tensor, losses: Tensor | None,
                                gramian: Tensor | None, shard: Shard | None) -> Combination:
        """``y`` is per column; ``Y Yᵀ`` (and the norms ``‖gₖ‖``) are summed over ranks
        (``shard=None``: every column, one process)."""
        k = matrix.shape[0]
        h = matrix
        if self.normalize_grads:
            assert losses is not None
            h = _loss_scaled_directions(matrix, losses, shard)
        y = torch.zeros_like(matrix) if self._y is None else self._y.to(matrix)
        lam = (torch.full((k,), 1.0 / k, dtype=torch.float64, device=matrix.device)
               if self._lambda is None else self._lambda.to(torch.float64))
        t = int(self._step) + 1
        beta_t = self.beta / t**self.beta_sigma
        gamma_t = self.gamma / t**self.gamma_sigma
        y, lam = moco_step(y, lam, h, beta_t, gamma_t, self.rho, self.lambda_update,
                           None if shard is None else shard.sum)
        self._y, self._lambda = y, lam
        self._step = torch.tensor(t, dtype=torch.int64)
        return Combination(lam.to(y.dtype) @ y)
