"""Solvers for box- (and simplex-) constrained QPs on a positive semi-definite Hessian.

Not a balancer module (no ``__all__``). ``min ½ xᵀQx + cᵀx`` s.t. ``x ≥ lower`` (and
``Σ x = 1``), for ``B`` right-hand sides ``c``/``lower`` sharing ``Q`` (symmetric PSD,
trace-normalised, ``c`` in its range). Every problem gets an answer; none raises.

1. **Block principal pivoting** (Júdice & Pires 1994, with a shrinking block and Murty's
   single-pivot safeguard), when ``Q`` is positive definite with condition number below
   ``1e10`` (every principal submatrix then is too): every infeasible index changes side at
   once while their number falls, typically 2–4 iterations for any ``K``, one batched
   Cholesky factorisation each. It accepts only points that satisfy every KKT condition to
   ``tol``.
2. **Least squares on a factor** for a singular or badly conditioned ``Q``, and for any
   problem the pivoting leaves open: ``Q ≈ L Lᵀ`` (:func:`psd_factor`; negative and
   rounding-level eigenvalues dropped), so the QP is a non-negative least-squares problem
   ``min ‖A y − b‖``, ``y ≥ 0`` (:func:`factored_box_qp`; the simplex as Lawson & Hanson's
   least-distance program, :func:`min_norm_ls`), solved by the Lawson–Hanson active-set
   method (:func:`nnls`). Its passive set stays linearly
   independent (an entering column is checked by its QR diagonal), so every subproblem is a
   well-posed least-squares solve; it terminates in finitely many steps in exact
   arithmetic, and is capped here at ``3n + 10`` additions.
   From ``MANY_TASKS`` tasks on, two batched paths come first, each finishing the problems
   it can prove optimal and leaving the rest to this one: a positive definite ``Q`` of any
   condition number is pivoted as in 1 with factorisations and a multiplier test relative to
   the problem's own scale (:func:`_relative_threshold`), and the box problems with ``c = 0``
   still open (a singular ``Q``) take Lawson–Hanson's steps all at once
   (:func:`~._active_set.box_active_set`: masks, one batched factorisation of the passive
   blocks per step) instead of one problem after another.
3. **Fallback**, only if the active set cycles in floating point or runs out of additions:
   FISTA (Beck & Teboulle 2009), whose ``N``-th iterate satisfies
   ``f(x_N) − f* ≤ 2‖A‖²‖x₀ − x*‖² / (N + 1)²``, for a fixed ``N``; its support then
   warm-starts the active set (the polish), and the better point is returned.

The cost of a call is bounded by the iteration counts above, whatever the input.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from ._active_set import box_active_set, solve_free
from ._admm import (
    ADMM_GROWTH,
    ADMM_MAX_STEPS,
    ADMM_QUIET,
    ADMM_SETTLED,
    ADMM_SINGULAR_MAX_STEPS,
    CLUSTER_MAX_FLOOR,
    PILOT_MIN_SIZE,
    PILOT_ROWS,
    admm_free_sets,
    cluster_floor,
    eigen_cluster_floor,
    first_rho,
    pilot_rho,
)
from ._cholesky import Factor, cholesky_ex, cholesky_solve, principal_block
from ._combinations import without_combinations
from ._interior import interior_nnls
from ._mixed import ScaledPreconditioner, mixed_free_solve
from ._pcg import pcg_free, rough_free_sets
from ._precond import (
    SHIFT,
    Preconditioner,
    SetupCache,
    deflated,
    either,
    preconditioner_inverse,
    shifted,
    shifted_inverse,
    sparse_product,
    symmetrized,
)
from ._projected import (
    ROUGH_MIN_SIZE,
    Plan,
    bfloat16_products,
    bulk_top,
    plan,
    projected_free_sets,
    projected_start,
)
from ._qr_update import ColumnQR
from ._zero_cone import DENSE_NULL_ROUNDS, zero_cone_box

#: Largest ratio of ``Q``'s positive diagonal entries a box problem is solved on as given;
#: above it, on ``D⁻¹QD⁻¹`` (:func:`_diagonal_scale`): below it the scaling changes the
#: conditioning by less than this factor and costs more than it saves.
DIAGONAL_MAX_RATIO = 1e3
#: Largest condition number of ``Q`` for which the Cholesky (pivoting) path is used.
CHOLESKY_MAX_COND = 1e10
#: :func:`full_rank_inverse`: the smallest eigenvalue it certifies, relative to the mean (a
#: float32 Gramian's rounding leaves eigenvalues about ``1e-7 √P`` of the mean and below:
#: ``1e-4`` at ``P = 10⁶``).
FULL_RANK_MIN_EIGEN = 1e-2
#: Eigenvalues of the cosine matrix below ``n`` times this fraction of the largest (``n``
#: rows: the rounding of an ``n × n`` eigen-decomposition) are dropped from ``Q``'s factor.
RANK_RTOL_PER_ROW = 4 * torch.finfo(torch.float64).eps
#: Smallest QR diagonal, relative to the column norm, of a column entering the passive set.
INDEPENDENCE_RTOL = 1e-10
#: FISTA iterations of the fallback (its error bound is stated for this count).
FALLBACK_ITERATIONS = 1000
#: Batched problems of at least this size pivot with conjugate-gradient solves (``O(K³)``
#: per step for all ``K`` of UPGrad's projections) instead of ``B`` factorisations
#: (``O(B K³)`` per pivoting iteration).
CG_MIN_SIZE = 64
#: Error of each projection, relative to its bound and to its own size (``‖x − x*‖_Q ≤
#: CG_ERROR min(‖lower‖_Q, ‖x‖_Q)``, the norm of the update's part in the rows' space), to
#: which the tight solves run; their relative residual (:func:`tight_residuals`,
#: :func:`_cg_solve`) is kept within ``[CG_RTOL_MIN, CG_RTOL_MAX]``.
#: ``CG_LOOSE_RTOL``: while the free set still moves. ``CG_MAX_PIVOTS``: pivoting iterations
#: before the problems still open go to the factorisations.
CG_ERROR = 1e-7
CG_RTOL_MIN = 1e-11
CG_RTOL_MAX = 1e-8
CG_LOOSE_RTOL = 1e-6
CG_MAX_PIVOTS = 30
#: Block pivoting's exchanges (Júdice & Pires 1994, with a shrinking block): every
#: infeasible index changes side while their number falls below its best and once after it
#: does not; from the ``HALVE_AFTER``-th iteration in a row without a new best, half as many
#: as the last time, the most infeasible first (at least one), and tight free-set solves
#: (loose ones leave their residual's rounding in ``y`` and ``w``, on a badly conditioned
#: ``Q`` above the tolerances); from ``MURTY_AFTER`` such iterations on, Murty's rule (one
#: index, the largest: finite for positive definite ``Q``). Exchanging every index each
#: time cycles on badly conditioned Gramians: on rows of rank ``K/2`` plus noise 1e-2 of
#: their size, K = 64, Murty's rule after three chances finished 40, 23, 7 and 3 of the 64
#: projections in 200 iterations, the shrinking block 62, 64, 50 and 47 (the others leave
#: after ``STALE_MAX`` iterations without progress; docs/balancers.md).
HALVE_AFTER = 2
MURTY_AFTER = 16
#: A problem whose number of infeasible indices has not fallen for this many iterations in a
#: row leaves the pivoting, open, at its last point: the factorised methods after it take
#: it (DualProj on rows of rank K/2 plus noise 1e-2 at K = 256: 778 iterations of Murty's
#: rule finished nothing, 18.9× → 9.9× the Gramian).
STALE_MAX = 48
#: From this many tasks on, a badly conditioned or singular ``Q`` is pivoted with the
#: relative multiplier test, or goes to the batched active set (:mod:`._active_set`), before
#: the per-problem least squares; below, it goes to least squares directly.
MANY_TASKS = 17
#: Pivoting iterations on a positive definite but badly conditioned ``Q`` (relative
#: multiplier test, factorisations) before the problems still open go to least squares.
ILL_MAX_PIVOTS = 50
#: Eigenvalues of the cosine matrix up to this multiple of its most negative one are
#: rounding (:func:`rounding_cut`; the low-rank route's cut), and a box batch on a ``Q``
#: with a negative eigenvalue ``λ_min`` is solved on ``Q + ROUNDING_MULTIPLE·|λ_min|·I``
#: (:func:`_lifted`).
ROUNDING_MULTIPLE = 2.0
#: Largest fraction of the eigenvalues at or below the lift for which :func:`_lifted` lifts.
LIFT_MAX_NULLITY = 1 / 8
#: :func:`cluster_lift` lifts a null space mostly the rounding's where the eigenvalues above
#: ``CLUSTER_MAX_FLOOR`` of the mean (the signal) are at most this fraction of them.
LOW_SIGNAL = 1 / 4
#: The rounding of a symmetric eigen-decomposition per dimension, relative to ``λ_max``
#: (float64's unit roundoff): :func:`rounding_lift` lifts by no less than its multiple.
EIGEN_ROUNDING = float(torch.finfo(torch.float64).eps)
#: The same for the single dual QPs of MGDA and PCD on a lifted cosine matrix
#: (:mod:`~._min_norm_dual`, :mod:`~._pcd`): one problem on direct factorisations, where
#: UPGrad's conjugate gradients resolve each rounding eigenvalue. Rows of rank ``3K/4`` lift in
#: 10 ms at K = 256; rank ``5K/8`` would take 0.33 s, against 0.04 s by least squares.
SINGLE_LIFT_MAX_NULLITY = 1 / 4
#: A ``Q`` that is not positive definite or badly conditioned (a Gramian of rank below K:
#: a task gradient that is a combination of others) is first pivoted with conjugate
#: gradients on ``Q`` itself, preconditioned through ``(Q + δI)⁻¹``
#: (:data:`~._precond.SHIFT`), for at most ``SINGULAR_MAX_PIVOTS`` iterations
#: (:func:`_pivot_singular`): UPGrad at K = 256, rank 200 / 254, 0.13 / 0.11 s against
#: 2.2 / 1.0 s by the batched active set; at rank K/2 and below it finishes few problems
#: and the cap bounds the attempt.
SINGULAR_MAX_PIVOTS = 8
#: A ``Q`` that is not positive definite with a numerical rank of at most this fraction of
#: its size (after the zero dual cone's certificate where it is tried; rows in a span of
#: rank a little above ``K/2``: a thin dual cone, Wendel 1962) is first pivoted with
#: factorisations of the free blocks from a long FISTA start (:func:`_pivot_from_fista`),
#: above it after the conjugate-gradient pivoting: UPGrad at K = 256, rank 144 / 160:
#: 9.5 / 1.6 s by the conjugate-gradient pivoting (none finished) and the batched active
#: set, 0.5 / 0.3 s so; rank 176 / 192 0.17 s by the conjugate-gradient pivoting alone; at
#: K = 1,024 the two orders cross near ``0.6K`` (rank 608: 14 against 30 s, 640: 15.8
#: against 10.4 s).
THIN_MAX_FRACTION = 0.65
#: FISTA steps of :func:`_pivot_from_fista`'s rounds (each from ``y = 0`` on the problems
#: still open), and the pivoting iterations after each.
THIN_STEPS = (500, 1500)
THIN_MAX_PIVOTS = 6
#: The rounds of a single problem (DualProj's): its pivoting iterations are one
#: factorisation of ``|F| ≤ r`` each, cheap against 400 FISTA steps (rank ``9K/16``,
#: ``combine`` over the Gramian at K = 256 3.3× → 2.1×, at K = 1,024 2.6× → 2.1×, the same
#: answers).
THIN_SINGLE_STEPS = (100, 1500)
#: Entries of the free blocks ``[B, m, m]`` one factorisation of :func:`_pivot_from_fista`
#: holds at most: the problems are pivoted in chunks (K = 1,024: 32 problems, 256 MiB).
THIN_MAX_ENTRIES = 2**25
#: A ``Q`` that is not positive definite (or badly conditioned) with a numerical rank of at
#: most this fraction of its size first tries the zero dual cone's certificate on its
#: eigen-factor (:func:`_zero_cone_first`): rows drawn in a span of rank ``r`` have a conic
#: hull equal to their span once ``K`` is well above ``2r`` (Wendel 1962), where the dense
#: paths take seconds (UPGrad at K = 256, rank 96 / 112: 22 / 46 s by the batched active
#: set; benchmarks/results/many_tasks_cpu.md).
ZERO_CONE_MAX_FRACTION = 0.5
#: :func:`_shares_eigenvectors`: the largest ratio of ``Q``'s diagonal entries on which
#: ``Q``'s own eigenvectors give the zero cone's factor.
SHARED_EIGEN_MAX_RATIO = 4.0
#: A problem of a badly conditioned ``Q`` finished by the pivoting or the batched active set
#: with a multiplier below ``−HOLD_RTOL`` times its size goes on (:func:`_multipliers_hold`).
HOLD_RTOL = 1e-6

_EPS = torch.finfo(torch.float64).eps
_norm = torch.linalg.vector_norm  # the direct kernel: Tensor.norm dispatches in Python first


def is_well_conditioned(q: Tensor, factor: Factor | None = None) -> bool:
    """``Q`` symmetric positive definite with condition number below ``1e10`` (one host sync
    below ``CG_MIN_SIZE`` tasks: the eigenvalues). From ``CG_MIN_SIZE`` tasks on one Cholesky
    factorisation and inverse decide where their bounds do (:func:`certified_inverse`; a
    third of the eigenvalues' cost: 42 against 94 ms at ``K = 1,024``), the eigenvalues only
    where they leave it open. ``factor``: ``Q``'s Cholesky factor where the caller has it."""
    if q.shape[0] >= CG_MIN_SIZE:
        verdict = _cholesky_verdict(q, factor).well
        if verdict is not None:
            return verdict
    return _conditioning(q)[0]


def certified_inverse(q: Tensor) -> Tensor | None:
    """``Q⁻¹`` where one Cholesky factorisation proves ``Q`` positive definite with condition
    number below ``CHOLESKY_MAX_COND``, else None (then the eigenvalues decide).

    ``λ_max ≤ tr Q`` and ``1/λ_min ≤ tr Q⁻¹``, so ``tr Q · tr Q⁻¹`` bounds the condition
    number from above (by at most ``K`` times its value); ``max Q_jj / min L_jj²`` bounds it
    from below (``λ_min ≤ L_jj²``) and skips the inverse of a surely ill ``Q``. One host
    sync each; ``O(K³/3)`` for the factor and ``O(2K³/3)`` for the inverse, about a third of
    :func:`torch.linalg.eigvalsh` together, and the inverse is the conjugate-gradient
    preconditioner of :func:`solve_lcp_pivoting`.
    """
    return _cholesky_verdict(q).inverse


def full_rank_inverse(q: Tensor) -> Tensor | None:
    """:func:`certified_inverse` where it also proves every eigenvalue of ``Q`` at least
    ``FULL_RANK_MIN_EIGEN`` times their mean (``λ_min ≥ 1/‖Q⁻¹‖_∞``, Gershgorin), else None:
    such a ``Q`` has no eigenvalue at a float32 product's rounding and no two parallel rows,
    so neither the low-rank route nor the parallel groups apply (their tests are skipped)."""
    h = certified_inverse(q)
    return h if h is not None and is_full_rank(q, h) else None


def is_full_rank(q: Tensor, h: Tensor) -> bool:
    """:func:`full_rank_inverse`'s test on ``h``, ``Q``'s certified inverse
    (:func:`certified_inverse`): ``1/‖Q⁻¹‖_∞ ≥ FULL_RANK_MIN_EIGEN · tr Q / K``."""
    return _inf_norm(h) * FULL_RANK_MIN_EIGEN * float(torch.trace(q)) <= q.shape[0]


def _inf_norm(h: Tensor) -> float:
    """``‖H‖_∞``, the largest row sum of ``|H|`` (one reduction: no ``|H|`` in memory)."""
    return float(torch.linalg.vector_norm(h, ord=1, dim=1).amax())


class _Verdict(NamedTuple):
    """:func:`_cholesky_verdict`'s answer."""

    well: bool | None  # proven well conditioned, surely not (False), or open (None)
    inverse: Tensor | None  # ``Q⁻¹`` where proven
    order: int = 0  # the first leading minor that is not positive definite (0: none)


def _cholesky_verdict(q: Tensor, factor: Factor | None = None) -> _Verdict:
    """:func:`certified_inverse`'s bounds: ``(True, Q⁻¹)`` proven well conditioned, ``False``
    surely not (the factorisation failed at the minor of order ``order``: not positive
    definite to float64's resolution, a condition number above ``1e13``; or the lower
    bound), ``None`` open (the upper bound is above the limit). ``factor``: ``Q``'s
    Cholesky factor, computed here when None."""
    chol, info = cholesky_ex(q) if factor is None else factor
    order = int(info)
    if order != 0:
        return _Verdict(False, None, order)
    pivots = torch.diagonal(chol).square()
    if float(torch.diagonal(q).amax() / pivots.amin()) >= CHOLESKY_MAX_COND:
        return _Verdict(False, None)
    h = torch.cholesky_inverse(chol)
    bound = float(torch.trace(q) * torch.trace(h))
    return _Verdict(True, h) if 0.0 < bound < CHOLESKY_MAX_COND else _Verdict(None, None)


def _conditioning(q: Tensor) -> tuple[bool, bool]:
    """``(well, definite)``: ``Q`` positive definite with condition number below ``1e10``,
    and positive definite at all (its eigenvalues, one decomposition)."""
    spectrum = _spectrum(q)
    return spectrum.well, spectrum.definite


class _Spectrum(NamedTuple):
    """What one eigenvalue decomposition tells the batched solve (:func:`_spectrum`)."""

    well: bool  # positive definite, condition number below ``CHOLESKY_MAX_COND``
    definite: bool  # positive definite at all
    lift: float | None  # the lift of :func:`_lifted`, None: not lifted
    rank: int  # eigenvalues above the rounding's cut (:func:`rounding_cut`)
    lifted_well: bool = False  # lifted, well conditioned (its classification, no new one)
    pairs: tuple[Tensor, Tensor] | None = None  # ``Q``'s eigenvalues and -vectors, where
    # asked for (:func:`_spectrum`)
    floor: float | None = None  # ``λ_min`` of a cluster of small eigenvalues
    # (:func:`~._admm.cluster_floor`), None: none


def _spectrum(q: Tensor, vectors: bool = False) -> _Spectrum:
    """:func:`_conditioning`, the lift of :func:`_lifted` (:func:`rounding_lift`, or from
    ``CG_MIN_SIZE`` tasks on :func:`cluster_lift`) with whether
    the lifted ``Q`` is well conditioned (``λ_max + lift`` below ``CHOLESKY_MAX_COND`` times
    ``λ_min + lift = |λ_min|``), and the numerical rank (:func:`rounding_cut`); with
    ``vectors``, ``Q``'s eigenvectors too (one decomposition with them: twice the time of
    the eigenvalues alone)."""
    if vectors:
        lam, vec = torch.linalg.eigh(q)
        pairs: tuple[Tensor, Tensor] | None = (lam, vec)
    else:
        lam, pairs = torch.linalg.eigvalsh(q), None
    low, high = lam[[0, -1]].tolist()  # one host sync
    definite = low > 0 and high > 0
    lift = rounding_lift(lam, low, high=high)
    well = definite and low > high / CHOLESKY_MAX_COND
    rank = q.shape[0]  # well conditioned: full rank, no count (the step's small K)
    if not well:
        rank = int((lam > rounding_cut(lam, rank, ROUNDING_MULTIPLE)).sum())
    lifted_well = lift is not None and high + lift < CHOLESKY_MAX_COND * (low + lift)
    if lift is None and not definite and q.shape[0] >= CG_MIN_SIZE:
        lift = cluster_lift(lam, low, high)  # classified again once lifted: lifted_well False
    floor = cluster_floor(q, eigenvalues=lam) if well else None
    return _Spectrum(well, definite, lift, rank, lifted_well, pairs, floor)


def cluster_lift(lam: Tensor, low: float, high: float) -> float | None:
    """:func:`rounding_lift` for the ascending eigenvalues ``lam`` (``low``, ``high``: the
    first and last) whatever the size of the rounding's null space, where more of the small
    eigenvalues (at most ``CLUSTER_MAX_FLOOR`` of the lifted mean) lie above the lift than at
    or below it, or the others (the signal) are at most ``LOW_SIGNAL`` of them, and the
    lifted ones form a cluster (:func:`~._admm.eigen_cluster_floor`), else None.

    A float32 Gramian of rows in a span of low rank plus noise near its rounding (rank 16
    plus noise 1e-3 of the rows' size at K = 256, P = 20,000: the noise's eigenvalues near
    ``9e-9`` of the trace, the rounding's ``λ_min`` at ``−1e-9``) has 57 of its 256
    eigenvalues at or below twice ``|λ_min|`` and 183 just above: too many for
    ``LIFT_MAX_NULLITY``, whose limit keeps them from the conjugate-gradient pivoting.
    Lifted, they are a cluster, ADMM's route (:func:`_pivot_admm`, once the lifted ``Q``
    is classified): UPGrad 4.5 → 0.18 s there (K = 1,024, rank 64: 1,016 → 9.6 s), the
    answer within the bound of any lift (:func:`_lifted`); rank 12 plus 1e-3, 167 at or
    below and 77 above but a signal of 12: 7.0 → 0.23 s. Rows in an exact span of rank above
    ``K/4``, whose small eigenvalues are all the rounding's, keep the singular routes:
    lifted there, ADMM took 3–4× their time (``span_5k8`` and three more kinds at K = 256).
    """
    lift = rounding_lift(lam, low, max_nullity=1.0, high=high)
    if lift is None:
        return None
    k = lam.shape[0]
    small = float(CLUSTER_MAX_FLOOR) * (float(lam.sum()) / k + lift)
    nullity, real = int((lam <= lift).sum()), int(((lam > lift) & (lam <= small)).sum())
    if real <= nullity and k - nullity - real > LOW_SIGNAL * k:  # mostly the rounding's own
        return None  # null space under a large signal: rows in an exact span
    return lift if eigen_cluster_floor(lam + lift) is not None else None


def rounding_lift(lam: Tensor, low: float | None = None,
                  max_nullity: float = LIFT_MAX_NULLITY,
                  high: float | None = None) -> float | None:
    """The lift of :func:`_lifted` for the ascending eigenvalues ``lam`` (``low``, ``high``:
    ``lam[0]``, ``lam[-1]`` where read already): ``ROUNDING_MULTIPLE·|λ_min|``, at least
    ``ROUNDING_MULTIPLE`` times the eigen-decomposition's own rounding ``K·eps·λ_max``
    (:data:`EIGEN_ROUNDING`), where ``λ_min < 0`` and at most ``max_nullity`` of the
    eigenvalues lie at or below it (the rounding's null space is small), else None.

    A ``λ_min`` within the decomposition's rounding (a float64 Gramian of parallel rows) is
    no measure of the matrix's: lifted by twice it, ``Q`` read a negative eigenvalue again
    and was lifted again, without end (UPGrad at K = 127 on float64 copies: a
    ``RecursionError``)."""
    low = float(lam[0]) if low is None else low
    if not low < 0.0:
        return None
    high = float(lam[-1]) if high is None else high
    floor = EIGEN_ROUNDING * lam.shape[0] * max(high, 0.0)
    lift = ROUNDING_MULTIPLE * max(-low, floor)
    return None if int((lam <= lift).sum()) > max_nullity * lam.shape[0] else lift


def _lifted(q: Tensor, lift: float | None) -> Tensor | None:
    """``Q + lift·I`` (``lift = ROUNDING_MULTIPLE·|λ_min|``, :func:`_spectrum`), or
    None without a lift.

    A negative eigenvalue is rounding (a float32 Gramian of dependent rows: a task gradient
    that is a combination of others, K > P): ``Q`` is at least ``|λ_min|`` from every positive
    semi-definite matrix (Weyl), the rows' exact Gramian ``Q*`` among them, so the lift
    moves it by at most ``ROUNDING_MULTIPLE`` times the rounding ``ε = ‖Q − Q*‖₂`` it carries,
    the bound of the low-rank route's cut (:mod:`~._low_rank`): ``‖Jᵀ(v − v*)‖² ≤ (1 +
    ROUNDING_MULTIPLE) ε (‖v‖² + ‖v*‖²)``. Lifted, ``Q`` is positive definite with condition
    number ``λ_max / (ROUNDING_MULTIPLE − 1)|λ_min|`` and takes the conjugate-gradient
    pivoting: UPGrad at K = 256 on conflicting rows with K/16 of them sums of two others,
    0.92 → 0.23 s (the update within 3e-6 of the unlifted solve's, the objective on ``Q``
    lower). Only where the rounding's null space is small (``LIFT_MAX_NULLITY``): lifted,
    each of its eigenvalues is one the conjugate gradients resolve apart (rank K/2 at
    K = 256: 8 → 94 s); or, from ``CG_MIN_SIZE`` tasks on, where the lifted eigenvalues
    form a cluster, which ADMM's route takes (:func:`cluster_lift`)."""
    return None if lift is None else shifted(q, lift)


# -- 1. block principal pivoting (positive definite Q) -----------------------------------
def _multipliers(yq: Tensor, shift: Tensor, free: Tensor, simplex: bool) -> Tensor:
    """``w = Qy + shift`` (``[B, K]``; ``yq = yQ``, from the solve), less ``ν``, its mean
    over the free set, with the simplex."""
    w = yq + shift
    if simplex:
        freef = free.to(yq.dtype)
        w = w - (w * freef).sum(dim=1, keepdim=True) / freef.sum(dim=1, keepdim=True)
    return w


def _exchange(free: Tensor, bad: Tensor, size: Tensor, murty: Tensor, simplex: bool,
              y: Tensor, w: Tensor) -> Tensor:
    """The next free sets: the ``size`` most infeasible indices of ``bad`` change side
    (every one where ``size`` covers them), ranked by ``−y`` against the row's largest
    ``|y|`` on the free set and by ``−w`` against its largest ``|w|`` elsewhere; only the
    largest index where ``murty`` (Murty's rule); with the simplex an empty free set gets
    the index of the smallest ``w`` (``Σy = total > 0`` needs a free index: the most
    attractive one)."""
    if bool(((size >= bad.sum(dim=1)) & ~murty).all()):  # one host sync
        free = free ^ bad
    else:
        top = y.abs().amax(dim=1, keepdim=True).clamp_min(1e-300)
        wtop = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-300)
        score = torch.where(free, -y / top, -w / wtop).masked_fill_(~bad, -torch.inf)
        order = torch.sort(score, dim=1, descending=True).values
        kth = order.gather(1, (size.clamp(1, bad.shape[1]) - 1)[:, None])
        last = bad.shape[1] - 1 - bad.flip(1).to(torch.uint8).argmax(dim=1, keepdim=True)
        single = torch.zeros_like(bad).scatter_(1, last, True)
        free = free ^ (bad & torch.where(murty[:, None], single, score >= kth))
    if simplex:
        none_free = ~free.any(dim=1, keepdim=True)
        smallest = torch.zeros_like(free).scatter_(1, w.argmin(dim=1, keepdim=True), True)
        free = free | (none_free & smallest)
    return free


