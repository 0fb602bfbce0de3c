"""CAGrad's root search over the auxiliary norm ``ρ``: its bracket, the exact root on a support
and the KKT test, on the simplex or on a weighted one (``aᵀw = 1``).

Not a balancer module (no ``__all__``). :func:`~._solvers.cagrad_dual` writes CAGrad's dual
``min_{w∈Δ} wᵀlin + r‖g_w‖`` as the root of ``φ'(ρ) = (r/2)(1 − ‖g_{w(ρ)}‖²/ρ²)``, ``w(ρ)``
one simplex QP (:func:`cagrad_root`); :mod:`~._cagrad_scaled` runs the same search on the
cosine matrix with the weighted simplex.

Example:
    >>> import torch
    >>> f64 = torch.float64
    >>> gram = torch.tensor([[1.0, -0.5, 0.0], [-0.5, 1.0, 0.2], [0.0, 0.2, 2.0]], dtype=f64)
    >>> mean = torch.full((3,), 1 / 3, dtype=f64)
    >>> lin = gram @ mean
    >>> r = 0.4 * float(mean @ lin) ** 0.5  # c = 0.4
    >>> rho, w = support_root(gram, lin, r, torch.tensor([True, True, False]))
    >>> is_cagrad_kkt(gram, lin, r, rho, w, 1e-12), round(float(w.sum()), 12)
    (True, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ._cholesky import BlockFactors, cholesky_solve

#: Steps of :func:`~._solvers.cagrad_dual`'s root search towards a lower end by its model of
#: ``‖g_{w(ρ)}‖`` before it falls by a factor 100 a step.
DESCENT_MODEL_STEPS = 4


def support_root(gram: Tensor, lin: Tensor, r: float, support: Tensor,
                 blocks: BlockFactors | None = None,
                 a: Tensor | None = None) -> tuple[float, Tensor] | None:
    """``(ρ*, w(ρ*))`` of CAGrad's norm equation on a fixed support, or None.

    On a fixed support ``F`` (``G_FF`` positive definite) the simplex QP of
    :func:`~._solvers.cagrad_dual` has the solution ``w(ρ) = w₀ + ρ w₁`` with ``w₀ = y_a/a``,
    ``w₁ = (β y_a/a − y_b)/r``, ``y_a = G_FF⁻¹1``, ``y_b = G_FF⁻¹ lin_F``, ``a = 1ᵀy_a``,
    ``β = 1ᵀy_b``; since ``G_FF w₀ ∝ 1`` and ``1ᵀw₁ = 0``,
    ``‖g_{w(ρ)}‖² = 1/a + C ρ²`` with ``C = w₁ᵀG w₁``, and ``‖g_w‖ = ρ`` gives
    ``ρ* = (a (1 − C))^{-1/2}`` (no root on this support when ``C ≥ 1``). ``w(ρ*)`` is the
    optimum if it is feasible and no task off the support wants in (:func:`is_cagrad_kkt`).
    ``blocks``: the factors of ``G``'s blocks kept by the search, ``C = ‖Lᵀw₁‖²`` with
    ``G_FF = LLᵀ``. ``a``: the weighted simplex ``aᵀw = 1`` instead (``a`` for ``1`` in
    ``y_a = G_FF⁻¹a``, ``a = aᵀy_a``, ``β = aᵀy_b``; the same formulas follow).
    """
    idx = torch.nonzero(support).flatten()
    if idx.numel() == 0:
        return None
    chol, info = (BlockFactors(gram) if blocks is None else blocks).factor(idx.tolist())
    if int(info) != 0:
        return None
    ones = torch.ones(idx.numel(), dtype=torch.float64) if a is None else a[idx]
    y = cholesky_solve(torch.stack([ones, lin[idx]], dim=1), chol)
    if a is None:
        alpha, beta = float(y[:, 0].sum()), float(y[:, 1].sum())
    else:
        alpha, beta = (float(v) for v in (ones @ y).tolist())
    if not alpha > 0.0:
        return None
    w1 = (beta / alpha * y[:, 0] - y[:, 1]) / r
    curv = float(torch.linalg.vector_norm(chol.mT @ w1).square())
    if not curv < 1.0:
        return None
    rho = (alpha * (1.0 - curv)) ** -0.5
    w = torch.zeros(gram.shape[0], dtype=torch.float64)
    w[idx] = y[:, 0] / alpha + rho * w1
    return rho, w


def is_cagrad_kkt(gram: Tensor, lin: Tensor, r: float, rho: float, w: Tensor,
                  tol: float, a: Tensor | None = None) -> bool:
    """KKT of ``min_{w∈Δ} wᵀlin + (r/2ρ) wᵀGw`` at ``w``: ``w ≥ 0`` and the gradient
    ``lin + (r/ρ) G w`` equal on the support and not smaller off it (to ``tol``, relative).
    ``a``: on the weighted simplex ``aᵀw = 1``, the gradient is ``ν a`` on the support and
    at least that off it (``ν`` fitted on the support by least squares)."""
    grad = lin + (r / rho) * (gram @ w)
    support = w > 0
    if a is None:
        nu = grad[support].mean()
        dev = torch.where(support, (grad - nu).abs(), (nu - grad).clamp_min(0)).max()
    else:
        on = a[support]
        level = a * ((on @ grad[support]) / (on @ on))
        dev = torch.where(support, (grad - level).abs(), (level - grad).clamp_min(0)).max()
    bound = tol * (1.0 + grad.abs().max())
    return bool((w >= 0).all()) and bool(dev <= bound)


#: :meth:`Bracket.inconsistent`: how far a value of ``f`` (a number below 1, without a
#: scale) may lie outside its bracket's ends before the search is taken as following
#: rounding (float64 QPs solved exactly move it by about 1e-12). CAGrad on the benchmark's
#: ``mixed`` rows at K = 256 (seeds 3 and 7; zero rows, near copies, rank-one rows): the
#: cosine route's search on the cut eigen-factor took 31 QPs at ``ρ = 4.73e-4`` to four
#: digits with ``f`` between −0.07 and +0.04 before its KKT test failed.
INCONSISTENT_MARGIN = 1e-6


@dataclass
class Bracket:
    """The state of :func:`cagrad_root`'s search: ``f`` at the bracket ends ``lo < hi``
    (``lo = 0``: no lower end yet), the side of the last step (Illinois), and ``log(hi/lo)``
    when it last halved with the steps since.

    The steps work in ``s = ρ²`` on ``ψ(s) = ‖g_{w(ρ)}‖² − ρ² = −ρ² f(ρ)``: on a fixed support
    ``‖g_{w(ρ)}‖² = A + Cρ²`` (:func:`support_root`), so ``ψ`` is piecewise linear in ``s``,
    decreasing, and a secant through two points of one piece lands on the root exactly, also
    where ``G_FF`` is singular and the support root is not available (near duplicates)."""

    lo: float
    f_lo: float
    hi: float
    f_hi: float
    side: int = 0
    mark: float = math.inf
    stale: int = 0
    psi_lo: float = 0.0
    psi_hi: float = 0.0
    above: tuple[float, float] | None = None  # the upper end before ``hi``: ``(s, ψ)``
    descent: int = 0

    def bisect_due(self) -> bool:
        """Whether ``log(hi/lo)`` has not halved over the two steps before."""
        if not self.lo > 0.0:
            return False
        span = math.log(self.hi / self.lo)
        if span <= 0.5 * self.mark:
            self.mark, self.stale = span, 0
        else:
            self.stale += 1
        return self.stale >= 2

    def inside(self, rho: float) -> bool:
        """Whether ``ρ`` lies strictly inside the bracket."""
        return self.lo < rho < self.hi

    def fallback(self, rho: float, floor: float, bisect: bool) -> float:
        """The next ``ρ`` without a support root. No lower end yet: the secant in ``s``
        through the last two upper ends where it lands below ``‖g_{w(hi)}‖²``, else that
        value (``ρ ← ‖g_{w(ρ)}‖`` stays at or above the root: ``‖g_w‖`` grows with ``ρ``),
        never below ``floor`` nor a hundredth of ``ρ``; after ``DESCENT_MODEL_STEPS`` such
        steps, a hundredth of ``ρ``. With a bracket: a bisection in
        ``log ρ`` when due or while ``hi > 4 lo``, else an Illinois regula falsi step in
        ``s``."""
        lo, hi = self.lo, self.hi
        if lo == 0.0:
            self.descent += 1
            if self.descent > DESCENT_MODEL_STEPS:
                return max(0.01 * rho, floor)
            s_hi = hi * hi
            nxt = s_hi + self.psi_hi  # ‖g_{w(hi)}‖²
            if self.above is not None and self.psi_hi != self.above[1]:
                s_prev, psi_prev = self.above
                sec = s_hi - self.psi_hi * (s_hi - s_prev) / (self.psi_hi - psi_prev)
                nxt = sec if 0.0 < sec < nxt else nxt
            # At most a factor 100 in ρ per step: each QP stays well scaled (f(ρ) needs
            # ‖g_w‖² to a precision of ρ²), and a root at a kink is not overshot by decades.
            return max(math.sqrt(max(nxt, 1e-4 * s_hi)), floor)
        if bisect or hi > 4.0 * lo:
            middle: float = (lo * hi) ** 0.5  # bisection in log ρ
            return middle
        s_lo, s_hi = lo * lo, hi * hi
        nxt = s_lo - self.psi_lo * (s_hi - s_lo) / (self.psi_hi - self.psi_lo)
        return math.sqrt(nxt if s_lo < nxt < s_hi else 0.5 * (s_lo + s_hi))

    def inconsistent(self, f_mid: float) -> bool:
        """Whether ``f`` at a point inside the bracket lies outside ``[f_lo, f_hi]`` by more
        than ``INCONSISTENT_MARGIN``: ``f`` increases with ``ρ`` (``φ`` is convex), so its
        QPs were not solved to a precision that decides the root."""
        margin = INCONSISTENT_MARGIN
        return f_mid > self.f_hi + margin or (self.lo > 0.0 and f_mid < self.f_lo - margin)

    def converged(self, f_mid: float, tol: float) -> bool:
        """``f`` flags a zero-norm combination (NaN), is within ``tol`` of 0, or the bracket
        is within ``tol`` relative."""
        lo, hi = self.lo, self.hi
        return f_mid != f_mid or abs(f_mid) <= tol or (lo > 0.0 and (hi - lo) <= tol * hi)

    def narrow(self, rho: float, f_mid: float) -> None:
        """``ρ`` replaces the end of its sign; the other end's ``ψ`` halves (Illinois) when
        the same end moved twice in a row."""
        psi = -rho * rho * f_mid
        if f_mid < 0.0:
            self.lo, self.f_lo, self.psi_lo = rho, f_mid, psi
            if self.side == -1:
                self.psi_hi *= 0.5
            self.side = -1
        else:
            if self.lo == 0.0:
                self.above = (self.hi * self.hi, self.psi_hi)
            self.hi, self.f_hi, self.psi_hi = rho, f_mid, psi
            if self.side == 1 and self.lo > 0.0:
                self.psi_lo *= 0.5
            self.side = 1


def next_rho(gram: Tensor, lin: Tensor, r: float, bracket: Bracket, rho: float,
             w: Tensor, floor: float, tol: float, blocks: BlockFactors | None = None,
             a: Tensor | None = None) -> tuple[float, Tensor | None]:
    """The next ``ρ`` of :func:`cagrad_root` after ``ρ`` gave ``w``: the exact root on
    ``w``'s support (:func:`support_root`) when it lies inside the bracket, with its weights
    when they are already optimal (KKT), else the bracket's fallback step."""
    bisect = bracket.bisect_due()
    root = None if bisect else support_root(gram, lin, r, w > 0, blocks, a)
    if root is None or not bracket.inside(root[0]) or root[0] == rho:
        return bracket.fallback(rho, floor, bisect), None
    if is_cagrad_kkt(gram, lin, r, root[0], root[1], tol, a):
        return root[0], root[1]  # the support is right: w(ρ*) is the optimum
    return root[0], None


