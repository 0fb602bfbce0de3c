"""An accelerated projected-gradient start of the box pivoting, where ``Q`` is well conditioned.

Not a balancer module (no ``__all__``). The float32 pivoting of :mod:`._pcg` (UPGrad's K
projections at K ≥ 64) starts from :func:`~._pcg.opposite_start`, about 50 indices per
problem away from the optimal free set at K = 1,024, and pivots five to seven times, each
pivot a preconditioned conjugate-gradient restart. Where ``Q`` has no outlying eigenvalue or
up to sixteen (rows sharing one direction, tasks in clusters sharing a few, a classifier's
per-sample rows), and its bulk, scaled to a unit diagonal, has a moderate condition number
(``torch.randn`` rows and the benchmark's conflicting rows at K = 1,024, P = 20,000: ``κ =
2.5``), FISTA (Beck & Teboulle 2009) with the strongly convex momentum of the bulk's
estimated condition number (Nesterov 2004) and the gradient-mapping restart (O'Donoghue &
Candès 2015), the outliers in the prox, comes within a few indices of the optimal free sets
in eight steps (up to 32 where the bulk's condition number is larger: :func:`start_steps`),
seven products of ``[B, K] × [K, K]`` (the first step starts from 0; 11
indices in all on those conflicting rows), and the pivoting confirms them in one solve. Only
a start: the float32 and float64 pivotings decide.

Example:
    >>> import torch
    >>> q = torch.tensor([[2.0, -1.0], [-1.0, 2.0]])
    >>> free, y, yq = fista(q, torch.tensor([[1.0, -2.0]]), 3.0, steps=40)
    >>> free.tolist(), torch.allclose(y, torch.tensor([[0.0, 1.0]]), atol=1e-5)
    ([[False, True]], True)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ._precond import Preconditioner, sparse_product
from ._thin_product import thin_product

#: Steps of :func:`projected_start` (on ``torch.randn`` rows at K = 1,024: 94 indices in all
#: from the optimal free sets after six, none after ten; seven to nine steps took the same
#: time per call within the noise).
PROJECTED_STEPS = 8
#: Where the bulk's estimated condition number ``κ`` (the plan's ``top/bottom``) is above
#: ``STEPS_KAPPA``, the steps grow as ``√κ`` (FISTA's rate), up to ``PROJECTED_MAX_STEPS``:
#: per-sample rows of a classifier at K = 1,024 (``κ`` ≈ 34, 29 steps) were 2,600 indices from
#: the optimal free sets after 24 steps, 30 after 48, and UPGrad took 3.4 s with 8 steps
#: against 2.6–2.7 s with 24–32 (the pivoting's float32 solves there need ``√κ`` steps
#: per decade too).
STEPS_KAPPA = 2.5
PROJECTED_MAX_STEPS = 32
#: The start is taken where ``λ₁ ‖Q⁻¹‖_∞`` (an upper estimate of the condition number: the
#: power steps' ``λ₁`` and Gershgorin's bound on ``1/λ_min``; of the bulk ``B`` where one
#: outlier is deflated) is at most this: FISTA's error falls by about ``1 − 1/√κ`` per
#: step, the pivoting's does not depend on ``κ``. The estimate is 3–5× the condition number
#: (conflicting rows at K = 1,024: 11 against 2.5); the wide-norm rows' cosine matrix at
#: K = 1,024, 36, solves in 0.96× the time with the start as without. Per-sample rows of a
#: classifier (``many_tasks.py --kinds per_sample``, K = 1,024, the classes' nine
#: directions deflated) estimate 280 for a bulk of condition number near 40: the start
#: there took UPGrad 23× → 9–10× the Gramian (the float32 pivoting from the opposite start
#: restarts its conjugate gradients on every pivot); those of trained classifiers (K = 512
#: and 1,024, five runs) estimate 1,400–2,900, and took 16–56× → 9–15× with the start. A
#: transformer's per-sample Gramian at K = 256 (estimate 3,800) took 0.21 → 0.28 s with it
#: (0.31 s before either change); no kind of the benchmark estimates between 1,000 and this.
PROJECTED_MAX_KAPPA = 1e4
#: :func:`projected_free_sets`: FISTA's steps with their product in bfloat16
#: (:func:`bfloat16_products`) from ``ROUGH_MIN_SIZE`` tasks on: all but the last
#: ``FINE_STEPS`` (:func:`rough_steps`), and at least ``ROUGH_STEPS``. One thread, K = 1,024:
#: the benchmark's conflicting rows (eight steps), UPGrad's solve 575 → 503 ms with four of
#: the six, 525 with six; a classifier's per-sample rows (32 steps, a bulk of condition
#: number near 40, whose error FISTA shrinks by about ``1 − 1/√κ`` a step: above
#: bfloat16's rounding ``2⁻⁸`` until the last few), ``combine`` 9.5 → 8.4× the Gramian with
#: 28 of them in bfloat16, 8.4–8.6× with 24–26 (trained: 10.6 → 9.3–9.6×), the same updates.
ROUGH_STEPS = 4
FINE_STEPS = 4
ROUGH_MIN_SIZE = 512
#: The step is ``1/(LIPSCHITZ_MARGIN λ₁)``: ``λ₁`` from a few power steps is below the
#: largest eigenvalue.
LIPSCHITZ_MARGIN = 1.1
#: Power steps of :func:`bulk_top`.
POWER_STEPS = 8


def fista(q: Tensor, shift: Tensor, top: float, v: Tensor | None = None, c: Weight = 0.0,
          steps: int = PROJECTED_STEPS, bottom: float = 0.0,
          last: Callable[[Tensor], Tensor] | None = None,
          rough: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``(free, y, yQ)`` ``[B, K]``: ``steps`` FISTA steps on ``min ½ yᵀQy + shiftᵀy``,
    ``y ≥ 0`` per row, from ``y = 0``, in the dtype of ``q``; ``top``: ``λ₁`` of the part
    of ``Q`` taken by gradient steps (estimated).

    ``y ← prox(z − (z∇)/L)``, ``z ← y + β(y − y_prev)``: with ``bottom``, an estimate of the
    gradient part's ``λ_min`` from above, the strongly convex momentum ``β = (√κ − 1)/(√κ +
    1)``, ``κ = L/bottom`` (Nesterov 2004, §2.2; at K = 1,024 on conflicting rows the start
    is 11 indices from the optimal free sets after eight steps, 79 with ``tₖ``), else
    ``β = (tₖ − 1)/tₖ₊₁``; a row's momentum is reset (``β = 0``, ``t = 1``) where ``(z −
    y)ᵀ(y − y_prev) > 0`` (the step went uphill); ``free =
    {y > 0}`` of the last step, returned with the point ``z`` it started from restricted
    to it and that point's product (``zQ``, which the step computed, less a sparse product
    of the few entries the restriction drops): no product of its own, where ``y`` would
    need one (one thread, ``K = 1,024``: 0.93–0.97× the time of UPGrad's solve). Without
    ``v`` the gradient is ``zQ + shift`` and
    the prox ``max(0, ·)``. With ``Q = B + c vvᵀ`` (``v`` ``[K]`` unit, an outlying
    eigenvalue ``c`` above the bulk) the gradient steps take ``B`` only (``top = λ₁(B)``:
    the bulk's condition number, not ``Q``'s), and the prox the outlier too:
    ``argmin_{y ≥ 0} ‖y − a‖²/(2η) + (c/2)(vᵀy)² = max(0, a − τv)`` with ``τ`` the root of
    ``τ − ηc vᵀmax(0, a − τv)`` (increasing, slope at least 1), one Newton step per FISTA
    step from the last one's ``τ``. With several, ``Q = B + V diag(c) Vᵀ`` (``v`` ``[K, m]``
    orthonormal, ``c`` ``[m]``), the prox is ``max(0, a − Vτ)`` with ``τ ∈ ℝᵐ`` the root of
    ``τ − η diag(c) Vᵀmax(0, a − Vτ)``, one semismooth Newton step per FISTA step
    (:func:`_prox_many`). ``last``: the last step's product ``z ↦ zQ`` where the caller
    takes it (in float64: :func:`projected_start`'s exact start); then ``(free, z, zQ)``
    are returned unrestricted. ``rough``: the first steps whose product is taken in
    bfloat16, on the bulk ``B`` alone (the outliers' large part would cancel its rounding
    away): far from the optimum a product to ``3e-3`` moves the point as well, at less than
    half the cost of a float32 one where the processor multiplies bfloat16 natively
    (:func:`bfloat16_products`).
    """
    step = 1.0 / (LIPSCHITZ_MARGIN * top)
    rows = shift.shape[0]
    tau = torch.zeros((rows, *(v.shape[1:] if v is not None else ())), dtype=q.dtype)
    lead = shift * -step
    scratch = torch.empty_like(lead)
    pairs = _pairs_of(v)
    y = _prox(lead.clone(), v, step * c, tau, scratch, pairs)  # the first step from z = 0
    if steps < 2:
        return y > 0.0, y, y @ q
    z = y.clone()
    momentum = _Momentum(rows, q.dtype, top, bottom)
    # three [B, K] buffers turn over (y, z and the next step's), and one scratch for the
    # prox: a fresh tensor per operation costs its pages' first touch, about as much as the
    # operation (one thread, K = 1,024)
    spare = torch.empty_like(y)
    bulk = _RoughBulk(q, v, c, z) if rough > 0 else None
    # the other steps' product on the bulk B too, formed once (in q's dtype): the outliers'
    # part then needs no product of its own per step
    fine = bulk_of(q, v, c) if steps - 2 > rough else q
    for i in range(steps - 2):
        a = torch.add(z, lead, out=spare)  # z − η(zB + shift), B = Q without the outliers
        if bulk is not None and i < rough:  # in bfloat16
            a.sub_(bulk.times(z), alpha=step)
        else:
            a.addmm_(z, fine, alpha=-step)
        new = _prox(a, v, step * c, tau, scratch, pairs)
        moved = torch.sub(new, y, out=y)  # y is not read again
        uphill = torch.linalg.vecdot(z.sub_(new), moved) > 0.0  # nor is z
        spare, z = z, moved.mul_(momentum.next(uphill)[:, None]).add_(new)
        y = new
    zq = z @ q if last is None else last(z)  # kept: the start is z on the last free set
    free = _step(torch.add(z, lead, out=spare).add_(zq, alpha=-step), z, v, c, step, tau,
                 scratch, pairs) > 0.0
    if last is not None:
        return free, z, zq
    return free, z * free, zq.sub_(sparse_product(z * ~free, q))