def _block(count: Tensor, best: Tensor, size: Tensor,
           stale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(best, size, stale)`` ``[B]`` after an iteration with ``count`` infeasible indices:
    the fewest so far, how many change side next (every one, or half the last block from
    ``HALVE_AFTER`` iterations without a new best on) and those iterations' number;
    :func:`_block_single` for one problem."""
    better = count < best
    stale = torch.where(better, 0, stale + 1)
    size = torch.where(stale < HALVE_AFTER, count, (size // 2).clamp_min(1))
    return torch.where(better, count, best), size, stale


def _block_single(count: int, best: int, size: int, stale: int) -> tuple[int, int, int]:
    """:func:`_block` for one problem, on numbers."""
    stale = 0 if count < best else stale + 1
    return min(count, best), count if stale < HALVE_AFTER else max(size // 2, 1), stale


Solve = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor],
                 "tuple[Tensor, Tensor, Tensor] | None"]
#: ``(rows, y, yQ)`` → the threshold below which a multiplier ``w`` is infeasible.
Threshold = Callable[[Tensor, Tensor, Tensor], "Tensor | float"]


def _relative_threshold(q: Tensor, lower: Tensor, c: Tensor, tol: float) -> Threshold:
    """``w_j < −tol (‖x‖ √Q_jj + |c_j|) − 8 eps (|Q||v|)_j`` is infeasible (``v = lower + y``,
    ``‖x‖² = vᵀQv``): the multipliers against the size of the point ``x = Jᵀv`` and of each
    row, as Lawson–Hanson's test (:func:`_lawson_hanson`), above their own rounding. Needed
    where ``Q`` is badly conditioned: large weights whose combination nearly cancels make
    every absolute tolerance too loose or too tight."""
    d = torch.diagonal(q).clamp_min(0.0).sqrt()
    qabs = q.abs()
    lq = lower @ q

    def threshold(rows: Tensor, y: Tensor, yq: Tensor) -> Tensor:
        v = lower[rows] + y
        size = ((v * (yq + lq[rows])).sum(dim=1).clamp_min(0.0).sqrt())
        noise = 8 * _EPS * (v.abs() @ qabs)
        return tol * (size[:, None] * d + c[rows].abs()) + noise

    return threshold


def solve_lcp_pivoting(
    q: Tensor, c: Tensor, lower: Tensor, simplex: bool, free0: Tensor, tol: float,
    max_iter: int, iterative: bool = False, relative: bool = False,
    inverse: Tensor | None = None,
) -> tuple[Tensor, Tensor] | None:
    """Block principal pivoting (Júdice & Pires 1994): ``(x, done)``, ``x`` valid where done.

    Optimality of ``y = x − lower ≥ 0`` is the complementarity problem ``w = Qy + c' − ν1 ≥ 0``
    (``c' = Q·lower + c``; ``ν`` and ``Σy = 1 − Σ lower`` only with the simplex), ``yᵀw = 0``.
    Given the free set ``F``, ``y_F`` solves the equalities and ``y`` is zero elsewhere; the
    indices with ``y_F < −tol`` or ``w_A < −tol`` change side, every one while their number
    falls and once after, then a shrinking block of the most infeasible, then one by Murty's
    rule (``HALVE_AFTER``, ``MURTY_AFTER``, :func:`_block`). Problems still open after
    ``max_iter`` iterations are returned with ``done`` False and ``x`` their last point (a
    start for the next method); None if a factorisation fails.

    The equalities of the open problems: one batched Cholesky factorisation of the masked
    ``Q`` each (``O(K³)`` per problem and iteration), or with ``iterative`` (box only)
    preconditioned conjugate gradients (:func:`~._pcg.pcg_free`: ``O(K²)`` per problem and
    step, warm-started from the last iteration's ``y``), loose while the free set moves and
    tight once it has no infeasible index or the last solve was tight (only a tight solve
    can finish a problem), from the free sets and solutions of the same pivoting in float32
    (:func:`~._pcg.rough_free_sets`); a problem whose solve does not converge, or whose free
    block does not factorise, stays open.
    With ``relative``, or where the preconditioner is shifted (small eigenvalues:
    :func:`~._precond.preconditioner_inverse`), a multiplier is infeasible against the
    problem's own scale (:func:`_relative_threshold`) instead of ``−tol``. ``inverse``:
    ``Q⁻¹`` when already computed (:func:`certified_inverse`), the preconditioner of
    ``iterative``.
    """
    lq = sparse_product(lower, q) if iterative else lower @ q
    shift = lq + c if bool(c.any()) else lq  # not written to
    total = 1.0 - lower.sum(dim=1) if simplex else None
    solve: Solve
    y0 = y0q = None
    if iterative:
        h = inverse if inverse is not None else shifted_inverse(q)
        if h is None:
            return None
        base = preconditioner_inverse(q, h)
        relative = relative or base is not h  # small eigenvalues: the relative test
        pre = deflated(q, base)  # both phases', in float32
        cache = SetupCache(pre, *shift.shape)  # the setups, from float32 on
        start = plan(q, pre)
        square = torch.linalg.vecdot(lower, lq)  # ‖lower‖²_Q per problem, read thrice
        targets = _targets(shift, tight_residuals(h, lower, lq, square), lower, square)
        solve = _cg_solve(q, pre, shift, targets, cache)
        if start is not None and not bool(free0.any()):  # FISTA's free sets, solved at once
            q32 = q.float()
            free0, y0, y0q = projected_free_sets(q, shift, start, q32)
            solve = _mixed_solve(q, q32, start, shift, targets, solve)
        else:
            whole = None if bool(c.any()) else -lower  # Q(−lower) + shift = 0: no product
            free0, y0 = rough_free_sets(q, pre, shift, free0, whole, cache, start)
    else:
        def solve(rows: Tensor, free: Tensor, y: Tensor, yq: Tensor,
                  tight: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
            out = solve_free(q, -shift[rows], free, None if total is None else total[rows])
            return out, torch.ones(len(rows), dtype=torch.bool), out.nan_to_num() @ q
    threshold = (_relative_threshold(q, lower, c, tol) if relative
                 else lambda rows, y, yq: tol)
    return _pivot_loop(q, shift, lower, simplex, free0, tol, threshold, max_iter, solve, y0,
                       y0q)


def tight_residuals(h: Tensor, lower: Tensor, lq: Tensor,
                    square: Tensor | None = None) -> Tensor:
    """``[B]``: the residual at which a tight free-set solve of each problem stops (``h =
    Q⁻¹``, ``lq = lower·Q``; ``square``: ``‖lower‖²_Q`` per problem where the caller has
    it), ``CG_ERROR ‖lower‖_Q / √min(‖Q⁻¹‖_∞, tr Q⁻¹)``; the solve
    keeps it within ``[CG_RTOL_MIN, CG_RTOL_MAX]`` times its right-hand side (:func:`_cg_solve`).

    On a free set ``F`` the error ``e`` of ``y`` has ``Q_FF e_F = r_F``, so ``‖e‖_Q ≤
    ‖r‖/√λ_min(Q_FF) ≤ ‖r‖/√λ_min(Q)`` (Cauchy interlacing), and ``1/λ_min(Q) = λ_max(Q⁻¹)``
    is at most ``‖Q⁻¹‖_∞`` (Gershgorin, symmetric) and ``tr Q⁻¹`` (positive definite):
    ``‖e‖_Q ≤ CG_ERROR ‖lower‖_Q``, ``O(K²)``. Measured against the problem's own bound,
    not ``λ_max``'s estimate ``‖(lower Q)_F‖ ≤ √λ_max ‖lower‖_Q``: 2× looser on UPGrad's
    conflicting rows at ``K = 1,024``, one conjugate-gradient step fewer for most rows."""
    inverse_top = min(_inf_norm(h), float(torch.trace(h)))
    square = torch.linalg.vecdot(lower, lq) if square is None else square
    size = square.clamp_min(0.0).sqrt()
    return size * (CG_ERROR / inverse_top ** 0.5) if inverse_top > 0.0 else torch.zeros_like(size)


#: ``(rows, y, yQ, exact) → (rtol, atol)``: the targets of the free-set solves of the open
#: problems ``rows`` (:func:`_targets`).
Targets = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def _targets(shift: Tensor, tight: Tensor, lower: Tensor, square: Tensor) -> Targets:
    """``(rows, y, yq, exact) → (rtol, atol)`` of the free-set solves of
    :func:`solve_lcp_pivoting`: to the residual ``tight`` ``[B]`` (:func:`tight_residuals`)
    where ``exact``, times the projection's last size against its bound's, ``min(1, ‖v‖_Q /
    ‖lower‖_Q)`` (``v = lower + y``; ``square = ‖lower‖²_Q``; ``‖v‖²_Q = square + 2
    lower·yQ + y·yQ``, ``Q`` symmetric: ``O(K)`` per problem from the last solve's ``yQ``),
    within ``[CG_RTOL_MIN, CG_RTOL_MAX]`` times the right-hand side ``‖shift_F‖`` (only
    those count as exact), else ``CG_LOOSE_RTOL`` times it. The error of each projection is
    then ``CG_ERROR`` of its own size: where the dual cone is thin, projections a thousandth
    of their bound (rows of rank ``K/4`` plus noise 1e-3 of their size) summed to an update
    1e-4 off with the bound's."""
    bound = square.clamp_min(0.0).sqrt()
    dtype = shift.dtype

    def targets(rows: Tensor, y: Tensor, yq: Tensor, exact: Tensor) -> tuple[Tensor, Tensor]:
        every = rows.numel() == lower.shape[0]  # the rows in order (the pivoting's): no gather
        low = lower if every else lower[rows]
        dot = torch.linalg.vecdot  # term by term: no [B, K] temporaries
        size = (square[rows] + 2.0 * dot(low, yq) + dot(y, yq)).clamp_min_(0.0).sqrt_()
        part = torch.where(size < bound[rows], size / bound[rows].clamp_min(1e-300), 1.0)
        rtol = torch.where(exact, CG_RTOL_MAX, CG_LOOSE_RTOL).to(dtype)
        return rtol, torch.where(exact, tight[rows] * part, torch.inf)
    return targets


def _cg_solve(q: Tensor, h: Preconditioner, shift: Tensor, targets: Targets,
              cache: SetupCache) -> Solve:
    """The free-set solves of :func:`solve_lcp_pivoting` by :func:`~._pcg.pcg_free`, to the
    residuals of ``targets`` (:func:`_targets`); the preconditioner's setups from ``cache``."""

    def solve(rows: Tensor, free: Tensor, y: Tensor, yq: Tensor,
              exact: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        rtol, atol = targets(rows, y, yq, exact)
        out, converged, outq = pcg_free(q, h, -shift[rows], free, y, yq, rtol,
                                        setup=lambda live, f: cache.setup(rows[live], f),
                                        atol=atol, rtol_min=CG_RTOL_MIN)
        stuck = exact & ~converged  # no tight solve within the steps: the factorisations'
        if bool(stuck.any()):
            out[stuck] = torch.nan
        return out, converged & exact, outq
    return solve


def _mixed_solve(q: Tensor, q32: Tensor, start: Plan, shift: Tensor, targets: Targets,
                 exact_solve: Solve) -> Solve:
    """The free-set solves of :func:`solve_lcp_pivoting` from the projected start ``start``
    in mixed precision (:func:`~._mixed.mixed_free_solve`: float32 steps on a float64
    residual, the new point's residual exact), to the residuals of ``targets``
    (:func:`_targets`); a tight solve whose round stalled goes on in float64
    (``exact_solve``, :func:`_cg_solve`); ``q32``: ``Q`` in float32."""
    pre = ScaledPreconditioner.of(start)
    rough = pre.bulk(q32) if q.shape[0] >= ROUGH_MIN_SIZE and bfloat16_products() else None

    def solve(rows: Tensor, free: Tensor, y: Tensor, yq: Tensor,
              exact: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        rtol, atol = targets(rows, y, yq, exact)
        part = shift if rows.numel() == shift.shape[0] else shift[rows]
        size = _norm(part * free, dim=1)
        target = torch.minimum(torch.maximum(atol, CG_RTOL_MIN * size), rtol * size)
        out = mixed_free_solve(q, q32, pre, part, free, y, yq, target, rough=rough)
        redo = torch.nonzero(exact & out.stalled).flatten()
        converged = out.converged & exact
        if redo.numel():
            got = exact_solve(rows[redo], free[redo], out.y[redo], out.yq[redo],
                              exact[redo])
            if got is None:
                return None
            out.y[redo], converged[redo], out.yq[redo] = got
        return out.y, converged, out.yq
    return solve


def _first_solve(q: Tensor, free: Tensor, simplex: bool, solve: Solve,
                 y0: Tensor | None, y0q: Tensor | None = None
                 ) -> tuple[Tensor, Tensor, Tensor] | None:
    """The pivoting's first point: a guessed solution ``y0`` (zero off ``free``) as it is (the
    float32 pivoting's, already solved to about 1e-6 on its free set: its multipliers are
    tested first, and only a tight solve can finish it), or where its product ``y0q = y0 Q``
    is given a tight solve on ``free`` from it (the projected start's: near the optimal free
    sets, not solved on them), else a loose solve from ``y = 0``; none from an empty free
    set and no guess (the default start of a box QP: ``y = 0``)."""
    b = free.shape[0]
    rows = torch.arange(b)
    if y0 is not None and y0q is not None:
        return solve(rows, free, y0, y0q, torch.ones(b, dtype=torch.bool))
    if y0 is not None:  # zero off ``free`` (:func:`~._pcg.rough_free_sets`)
        return y0, torch.zeros(b, dtype=torch.bool), y0 @ q
    y = torch.zeros(free.shape, dtype=q.dtype)
    if simplex or bool(free.any()):
        return solve(rows, free, y, torch.zeros_like(y), torch.zeros(b, dtype=torch.bool))
    return y, torch.ones(b, dtype=torch.bool), torch.zeros_like(y)


def _pivot_loop(q: Tensor, shift: Tensor, lower: Tensor, simplex: bool, free0: Tensor,
                tol: float, threshold: Threshold, max_iter: int,
                solve: Solve, y0: Tensor | None = None,
                y0q: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """The iterations of :func:`solve_lcp_pivoting`; ``solve(rows, free, y_last, y_last Q,
    tight)`` gives the free-set solutions of the open problems ``rows``, which are exact
    (``tight``: the free set had no infeasible index, or the last solve was exact) and their
    products ``yQ``; a free ``y`` below ``−tol`` or a multiplier below
    ``−threshold(rows, y, yQ)`` is infeasible. ``y0``: a guessed first solution (with its
    product ``y0q``, solved on ``free0`` first: :func:`_first_solve`)."""
    b, k = shift.shape
    free = free0.clone()
    # the open problems' state, compacted together: no per-iteration gathers by ``rows``
    best = torch.full((b,), k + 1, dtype=torch.int64)
    size = torch.full((b,), k, dtype=torch.int64)
    stale = torch.zeros(b, dtype=torch.int64)
    rows = torch.arange(b)
    solved = _first_solve(q, free, simplex, solve, y0, y0q)
    x = lower.clone()
    done = torch.zeros(b, dtype=torch.bool)
    for _ in range(max_iter):
        if solved is None:
            return None
        y, exact, yq = solved
        w = _multipliers(yq, shift, free, simplex)
        bad = either(free, y < -tol, w < -threshold(rows, y, yq))
        count = bad.sum(dim=1)
        failed = y.sum(dim=1).isnan()  # a free block that did not factorise: left open
        finished = (count == 0) & exact & ~failed
        if bool(finished.all()):  # the usual last iteration: no compaction
            x[rows] = lower + y.clamp_min(0.0)
            done[rows] = True
            break
        stuck = (stale >= STALE_MAX) & ~finished & ~failed  # left open, at its last point
        keep = ~(finished | failed | stuck)
        if not bool(keep.all()):
            at = torch.nonzero(finished | stuck).flatten()  # row gathers by index, not mask
            x.index_copy_(0, rows[at], y.index_select(0, at).clamp_min_(0.0).add_(
                lower.index_select(0, at)))
            done[rows[at]] = finished[at]
            keep = torch.nonzero(keep).flatten()
            rows, y, yq, free, bad, w, count, exact, best, size, stale, shift, lower = (
                t.index_select(0, keep) for t in (rows, y, yq, free, bad, w, count, exact,
                                                  best, size, stale, shift, lower))
            if rows.numel() == 0:
                break
        best, size, stale = _block(count, best, size, stale)
        free = _exchange(free, bad, size, stale >= MURTY_AFTER, simplex, y, w)
        solved = solve(rows, free, y, yq, (count == 0) | exact | (stale >= HALVE_AFTER))
    else:  # out of iterations: the open problems' last points, a start for the next method
        if solved is not None:
            x[rows] = lower + solved[0].nan_to_num().clamp_min(0.0)
    return x, done


#: ``F ↦`` the Cholesky factor of ``Q_FF`` (``F``: the increasing free indices), for
#: :func:`_pivot_single`: a caller's kept factors (:class:`~._cholesky.BlockFactors`).
FactorOf = Callable[[list[int]], Factor]


def _solve_free_single(q: Tensor, shift: Tensor, idx: list[int], simplex: bool,
                       total: float, factor_of: FactorOf | None = None,
                       weights: Tensor | None = None) -> Tensor | None:
    """``y`` ``[K]`` with ``Q_FF y_F = −shift_F`` (``+ ν1`` and ``1ᵀy_F = total`` with the
    simplex; ``+ νa`` and ``aᵀy_F = total`` with its ``weights`` ``a``) on the free indices
    ``idx``, zero elsewhere (``Q_FF``'s factor from ``factor_of`` where given); None if the
    Cholesky fails."""
    y = torch.zeros(shift.shape[0], dtype=q.dtype)
    if not idx:
        return y
    sel = torch.tensor(idx)
    chol, info = (cholesky_ex(principal_block(q, sel))
                  if factor_of is None else factor_of(idx))
    if int(info) != 0:
        return None
    rhs = -shift[sel]
    if simplex:
        on = torch.ones_like(rhs) if weights is None else weights[sel]
        sol = cholesky_solve(torch.stack([rhs, on], 1), chol)
        along = on @ sol[:, 1]
        part = sol[:, 0] + (total - on @ sol[:, 0]) / along * sol[:, 1]
        # once more along Q_FF⁻¹a: the first sum cancels terms far larger than the total
        # (weights 11 decades apart: aᵀy 1.2e-10 off), and the step keeps Qy + shift ∝ a
        y[sel] = part + (total - on @ part) / along * sol[:, 1]
    else:
        y[sel] = cholesky_solve(rhs[:, None], chol)[:, 0]
    return y


def _infeasible_single(q: Tensor, shift: Tensor, y: Tensor, free: list[bool], idx: list[int],
                       simplex: bool, tol: float, weights: Tensor | None = None,
                       relative: _SingleThreshold | None = None,
                       ) -> tuple[list[int], list[float], list[float]]:
    """The indices with ``y_F < −tol`` or ``w_A < −tol`` (``w = Qy + shift − ν1``; ``w_A <
    −relative(y, w)`` where given, :class:`_SingleThreshold`), ``y`` and ``w``; with the
    simplex's ``weights`` ``a``, ``w = Qy + shift − νa`` (``ν`` fitted on ``F`` by least
    squares) and both tests relative: ``y_F < −tol max|y|``, ``w_A < −tol (1 +
    max|Qy + shift|)`` (:func:`~._cagrad_root.is_cagrad_kkt`'s bound), ``y``'s entries far
    apart in size where ``a``'s are."""
    w = q @ y + shift
    if relative is not None:  # the box's multipliers against the point's size
        return _infeasible_by_size(y, w, free, tol, relative)
    y_tol = w_tol = tol
    if simplex and weights is not None:
        on = weights[idx]
        w_tol = tol * (1.0 + float(w.abs().max()))
        y_tol = tol * float(y.abs().max())
        w = w - (on @ w[idx]) / (on @ on) * weights
    y_l, w_l = torch.stack([y, w]).tolist()
    if simplex and weights is None:
        nu_v = sum(w_l[i] for i in idx) / len(idx)
        w_l = [v - nu_v for v in w_l]
    bad = [i for i, f in enumerate(free) if (y_l[i] < -y_tol if f else w_l[i] < -w_tol)]
    return bad, y_l, w_l


def _infeasible_by_size(y: Tensor, w: Tensor, free: list[bool], tol: float,
                        relative: _SingleThreshold) -> tuple[list[int], list[float], list[float]]:
    """:func:`_infeasible_single` for a box problem: ``y_F < −tol`` or ``w_A < −relative(y,
    w)`` (:class:`_SingleThreshold`), ``y`` and ``w`` (``w = Qv + c``)."""
    bad_w = (w < -relative(y, w)).tolist()
    y_l, w_l = torch.stack([y, w]).tolist()
    bad = [i for i, f in enumerate(free) if (y_l[i] < -tol if f else bad_w[i])]
    return bad, y_l, w_l


def _exchange_single(free: list[bool], bad: list[int], size: int, murty: bool,
                     simplex: bool, y_l: list[float], w_l: list[float],
                     weights: list[float] | None = None) -> None:
    """:func:`_exchange` for one problem, on lists: the ``size`` most infeasible indices of
    ``bad`` change side, only the largest where ``murty``; with the simplex an empty free
    set gets the index of the smallest ``w`` (``Σy = total > 0``; of the smallest ``wⱼ/aⱼ``
    with its ``weights`` ``a``: the cheapest step along ``aᵀy``)."""
    if murty:
        chosen = bad[-1:]
    elif size >= len(bad):
        chosen = bad
    else:
        top = max(max(map(abs, y_l)), 1e-300)
        wtop = max(max(map(abs, w_l)), 1e-300)
        chosen = sorted(bad, key=lambda i: y_l[i] / top if free[i] else w_l[i] / wtop)[:size]
    for i in chosen:
        free[i] = not free[i]
    if simplex and not any(free):
        rate = w_l if weights is None else [v / a for v, a in zip(w_l, weights, strict=True)]
        free[min(range(len(free)), key=rate.__getitem__)] = True


class _SingleThreshold:
    """The box's multiplier test of :func:`_pivot_single`: ``w_j < −tol (‖x‖ √Q_jj + |c_j|)
    − 8 eps ‖v‖_∞ Σᵢ|Q_ij|`` is infeasible (``v = lower + y``, ``w = Qv + c``, ``‖x‖² =
    vᵀQv = vᵀ(w − c)``: no product of its own), as :func:`_relative_threshold`'s with its
    rounding bound taken by rows. Against an absolute ``tol`` a projection far smaller than
    its bound (rows of low rank plus noise 1e-4, ``Q``'s condition number 2e9: ``‖x‖`` 7e-7
    of the bound's) was finished with multipliers ``−6.5e-13``, a conflict of ``−1.1e-5``
    of the update's size with one task."""

    def __init__(self, q: Tensor, lower: Tensor, c: Tensor, tol: float) -> None:
        self.lower, self.c, self.tol = lower, c, tol
        self.d = torch.diagonal(q).clamp_min(0.0).sqrt()
        self.rows = torch.linalg.vector_norm(q, ord=1, dim=1)  # Σᵢ|Q_ij|, no |Q| in memory

    def __call__(self, y: Tensor, w: Tensor) -> Tensor:
        v = self.lower + y
        size = float(torch.dot(v, w - self.c).clamp_min(0.0).sqrt())
        noise: Tensor = (8 * _EPS * float(v.abs().max())) * self.rows
        return noise.add_(self.d * size + self.c.abs(), alpha=self.tol)


def _pivot_single(
    q: Tensor, c: Tensor, lower: Tensor, simplex: bool, free0: list[bool], tol: float,
    max_iter: int, factor_of: FactorOf | None = None, weights: Tensor | None = None,
    on_stall: Callable[[list[bool]], Tensor | None] = lambda free: None,
    stall_after: int = STALE_MAX,
) -> Tensor | None:
    """:func:`solve_lcp_pivoting` for one problem (``c``, ``lower`` ``[K]``).

    The same iterations, with the pivoting decisions made on Python lists (one host sync per
    iteration) and the subproblem solved on the free indices only: a few tensor operations
    per iteration instead of dozens of masked ones. None when it does not finish.
    ``factor_of``: the factors of ``Q``'s free blocks where the caller keeps them.
    ``weights``: the simplex ``aᵀx = 1`` (``a > 0``) instead of ``1ᵀx = 1``.
    ``on_stall``: the answer from the last free set where the count of infeasible indices
    has not fallen for ``stall_after`` iterations (default: None, open, after
    ``STALE_MAX``; with ``MURTY_AFTER`` the block exchanges cycled, and ``on_stall``
    answers in place of Murty's one exchange per iteration, each a factorisation).
    """
    k = c.shape[0]
    shift = lower @ q + c
    bound = float(lower.sum()) if weights is None else float(weights @ lower)
    total = 1.0 - bound if simplex else 0.0
    rates = None if weights is None else weights.tolist()
    relative = None if simplex else _SingleThreshold(q, lower, c, tol)
    free = list(free0)
    best, size, stale = k + 1, k, 0
    for _ in range(max_iter):
        idx = [i for i in range(k) if free[i]]
        y = _solve_free_single(q, shift, idx, simplex, total, factor_of, weights)
        if y is None:
            return None
        bad, y_l, w_l = _infeasible_single(q, shift, y, free, idx, simplex, tol, weights,
                                           relative)
        if not bad:
            return lower + y.clamp_min(0.0)
        best, size, stale = _block_single(len(bad), best, size, stale)
        if stale >= stall_after:
            return on_stall(free)
        _exchange_single(free, bad, size, stale >= MURTY_AFTER, simplex, y_l, w_l, rates)
    return None


def _factored_from(q: Tensor, c: Tensor, lower: Tensor, simplex: bool,
                   tol: float) -> Callable[[list[bool]], Tensor | None]:
    """:func:`_pivot_single`'s ``on_stall`` on a positive definite ``Q``: Lawson–Hanson on its
    Cholesky factor (:func:`factored_box_qp`, a cold start: from the stalled free set it
    took 1.2–2.3× as long, its drops one rotation each); None where ``Q`` does not
    factorise. DualProj on rows of rank K/2 plus noise 1e-3 (K = 256, seed 7): the
    pivoting's 184 iterations and ADMM's route, 107 ms, against 33 ms (docs/balancers.md)."""

    def finish(free: list[bool]) -> Tensor | None:
        del free  # the stalled set: a slower start than none
        chol, info = cholesky_ex(q)
        if int(info) != 0:
            return None
        return factored_box_qp(chol, c, lower, simplex, None, tol)
    return finish


#: Iterations of :func:`pivot_weighted_simplex` at most: from the last point of CAGrad's
#: root search its QPs on ``torch.randn`` rows of norms 1e-6 … 1e6 finish in 2–6 (K = 64 …
#: 1,024; Lawson–Hanson: 466 additions at K = 1,024); on rows sharing a direction some take
#: 11–37 or stall near 80, where Lawson–Hanson from the same start takes 2–7 ms a QP (K =
#: 64, 256) and the pivoting 0.17 ms (K = 64) to 0.35 ms (K = 256) an iteration.
WEIGHTED_MAX_ITER = 8


def pivot_weighted_simplex(q: Tensor, c: Tensor, weights: Tensor, x0: Tensor,
                           tol: float, factor_of: FactorOf) -> Tensor | None:
    """``argmin ½ xᵀQx + cᵀx`` s.t. ``x ≥ 0``, ``aᵀx = 1`` (``a = weights > 0``) on a
    well-conditioned ``Q`` from ``x0``'s support, or None where the pivoting does not
    finish within ``WEIGHTED_MAX_ITER`` iterations.

    :func:`_pivot_single` with the weighted simplex (each free block's factor from
    ``factor_of``, a caller's kept factors): ``O(|F|³/3)`` per iteration for a new free set
    ``F``, ``O(K|F|)`` for its multipliers."""
    free0 = (x0 > 0.0).tolist()
    if not any(free0):
        free0[int(torch.argmin(c / weights))] = True  # the vertex the linear part prefers
    return _pivot_single(q, c, torch.zeros_like(c), True, free0, tol, WEIGHTED_MAX_ITER,
                         factor_of, weights)


# -- 2. non-negative least squares (Lawson & Hanson) ---------------------------------------
@dataclass
class NNLSResult:
    """``x`` of :func:`nnls`, with its work: LH additions and least-squares solves, FISTA steps."""

    x: Tensor
    additions: int
    solves: int
    fallback_steps: int = 0


class _Work:
    """Counters of one :func:`nnls` call: Lawson–Hanson additions, least-squares solves,
    and the candidates to enter left when the additions ran out."""

    def __init__(self) -> None:
        self.additions = 0
        self.solves = 0
        self.open = 0  # candidates left when the additions ran out


#: Columns from which a cold Lawson–Hanson start not finished after ``INTERIOR_AFTER``
#: additions goes to the interior point (:func:`nnls`): a handful of additions finish
#: most problems; rank-deficient rows with float32 rounding take about ``n/2``.
INTERIOR_MIN_COLUMNS = 64
INTERIOR_AFTER = 16


def _solve(qr: ColumnQR, work: _Work) -> tuple[Tensor, list[float]]:
    """The least-squares solution on the passive columns, in their order in ``qr``, as a
    tensor and as a list."""
    work.solves += 1
    z = qr.solve()
    return z, z.tolist()


def _drop(qr: ColumnQR, leaving: list[int]) -> None:
    """The columns ``leaving`` leave the factorisation, the last-placed first (the shorter
    rotations)."""
    place = {j: i for i, j in enumerate(qr.cols)}
    for j in sorted(leaving, key=place.__getitem__, reverse=True):
        qr.drop(j)


def _enter(qr: ColumnQR, guess: list[int], norms: Tensor) -> None:
    """The guessed columns enter in their order, each that is independent of those before
    it: those off the span as one block (:meth:`~._qr_update.ColumnQR.add_block`), cut
    before its first column that depends on those before it in the block, which is left
    out; then again with the rest."""
    rest = guess
    while rest and qr.size < qr.tt.shape[1]:
        off = (qr.off_norms()[rest] > INDEPENDENCE_RTOL * norms[rest]).tolist()
        rest = [j for j, ok in zip(rest, off, strict=True) if ok]
        block, p = rest[: qr.tt.shape[1] - qr.size], qr.size
        if not block:
            return
        qr.add_block(block)
        independent = (qr.diagonal(p) > INDEPENDENCE_RTOL * norms[block]).tolist()
        i = next((i for i, ok in enumerate(independent) if not ok), len(block))
        qr.truncate(p + i)
        rest = rest[i + 1 :] if i < len(block) else rest[i:]


def _warm_start(guess: list[int], norms: Tensor, qr: ColumnQR, work: _Work,
                point: Tensor | None) -> Tensor:
    """A feasible start from a guessed passive set (its non-zero columns, in order of
    preference): its columns independent of those before them enter; from a feasible
    ``point``, Lawson–Hanson's inner loop then moves it on them towards their least-squares
    solution (steps 7–11: each index that reaches zero leaves); without one, the indices of
    a non-positive least-squares solution leave until none is left (each solve drops one or
    more)."""
    x = torch.zeros(qr.n, dtype=qr.tt.dtype)
    _enter(qr, guess, norms)
    if point is not None and qr.size:
        x.index_copy_(0, qr.cols_t, point[qr.cols_t].clamp_min(0.0))
        z, z_l = _solve(qr, work)
        return _inner_loop(x, z, z_l, qr, work)
    while qr.size:
        z, z_l = _solve(qr, work)
        if min(z_l) > 0.0:
            return x.index_copy_(0, qr.cols_t, z)
        _drop(qr, [j for j, v in zip(qr.cols, z_l, strict=True) if v <= 0.0])
    return x


def _step_to_boundary(x: Tensor, qr: ColumnQR, z: Tensor) -> tuple[Tensor, list[int]]:
    """Lawson–Hanson steps 8–11: the largest step from ``x`` towards ``z`` (on the passive
    set) that keeps it feasible; the blocking index (the smallest of equal ratios) and every
    other that reaches zero leave the passive set (returned)."""
    idx = qr.cols_t
    now = x[idx]
    ratios = torch.where(z <= 0.0, now / (now - z), math.inf)
    alpha = ratios.min()
    block = torch.where(ratios == alpha, idx, x.shape[0]).min()
    moved = now + alpha * (z - now)
    leave = (moved <= 0.0) | (idx == block)
    out = torch.zeros_like(x).index_copy_(0, idx, moved.masked_fill_(leave, 0.0))
    return out, idx[leave].tolist()


def _inner_loop(x: Tensor, z: Tensor, z_l: list[float], qr: ColumnQR, work: _Work) -> Tensor:
    """Lawson–Hanson steps 7–11: move towards the least-squares solution ``z`` on the
    passive set until it is positive, dropping each index that reaches zero."""
    while min(z_l) <= 0.0:
        x, leaving = _step_to_boundary(x, qr, z)
        _drop(qr, leaving)
        if not qr.size:
            return torch.zeros_like(x)
        z, z_l = _solve(qr, work)
    return torch.zeros_like(x).index_copy_(0, qr.cols_t, z)


@dataclass
class _Scales:
    """The fixed scales of one :func:`_lawson_hanson` call: the column norms ``‖Aⱼ‖`` (as a
    tensor too) and ``‖b‖``."""

    norms: list[float]
    bnorm: float
    norms_t: Tensor


def _candidates(x: Tensor, scales: _Scales, tol: float, qr: ColumnQR) -> Tensor:
    """``gⱼ`` ``[n]`` of every index that may enter the passive set (see
    :func:`_lawson_hanson`), ``−inf`` elsewhere: outside it, independent of it, and with
    ``wⱼ`` above both ``tol ‖eⱼ‖‖r‖`` and rounding. One pass of tensor operations over the
    ``n`` columns (no per-column Python work): ``x`` is the least-squares solution on the
    passive set, so ``r``, ``w = Aᵀr`` and ``‖eⱼ‖`` are read off the factorisation (a
    passive column has ``eⱼ = 0``, exactly)."""
    tail = qr.tt[:, qr.size :]
    r = tail[-1]
    w = tail[:-1] @ r
    off = _norm(tail[:-1], dim=1)
    noise = (scales.norms_t @ x).add_(scales.bnorm).mul_(8 * _EPS)  # x ≥ 0
    floor = torch.maximum(off * (tol * _norm(r)), scales.norms_t * noise)
    ok = (off > INDEPENDENCE_RTOL * scales.norms_t) & (w > floor)
    return torch.where(ok, w / off, -math.inf)


def _pick(scores: Tensor, aside: set[int]) -> int | None:
    """The index of the largest score not set aside (the last one of equal scores), or None
    when no candidate is left."""
    if aside:
        scores = scores.clone()
        scores[list(aside)] = -math.inf
    flipped = scores.flip(0)
    first = flipped.argmax()
    if float(flipped[first]) == -math.inf:
        return None
    return scores.shape[0] - 1 - int(first)


def _add(x: Tensor, t: int, qr: ColumnQR, work: _Work) -> Tensor | None:
    """Index ``t`` enters the passive set and ``x`` moves to the new solve (Lawson–Hanson
    steps 5–11); None, with ``t`` left out, if the solve gives it no positive value."""
    qr.add(t)
    z, z_l = _solve(qr, work)
    if z_l[-1] <= 0.0:
        qr.drop(t)
        return None
    return _inner_loop(x, z, z_l, qr, work)


def _lawson_hanson(a: Tensor, b: Tensor, guess: list[int], tol: float,
                   max_additions: int, work: _Work,
                   point: Tensor | None = None) -> tuple[Tensor, bool]:
    """Lawson & Hanson (1974, *Solving Least Squares Problems*, Ch. 23, Alg. NNLS).

    ``(x, converged)``. With ``r = b − Ax`` orthogonal to the passive columns and
    ``w = Aᵀr``, an index ``j`` outside with ``wⱼ > 0`` lowers ``‖r‖²/2`` by up to
    ``gⱼ²/2``, ``gⱼ = wⱼ/‖eⱼ‖`` (``eⱼ``: the part of ``Aⱼ`` off the passive columns' span).
    Each addition moves the index of the largest ``gⱼ`` into the passive set and re-solves;
    ``x`` stays feasible and ``‖r‖`` strictly decreases, so no passive set repeats. Optimal
    when no ``gⱼ`` exceeds ``tol ‖r‖`` (the residual is then within ``tol ‖r‖`` of its
    optimum along every single column) or ``wⱼ`` is rounding (below ``8 eps ‖Aⱼ‖(‖b‖ +
    Σᵢ‖Aᵢ‖|xᵢ|)``). A column with ``‖eⱼ‖`` below ``INDEPENDENCE_RTOL ‖Aⱼ‖`` depends on the
    passive ones and never enters (its ``wⱼ = eⱼᵀr`` is at most ``INDEPENDENCE_RTOL
    ‖Aⱼ‖‖r‖``), so every least-squares solve is well posed. The passive columns' QR
    factorisation is updated, not recomputed (:class:`~._qr_update.ColumnQR`: ``O(m n)``
    per addition, ``O(p n)`` per removal, ``‖eⱼ‖`` read off it). Not
    converged: a passive set repeats (rounding), the additions run out, or a solve gives the
    entering index no positive value (it is then set aside until ``x`` changes).
    """
    norms_t = _norm(a, dim=0)
    scales = _Scales(norms_t.tolist(), float(_norm(b)), norms_t)
    qr = ColumnQR(a, b)
    x = _warm_start([j for j in guess if scales.norms[j] > 0.0], norms_t, qr, work, point)
    seen: set[frozenset[int]] = set()
    aside: set[int] = set()
    while work.additions < max_additions:
        scores = _candidates(x, scales, tol, qr)
        t = _pick(scores, aside)
        if t is None:
            return x, not bool((scores > -math.inf).any())
        work.additions += 1
        moved = _add(x, t, qr, work)
        if moved is None:
            aside.add(t)
            continue
        x = moved
        aside.clear()
        key = frozenset(qr.cols)
        if key in seen:
            return x, False
        seen.add(key)
    work.open = int((_candidates(x, scales, tol, qr) > -math.inf).sum())
    return x, False


def _fista(a: Tensor, b: Tensor, x0: Tensor, steps: int) -> Tensor:
    """Accelerated projected gradient (Beck & Teboulle 2009, FISTA) for the NNLS problem.

    Step ``1/L``, ``L = ‖A‖₂²``; after ``N`` steps ``f(x_N) − f* ≤ 2L‖x₀ − x*‖²/(N + 1)²``
    for ``f(x) = ½‖Ax − b‖²`` (their Theorem 4.4), whatever the conditioning.
    """
    lip = float(torch.linalg.matrix_norm(a, ord=2)) ** 2
    if lip == 0.0:
        return x0
    gram, atb = a.T @ a, a.T @ b
    x, y, t = x0, x0, 1.0
    for _ in range(steps):
        nxt = (y - (gram @ y - atb) / lip).clamp_min(0.0)
        t_next = 0.5 * (1.0 + math.sqrt(1.0 + 4.0 * t * t))
        y = nxt + ((t - 1.0) / t_next) * (nxt - x)
        x, t = nxt, t_next
    return x


def _is_optimal(a: Tensor, b: Tensor, x: Tensor, tol: float) -> bool:
    """Lawson–Hanson's optimality test (:func:`_lawson_hanson`) for any ``x ≥ 0``, on both
    sides: every ``|wⱼ|`` (``w = Aᵀ(b − Ax)``) below ``tol ‖Aⱼ‖‖r‖`` or rounding, so no
    column, in or out, moves the residual by more than ``tol ‖r‖``."""
    r = b - a @ x
    norms = _norm(a, dim=0)
    noise = 8 * _EPS * (float(_norm(b)) + float(norms @ x))
    floor = norms * max(tol * float(_norm(r)), noise)
    return bool((x >= 0.0).all()) and bool(((a.T @ r).abs() <= floor).all())


def _corrected(a: Tensor, b: Tensor, x: Tensor) -> Tensor | None:
    """``x + A⁺(b − Ax)`` (the least-norm correction) where ``A`` has fewer rows than
    columns: the residual of an interior point whose every coordinate is positive (a solution
    with ``Ax = b`` up to rounding, not unique) taken to rounding; None elsewhere. By the
    least-norm normal equations, ``Aᵀz`` with ``AAᵀz = r`` (one Cholesky factorisation of
    the ``m × m`` ``AAᵀ``: ``[577, 1024]`` 16 ms against 28 ms by ``gelsy``), ``gelsd``
    where ``AAᵀ`` does not factorise; never ``gelsy``, which reads an uninitialised pivot
    array on the CPU (:func:`least_squares`). The caller tests the result."""
    if a.shape[0] >= a.shape[1]:
        return None
    r = (b - a @ x)[:, None]
    low, info = cholesky_ex(a @ a.T)
    if int(info) == 0:
        return x + (a.T @ cholesky_solve(r, low))[:, 0]
    return x + least_squares(a, r)[:, 0]


def least_squares(a: Tensor, b: Tensor) -> Tensor:
    """The least-norm least-squares solution of ``A X = B`` (``torch.linalg.lstsq`` with the
    SVD driver ``gelsd``, ranks cut at its default ``rcond``). Not ``gelsy``, the default on
    the CPU: it reads its column-pivot array uninitialised, so the same input gives
    different answers from call to call (at rounding on well-conditioned problems, by up to
    37 % in PCD's update on cancelling rows; docs/balancers.md, "Determinism")."""
    out: Tensor = torch.linalg.lstsq(a, b, driver="gelsd").solution
    return out


def _accepted(a: Tensor, b: Tensor, point: Tensor, tol: float) -> Tensor | None:
    """The interior point, or its correction (:func:`_corrected`), where it passes
    Lawson–Hanson's test (:func:`_is_optimal`); None where neither does."""
    if _is_optimal(a, b, point, tol):
        return point
    corrected = _corrected(a, b, point)
    return corrected if corrected is not None and _is_optimal(a, b, corrected, tol) else None


def _first_pass(a: Tensor, b: Tensor, passive0: list[bool] | None, tol: float, budget: int,
                work: _Work) -> tuple[Tensor, bool]:
    """Lawson–Hanson from ``passive0``; a cold start on ``INTERIOR_MIN_COLUMNS`` columns or
    more stops after ``INTERIOR_AFTER`` additions and, with more candidates than that left,
    goes to the interior point (its point if accepted, else its support and point start
    Lawson–Hanson again), or else goes on from its support."""
    if passive0 is not None or a.shape[1] < INTERIOR_MIN_COLUMNS:
        guess = [] if passive0 is None else [j for j, p in enumerate(passive0) if p]
        return _lawson_hanson(a, b, guess, tol, budget, work)
    x, converged = _lawson_hanson(a, b, [], tol, min(budget, INTERIOR_AFTER), work)
    if converged:
        return x, True
    if work.open <= INTERIOR_AFTER:
        return _lawson_hanson(a, b, torch.nonzero(x).flatten().tolist(), tol, budget, work)
    point, support = interior_nnls(a, b, lambda v: _is_optimal(a, b, v, tol))
    answer = _accepted(a, b, point, tol)
    if answer is not None:
        return answer, True
    return _lawson_hanson(a, b, support, tol, budget, work, point)


def nnls(a: Tensor, b: Tensor, passive0: list[bool] | None = None, tol: float = 1e-12,
         max_additions: int | None = None) -> NNLSResult:
    """``argmin_{x ≥ 0} ‖A x − b‖`` for ``A`` ``[m, n]``, ``b`` ``[m]`` (float64).

    The Lawson–Hanson active set (:func:`_lawson_hanson`; warm-started from ``passive0`` if
    given), at most ``max_additions`` (default ``3n + 10``) additions. A cold start on
    ``INTERIOR_MIN_COLUMNS`` columns or more that ``INTERIOR_AFTER`` additions do not finish,
    with more than as many candidates left to enter, goes to an interior point
    (:func:`~._interior.interior_nnls`): its point if it passes Lawson–Hanson's optimality
    test on both sides (:func:`_is_optimal`), else Lawson–Hanson again, from the support it
    guesses and its point (the inner loop's start). If it does not converge:
    ``FALLBACK_ITERATIONS`` FISTA steps (:func:`_fista`, a proven error bound) from its
    point, then the active set again from the support of the FISTA point (the polish); the
    point with the smaller residual is returned.
    """
    n = a.shape[1]
    budget = 3 * n + 10 if max_additions is None else max_additions
    work = _Work()
    x, converged = _first_pass(a, b, passive0, tol, budget, work)
    if converged:
        return NNLSResult(x, work.additions, work.solves)
    rough = _fista(a, b, x, FALLBACK_ITERATIONS)
    rough_support = torch.nonzero(rough > 1e-9 * float(rough.max().clamp_min(1e-300)))
    polished, _ = _lawson_hanson(a, b, rough_support.flatten().tolist(), tol,
                                 work.additions + 3 * n + 10, work)
    best = min((polished, rough, x), key=lambda v: float(_norm(a @ v - b)))
    return NNLSResult(best, work.additions, work.solves, FALLBACK_ITERATIONS)


# -- the QPs as least squares on a factor of Q -------------------------------------------
def psd_factor(q: Tensor, rounding: float = 0.0) -> Tensor:
    """``L`` ``[K, r]`` with ``L Lᵀ`` the positive part of the symmetric ``Q``, rank-truncated.

    Eigen-decomposition of the cosine matrix ``C = D⁻¹QD⁻¹`` (``D = diag(Q)^{1/2}``, zero rows
    left out): ``L = D V_r Λ_r^{1/2}`` over the eigenvalues of ``C`` above
    ``RANK_RTOL_PER_ROW · n · λ_max(C)`` (``n`` non-zero rows: rounding of the
    decomposition) and above ``rounding · |λ_min(C)|`` (``C``'s negative part measures the
    rounding ``Q`` carries, see :func:`rounding_cut`). Scaling by ``D`` first keeps a zero row
    of ``Q`` exactly zero in ``L`` and a short row accurate relative to its own length;
    ``|(LLᵀ − Q)ᵢⱼ|`` is at most that cut-off times ``√(QᵢᵢQⱼⱼ)``, plus ``C``'s most
    negative eigenvalue (rounding of ``Q``: the negative part is dropped). ``r = 0`` for a
    zero ``Q``.
    """
    return eigen_factor(q, rounding)[0]


class CosineSpectrum(NamedTuple):
    """The eigen-decomposition of the cosine matrix ``C = D⁻¹Q_LL D⁻¹`` of a symmetric ``Q``
    over its non-zero rows ``L`` (``D = diag(Q_LL)^{1/2}``; :func:`cosine_spectrum`)."""

    norms: Tensor  # [K]: diag(Q)^{1/2}, zero on the zero rows
    live: Tensor  # the non-zero rows L
    cosine: Tensor  # [n, n]: C, unit diagonal
    lam: Tensor  # [n]: its eigenvalues, ascending
    vec: Tensor  # [n, n]: its eigenvectors


def cosine_spectrum(q: Tensor) -> CosineSpectrum:
    """:class:`CosineSpectrum` of ``Q`` (symmetrised first): one eigen-decomposition. With no
    zero row the cosine matrix is formed in place on the symmetrised copy (no gathers: two
    copies of ``[K, K]``, 9 + 8 ms of 0.25 s at K = 1,024)."""
    q = symmetrized(q)
    norms = torch.diagonal(q).clamp_min(0.0).sqrt()
    live = torch.nonzero(norms > 0.0).flatten()
    d = norms[live]
    if live.numel() == norms.numel():
        cosine = q.div_(torch.outer(d, d))
    else:
        cosine = q[live][:, live] / torch.outer(d, d)
    lam, vec = torch.linalg.eigh(cosine)
    return CosineSpectrum(norms, live, cosine, lam, vec)


def eigen_factor(q: Tensor, rounding: float,
                 spectrum: CosineSpectrum | None = None) -> tuple[Tensor, float]:
    """``(L, cut)``: :func:`psd_factor`'s factor and the cut-off on the cosine matrix's
    eigenvalues (:func:`rounding_cut`; 0 for a zero ``Q``); ``spectrum``: the
    :func:`cosine_spectrum` of ``Q``'s cosine matrix where the caller has it."""
    k = q.shape[0]
    spectrum = cosine_spectrum(q) if spectrum is None else spectrum
    live = spectrum.live
    if live.numel() == 0:
        return q.new_zeros(k, 0), 0.0
    lam = spectrum.lam
    cut = rounding_cut(lam, live.numel(), rounding)
    keep = lam > cut
    factor = q.new_zeros(k, int(keep.sum()))
    norms = torch.diagonal(q).clamp_min(0.0).sqrt()  # Q's own: the spectrum may be C's
    factor[live] = norms[live][:, None] * spectrum.vec[:, keep] * lam[keep].sqrt()
    return factor, cut


def rounding_cut(lam: Tensor, n: int, rounding: float) -> float:
    """The eigenvalue cut-off of :func:`psd_factor` for the ascending eigenvalues ``lam`` of
    an ``n × n`` cosine matrix: ``RANK_RTOL_PER_ROW · n · λ_max``, and ``rounding · |λ_min|``.

    A negative ``λ_min`` bounds the matrix's distance from every positive semi-definite
    one, the exact Gramian of the rows among them: ``‖C − C_exact‖₂ ≥ |λ_min|`` (Weyl), so
    the eigenvalues cut at ``rounding · |λ_min|`` change ``C`` by no more than ``rounding``
    times the rounding it already carries (a Gramian multiplied in float32: ``≈ 10⁻⁶``)."""
    low, high = (float(v) for v in lam[[0, -1]].tolist())
    return max(RANK_RTOL_PER_ROW * n * high, rounding * max(-low, 0.0))


def singular_spectrum(q: Tensor) -> CosineSpectrum | None:
    """:func:`cosine_spectrum` of ``Q`` where its Cholesky factorisation fails (``Q`` not
    positive definite to rounding: a lift or the factor's least squares is the path then),
    else None (pivoting decides, after its own eigenvalue check). One ``K³/3`` factorisation
    decides instead of the eigenvalues, so a singular ``Q`` costs one eigen-decomposition,
    not two."""
    if int(cholesky_ex(q.to(torch.float64)).info) == 0:
        return None
    return cosine_spectrum(q)


def min_norm_ls(points: Tensor, start: Tensor | None, tol: float,
                weights: Tensor | None = None) -> Tensor:
    """``argmin ‖P w‖`` over ``w ≥ 0``, ``aᵀw = 1`` for the points ``P`` ``[r, K]`` and
    positive ``weights`` ``a`` (default ones: the simplex): the least-distance program.

    Lawson & Hanson (1974, Ch. 23): ``u = argmin_{u ≥ 0} ‖[P; aᵀ] u − e_{r+1}‖`` has
    ``u = w*/(1 + ‖Pw*‖²)`` (for ``u = t w``, ``aᵀw = 1``, the value ``t²m + (t − 1)²`` is
    smallest at ``t = 1/(1 + m)``, where it is ``m/(1 + m)``, increasing in ``m = ‖Pw‖²``);
    so ``w* = u/aᵀu``. The points are first scaled to a largest norm of 1. The NNLS dual
    ``wⱼ = t(aⱼ‖Pw‖² − pⱼᵀPw)`` is MGDA's KKT condition.
    """
    r, k = points.shape
    a = torch.ones(k, dtype=points.dtype) if weights is None else weights
    scale = float(points.norm(dim=0).max()) if r else 0.0
    if scale == 0.0:  # every point is the origin: every w is optimal
        return start.clone() if start is not None else torch.full((k,), 1.0 / float(a.sum()),
                                                                   dtype=points.dtype)
    m = torch.cat([points / scale, a[None]])
    b = torch.zeros(r + 1, dtype=points.dtype)
    b[-1] = 1.0
    guess = None if start is None else (start > 0).tolist()
    u = nnls(m, b, guess, tol).x
    return u / (u.sum() if weights is None else a @ u)


def factored_box_qp(factor: Tensor, c: Tensor, lower: Tensor, simplex: bool,
                    start: Tensor | None, tol: float, coords: Tensor | None = None) -> Tensor:
    """``argmin ½ xᵀLLᵀx + cᵀx`` s.t. ``x ≥ lower`` (and ``Σx = 1``), one problem ``[K]``.

    With ``c = L h`` (``h = L⁺c``, or ``coords`` when the caller has it: a sequence of QPs
    on multiples of one ``Q`` factors and solves it once; a part of ``c`` outside the range
    of ``L`` is dropped) and
    ``y = x − lower``, the objective is ``½‖Lᵀy + a‖²`` up to a constant, ``a = Lᵀlower + h``:
    the box QP is NNLS with ``A = Lᵀ``, ``b = −a``; on the simplex (``Σy = s = 1 − Σ lower``)
    it is ``(s²/2)‖Σᵢ wᵢ(ℓᵢ + a/s)‖²`` over ``w = y/s ∈ Δ``, a min-norm point
    (:func:`min_norm_ls`).
    """
    shift = lower @ factor
    if coords is not None:
        shift = shift + coords
    elif bool(c.any()):
        shift = shift + least_squares(factor, c[:, None])[:, 0]
    guess = None if start is None else start - lower
    if not simplex:
        return lower + nnls(factor.T, -shift, None if guess is None else (guess > 0).tolist(),
                            tol).x
    total = 1.0 - float(lower.sum())
    if total < 0.0:
        raise ValueError(f"lower sums to {1.0 - total} > 1: the simplex constraint is infeasible")
    if total == 0.0:
        return lower.clone()
    points = factor.T + (shift / total)[:, None]
    return lower + total * min_norm_ls(points, None if guess is None else guess / total, tol)


#: :func:`weight_ratios`: the weights' size ``‖D y‖``, relative to the bound's
#: ``‖lower‖_Q``, from which a batch of box answers on a ``Q`` not certified well conditioned
#: leans on a direction ``Q``'s rounding decides (:func:`resolved_box`), and from which its
#: problems are then solved again. Measured, UPGrad and DualProj: at most 4.2e4 on every
#: benchmark kind of rows at K = 12, 64 and 256 (float32 and float64; rows in a span of rank
#: 3K/8 at K = 64 the largest) and 2.1e4 on the singular kinds at K = 1,024 (the ratios
#: 6–9 ms there), 9.3e5 … 3e9 where two tasks are opposite within the rounding, whose other
#: problems carry the error from 1e3 on (K = 40: 2.4e-4 of the update with only those above
#: 1e5 solved again).
UNRESOLVED_RATIO = 1e5
SUSPECT_RATIO = 1e3


def weight_ratios(q: Tensor, lower: Tensor, x: Tensor) -> Tensor:
    """``‖D(x − lower)‖ / ‖lower‖_Q`` ``[B]`` of box answers ``x`` ``[B, K]`` (``x ≥ lower``
    on ``Q``, ``D = diag(Q)^{1/2}``): the weights' size against their bound's (``inf`` for a
    zero bound with non-zero weights, ``nan`` for neither). ``O(BK)`` where each ``lower``
    has one non-zero entry (UPGrad's), ``O(BK²)`` otherwise."""
    d = torch.diagonal(q).clamp_min(0.0).sqrt()
    size = _norm((x - lower) * d, dim=1)
    bound = (lower * sparse_product(lower, q)).sum(dim=1).clamp_min(0.0).sqrt()
    ratios: Tensor = size / bound
    return ratios


def resolved_box(q: Tensor, lower: Tensor, x: Tensor, tol: float) -> Tensor:
    """``x`` (box answers, ``c = 0``, on a ``Q`` not certified well conditioned), where one
    problem's weights lean on a direction ``Q`` does not resolve (:func:`weight_ratios` above
    ``UNRESOLVED_RATIO``), each problem's above ``SUSPECT_RATIO`` replaced by the batched
    active set's answer with every entering column whose Schur complement is within ``Q``'s
    rounding dependent (:func:`~._active_set.box_active_set`, ``dependent``: the eigenvalue
    cut :func:`rounding_cut` with ``ROUNDING_MULTIPLE``), kept where ``Q`` ranks it no worse
    than the first answer plus what the cut leaves unresolved of it (``cut·‖D y‖²``, ``D =
    diag(Q)^{1/2}``).

    Two tasks opposite within float64's rounding (``g`` and ``−2.5g`` plus ``1e-8`` of its
    size in noise: ``1 − |cos| ≈ 1e-17``) have free blocks, and factor columns, that hold
    both: the pivoting's factorisations and Lawson–Hanson solved them as independent, with
    weights of ``1e6 … 1e10`` along their sum, which the Gramian's rounding decides, and an
    update 20 % to 8 times the projection's size off the projection with the two exactly
    opposite (K = 5 … 40, UPGrad and DualProj); now within ``1e-8`` of it."""
    ratios = weight_ratios(q, lower, x)
    if not bool((ratios > UNRESOLVED_RATIO).any()):
        return x
    bad = torch.nonzero(ratios > SUSPECT_RATIO).flatten()
    spectrum = cosine_spectrum(q)
    if spectrum.live.numel() == 0:
        return x
    cut = rounding_cut(spectrum.lam, spectrum.live.numel(), ROUNDING_MULTIPLE)
    again, done = box_active_set(q, lower[bad], tol, 10 + 3 * q.shape[0], cut)
    d = torch.diagonal(q).clamp_min(0.0).sqrt()
    slack = cut * _norm((x[bad] - lower[bad]) * d, dim=1) ** 2
    old = (x[bad] * (x[bad] @ q)).sum(dim=1)
    new = (again * (again @ q)).sum(dim=1)
    keep = done & (new <= old + slack)
    out = x.clone()
    out[bad[keep]] = again[keep]
    return out


def _ldp_violation(rows: Tensor, h: Tensor, mu: Tensor) -> float:
    """Largest KKT violation of ``μ`` for ``min ½‖x‖²`` s.t. ``Mx ≥ h``, ``x = Mᵀμ``: of a
    constraint, of ``μ ≥ 0`` or of complementarity, each relative to its scale."""
    x = rows.T @ mu
    scale = rows.norm(dim=1) * float(x.norm()) + h.abs() + 1e-300
    slack = (rows @ x - h) / scale
    return max(float((-slack).clamp_min(0.0).max()), float((-mu).clamp_min(0.0).max()),
               float((mu * slack).abs().max()) / max(1.0, float(mu.abs().max())))


def ldp(rows: Tensor, h: Tensor, tol: float = 1e-12, resolution: float = _EPS) -> Tensor | None:
    """``μ ≥ 0`` with ``x = Mᵀμ = argmin ½‖x‖²`` s.t. ``M x ≥ h`` (``M`` ``[n, r]``); None
    when no ``x`` satisfies the constraints.

    Lawson & Hanson (1974, Ch. 23, least-distance programming): ``u = argmin_{u ≥ 0}
    ‖E u − e_{r+1}‖`` with ``E = [M̂ᵀ; ĥᵀ]`` (each constraint over its row's norm, ``ĥ`` over
    its largest entry) and residual ``ρ = Eu − e_{r+1}``; ``ρ = 0`` is a Farkas certificate
    of infeasibility (``M̂ᵀu = 0``, ``ĥᵀu = 1``), otherwise ``x = −ρ_{1:r}/ρ_{r+1}``, i.e.
    ``μ̂ = u/(1 − ĥᵀu)``, and ``‖x‖² = 1/‖ρ‖² − 1``. Infeasible is decided at
    ``‖ρ‖ < √resolution``: constraints that only an ``x`` over ``1/√resolution`` times
    ``max |hⱼ|/‖Mⱼ‖`` meets, whose direction rounding decides. ``resolution``: the rounding
    of the rows' Gramian, relative (``eps`` by default; a factor cut at ``c`` on the cosine
    matrix's eigenvalues, at least ``c``; a float32 Gramian's,
    :func:`~gradbalance.gramian.products_rounding`): rows opposite within it are met
    together by an ``x`` of ``|h|/√resolution`` along the rounding (PCD with ``τ = 0.02`` met
    a float32 task and its reversal at ``‖x‖ ≈ 5·10⁶``, within the bound ``1/√eps`` this
    was, and its update was 0 where no direction serves both). Dividing by
    ``1 − ĥᵀu = ‖ρ‖²`` magnifies rounding as ``‖x‖`` grows, so where ``μ``'s KKT violation
    (:func:`_ldp_violation`) is above ``tol`` it is re-solved on its support ``S``
    (``x = M_S⁺h_S``, ``μ_S = (M_Sᵀ)⁺x``, each by :func:`least_squares`), and the one with
    the smaller violation is returned; where it is within ``tol`` it is the answer (the two
    SVDs, 94 ms of PCD's 0.95 s on rows of rank 0.6K at K = 1,024, bought a violation of
    3.5e-15 for 1.5e-15).
    """
    norms = rows.norm(dim=1)
    safe = torch.where(norms > 0.0, norms, torch.ones_like(norms))
    scaled = h / safe
    size = float(scaled.abs().max()) if h.numel() else 0.0
    if size == 0.0:
        return torch.zeros_like(h)  # x = 0 meets Mx ≥ 0
    e = torch.cat([(rows / safe[:, None]).T, scaled[None] / size])
    f = torch.zeros(e.shape[0], dtype=e.dtype)
    f[-1] = 1.0
    u = nnls(e, f, None, tol).x
    res = e @ u - f
    if float(res.norm()) < max(resolution, _EPS) ** 0.5:
        return None
    mu = u * (size / float(-res[-1])) / safe
    support = torch.nonzero(u > 0).flatten()
    violation = _ldp_violation(rows, h, mu)
    if support.numel() == 0 or violation <= tol:
        return mu
    sub = rows[support]
    x = least_squares(sub, h[support][:, None])
    polished = torch.zeros_like(mu)
    polished[support] = least_squares(sub.T, x)[:, 0]
    return polished if _ldp_violation(rows, h, polished) < violation else mu


def _start_points(lower: Tensor, simplex: bool, x0: Tensor | None) -> Tensor:
    """``[B, K]`` feasible starts: ``x0``, else ``lower`` (the box) or ``max(1/K, lower)``."""
    if x0 is not None:
        return x0.to(torch.float64).clone()
    if not simplex:
        return lower.clone()
    b, k = lower.shape
    return torch.maximum(torch.full((b, k), 1.0 / k, dtype=torch.float64), lower)


def _pivot_all(q: Tensor, c: Tensor, lower: Tensor, simplex: bool, x: Tensor,
               tol: float, inverse: Tensor | None = None
               ) -> Tensor | tuple[Tensor, Tensor] | None:
    """The pivoting path from ``x``: the solutions when it solves every problem, else
    ``(out, done)`` (valid where done); None if a factorisation fails or the single problem
    stays open. ``inverse``: ``Q⁻¹`` if known (the conjugate gradients' preconditioner)."""
    b, k = c.shape
    budget = 10 + 3 * k
    if b == 1:
        single = _pivot_single(q, c[0], lower[0], simplex, (x[0] > lower[0]).tolist(), tol,
                               budget, on_stall=_factored_from(q, c[0], lower[0], simplex, tol),
                               stall_after=MURTY_AFTER)
        return None if single is None else single[None]
    pivot = None
    if not simplex and k >= CG_MIN_SIZE:
        pivot = solve_lcp_pivoting(q, c, lower, simplex, x > lower, tol, CG_MAX_PIVOTS,
                                   iterative=True, inverse=inverse)
    if pivot is None:
        pivot = solve_lcp_pivoting(q, c, lower, simplex, x > lower, tol, budget)
    elif not bool(pivot[1].all()):
        pivot = _finish_direct(q, c, lower, tol, pivot)
    return pivot[0] if pivot is not None and bool(pivot[1].all()) else pivot


def _finish_direct(q: Tensor, c: Tensor, lower: Tensor, tol: float,
                   pivot: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The box problems the iterative pivoting left open, pivoted with factorisations from
    the free sets it left them at."""
    out, done = pivot
    rest = torch.nonzero(~done).flatten()
    direct = solve_lcp_pivoting(q, c[rest], lower[rest], False, out[rest] > lower[rest], tol,
                                10 + 3 * q.shape[0], relative=True)
    if direct is not None:
        out[rest] = torch.where(direct[1][:, None], direct[0], out[rest])
        done[rest] = direct[1]
    return out, done


def _start_of(given: Tensor | None, previous: Tensor | None, lower: Tensor) -> Tensor | None:
    """A problem's start: the given one, else the previous problem's support (UPGrad's
    projections share most of their active set)."""
    if given is not None:
        return given
    if previous is not None:
        return torch.where(previous > lower, previous, lower)
    return None


def _solve_factored(q: Tensor, c: Tensor, lower: Tensor, simplex: bool, x: Tensor | None,
                    out: Tensor, done: Tensor, tol: float) -> Tensor:
    """``out`` with every open problem solved on a factor of ``q`` (from ``x`` if given)."""
    factor = psd_factor(q)
    previous: Tensor | None = None
    for i in torch.nonzero(~done).flatten().tolist():
        start = _start_of(None if x is None else x[i], previous, lower[i])
        out[i] = previous = factored_box_qp(factor, c[i], lower[i], simplex, start, tol)
    return out


def solve_single_kept(q: Tensor, c: Tensor, lower: Tensor, simplex: bool, x0: Tensor | None,
                      tol: float, factor_of: FactorOf) -> Tensor:
    """:func:`solve_box_qp_batched`'s path for one problem (``c``, ``lower`` ``[K]``) on a
    well-conditioned ``q``, its free blocks' factors from ``factor_of`` (a caller's kept
    factors, CAGrad's): :func:`_pivot_single` from ``x0``'s support (the default start
    without), least squares on a factor of ``q`` where it does not finish."""
    x = _start_points(lower[None], simplex, None if x0 is None else x0[None])
    got = _pivot_single(q, c, lower, simplex, (x[0] > lower).tolist(), tol,
                       10 + 3 * q.shape[0], factor_of)
    if got is not None:
        return got
    given = None if x0 is None else x
    return _solve_factored(q, c[None], lower[None], simplex, given, x.clone(),
                           torch.zeros(1, dtype=torch.bool), tol)[0]


def solve_box_qp_batched(
    q: Tensor,
    c: Tensor,
    lower: Tensor,
    simplex: bool = False,
    x0: Tensor | None = None,
    tol: float = 1e-12,
    well_conditioned: bool | None = None,
    inverse: Tensor | None = None,
    scaled: bool = False,
) -> Tensor:
    """``[B, K]`` minimisers of ``½ xᵀ q x + c_bᵀx`` s.t. ``x ≥ lower_b`` (``Σ x = 1``).

    ``q`` ``[K, K]`` symmetric PSD (trace-normalised) with every ``c_b`` in its range; ``c``,
    ``lower`` and the optional feasible start ``x0`` are ``[B, K]``, float64 on the CPU.
    ``well_conditioned`` selects the pivoting path (computed from ``q`` when None, with
    whether ``q`` is positive definite at all; ``inverse``, the caller's
    :func:`certified_inverse` of ``q``, certifies it); from ``MANY_TASKS`` tasks on a positive
    definite ``q`` is pivoted with the relative test and open box problems go to the batched
    active set; the problems still open are solved on a factor of ``q``
    (:func:`factored_box_qp`). Box problems on a ``q`` whose diagonal spans more than
    ``DIAGONAL_MAX_RATIO`` are solved on ``D⁻¹qD⁻¹`` (:func:`_scaled_box`); ``scaled``: the
    caller's ``q`` is known not to (the dual-cone route's), and is not checked.
    """
    q, c, lower = q.to(torch.float64), c.to(torch.float64), lower.to(torch.float64)
    scale = _diagonal_scale(q, simplex, well_conditioned, inverse, scaled)
    if scale is not None:
        return _scaled_box(q, c, lower, x0, tol, scale)
    spectrum, inverse = _classified(q, c, simplex, well_conditioned, inverse)
    out = _solve_classified(q, c, lower, simplex, x0, tol, spectrum, inverse)
    if spectrum.well or simplex or bool(c.any()):
        return out
    return resolved_box(q, lower, out, tol)  # weights the rounding does not decide


def _solve_classified(q: Tensor, c: Tensor, lower: Tensor, simplex: bool, x0: Tensor | None,
                      tol: float, spectrum: _Spectrum, inverse: Tensor | None) -> Tensor:
    """:func:`solve_box_qp_batched` once ``q`` is classified (:func:`_classified`)."""
    well_conditioned, definite = spectrum[:2]
    if not well_conditioned:
        zero = _zero_cone_first(q, c, lower, simplex, x0, tol, spectrum.rank,
                                spectrum.pairs)
        if zero is not None:
            return zero
    x = _start_points(lower, simplex, x0)
    given = None if x0 is None else x
    early = (_early_routes(q, c, lower, x0, x, tol, spectrum, inverse)
             if _conjugate_box(q, c, simplex) else None)
    if isinstance(early, Tensor):
        return early
    rest = partial(_solve_rest, q, simplex=simplex, tol=tol, definite=definite,
                   inverse=inverse, well_conditioned=well_conditioned)
    if early is None:
        return rest(c, lower, x=x, given=given)
    out, done = early
    if not bool(done.all()):
        at = torch.nonzero(~done).flatten()
        out[at] = rest(c[at], lower[at], x=x[at], given=None if given is None else given[at])
    return out


#: The rounding of a singular ``Q`` without a lift (no negative eigenvalue, or a large null
#: space), relative to its mean diagonal: float32's, for :func:`without_combinations`'s null
#: space (its shift) and its dependencies' residuals.
NULL_ROUNDING = 1e-7


def _early_routes(q: Tensor, c: Tensor, lower: Tensor, x0: Tensor | None, x: Tensor,
                  tol: float, spectrum: _Spectrum,
                  inverse: Tensor | None) -> Tensor | tuple[Tensor, Tensor] | None:
    """The routes a batch of box problems with ``c = 0`` (:func:`_conjugate_box`) takes
    before the pivoting: the solutions on the lifted ``Q`` (:func:`_lifted`), or ``(out,
    done)`` of the singular routes (:func:`_pivot_singular_routes`) or, on a well-conditioned
    ``Q`` with a cluster of small eigenvalues, of ADMM's (:func:`_pivot_admm`); None where
    none applies."""
    if spectrum.well:
        return _pivot_admm(q, lower, tol, spectrum.floor, inverse) if c.shape[0] >= 2 else None
    lifted = _lifted(q, spectrum.lift)

    def otherwise(at: Tensor) -> Tensor | tuple[Tensor, Tensor] | None:
        if lifted is None:
            return _pivot_singular_routes(q, lower[at], x[at], tol, spectrum.rank)
        # positive definite, never lifted again: well conditioned by the spectrum, else
        # classified afresh
        return solve_box_qp_batched(lifted, c[at], lower[at], False,
                                    None if x0 is None else x0[at], tol,
                                    True if spectrum.lifted_well else None)

    if c.shape[0] < 2:  # one problem (DualProj's): the lift or the routes are as fast
        return otherwise(torch.arange(1))
    rounding = (spectrum.lift if spectrum.lift is not None
                else NULL_ROUNDING * float(torch.trace(q)) / q.shape[0])
    dropped = without_combinations(
        q, lower, rounding, q.shape[0] - spectrum.rank,
        lambda reduced, low: solve_box_qp_batched(reduced, torch.zeros_like(low), low,
                                                  tol=tol, scaled=True))
    if dropped is None:
        return otherwise(torch.arange(c.shape[0]))
    out, done = dropped
    if bool(done.all()):
        return out
    rest = torch.nonzero(~done).flatten()
    got = otherwise(rest)
    if got is None:
        return out, done
    if isinstance(got, Tensor):
        out[rest] = got
        return out
    out[rest], done[rest] = got
    return out, done


def _diagonal_scale(q: Tensor, simplex: bool, well_conditioned: bool | None,
                    inverse: Tensor | None, scaled: bool) -> Tensor | None:
    """``D = diag(Q)^{1/2}`` (1 where ``Qᵢᵢ ≤ 0``: a zero row) where the positive diagonal
    entries span more than ``DIAGONAL_MAX_RATIO``, else None (always for simplex problems,
    for a ``Q`` the caller has classified, ``well_conditioned`` or ``inverse`` given, and
    for one it has ``scaled``; one host sync where every diagonal entry is positive).
    On ``D⁻¹QD⁻¹`` (a unit diagonal) the condition number is that of the rows' directions
    alone, within a factor ``K`` of the best diagonal scaling's (van der Sluis 1969): rows
    of norms spanning ``1e-6 … 1e6`` make ``Q``'s ``1e24``, and the pivoting's multipliers
    would be tested against rounding of that size."""
    if scaled or simplex or well_conditioned is not None or inverse is not None:
        return None
    diag = torch.diagonal(q)
    low, high = torch.stack(diag.aminmax()).tolist()
    if low > 0.0 and high <= DIAGONAL_MAX_RATIO * low:
        return None
    positive = diag > 0.0
    if not bool(positive.any()):
        return None
    low = float(diag[positive].amin())
    if high <= DIAGONAL_MAX_RATIO * low:
        return None
    return torch.where(positive, diag.clamp_min(0.0).sqrt(), 1.0)


def _scaled_box(q: Tensor, c: Tensor, lower: Tensor, x0: Tensor | None, tol: float,
                scale: Tensor) -> Tensor:
    """The box problems of :func:`solve_box_qp_batched` solved on ``D⁻¹QD⁻¹`` (``D =
    diag(scale)``, :func:`_diagonal_scale`; ``s = Dx``, trace-normalised), each problem
    scaled to a largest datum of 1 (``x`` is homogeneous in ``(c, lower)`` and ``tol`` is
    absolute)."""
    n = float(torch.diagonal(q).gt(0.0).sum())
    unit = symmetrized(q / torch.outer(scale, scale * n))
    cs, ls = c / (scale * n), lower * scale
    top = torch.maximum(cs.abs().amax(dim=1), ls.abs().amax(dim=1))
    top = torch.where(top > 0.0, top, 1.0)[:, None]
    s = solve_box_qp_batched(unit, cs / top, ls / top, False,
                             None if x0 is None else x0 * scale / top, tol, scaled=True)
    return torch.maximum(s * top / scale, lower)  # ≥ lower exactly, whatever the rounding


def _classified(q: Tensor, c: Tensor, simplex: bool, well_conditioned: bool | None,
                inverse: Tensor | None) -> tuple[_Spectrum, Tensor | None]:
    """The batch's :class:`_Spectrum` and ``Q⁻¹`` where certified: ``well_conditioned`` as
    given, else certified by :func:`certified_inverse` where :func:`_certifies` (the
    conjugate-gradient pivoting's preconditioner, and the conditioning test without the
    eigenvalues; ``inverse``: the caller's certified ``Q⁻¹``), else from
    the eigenvalues (:func:`_spectrum`; with ``Q``'s eigenvectors where
    :func:`_shares_eigenvectors`, from the order at which the factorisation failed)."""
    if well_conditioned is not None:
        return _Spectrum(well_conditioned, False, None, q.shape[0]), inverse
    order = 0
    if inverse is None and _certifies(q, c, simplex):
        inverse, order = _cholesky_verdict(q)[1:]
    if inverse is not None:
        return _Spectrum(True, True, None, q.shape[0]), inverse
    return _spectrum(q, _shares_eigenvectors(q, c, simplex, order)), None


def _certifies(q: Tensor, c: Tensor, simplex: bool) -> bool:
    """Whether :func:`_classified` tries :func:`certified_inverse` before the eigenvalues: box
    problems from ``CG_MIN_SIZE`` tasks on, a batch (the conjugate-gradient pivoting takes
    the inverse as its preconditioner) or one problem with ``c = 0`` (DualProj's: a third of
    the eigenvalues' cost where it certifies, and where the factorisation fails early, the
    order that lets :func:`_shares_eigenvectors` keep one decomposition for the zero cone)."""
    if simplex or q.shape[0] < CG_MIN_SIZE:
        return False
    return c.shape[0] >= 2 or not bool(c.any())


def _shares_eigenvectors(q: Tensor, c: Tensor, simplex: bool, order: int) -> bool:
    """Whether :func:`_spectrum` keeps ``Q``'s eigenvectors for :func:`_zero_cone_first`'s
    factor instead of its cosine matrix's own decomposition: box problems with ``c = 0``
    from ``CG_MIN_SIZE`` tasks on whose Cholesky factorisation failed at a minor of order
    ``order`` at most ``(ZERO_CONE_MAX_FRACTION + 1/16)·K`` (its leading block of order
    ``order − 1`` is positive definite: a larger rank would never take the zero cone; the
    sixteenth: rounding lets the factorisation run a few pivots past the rank), on a
    diagonal within ``SHARED_EIGEN_MAX_RATIO`` (where ``Q``'s factor is as accurate per row
    as the cosine matrix's). One decomposition with vectors instead of the eigenvalues and
    then the cosine matrix's: UPGrad on rows of rank ``3K/8`` at K = 1,024, 0.30 + 0.15 s →
    0.30 s."""
    k = q.shape[0]
    if not 0 < order <= (ZERO_CONE_MAX_FRACTION + 1 / 16) * k or simplex or bool(c.any()):
        return False
    diag = torch.diagonal(q)
    low, high = torch.stack(diag.aminmax()).tolist()
    return bool(low > 0.0 and high <= SHARED_EIGEN_MAX_RATIO * low)


def _zero_cone_first(q: Tensor, c: Tensor, lower: Tensor, simplex: bool, x0: Tensor | None,
                     tol: float, rank: int,
                     pairs: tuple[Tensor, Tensor] | None = None) -> Tensor | None:
    """:func:`solve_box_qp_batched` by :func:`~._zero_cone.zero_cone_box` on the eigen-factor
    of ``Q`` cut at its rounding (:func:`eigen_factor`) for box problems with ``c = 0`` from
    ``CG_MIN_SIZE`` tasks on and a numerical ``rank`` up to ``ZERO_CONE_MAX_FRACTION`` of
    ``K``, where the rows' conic hull is their span (every projection zero; the certificate
    checked per problem), the problems it leaves open by the dense paths; None where it is
    not tried or finds no certificate. ``pairs``: ``Q``'s eigen-decomposition where
    :func:`_spectrum` kept it (:func:`_shares_eigenvectors`), the factor's then: its
    ``rank`` leading pairs, those above the same cut, their vectors the certificate's
    orthonormal basis."""
    k = q.shape[0]
    if simplex or k < CG_MIN_SIZE or rank > ZERO_CONE_MAX_FRACTION * k or bool(c.any()):
        return None
    basis = None if pairs is None else pairs[1][:, k - rank:]
    factor = (eigen_factor(q, ROUNDING_MULTIPLE)[0] if pairs is None
              else _top_factor(*pairs, rank))
    zero = zero_cone_box(factor, lower, tol, DENSE_NULL_ROUNDS, _nnls_point, basis)
    if zero is None:
        return None
    out, done = zero
    if not bool(done.all()):
        rest = torch.nonzero(~done).flatten()
        out[rest] = solve_box_qp_batched(q, c[rest], lower[rest], simplex,
                                         None if x0 is None else x0[rest], tol, False)
    return out


def _top_factor(lam: Tensor, vec: Tensor, rank: int) -> Tensor:
    """``L = V_r Λ_r^{1/2}`` ``[K, r]`` over the ``rank`` largest of the eigenpairs ``(lam,
    vec)`` (ascending, as :func:`torch.linalg.eigh` orders them)."""
    k = lam.shape[0]
    return vec[:, k - rank:] * lam[k - rank:].clamp_min(0.0).sqrt()


def _nnls_point(a: Tensor, b: Tensor) -> Tensor:
    """``argmin_{y ≥ 0} ‖A y − b‖`` by :func:`nnls` (the zero dual cone's exact search for
    its certificate, :func:`~._zero_cone.interior_null`)."""
    return nnls(a, b).x


def _conjugate_box(q: Tensor, c: Tensor, simplex: bool) -> bool:
    """Whether a batch on a ``Q`` that is not well conditioned is lifted or takes the
    conjugate-gradient pivoting: box problems with ``c = 0`` (UPGrad's and DualProj's
    projections) from ``CG_MIN_SIZE`` tasks on, one problem too (DualProj's: ``combine``
    over the Gramian on rows of rank ``3K/4`` at ``K = 1,024`` 3.1× → 2.4×, ``9K/16``
    3.7× → 2.6×, docs/balancers.md)."""
    return not simplex and q.shape[0] >= CG_MIN_SIZE and not bool(c.any())


def _solve_rest(q: Tensor, c: Tensor, lower: Tensor, simplex: bool, x: Tensor,
                given: Tensor | None, tol: float, definite: bool, inverse: Tensor | None,
                well_conditioned: bool = False) -> Tensor:
    """:func:`solve_box_qp_batched` from the pivoting on (``x``: the start points, ``given``
    where the caller gave them): the pivoting where it applies, then the batched active set
    (many tasks, box, ``c = 0``) and least squares on a factor for the problems still open."""
    many = q.shape[0] >= MANY_TASKS
    pivot = _pivot_first(q, c, lower, simplex, x, tol, well_conditioned, definite and many,
                         inverse)
    if isinstance(pivot, Tensor):
        return pivot
    out, done = pivot or (x.clone(), torch.zeros(c.shape[0], dtype=torch.bool))
    if many and not simplex and not bool(c.any()) and not bool(done.all()):
        if well_conditioned:
            _finish_single_admm(q, lower, out, done, tol, inverse)
        if not bool(done.all()):
            _finish_active_set(q, lower, out, done, tol)
    if bool(done.all()):
        return out
    return _solve_factored(q, c, lower, simplex, given, out, done, tol)


def _pivot_first(q: Tensor, c: Tensor, lower: Tensor, simplex: bool, x: Tensor, tol: float,
                 well_conditioned: bool, ill_but_definite: bool,
                 inverse: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor] | None:
    """The pivoting, where it applies: absolute multiplier test on a well-conditioned ``q``,
    relative test on a badly conditioned positive definite one (many tasks); else None.
    ``inverse``: ``Q⁻¹`` if known."""
    if well_conditioned:
        return _pivot_all(q, c, lower, simplex, x, tol, inverse)
    if ill_but_definite:
        pivot = solve_lcp_pivoting(q, c, lower, simplex, x > lower, tol, ILL_MAX_PIVOTS,
                                   relative=True)
        if pivot is None or simplex or bool(c.any()):
            return pivot
        out, done = pivot
        return out, done & _multipliers_hold(q, lower, out)
    return None


def _pivot_singular(q: Tensor, lower: Tensor, x: Tensor,
                    tol: float) -> tuple[Tensor, Tensor] | None:
    """``(out, done)`` for box problems (``c = 0``) on a ``Q`` that is not positive definite:
    the conjugate-gradient pivoting of :func:`solve_lcp_pivoting` on ``Q`` itself, its
    preconditioner ``(Q + δI)⁻¹`` (``δ = SHIFT · tr Q / K``, :mod:`._precond`), at most
    ``SINGULAR_MAX_PIVOTS`` iterations; None if ``Q + δI`` does not factorise.

    Each free-set system ``Q_FF y_F = −(Q·lower)_F`` is consistent (its right-hand side is
    ``L_F Lᵀlower`` for ``Q = LLᵀ``, in the range of ``Q_FF = L_F L_Fᵀ``), so conjugate
    gradients converge on it where ``y`` is not unique; a direction with ``pᵀQ_FF p ≤ 0`` leaves
    its problem open. A finished problem satisfies the optimality conditions of the convex
    QP to the pivoting's tolerances (``y ≥ −tol``, multipliers above the threshold, the
    free residual at most ``CG_RTOL_MAX`` of its right-hand side) and its multipliers pass
    :func:`_multipliers_hold` on ``Q``: the update ``Jᵀv`` is unique although ``v`` need not
    be. The problems it leaves open go on (the batched active set, then least squares)."""
    delta = SHIFT * float(torch.trace(q)) / q.shape[0]
    h = shifted_inverse(q, delta) if delta > 0.0 else None
    if h is None:
        return None
    pivot = solve_lcp_pivoting(q, torch.zeros_like(lower), lower, False, x > lower, tol,
                               SINGULAR_MAX_PIVOTS, iterative=True, relative=True, inverse=h)
    if pivot is None:
        return None
    out, done = pivot
    return out, done & _multipliers_hold(q, lower, out)


def _pivot_singular_routes(q: Tensor, lower: Tensor, x: Tensor, tol: float,
                           rank: int) -> tuple[Tensor, Tensor] | None:
    """``(out, done)`` of the box problems (``c = 0``) on a ``Q`` that is not positive
    definite: where the numerical ``rank`` is at most ``THIN_MAX_FRACTION`` of ``K``,
    :func:`_pivot_from_admm` (a batch only), then :func:`_pivot_from_fista`, then
    :func:`_pivot_singular`; above, :func:`_pivot_singular` first, then the other two; each
    on the problems the ones before leave open; None if none applies."""
    fista = partial(_pivot_from_fista, rank=rank)
    thin = rank <= THIN_MAX_FRACTION * q.shape[0]
    routes: tuple[Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor] | None],
                  ...] = (fista, _pivot_singular) if thin else (_pivot_singular, fista)
    if lower.shape[0] >= 2:  # a batch: ADMM's steps are products of [B, K] by [K, K]
        admm = partial(_pivot_from_admm, rank=rank)
        routes = (admm, *routes) if thin else (routes[0], admm, routes[1])
    out, done = x.clone(), torch.zeros(x.shape[0], dtype=torch.bool)
    tried = False
    for route in routes:
        rest = torch.nonzero(~done).flatten()
        if rest.numel() == 0:
            break
        got = route(q, lower[rest], x[rest], tol)
        if got is None:
            continue
        tried = True
        finished = rest[got[1]]
        out[finished], done[finished] = got[0][got[1]], True
    return (out, done) if tried else None


def _pivot_from_fista(q: Tensor, lower: Tensor, x: Tensor, tol: float,
                      rank: int | None = None) -> tuple[Tensor, Tensor] | None:
    """``(out, done)`` for box problems (``c = 0``) on a singular ``Q``: the block pivoting
    with one batched factorisation of the free blocks per iteration
    (:func:`solve_lcp_pivoting`, relative multiplier test, at most ``THIN_MAX_PIVOTS``
    iterations) from the free sets of FISTA (:func:`~._projected.projected_start` on ``Q``
    scaled to a unit diagonal, in float32, ``THIN_STEPS`` steps in rounds on the problems
    still open, ``THIN_SINGLE_STEPS`` for a single problem).

    Rows in a span of rank ``r`` a little above ``K/2`` have optimal free sets of nearly
    ``r`` indices (127–142 at K = 256, ``r = 144``), on which ``Q_FF`` is positive definite
    (rows in general position), while the pivoting from a far start passes through free
    sets of more than ``r`` indices, where it is singular. A few hundred FISTA steps end
    within a few indices of each optimal free set. A problem is finished only where the
    pivoting's optimality test and :func:`_multipliers_hold` pass; the others stay open, and
    so do those whose FISTA free set holds more than the numerical ``rank`` (default ``K``)
    indices (a singular free block, as on some rows of rank just above ``K/2``: K = 64,
    rank 33). A round that finishes none ends the attempt.
    ``x`` is not read (the signature of :func:`_pivot_singular`)."""
    del x
    b, k = lower.shape
    rank = k if rank is None else rank
    diag = torch.diagonal(q)
    scale = torch.where(diag > 0, diag.clamp_min(1e-300).rsqrt(), 1.0)
    start = Plan(scale, bulk_top(q, None, 0.0, scale))
    if not start.top > 0.0:
        return None
    out, done = lower.clone(), torch.zeros(b, dtype=torch.bool)
    q32 = q.float()  # the start only guesses the free sets: half the products' cost
    for steps in THIN_SINGLE_STEPS if b == 1 else THIN_STEPS:
        rest = torch.nonzero(~done).flatten()
        if rest.numel() == 0:
            break
        free, _, _ = projected_start(q32, (lower[rest] @ q).float(), start, steps)
        fits = free.sum(dim=1) <= rank  # a larger free block is singular: no factorisation
        before = int(done.sum())
        _pivot_chunks(q, lower, rest[fits], free[fits], tol, out, done)
        if int(done.sum()) == before:  # a round that finishes none: stop, the rest go on
            break
    return out, done


def _pivot_admm(q: Tensor, lower: Tensor, tol: float, floor: float | None,
                inverse: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """``(out, done)`` for box problems (``c = 0``) on a positive definite ``Q`` whose small
    eigenvalues form a cluster (``floor``: its ``λ_min`` from the eigenvalues, else found
    from ``inverse``, :func:`~._admm.cluster_floor`; None where there is none): the
    factorised pivoting of :func:`_pivot_chunks` from the free sets of ADMM
    (:func:`~._admm.admm_free_sets`). UPGrad on rows of rank K/2 plus noise 1e-2 of their
    size at K = 256: 10.5 → 0.3 s (the block pivoting cycled, the conjugate gradients found
    no preconditioner; docs/balancers.md); the problems it leaves open go on."""
    if floor is None:
        floor = cluster_floor(q, inverse)
    if floor is None:
        return None
    return _pivot_from_admm(q, lower, None, tol, floor=floor)


def _pivot_from_admm(q: Tensor, lower: Tensor, x: Tensor | None, tol: float,
                     rank: int | None = None,
                     floor: float | None = None) -> tuple[Tensor, Tensor]:
    """``(out, done)`` for box problems (``c = 0``): the factorised pivoting of
    :func:`_pivot_chunks` from ADMM's free sets (:func:`~._admm.admm_free_sets`, its first
    ``ρ`` from the cluster's ``floor`` or, without, from ``Q``'s mean eigenvalue:
    :func:`~._admm.first_rho`), those of more than the numerical ``rank`` indices (a
    singular free block) left open; a second round of ADMM steps on the problems left
    open, from a third of the first ``ρ``, until none of their free sets has moved for
    ``ADMM_QUIET`` looks in a row (the first stops with ``ADMM_SETTLED`` of them still
    moving: on rows of rank 9K/16 at K = 256 three problems stopped 2–4 indices from the
    optimal free sets, from which the pivoting diverged; 1,000 steps reach them), only
    where the first finished at least half of a batch (else the steps did not settle:
    FISTA's route next). At most ``ADMM_SINGULAR_MAX_STEPS`` steps a round on a singular
    ``Q`` (``floor`` None). On a singular ``Q`` (rows in a span of rank 5K/8)
    at K = 1,024, 3.7 s of ADMM steps against 13.7 s of FISTA's for the same free sets
    (:func:`_pivot_from_fista`, the route after it). ``x`` is not read (the signature of
    :func:`_pivot_singular`)."""
    del x
    b, k = lower.shape
    rank = k if rank is None else rank
    rho = first_rho(q, floor)
    if floor is not None and k >= PILOT_MIN_SIZE and b > PILOT_ROWS:
        rho = pilot_rho(q, lower, rho)
    out, done = lower.clone(), torch.zeros(b, dtype=torch.bool)
    rows = torch.arange(b)
    steps = ADMM_MAX_STEPS if floor is not None else ADMM_SINGULAR_MAX_STEPS
    for settled, quiet in ((ADMM_SETTLED, 1), (0.0, ADMM_QUIET)):  # then the open ones
        free = admm_free_sets(q, lower[rows], rho, settled, quiet, steps)
        rho /= ADMM_GROWTH  # a second round from a smaller ρ: slower but surer
        fits = free.sum(dim=1) <= rank
        _pivot_chunks(q, lower, rows[fits], free[fits], tol, out, done)
        rows = torch.nonzero(~done).flatten()
        if rows.numel() == 0 or 2 * int(done.sum()) < b - 1:  # none left, or the steps
            break  # failed on a batch (a single problem takes its second round)
    return out, done


def _pivot_chunks(q: Tensor, lower: Tensor, rows: Tensor, free: Tensor, tol: float,
                  out: Tensor, done: Tensor) -> None:
    """:func:`_pivot_from_fista`'s pivoting of the problems ``rows`` from the free sets
    ``free``, in chunks of at most ``THIN_MAX_ENTRIES`` block entries; ``out`` and ``done``
    set in place where the pivoting's test and :func:`_multipliers_hold` pass."""
    k = q.shape[0]
    chunk = max(1, THIN_MAX_ENTRIES // (k * k))
    for part in torch.split(torch.arange(rows.numel()), chunk):
        at = rows[part]
        pivot = solve_lcp_pivoting(q, torch.zeros_like(lower[at]), lower[at], False,
                                   free[part], tol, THIN_MAX_PIVOTS, relative=True)
        if pivot is None:
            continue
        finished = pivot[1] & _multipliers_hold(q, lower[at], pivot[0])
        out[at[finished]], done[at[finished]] = pivot[0][finished], True


def _finish_single_admm(q: Tensor, lower: Tensor, out: Tensor, done: Tensor, tol: float,
                        inverse: Tensor | None) -> None:
    """One box problem (``c = 0``, DualProj's) the pivoting left open on a positive definite
    ``Q`` whose small eigenvalues form a cluster (from ``inverse``,
    :func:`~._admm.cluster_floor`): ADMM's route (:func:`_pivot_admm`; its steps are
    matrix-vector products), in place where it finishes it, before the active set. DualProj
    on rows of rank K/2 plus noise 1e-2 at K = 256: the active set's 0.17 s → 0.01 s.
    Nothing for a batch (it took the route first) or below ``CG_MIN_SIZE`` tasks."""
    if lower.shape[0] != 1 or q.shape[0] < CG_MIN_SIZE:
        return
    got = _pivot_admm(q, lower, tol, None, inverse)
    if got is not None and bool(got[1].all()):
        out.copy_(got[0])
        done.fill_(True)


def _finish_active_set(q: Tensor, lower: Tensor, out: Tensor, done: Tensor,
                       tol: float) -> None:
    """The open box problems (``c = 0``) by the batched active set
    (:func:`~._active_set.box_active_set`), in place where it finishes them."""
    rest = torch.nonzero(~done).flatten()
    v, finished = box_active_set(q, lower[rest], tol, 3 * q.shape[0] + 10)
    finished &= _multipliers_hold(q, lower[rest], v)
    out[rest[finished]] = v[finished]
    done[rest[finished]] = True


def _multipliers_hold(q: Tensor, lower: Tensor, v: Tensor) -> Tensor:
    """``[B]``: no multiplier ``w = Qv`` of an index at its bound is below ``−HOLD_RTOL``
    times the sizes it is made of, ``(|Q||v|)ⱼ`` (``c = 0``). On a ``Q`` of condition number
    1e24 (norms spanning 1e-6 … 1e6, not positive definite to its rounding) the batched
    active set can take an index for dependent while its multiplier is ``−3e-4`` of its
    size, and the pivoting's factorisations of the free blocks can finish a problem 33 %
    above its minimum: such a problem goes on (the active set, then least squares on a
    factor). Rounding leaves ``w`` within about ``K·eps`` of its size, far above the
    pivoting's own threshold on a singular ``Q`` but far below ``HOLD_RTOL``."""
    at_bound = v <= lower
    w = v @ q
    return ~(at_bound & (w < -HOLD_RTOL * (v.abs() @ q.abs()))).any(dim=1)