class InconsistentRoot(ArithmeticError):
    """:func:`cagrad_root` with ``strict``: ``f`` at a point inside the bracket lies outside
    its ends' values (:meth:`Bracket.inconsistent`)."""


def cagrad_root(gram: Tensor, lin: Tensor, r: float, hi: float,
                f: Callable[[float], tuple[float, Tensor]], tol: float,
                max_iter: int, blocks: BlockFactors | None = None,
                a: Tensor | None = None, floor: float | None = None,
                strict: bool = False) -> Tensor:
    """The safeguarded root search of :func:`~._solvers.cagrad_dual` over ``ρ ∈ (0, hi]``
    (``a``: on the weighted simplex ``aᵀw = 1``; ``floor``: the smallest ``ρ``, ``1e-12 hi``
    by default).

    A NaN from ``f`` flags ``g_{w(ρ)} = 0``: that ``w`` minimises both terms of every smaller
    ``ρ``'s objective too, so it stays optimal as ``ρ → 0``, where the root then lies (e.g. a
    zero task gradient), and it is returned.

    Bounded: the descent to a lower bracket takes at most ``DESCENT_MODEL_STEPS`` steps of
    the model, then 6 of a factor 100 (down to ``1e-12 hi``); after it, a step bisects
    ``log ρ`` while ``hi > 4 lo`` and whenever ``log(hi/lo)`` has not halved
    over the two steps before, so it halves at least every third step, and it falls from
    ``ln 10¹²`` to ``tol`` within ``3 log₂(27.6/tol) ≤ 135`` steps for ``tol = 1e-12``. The
    default ``max_iter = 200`` is not reached; with a smaller one the last point is returned.
    ``strict``: raises :class:`InconsistentRoot` at the first value of ``f`` inside the
    bracket beyond its ends' (a search on QPs that rounding decides, whose narrowing would
    follow the rounding to ``tol``; the caller has another route).
    """
    floor = 1e-12 * hi if floor is None else floor  # a root below: a zero-norm optimum
    f_hi, w_hi = f(hi)
    if f_hi != f_hi or f_hi <= 0.0:
        return w_hi
    # φ' < 0 near ρ = 0 unless g_w* = 0
    bracket = Bracket(0.0, -math.inf, hi, f_hi, psi_hi=-hi * hi * f_hi)
    rho, w_mid = hi, w_hi
    for _ in range(max_iter):
        rho, optimum = next_rho(gram, lin, r, bracket, rho, w_mid, floor, tol, blocks, a)
        if optimum is not None:
            return optimum
        f_mid, w_mid = f(rho)
        if strict and bracket.inconsistent(f_mid):
            raise InconsistentRoot(f"f({rho:.6g}) = {f_mid:.6g} outside [{bracket.f_lo:.6g}, "
                                   f"{bracket.f_hi:.6g}]")
        if bracket.converged(f_mid, tol) or (rho == floor and f_mid > 0.0):
            return w_mid  # (the latter: the root lies below 1e-12 ‖g‖_max, a zero norm)
        bracket.narrow(rho, f_mid)
    return w_mid
