"""ADMM guesses of the free sets of many box QPs on one badly conditioned or singular Gramian.

Not a balancer module (no ``__all__``). Rows in a span of low rank plus noise (per-sample
gradients: a few shared directions and each sample's own) give a positive definite Gramian
whose smallest eigenvalues, a large fraction of them, sit together near the noise's square
(:func:`cluster_floor`). On it UPGrad's K projections ``min ½ vᵀQv``, ``v ≥ lower`` defeat
the block pivoting (it cycles, then moves one index an iteration: 216 iterations at K = 256)
and the conjugate gradients (``(Q⁻¹)_FF`` does not precondition ``Q_FF`` when half the
eigenvalues are small: no tight solve converges, even from the optimal free sets).

ADMM (Boyd et al. 2011, §5.2; over-relaxed, ``α = 1.6``) splits ``v = z``, ``z ≥ lower``:

    v ← ρ (z − u) (Q + ρI)⁻¹,   v̂ ← αv + (1 − α)z,   z ← max(lower, v̂ + u),   u ← u + v̂ − z

one ``[B, K] × [K, K]`` product a step for all the problems, on one inverse shared by them;
its conditioning is ``(λ_max + ρ)/(λ_min + ρ)``, not ``Q``'s. From ``ρ = ADMM_START·λ_min``
(λ_min: the cluster's floor; ``ADMM_SINGULAR_START`` times the mean eigenvalue on a
singular ``Q``, rows in a span of rank above K/2), ``ρ`` grows by ``ADMM_GROWTH`` whenever
a window of ``ADMM_WINDOW`` steps moves more than half as many indices as the one before
(the best ``ρ`` sits between 10 and 100 times the floor on the measured rows). The free
sets ``{z > lower}``
are only a guess: the factorised pivoting decides (:func:`~._boxqp._pivot_admm`).

Example:
    >>> import torch
    >>> q = torch.tensor([[2.0, -1.0], [-1.0, 2.0]], dtype=torch.float64) / 4
    >>> admm_free_sets(q, torch.tensor([[1.0, 0.0]], dtype=torch.float64), 2.5).tolist()
    [[False, True]]
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._precond import shifted_inverse
from ._projected import bulk_top

#: Over-relaxation of the steps (Boyd et al. 2011, §3.4.3: 1.5–1.8).
ADMM_RELAXATION = 1.6
#: The first ``ρ`` in units of the cluster's floor ``λ_min``, its growth factor, and the
#: window of steps over which the index moves are compared.
ADMM_START = 10.0
#: The first ``ρ`` on a singular ``Q`` (rows in a span of rank above K/2), in units of its
#: mean eigenvalue: on Gaussian rows of rank 9K/16, 5K/8 and 3K/4 at K = 256 the steps took
#: 0.21, 0.06 and 0.05 s from 0.1 times the mean, 0.14, 0.11 and 0.13 s from 0.03 (the
#: smallest non-zero eigenvalue is 0.03–0.1 of the mean).
ADMM_SINGULAR_START = 0.1
ADMM_GROWTH = 3.0
ADMM_WINDOW = 50
#: Steps between two looks at the free sets, and the step cap.
ADMM_CHECK = 25
ADMM_MAX_STEPS = 2000
#: The step cap on a singular ``Q``: there the steps settled within 125–500 steps on rows of
#: rank 0.55K … 0.65K, or not at all (exact rank just above K/2, float64 rows: the optimal
#: ``v`` is not unique, and the steps wander on its face), and FISTA's route comes next.
ADMM_SINGULAR_MAX_STEPS = 600
#: The steps stop once at most this fraction of the problems' free sets moved since the last
#: look (none for fewer than ``1/ADMM_SETTLED`` problems).
ADMM_SETTLED = 1 / 128
#: Looks in a row without a move that end the second round on the problems left open.
ADMM_QUIET = 8
#: :func:`cluster_floor`: at least this fraction of the eigenvalues near the smallest
#: (``λ_min Σ 1/λᵢ``), the smallest at most ``CLUSTER_MAX_FLOOR`` of their mean.
CLUSTER_MIN_FRACTION = 1 / 8
CLUSTER_MAX_FLOOR = 1e-3
#: :func:`pilot_rho`: the candidates for the first ``ρ`` on a cluster, the problems they are
#: tried on, their step cap, and the least ``K`` from which the pilot runs (at K = 256 it
#: would cost a quarter of the whole route, which settles from ``ADMM_START`` in 150 steps).
PILOT_CANDIDATES = 3
PILOT_ROWS = 16
PILOT_MAX_STEPS = 600
PILOT_MIN_SIZE = 512


def cluster_floor(q: Tensor, inverse: Tensor | None = None,
                  eigenvalues: Tensor | None = None) -> float | None:
    """``λ_min`` of a positive definite ``Q`` whose small eigenvalues form a cluster, else None.

    A cluster: ``λ_min Σᵢ 1/λᵢ ≥ CLUSTER_MIN_FRACTION·K`` (as many eigenvalues near
    ``λ_min``, counted with weight ``λ_min/λᵢ``) and ``λ_min ≤ CLUSTER_MAX_FLOOR·tr Q/K``.
    From the ascending ``eigenvalues`` where known (:func:`eigen_cluster_floor`, which also
    takes a spread cluster), else from ``inverse`` (``Q⁻¹``): the
    test ``tr Q⁻¹ · tr Q ≥ CLUSTER_MIN_FRACTION·K²/CLUSTER_MAX_FLOOR`` first (both
    conditions imply it; ``O(K)``), then ``λ_min`` by power steps on ``Q⁻¹``
    (:func:`~._projected.bulk_top`; from above: the count is then at least the true one).
    A few small eigenvalues (a Gaussian mixing of the rows, condition number near ``K²``)
    are not a cluster: the conjugate-gradient pivoting solves those.

    Example:
        >>> import torch
        >>> lam = torch.tensor([1e-6] * 4 + [1.0] * 4, dtype=torch.float64)
        >>> cluster_floor(torch.diag(lam), eigenvalues=lam)
        1e-06
    """
    if eigenvalues is not None:
        return eigen_cluster_floor(eigenvalues)
    k = q.shape[0]
    mean = float(torch.trace(q)) / k
    if inverse is None:
        return None
    total = float(torch.trace(inverse))
    if not total * mean * k >= CLUSTER_MIN_FRACTION * k * k / CLUSTER_MAX_FLOOR:
        return None
    top = bulk_top(inverse, None, 0.0)  # λ_max(Q⁻¹) from below: its power steps
    if not top > 0.0:
        return None
    low = 1.0 / top
    if low > CLUSTER_MAX_FLOOR * mean or low * total < CLUSTER_MIN_FRACTION * k:
        return None
    return low


def eigen_cluster_floor(eigenvalues: Tensor) -> float | None:
    """:func:`cluster_floor` from the ascending ``eigenvalues`` of ``Q`` (``λ_min > 0``): a
    cluster by the count ``λ_min Σᵢ 1/λᵢ``, or where at least ``CLUSTER_MIN_FRACTION·K`` of
    them lie at or below ``CLUSTER_MAX_FLOOR`` times their mean however they spread below
    it. The rounding of a float32 Gramian spreads the noise's eigenvalues of rows in a span
    plus noise near it (rank 32 plus noise 1e-3 of the rows' size at K = 256, P = 20,000:
    the 224 of them from 3e-10 to 1e-8 of the trace, a count of 13 against the 32 needed,
    where the float64 rows' lie within 1.6× of one another); ADMM's steps take them alike
    (its conditioning ``(λ_max + ρ)/(λ_min + ρ)``, ``ρ`` above them): UPGrad 1.14 → 0.13 s
    there, where the conjugate-gradient pivoting deflates at most 16 of the 32 outliers.

    Example:
        >>> import torch
        >>> spread = torch.tensor([1e-9, 1e-8, 1e-7, 1e-6] + [1.0] * 28, dtype=torch.float64)
        >>> eigen_cluster_floor(spread)  # 4 of 32 far below the mean: a cluster
        1e-09
    """
    k = eigenvalues.shape[0]
    mean = float(eigenvalues.sum()) / k
    low = float(eigenvalues[0])
    if not 0.0 < low <= CLUSTER_MAX_FLOOR * mean:
        return None
    at = max(1, math.ceil(CLUSTER_MIN_FRACTION * k)) - 1  # the smallest of that many
    if float(eigenvalues[at]) <= CLUSTER_MAX_FLOOR * mean:
        return low
    count = float((low / eigenvalues).sum())
    return low if count >= CLUSTER_MIN_FRACTION * k else None


def first_rho(q: Tensor, floor: float | None) -> float:
    """ADMM's first ``ρ``: ``ADMM_START`` times the cluster's ``floor`` (:func:`cluster_floor`),
    or for a singular ``Q`` (``floor`` None) ``ADMM_SINGULAR_START`` times its mean eigenvalue
    ``tr Q/K``."""
    if floor is not None:
        return ADMM_START * floor
    return ADMM_SINGULAR_START * float(torch.trace(q)) / q.shape[0]


def admm_free_sets(q: Tensor, lower: Tensor, rho: float,
                   settled_fraction: float = ADMM_SETTLED, quiet: int = 1,
                   max_steps: int = ADMM_MAX_STEPS) -> Tensor:
    """``[B, K]`` guesses of the optimal free sets ``{v > lower}`` of ``min ½ vᵀQv``, ``v ≥
    lower`` (``Q`` positive semi-definite, float64; ``rho``: the first ``ρ``,
    :func:`first_rho`), by the over-relaxed ADMM steps in float32 (module docstring):
    until at most ``settled_fraction`` of the problems' free sets moved over ``ADMM_CHECK``
    steps ``quiet`` times in a row, at most ``max_steps``; all False where ``Q + ρI`` does
    not factorise."""
    return _admm_steps(q, lower, rho, settled_fraction, quiet, max_steps)[0]


def pilot_rho(q: Tensor, lower: Tensor, rho: float) -> float:
    """The first ``ρ`` among ``rho·ADMM_GROWTHʲ`` (``j < PILOT_CANDIDATES``) whose steps
    settle soonest on ``PILOT_ROWS`` of the problems spread over the batch (every free set
    at rest over ``ADMM_CHECK`` steps, at most ``PILOT_MAX_STEPS``; ties to the smaller):
    the best first ``ρ`` on a cluster was 10 times its floor at K = 256 and 100 at K = 1,024
    (rows of rank K/2 plus noise 1e-2: 425 steps from 100, 1,050 from 10 with the growth)."""
    b = lower.shape[0]
    rows = torch.linspace(0, b - 1, min(PILOT_ROWS, b)).round().long()
    best, fewest = rho, PILOT_MAX_STEPS + 1
    for j in range(PILOT_CANDIDATES):
        candidate = rho * ADMM_GROWTH**j
        steps = _admm_steps(q, lower[rows], candidate, 0.0, 1, PILOT_MAX_STEPS)[1]
        if steps < fewest:
            best, fewest = candidate, steps
    return best


def _admm_steps(q: Tensor, lower: Tensor, rho: float, settled_fraction: float, quiet: int,
                max_steps: int) -> tuple[Tensor, int]:
    """:func:`admm_free_sets` and the steps it took (``max_steps + 1`` where it did not
    settle or ``Q + ρI`` does not factorise)."""
    inverse = _shifted_inverse(q, rho)
    if inverse is None:
        return torch.zeros_like(lower, dtype=torch.bool), max_steps + 1
    low = lower.float()
    z, u = low.clone(), torch.zeros_like(low)
    free = z > low
    settled = int(settled_fraction * lower.shape[0])
    moves = [0, -1]  # this window's index moves, the last window's (-1: none yet)
    calm = 0  # looks in a row with at most ``settled`` free sets moved
    for step in range(ADMM_CHECK, max_steps + 1, ADMM_CHECK):
        for _ in range(ADMM_CHECK):
            v = (z - u).mm(inverse).mul_(rho)
            relaxed = v.mul_(ADMM_RELAXATION).add_(z, alpha=1.0 - ADMM_RELAXATION)
            z = torch.maximum(low, relaxed + u)
            u.add_(relaxed).sub_(z)
        now = z > low
        changed = now ^ free
        free = now
        calm = calm + 1 if int(changed.any(dim=1).sum()) <= settled else 0
        if calm >= quiet:
            return free, step
        moves[0] += int(changed.sum())
        if step % ADMM_WINDOW == 0:
            if moves[1] >= 0 and 2 * moves[0] > moves[1]:  # stalled: a larger ρ
                grown = _shifted_inverse(q, rho * ADMM_GROWTH)
                if grown is None:
                    return free, max_steps + 1
                rho, inverse = rho * ADMM_GROWTH, grown
                u.div_(ADMM_GROWTH)  # the scaled dual y/ρ
                moves = [0, -1]
            else:
                moves = [0, moves[0]]
    return free, max_steps + 1


def _shifted_inverse(q: Tensor, rho: float) -> Tensor | None:
    """``(Q + ρI)⁻¹`` in float32 (factorised in float64, :func:`~._precond.shifted_inverse`),
    None where it does not factorise."""
    inverse = shifted_inverse(q, rho)
    return None if inverse is None else inverse.float()
