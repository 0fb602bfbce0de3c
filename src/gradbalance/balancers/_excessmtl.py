"""ExcessMTL: task weights driven by estimated excess risks."""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_int, check_range
from .._shard import Shard
from ..gramian import unit_rows
from ._base import Balancer, Combination
from ._row_blocks import row_blocks

__all__ = ["ExcessMTL", "excessmtl_risks"]


#: ``hypot(r, c)`` rounds to ``r`` once ``r ≥ 2⁴⁰ c`` (``(c/r)² ≤ 2⁻⁸⁰``, below half a float64
#: ulp): :func:`hypot_with_constant` gives those entries ``r`` itself.
HYPOT_LIFT = 2.0**40


def hypot_with_constant(r: Tensor, c: float) -> Tensor:
    """``hypot(r, c)`` for ``r ≥ 0`` ``[K, P]`` and a constant ``c ≥ 0``, bit for bit, without
    subnormal intermediates: entries ``r ≥ 2⁴⁰ c`` take ``r`` (the correctly rounded value),
    the others ``hypot``, whose ``(c/r)²`` then stays normal. ``torch.hypot(r, c)`` forms a
    subnormal square where ``r/c`` exceeds about ``2⁶³`` in float32 (``r ≥ 1e15`` at the
    default ``c = √1e-7``) and runs about 10× slower there. One ``hypot`` pass where no
    entry reaches the lift (read from ``max r``, one host synchronisation), else three
    passes in one buffer.

    Example:
        >>> import torch
        >>> r = torch.tensor([0.0, 3.0, 1e30])
        >>> hypot_with_constant(r, 4.0)
        tensor([4.0000e+00, 5.0000e+00, 1.0000e+30])
    """
    lift = c * HYPOT_LIFT
    if r.numel() == 0 or float(r.amax()) < lift:  # no entry above the lift: one pass
        return torch.hypot(r, r.new_tensor(c))
    h = torch.clamp_max(r, lift)
    torch.hypot(h, h.new_tensor(c), out=h)
    return torch.maximum(h, r, out=h)  # hypot(r, c) ≥ r: exactly the entries above the lift


def excessmtl_risks(matrix: Tensor, root_sq_sum: Tensor, eps: float = 1e-7) -> Tensor:
    """``Êₖ = gₖᵀ Hₖ⁻¹ gₖ`` ``[K]`` (float64), ``Hₖ = diag(√(Σ_{τ≤t} gₖ,τ² + ε))`` (AdaGrad).

    ``root_sq_sum`` is ``R = √(Σ_{τ≤t} g_τ²)`` ``[K, P]`` (the current step included) and
    ``H = hypot(R, √ε)``; scale-safe, ``gₖⱼ²`` never formed (docs/balancers.md, "Numerical
    range"): each term is ``(gₖⱼ/Hₖⱼ) gₖⱼ``, at most ``|gₖⱼ|`` (``H ≥ |g|``), and a row whose
    sum is not finite or below ``2⁴⁶ P`` times the smallest normal number (its terms below
    the normal range could move it by more than ``2⁻⁴⁶``) is summed again on its rows scaled
    by a power of two (:func:`~gradbalance.gramian.unit_rows`; one host synchronisation to
    find them, one more in :func:`hypot_with_constant`). ``O(K·P)``.

    Example:
        >>> import torch
        >>> from gradbalance.functional import excessmtl_risks
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> excessmtl_risks(g, g.abs())  # first step: R = |g|, so Êₖ ≈ ‖gₖ‖₁
        tensor([1.0000, 2.0000], dtype=torch.float64)
    """
    rows = matrix.to(torch.float64 if matrix.dtype == torch.float64 else torch.float32)
    terms = _ratios(rows, root_sq_sum, eps)
    risks = terms.mul_(rows).sum(dim=1).to(torch.float64)
    floor = torch.finfo(rows.dtype).tiny * rows.shape[1] * 2.0**46
    again = torch.nonzero(~(risks >= floor) | ~torch.isfinite(risks)).flatten()
    if again.numel():  # tiny or huge rows: on the scaled rows
        risks[again] = _scaled_risks(matrix[again], root_sq_sum[again], eps)
    return risks


def _ratios(rows: Tensor, root_sq_sum: Tensor, eps: float) -> Tensor:
    """``g/H`` (``[K, P]``, in ``[−1, 1]``: ``H ≥ |g|``) in the dtype of ``rows``, 0 where
    ``g = H = 0`` (``ε = 0``)."""
    h = hypot_with_constant(root_sq_sum.to(rows.dtype), eps**0.5)
    terms = torch.div(rows, h, out=h)
    return terms.nan_to_num_(0.0) if eps == 0 else terms


def _scaled_risks(matrix: Tensor, root_sq_sum: Tensor, eps: float) -> Tensor:
    """:func:`excessmtl_risks` of the rows ``matrix`` on their power-of-two scaled rows:
    ``sₖ Σⱼ (gₖⱼ/Hₖⱼ) uₖⱼ``, every factor at most 1 (``g = diag(s) U``)."""
    unit, scale = unit_rows(matrix)
    terms = _ratios(matrix.to(unit.dtype), root_sq_sum, eps).mul_(unit)
    # nonnegative terms (no cancellation): a pairwise sum is exact to about log₂P roundings
    return terms.sum(dim=1).to(torch.float64) * scale