#: The outliers taken into the prox: ``c`` a number for one (``v`` ``[K]``), ``[m]`` for
#: several (``v`` ``[K, m]``).
Weight = float | Tensor


class _Momentum:
    """:func:`fista`'s momentum per row: ``β = (√κ − 1)/(√κ + 1)`` with ``κ = L/bottom`` where
    ``bottom`` (the bulk's ``λ_min`` from above) is known, else ``β = (tₖ − 1)/tₖ₊₁``; reset
    (``β = 0``, ``t = 1``) where the step went uphill."""

    def __init__(self, rows: int, dtype: torch.dtype, top: float, bottom: float) -> None:
        root = max(1.0, LIPSCHITZ_MARGIN * top / bottom) ** 0.5 if bottom > 0.0 else None
        self.constant = None if root is None else (root - 1.0) / (root + 1.0)
        self.t = torch.ones(rows, dtype=dtype)

    def next(self, uphill: Tensor) -> Tensor:
        """``β`` ``[B]`` of this step, ``uphill`` ``[B]`` the rows whose step went uphill."""
        if self.constant is not None:
            return torch.where(uphill, 0.0, self.constant)
        t_next = (1.0 + (1.0 + 4.0 * self.t * self.t).sqrt()) / 2.0
        beta = torch.where(uphill, 0.0, (self.t - 1.0) / t_next)
        self.t = torch.where(uphill, 1.0, t_next)
        return beta


