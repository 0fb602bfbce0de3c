"""The support of a non-negative least-squares solution, guessed by an interior point.

Not a balancer module (no ``__all__``). Lawson–Hanson (:func:`~._boxqp.nnls`) takes one
Python-level step per column that enters or leaves its passive set: about ``K/2`` of them on
the Gramian of rank-deficient float32 rows, whose rounding makes the support of the min-norm
point about half the columns. A primal–dual interior point (Mehrotra's predictor–corrector,
Nocedal & Wright, *Numerical Optimization*, 2nd ed., Alg. 16.4, on the complementarity
problem ``s = AᵀAx − Aᵀb ≥ 0``, ``x ≥ 0``, ``xᵀs = 0``) reaches the same point in a few
dozen whole-matrix iterations (one Cholesky factorisation of ``AᵀA + X⁻¹S`` each): there
``xⱼ/sⱼ`` grows without bound on the support and vanishes off it. The caller checks the
point against Lawson–Hanson's own optimality test, or starts Lawson–Hanson from its support:
the guess decides where the exact method starts, not what it accepts.

Example:
    >>> import torch
    >>> from gradbalance.balancers._interior import interior_nnls
    >>> a = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    >>> b = torch.tensor([1.0, -1.0], dtype=torch.float64)
    >>> x, support = interior_nnls(a, b, lambda x: False)
    >>> x.round(decimals=6), support
    (tensor([1., 0., 0.], dtype=torch.float64), [0])
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..gramian import symmetric_product
from ._cholesky import cholesky_ex, cholesky_solve

#: Iterations at most.
MAX_ITERATIONS = 60
#: Iterations in a row that may fail to halve the mean complementarity ``xᵀs/n`` before
#: the iterations stop (rounding has stalled them) …
STALLS = 2
#: … or in which the guessed support may stay the same, once ``xᵀs/n`` is below ``SETTLED``.
STABLE = 3
SETTLED = 1e-12
#: Iterations after ``xᵀs/n`` first falls below ``SETTLED`` at most: on the Gramian of
#: rank-deficient float32 rows the optimum is degenerate at rounding level and the guessed
#: support keeps moving (each further step costs about one Lawson–Hanson pass over a
#: tenth of the columns and no longer improves the start it hands over).
SETTLED_STEPS = 8
#: Fraction of the step to the boundary taken.
STEP = 0.99
#: Rows per column of the factor from which the Newton systems are factorised in the
#: columns' dimension (``n³/3`` flops a step) rather than by the Woodbury identity in the
#: rows' (``2m²n + m³/3``). The flops meet near ``m = n/√6``, the times on one thread near
#: ``0.7n`` (a Cholesky factorisation of order 256 takes as long as a product of that order;
#: a step at ``m = 145, n = 256``: 0.33 ms by Woodbury, 0.58 ms directly; MGDA on rows of
#: rank 9K/16 0.89× the time at K = 256, 0.94× at K = 1,024, the same answers).
DIRECT_MIN_ROWS_PER_COLUMN = 0.65
#: Rows from which :func:`_gram` takes the blocked symmetric product.
SYMMETRIC_FROM_ROWS = 256
#: From ``LOW_PRECISION_MIN_COLUMNS`` columns on, the Newton systems are formed and
#: factorised in float32 (the residuals stay float64: an inexact Newton direction, which
#: only bends the path the iterates take; the caller's exact method decides) while the steps
#: halve the mean complementarity ``xᵀs/n``; from the first step that does not, or whose
#: float32 factorisation fails (that step redone), in float64. MGDA at K = 1,024 on rows of
#: rank 5K/8, 3K/5 and 9K/16: 3.27 → 3.05–3.10, 3.40 → 3.21 and 3.22 → 2.89 times the
#: Gramian (the earlier rule, float32 while ``xᵀs/n > 1e-6``), the same weights.
LOW_PRECISION_MIN_COLUMNS = 256


def _to_boundary(v: Tensor, dv: Tensor) -> float:
    """The largest ``α ≤ 1`` with ``v + α dv ≥ 0``."""
    return min(1.0, float(torch.where(dv < 0.0, -v / dv, 1.0).min()))


def _guess(x: Tensor, s: Tensor) -> Tensor:
    """The columns guessed to carry the solution: ``xⱼ/sⱼ`` above ``max x / max s``
    (between the two scales: ``x`` on the support, ``s`` off it)."""
    return x / s > float(x.max()) / float(s.max().clamp_min(torch.finfo(x.dtype).tiny))


def _gram(a: Tensor) -> Tensor:
    """``AAᵀ``: from ``SYMMETRIC_FROM_ROWS`` rows on by the Gramian's blocked product
    (:func:`~gradbalance.gramian.symmetric_product`, the blocks on and below the diagonal
    only: MGDA on rows of rank 9K/16 at K = 1,024, 577 rows, 0.93× the time of ``combine``),
    below by one product (its blocks' overhead outweighs the flops they save: 1.02–1.03× at
    K = 256, 144 rows)."""
    return symmetric_product(a) if a.shape[0] >= SYMMETRIC_FROM_ROWS else a @ a.T


def _newton(u: Tensor, h: Tensor | None, d: Tensor) -> Callable[[Tensor], Tensor] | None:
    """Solves of ``(UᵀU + D) v = rhs`` (``D = diag(d) > 0``): one Cholesky factorisation of
    the ``n × n`` matrix ``h + D`` (``h = UᵀU``), or, with few rows (``h`` None,
    ``m < DIRECT_MIN_ROWS_PER_COLUMN · n``), of the ``m × m`` ``I + UD⁻¹Uᵀ`` (the Woodbury identity,
    ``(D + UᵀU)⁻¹ = D⁻¹ − D⁻¹Uᵀ(I + UD⁻¹Uᵀ)⁻¹UD⁻¹``); None if it fails."""
    if h is not None:
        chol, info = cholesky_ex(h + torch.diag(d))
        if int(info) != 0:
            return None
        return lambda rhs: cholesky_solve(rhs[:, None], chol)[:, 0]
    small = _gram(u * d.rsqrt())  # UD⁻¹Uᵀ
    small.diagonal().add_(1.0)
    chol, info = cholesky_ex(small)
    if int(info) != 0:
        return None

    def solve(rhs: Tensor) -> Tensor:  # D⁻¹(rhs − Uᵀ(I + UD⁻¹Uᵀ)⁻¹UD⁻¹rhs): no [m, n] D⁻¹U
        t = rhs / d
        return t.sub_((cholesky_solve((u @ t)[:, None], chol)[:, 0] @ u).div_(d))
    return solve


def _low_newton(low: tuple[Tensor, Tensor | None], d: Tensor) -> Callable[[Tensor], Tensor] | None:
    """:func:`_newton` on float32 copies ``low = (U, UᵀU or None)``, its solves returned in
    float64; None where the float32 factorisation fails."""
    inner = _newton(low[0], low[1], d.float())
    if inner is None:
        return None
    return lambda rhs: inner(rhs.float()).double()


def _step(u: Tensor, h: Tensor | None, b: Tensor, x: Tensor, s: Tensor, mu: float,
          low: tuple[Tensor, Tensor | None] | None = None) -> tuple[Tensor, Tensor, float] | None:
    """One predictor–corrector step from ``(x, s)`` (``mu = xᵀs/n``): the next point and its
    ``xᵀs/n``; None where the factorisation fails or the step is not finite (rounding).
    ``low``: float32 copies of ``(U, h)``, whose Newton systems are taken instead; None
    where their factorisation fails (:func:`_adaptive_step` goes on in float64)."""
    n = x.shape[0]
    solve = _newton(u, h, s / x) if low is None else _low_newton(low, s / x)
    if solve is None:
        return None
    r = u.T @ (u @ x - b) - s  # from the columns: UᵀU's rounding left out
    dx = solve(-r - s)  # the affine direction
    ds = -s - s / x * dx
    alpha = min(_to_boundary(x, dx), _to_boundary(s, ds))
    sigma = (float((x + alpha * dx) @ (s + alpha * ds)) / n / mu) ** 3
    centre = (sigma * mu - dx * ds) / x  # the corrector's term
    dx = solve(-r - s + centre)
    ds = -s - s / x * dx + centre
    alpha = STEP * min(_to_boundary(x, dx), _to_boundary(s, ds))
    x, s = x + alpha * dx, s + alpha * ds
    now = float(x @ s) / n
    return (x, s, now) if math.isfinite(now) else None


def _iterate(u: Tensor, b: Tensor, accept: Callable[[Tensor], bool]) -> tuple[Tensor, Tensor]:
    """``(x, s)`` after Mehrotra's iterations on ``s = UᵀUx − Uᵀb``, ``x, s ≥ 0``,
    ``xᵀs = 0`` from ``x = s = 1``, until the guessed support settles or ``accept(x)``
    (both checked once ``xᵀs/n < SETTLED``), ``SETTLED_STEPS`` steps have passed below
    ``SETTLED``, the complementarity stalls, or a step fails
    (:func:`_step`; the last point is kept)."""
    m, n = u.shape
    h = _gram(u.T.contiguous()) if m >= DIRECT_MIN_ROWS_PER_COLUMN * n else None
    low = ((u.float(), None if h is None else h.float())
           if n >= LOW_PRECISION_MIN_COLUMNS else None)
    x = torch.ones(n, dtype=u.dtype)
    s = torch.ones(n, dtype=u.dtype)
    last, stalls, stable, guess = 1.0, 0, 0, _guess(x, s)
    settled_steps = 0
    for _ in range(MAX_ITERATIONS):
        step, low = _adaptive_step(u, h, b, x, s, last, low)
        if step is None:
            break
        x, s, now = step
        stalls = stalls + 1 if now > 0.5 * last else 0
        nxt = _guess(x, s)
        settled = now < SETTLED
        settled_steps += settled
        stable = stable + 1 if settled and bool((nxt == guess).all()) else 0
        if _done(stalls, stable, settled_steps, now) or (settled and accept(x)):
            break
        last, guess = now, nxt
    return x, s


def _adaptive_step(u: Tensor, h: Tensor | None, b: Tensor, x: Tensor, s: Tensor, mu: float,
                   low: tuple[Tensor, Tensor | None] | None
                   ) -> tuple[tuple[Tensor, Tensor, float] | None,
                              tuple[Tensor, Tensor | None] | None]:
    """:func:`_step` on the float32 systems ``low`` while they serve, and the ``low`` of the
    next step: None (float64 from here) after a float32 step whose factorisation fails or
    that is not finite (either redone in float64: the iterates near the boundary make the
    next systems no better conditioned), or that does not halve ``xᵀs/n``."""
    step = _step(u, h, b, x, s, mu, low)
    if step is None and low is not None:
        return _step(u, h, b, x, s, mu), None
    if step is not None and step[2] > 0.5 * mu:
        return step, None
    return step, low


def _done(stalls: int, stable: int, settled_steps: int, now: float) -> bool:
    """Whether the iterations stop whatever the point: the complementarity stalled or is
    zero, the guessed support stayed, or ``SETTLED_STEPS`` steps passed below ``SETTLED``."""
    return (stalls >= STALLS or stable >= STABLE or settled_steps >= SETTLED_STEPS
            or now == 0.0)


def interior_nnls(a: Tensor, b: Tensor,
                  accept: Callable[[Tensor], bool]) -> tuple[Tensor, list[int]]:
    """``(x, support)``: the interior point's last iterate for ``min_{x ≥ 0} ‖Ax − b‖``
    (``A`` ``[m, n]``, ``b`` ``[m]``, float64; zero on zero columns), which stops early
    where ``accept(x)`` holds, and the columns it guesses carry the solution
    (:func:`_guess`), the largest ``x`` first."""
    n = a.shape[1]
    norms = torch.linalg.vector_norm(a, dim=0)
    live = torch.nonzero(norms > 0.0).flatten()
    bnorm = float(torch.linalg.vector_norm(b))
    x = a.new_zeros(n)
    if live.numel() == 0 or bnorm == 0.0:
        return x, []
    unit = a[:, live] / norms[live]  # unit columns and ‖b‖ = 1: the scales are O(1)
    scale = bnorm / norms[live]

    def accept_unit(y: Tensor) -> bool:
        return accept(x.index_copy(0, live, y * scale))

    y, s = _iterate(unit, b / bnorm, accept_unit)
    x[live] = y * scale
    keep = _guess(y, s)
    order = torch.argsort(y[keep], descending=True)
    support: list[int] = live[keep][order].tolist()
    return x, support