class ExcessMTL(Balancer):
    """``g = Σₖ αₖ gₖ`` with ``α`` updated by exponentiated gradient on the excess risks.

    Update rule at each call, after ``n_warmup_steps`` warm-up calls (uniform weights, excess
    risks recorded):

    * ``Sₖ += gₖ²``; ``Êₖ = Σⱼ gₖⱼ² / √(Sₖⱼ + ε)`` (kept as ``Rₖ = √Sₖ``,
      ``R ← hypot(R, g)``);
    * scale processing: ``rₖ = Êₖ / Êₖ⁰`` with the baseline ``Ê⁰`` = the first post-warm-up
      estimate (``n_warmup_steps = 0``) or the warm-up average;
    * ``αₖ ← αₖ exp(η rₖ) / Σⱼ αⱼ exp(η rⱼ)`` (in log space), starting at ``1/K`` (the paper;
      the official code and LibMTL start at 1 and keep ``Σα = K``: multiply by K to match).

    Cost in K: ``O(KP)``: elementwise passes over the ``[K, P]`` rows, block by block of
    rows (:mod:`~._row_blocks`).

    Args:
        robust_step_size: ``η > 0`` (default 1.0).
        n_warmup_steps: calls with uniform weights that average the baseline (default 0; the
            paper's Appendix C.1 uses three epochs).
        eps: added inside the square root of ``H`` (default 1e-7, the official code's value).

    Reference: He et al., "Robust Multi-Task Learning with Excess Risks", ICML 2024, eqs. 6-9
    and §3.2.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import ExcessMTL
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> ExcessMTL()(g)  # the first step weighs the tasks equally
        tensor([0.5000, 1.0000], dtype=torch.float64)
    """

    _root_sq_sum: Tensor | None
    _weights: Tensor | None
    _baseline: Tensor | None
    _warmup_sum: Tensor | None
    _step: Tensor

    name = "excessmtl"
    _repr_args = ("num_tasks", "robust_step_size", "n_warmup_steps")
    from_gramian = False
    homogeneous = False  # ε makes the excess-risk ratios depend on the scale

    def __init__(self, num_tasks: int | None = None, robust_step_size: float = 1.0,
                 n_warmup_steps: int = 0, eps: float = 1e-7) -> None:
        super().__init__(num_tasks)
        self.robust_step_size = check_range("robust_step_size", robust_step_size, 0.0, None,
                                            low_open=True)
        self.n_warmup_steps = check_int("n_warmup_steps", n_warmup_steps, 0)
        self.eps = check_range("eps", eps, 0.0, None)
        self.register_state("_root_sq_sum", None, optional=True, like_rows=True)
        for name in ("_weights", "_baseline", "_warmup_sum"):
            self.register_state(name, None, optional=True, per_task=True)
        self.register_state("_step", torch.zeros((), dtype=torch.int64))

    def _combine_matrix(self, matrix: Tensor, losses: Tensor | None) -> Combination:
        return self._combine_matrix_sharded(matrix, losses, None, None)

    def _combine_matrix_sharded(self, matrix: Tensor, losses: Tensor | None,
                                gramian: Tensor | None, shard: Shard | None) -> Combination:
        """``R`` is per column; the excess risks are summed over ranks (``shard=None``: every
        column, one process)."""
        k = matrix.shape[0]
        past = None if self._root_sq_sum is None else self._root_sq_sum.to(matrix)
        root = torch.empty(matrix.shape, dtype=matrix.dtype, device=matrix.device)
        risks = torch.empty(k, dtype=torch.float64, device=matrix.device)
        for rows in row_blocks(k, matrix.shape[1], matrix.device):  # each block in the cache
            g, r = matrix[rows], root[rows]
            torch.abs(g, out=r) if past is None else torch.hypot(past[rows], g, out=r)
            risks[rows] = excessmtl_risks(g, r, self.eps)
        if shard is not None:
            risks = shard.sum(risks)
        weights = (torch.full((k,), 1.0 / k, dtype=torch.float64, device=matrix.device)
                   if self._weights is None else self._weights)
        warmup_sum = (torch.zeros(k, dtype=torch.float64, device=matrix.device)
                      if self._warmup_sum is None else self._warmup_sum)
        baseline = self._baseline
        t = int(self._step)
        if t < self.n_warmup_steps:
            warmup_sum = warmup_sum + risks
        else:
            if baseline is None:
                baseline = risks if self.n_warmup_steps == 0 else warmup_sum / self.n_warmup_steps
            safe = torch.where(baseline > 0, baseline, torch.ones_like(baseline))
            ratios = torch.where(baseline > 0, risks / safe, torch.zeros_like(risks))
            weights = torch.softmax(torch.log(weights) + self.robust_step_size * ratios, dim=0)
        self._root_sq_sum, self._weights, self._baseline = root, weights, baseline
        self._warmup_sum = warmup_sum
        self._step = torch.tensor(t + 1, dtype=torch.int64)
        return Combination(weights.to(matrix.dtype) @ matrix, weights)