def bulk_of(q: Tensor, v: Tensor | None, c: Weight) -> Tensor:
    """``B = Q − V diag(c) Vᵀ`` in the dtype of ``q`` (``v`` ``[K]`` with ``c`` a number, or
    ``[K, m]`` with ``c`` ``[m]``; ``Q`` itself without outliers): the part of ``Q`` that
    :func:`fista`'s gradient steps take (the outliers go into the prox)."""
    if v is None:
        return q
    if v.dim() == 2:
        return torch.addmm(q, v * c, v.T, alpha=-1.0)
    return torch.addr(q, v, v, alpha=-float(c))


def bfloat16_bulk(q: Tensor, v: Tensor | None, c: Weight) -> Tensor:
    """:func:`bulk_of` in bfloat16: the part of ``Q`` whose products may be rounded to
    bfloat16, the outliers' large part taken apart (it would cancel the rounding away)."""
    return bulk_of(q, v, c).bfloat16()


class _RoughBulk:
    """``B`` of :func:`bfloat16_bulk`, and :meth:`times`, ``zB`` for points like ``like``
    through two bfloat16 buffers."""

    def __init__(self, q: Tensor, v: Tensor | None, c: Weight, like: Tensor) -> None:
        self.bulk = bfloat16_bulk(q, v, c)
        self.rounded = torch.empty_like(like, dtype=torch.bfloat16)
        self.product = torch.empty_like(self.rounded)

    def times(self, z: Tensor) -> Tensor:
        """``zB`` in bfloat16 (a buffer, overwritten by the next call)."""
        return torch.matmul(self.rounded.copy_(z), self.bulk, out=self.product)


@functools.cache
def bfloat16_products() -> bool:
    """Whether :func:`projected_free_sets` takes FISTA's first products in bfloat16
    (:func:`rough_steps`): where the processor multiplies it natively (AVX-512 BF16 or
    AMX: one thread, ``[1024, 1024]²``, 10 against 25 ms in float32); elsewhere torch's
    bfloat16 product may be far slower than float32's. Asked once per process (the
    processor does not change)."""
    cpu = torch.cpu
    native = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported",
                                                   "_is_amx_tile_supported")]
    onednn = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
    return onednn and any(f is not None and bool(f()) for f in native)


def _step(a: Tensor, z: Tensor, v: Tensor | None, c: Weight, step: float,
          tau: Tensor, scratch: Tensor | None = None, pairs: Tensor | None = None) -> Tensor:
    """The prox of the gradient step ``a = z − η(zQ + shift)`` (:func:`_prox`, in ``a``), the
    outliers ``V diag(c) Vᵀ`` taken out of the gradient and into the prox."""
    if v is not None and v.dim() == 2:
        a.addmm_(thin_product(z, v).mul_(c), v.T, alpha=step)
    elif v is not None:
        a.addr_(z @ v, v, alpha=step * float(c))
    return _prox(a, v, step * c, tau, scratch, pairs)


def _prox(a: Tensor, v: Tensor | None, weight: Weight, tau: Tensor,
          scratch: Tensor | None = None, pairs: Tensor | None = None) -> Tensor:
    """``max(0, a − τv)`` (``max(0, a)`` without ``v``) in ``a``, ``τ`` ``[B]`` moved in place
    by one Newton step on ``τ − weight·vᵀmax(0, a − τv)`` (``weight = ηc``); several
    outliers: :func:`_prox_many` (``pairs``: :func:`outer_pairs` of ``v``, computed there
    where None); ``scratch``: a tensor like ``a`` to work in."""
    if v is None:
        return a.clamp_min_(0.0)
    if v.dim() == 2:
        return _prox_many(a, v, weight, tau, scratch, pairs)
    r = torch.addr(a, tau, v, alpha=-1.0, out=torch.empty_like(a) if scratch is None
                   else scratch).clamp_min_(0.0)  # one pass each, and matrix-vector
    value = tau - weight * (r @ v)  # products for the sums: a third of the element-wise time
    slope = 1.0 + weight * (r.sign_() @ (v * v))  # sign: 1 where a − τv > 0, else 0
    tau.sub_(value / slope)
    return a.addr_(tau, v, alpha=-1.0).clamp_min_(0.0)


def _pairs_of(v: Tensor | None) -> Tensor | None:
    """:func:`outer_pairs` of several outliers ``v`` ``[K, m]``, else None."""
    return outer_pairs(v) if v is not None and v.dim() == 2 else None


def outer_pairs(v: Tensor) -> Tensor:
    """``[K, m²]``: the products ``vᵢⱼ vᵢₗ`` of ``V``'s columns row by row (``v`` ``[K, m]``),
    for :func:`_prox_many`'s ``VᵀDV``."""
    k, m = v.shape
    return (v[:, :, None] * v[:, None, :]).reshape(k, m * m)


def _prox_many(a: Tensor, v: Tensor, weight: Weight, tau: Tensor,
               scratch: Tensor | None = None, pairs: Tensor | None = None) -> Tensor:
    """``max(0, a − τVᵀ)`` per row (``v`` ``[K, m]``, ``τ`` ``[B, m]``), ``τ`` moved in place by
    one semismooth Newton step on ``F(τ) = τ − W Vᵀmax(0, a − Vτ)`` (``W = diag(weight)``):
    its Jacobian ``I + W Vᵀ D V`` (``D`` the positive entries of ``a − Vτ``) is ``m × m``
    per row, ``VᵀDV`` one product of ``D`` with ``pairs``, the ``[K, m²]`` products of
    ``V``'s columns (:func:`outer_pairs`, computed here where None)."""
    m = v.shape[1]
    r = torch.addmm(a, tau, v.T, alpha=-1.0, out=torch.empty_like(a) if scratch is None
                    else scratch).clamp_min_(0.0)
    value = tau - weight * thin_product(r, v)
    pairs = outer_pairs(v) if pairs is None else pairs
    jac = (r.sign_() @ pairs).view(-1, m, m).mul_(torch.as_tensor(weight, dtype=a.dtype)[:, None])
    jac.diagonal(dim1=1, dim2=2).add_(1.0)
    tau.sub_(torch.linalg.solve_ex(jac, value).result)  # no raise: a non-finite row stays so
    return a.addmm_(tau, v.T, alpha=-1.0).clamp_min_(0.0)


def bulk_top(q: Tensor, v: Tensor | None, c: Weight, scale: Tensor | None = None) -> float:
    """``λ₁(SQS − V diag(c) Vᵀ)`` (``λ₁(SQS)`` without ``v``; ``S = diag(scale)``, the
    identity without) by ``POWER_STEPS`` power steps (``v`` ``[K]`` unit or ``[K, m]``
    orthonormal, ``Q`` ``[K, K]``), from the ones vector with ``V`` taken out; ``O(K²)``
    each, ``SQS`` never formed."""
    x = torch.ones(q.shape[0], dtype=q.dtype)
    s = torch.ones_like(x) if scale is None else scale.to(q.dtype)
    if v is None:
        vm, cm = x.new_zeros(x.shape[0], 1), x.new_zeros(1)
    else:
        vm = (v if v.dim() == 2 else v[:, None]).to(q.dtype)
        cm = torch.as_tensor(c, dtype=q.dtype).reshape(-1)
    x = x - vm @ (vm.T @ x)
    for _ in range(POWER_STEPS):
        x = x / torch.linalg.vector_norm(x).clamp_min(1e-300)
        x = s * (q @ (s * x)) - vm @ (cm * (vm.T @ x))
    x = x / torch.linalg.vector_norm(x).clamp_min(1e-300)
    return float(x @ (s * (q @ (s * x))) - cm @ (vm.T @ x) ** 2)


@dataclass(frozen=True)
class Plan:
    """What :func:`projected_start` takes: the diagonal scaling ``scale`` ``[K]`` (float64),
    ``top`` (``λ₁`` of the scaled gradient part), the scaled outliers ``v`` (float32: ``[K]``
    unit and ``c`` a number for one, ``[K, m]`` orthonormal and ``c`` ``[m]`` for several;
    None, 0: none), and ``bottom``, the gradient part's ``λ_min`` from above (0: unknown,
    FISTA's ``tₖ`` momentum)."""

    scale: Tensor
    top: float
    v: Tensor | None = None
    c: Weight = 0.0
    bottom: float = 0.0


def start_steps(start: Plan) -> int:
    """FISTA's steps for the plan ``start``: ``PROJECTED_STEPS`` times ``√(κ/STEPS_KAPPA)``
    where the bulk's ``κ = top/bottom`` is above ``STEPS_KAPPA``, at most
    ``PROJECTED_MAX_STEPS`` (``PROJECTED_STEPS`` where ``bottom`` is unknown); read at the
    call (tests set the constants)."""
    if start.bottom <= 0.0 or start.top <= STEPS_KAPPA * start.bottom:
        return PROJECTED_STEPS
    grown = math.ceil(PROJECTED_STEPS * math.sqrt(start.top / (STEPS_KAPPA * start.bottom)))
    return max(PROJECTED_STEPS, min(PROJECTED_MAX_STEPS, grown))


def rough_steps(steps: int) -> int:
    """How many of FISTA's ``steps`` take their product in bfloat16 where it is native:
    ``steps − FINE_STEPS``, at least ``ROUGH_STEPS`` (the first step has no product and the
    last a float64 one: two float32 steps before it; read at the call)."""
    return max(ROUGH_STEPS, steps - FINE_STEPS)


def projected_start(q: Tensor, shift: Tensor, start: Plan,
                    steps: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(free, y, yQ)`` ``[B, K]`` of :func:`fista` on the problem scaled by ``S =
    diag(start.scale)``: ``y = Sỹ`` with ``ỹ ≥ 0`` the same box, ``Q̃ = SQS`` (the bulk's
    diagonal made 1: rows of norms far apart, such as the cosine matrix of rows that share
    one direction to different degrees, leave the bulk's condition number at 7 instead of
    50), ``yQ = (ỹQ̃)S⁻¹``; in the dtype of ``q``."""
    steps = start_steps(start) if steps is None else steps
    free, y, yq = _scaled_fista(q, shift, start, steps)
    scale = start.scale.to(q.dtype)
    return free, y.mul_(scale), yq.div_(scale)


def _scaled_fista(q: Tensor, shift: Tensor, start: Plan, steps: int,
                  last: Callable[[Tensor], Tensor] | None = None,
                  rough: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`fista` on ``SQS`` and ``S·shift`` (``S = diag(start.scale)``, the dtype of
    ``q``), its answer in the scaled variables."""
    scale = start.scale.to(q.dtype)
    scaled = torch.mul(q, scale[:, None]).mul_(scale[None, :])
    return fista(scaled, shift * scale, start.top, start.v, start.c, steps, start.bottom, last,
                 rough)


def projected_free_sets(q: Tensor, shift: Tensor, start: Plan,
                        q32: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(free, y, yQ)`` ``[B, K]`` in the dtype of ``q`` (float64; ``y`` zero off ``free``):
    :func:`projected_start`'s steps in float32 on ``Q`` and ``shift``, its last product in
    the dtype of ``q`` (the start's product exact: the mixed-precision solves of
    :mod:`._mixed` need no product of their own to begin); a row that overflowed in
    float32 has no free index and ``y = 0`` (a cold start). ``q32``: ``Q`` in float32 where
    the caller has it."""
    scale = start.scale.to(q.dtype)
    scale32 = scale.float()
    exact: dict[str, Tensor] = {}

    def last(z: Tensor) -> Tensor:  # z on the scaled problem: y = Sz, zQ̃ = (yQ)S
        exact["y"] = y = z.to(q.dtype).mul_(scale)
        exact["yq"] = yq = y @ q
        return yq.float().mul_(scale32)

    q32 = q.float() if q32 is None else q32
    steps = start_steps(start)
    rough = rough_steps(steps) if q.shape[0] >= ROUGH_MIN_SIZE and bfloat16_products() else 0
    free, _, _ = _scaled_fista(q32, shift.float(), start, steps, last, rough)
    y, yq = exact["y"], exact["yq"]
    free &= torch.isfinite(yq).all(dim=1, keepdim=True)
    dropped = y * ~free
    kept = y.sub_(dropped).nan_to_num_(0.0, 0.0, 0.0)
    return free, kept, yq.sub_(sparse_product(dropped.nan_to_num_(0.0, 0.0, 0.0), q)).mul_(
        free.any(dim=1, keepdim=True)).nan_to_num_(0.0, 0.0, 0.0)


def plan(q: Tensor, pre: Preconditioner) -> Plan | None:
    """The projected start of the box problems on ``q`` (float64) with the preconditioner
    ``pre`` (:func:`~._precond.deflated`, ``h`` its ``B⁻¹``), or None: its deflated
    outliers, if any, taken out (``B = Q − V diag(c) Vᵀ``; ``B = Q`` for none), scaled by
    ``S = diag(B)^{-1/2}``, the outliers taken into the prox found again on ``SQS``
    (:func:`_scaled_outliers`), and ``λ₁(SBS) ‖(SBS)⁻¹‖_∞`` at most ``PROJECTED_MAX_KAPPA``
    (:func:`bulk_top`; ``(SBS)⁻¹ = S⁻¹B⁻¹S⁻¹``, one pass over ``h``)."""
    diag = torch.diagonal(q)
    unit: Tensor | None = None
    weight: Weight = 0.0
    if pre.v is not None and pre.c is not None:
        v, c = pre.v.to(q.dtype), pre.c.to(q.dtype)
        diag = diag - (v * v) @ c
    if not bool((diag > 0.0).all()):
        return None
    scale = diag.rsqrt()
    if pre.v is not None and pre.c is not None:
        found = _scaled_outliers(q, scale, v * scale[:, None], c)
        if found is None:
            return None
        unit, weight = found
    top = bulk_top(q, unit, weight, scale)
    inverse_scale = scale.reciprocal().to(pre.h.dtype)  # ‖S⁻¹B⁻¹S⁻¹‖_∞, no scaled copy
    inverse = float(((pre.h.abs() @ inverse_scale) * inverse_scale).amax())
    if not 0.0 < top * inverse <= PROJECTED_MAX_KAPPA:
        return None
    return Plan(scale, top, None if unit is None else unit.float(),
                weight.float() if isinstance(weight, Tensor) else weight,
                _bulk_bottom(pre.h, inverse_scale))


def _scaled_outliers(q: Tensor, scale: Tensor, sv: Tensor,
                     c: Tensor) -> tuple[Tensor, Weight] | None:
    """``(U, c̃)``: the ``m`` outliers of ``SQS`` (``S = diag(scale)``) taken into the prox,
    ``U diag(c̃) Uᵀ`` with ``U`` its top eigenvectors by ``POWER_STEPS`` steps of subspace
    iteration from ``SV`` (``sv`` ``[K, m]``: the outliers ``V diag(c) Vᵀ`` of ``Q`` scaled)
    and a Rayleigh–Ritz rotation, and ``c̃ = λ̃ − μ̃`` (``λ̃`` their Ritz values, ``μ̃`` the
    mean of the other eigenvalues, from the trace): ``SQS − U diag(c̃) Uᵀ`` keeps the
    eigenvalue ``μ̃`` in their place. ``Q``'s own eigenvectors scaled are not ``SQS``'s where
    ``S`` is far from a multiple of the identity (the cosine matrix of rows sharing one
    direction: ``S`` spans 8×, and the remainder ``S(Q − c vvᵀ)S`` kept a part of the
    outlier, ``λ₁`` 4.4 against 1.4, at K = 1,024: 6,181 indices from the optimal free sets
    after FISTA's eight steps, against 27 on the unscaled rows). One outlier: ``U`` ``[K]``
    and ``c̃`` a number, ``Sv`` normalised and ``c‖Sv‖²`` where the steps find no eigenvalue
    above the mean; several: ``[K, m]`` and ``[m]``, None where one is not above it."""
    k, m = sv.shape
    norm = float(torch.linalg.vector_norm(sv[:, 0]))
    fallback = (sv[:, 0] / norm, float(c[0]) * norm * norm) if m == 1 else None
    if k <= m:
        return fallback
    x = torch.linalg.qr(sv).Q
    for _ in range(POWER_STEPS):
        x = torch.linalg.qr(scale[:, None] * thin_product(q, scale[:, None] * x)).Q
    sx = scale[:, None] * x
    lam, rot = torch.linalg.eigh(sx.T @ thin_product(q, sx))
    x = x @ rot
    mu = (float(torch.diagonal(q) @ (scale * scale)) - float(lam.sum())) / (k - m)
    excess = lam - mu
    if not (mu > 0.0 and bool((excess > 0.0).all())):
        return fallback
    return (x[:, 0], float(excess[0])) if m == 1 else (x, excess)


def _bulk_bottom(h: Tensor, inverse_scale: Tensor) -> float:
    """``λ_min(SBS)`` from above: one over :func:`bulk_top` of the inverse, ``S⁻¹B⁻¹S⁻¹`` (``h
    = B⁻¹``, ``inverse_scale = diag(S⁻¹)``), whose power steps' Rayleigh quotient is at most
    its ``λ₁``; so the momentum it sets is at most the optimal one."""
    top = bulk_top(h, None, 0.0, inverse_scale)
    return 1.0 / top if top > 0.0 else 0.0
