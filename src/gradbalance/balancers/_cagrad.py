"""CAGrad: the update closest to the mean that maximises the worst task's improvement."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from .._checks import check_choice, check_range, check_square
from ._active_set import box_active_set
from ._base import Balancer
from ._boxqp import CHOLESKY_MAX_COND, INTERIOR_MIN_COLUMNS, factored_box_qp, psd_factor
from ._denoise import KeptSpectrum
from ._solvers import QP_TOL, cagrad_dual, trace_normalized

__all__ = ["CAGrad", "cagrad_weights"]

Rescale = Literal["none", "c2", "c"]

#: :func:`_vanishes`: ``‖g_w‖²`` relative to ``(Σ wₖ‖gₖ‖)²`` at and below which ``g_w`` is
#: zero (``1e-10``: ``‖g_w‖`` within ``1e-5`` of the rows it combines). The dual's root
#: search and quadratic programs resolve ``w`` to about ``1e-6`` where ``g_w = 0`` is the
#: optimum and stop a little above it; below ``1e-5`` the direction of ``g_w`` is their
#: error's. A task and its reversal (``g``, ``−λg``, ``λ`` 0.1 … 2.5) among conflicting
#: rows, K = 4 … 40, 384 cases in float32 and float64 and the 32 float32 ones of
#: ``tests/unit/balancers/test_float32_rounding.py``: the zero optima left up to ``3e-12``
#: (weights off the cancelling ratio by ``6e-7``; where the bound was ``16 eps``, 5 and 4 of
#: them took that direction, weights ``1e4 … 3e6`` on the pair), the smallest non-zero
#: optimum ``0.44``.
VANISH_RTOL = 1e-10
#: :func:`_vanishes`: the share of the dual's weights off the zero rows below which ``g_w``
#: is zero. Along ``w = (1 − ε)eₖ + εw'`` from a zero row ``k`` the dual's objective is
#: ``ε`` times its value at ``w'``, so an optimum holds all its weight on the zero rows or
#: none (or its value is 0); the searches leave ``1e-8 … 3e-7`` on the shortest rows
#: (norms 1e-3 … 1e3), whose direction is their error's: updates on the ball's surface
#: with a task at cosine −0.05 where the optimum conflicts with none.
ZERO_ROWS_REST = 1e-3
#: :func:`_lifted` from at most this fraction of cut directions (PCD's and MGDA's
#: single lifts stop at a quarter: their QPs on a lift of more fail and pay twice). K = 1,024,
#: rows of rank 5K/8 and K/2: 3.8× and 3.4× the Gramian by the factor, 2.6× and 2.4× lifted;
#: below rank K/2 the dual cone is thin and ``g_w = 0`` frequent (the lift's support fails).
LIFT_MAX_NULLITY = 1 / 2


def cagrad_weights(gramian: Tensor, c: float = 0.4, rescale: Rescale = "none",
                   spectrum: KeptSpectrum | None = None) -> Tensor:
    """Weights ``[K]`` (float64, CPU) of CAGrad's update ``d = g₀ + (√φ/‖g_w‖) g_w``.

    Primal (eq. 3): ``max_d min_k gₖ·d`` s.t. ``‖d − g₀‖ ≤ c‖g₀‖``, ``g₀ = Σgₖ/K``. Dual
    (eq. 4): ``w = argmin_{w∈Δ} g_w·g₀ + √φ ‖g_w‖``, ``√φ = c‖g₀‖`` (see
    :func:`~gradbalance.balancers._solvers.cagrad_dual`), then ``d = g₀ + √φ g_w/‖g_w‖``:
    weights ``1/K + c‖g₀‖ wₖ/‖g_w‖``. ``rescale``: ``"none"`` (the paper), ``"c2"`` divides
    by ``1 + c²`` (the authors' code and LibMTL, ``rescale=1``), ``"c"`` by ``1 + c``.
    When the dual optimum has ``g_w = 0`` (a zero task gradient, tasks that cancel) the
    optimum is 0 and every update of the ball that conflicts with no task attains it: the
    update is the one closest to ``g₀``, ``g₀`` projected onto the dual cone ``{d : gₖ·d ≥
    0}`` (DualProj's; ``g₀`` itself where it conflicts with no task). With a zero row that
    projection is tried before the dual: inside the ball, it is the answer.
    ``spectrum``: the Gramian as ``DVΛVᵀD`` (:func:`~._denoise.cleaned`), whose factor
    ``DVΛ^{1/2}`` the dual's singular path then uses instead of decomposing it again.

    Example:
        >>> import torch
        >>> from gradbalance.functional import cagrad_weights
        >>> cagrad_weights(torch.eye(3, dtype=torch.float64), c=0.4)  # (1 + c) / 3
        tensor([0.4667, 0.4667, 0.4667], dtype=torch.float64)
    """
    check_square("gramian", gramian)
    check_choice("rescale", rescale, ("none", "c2", "c"))
    k = gramian.shape[0]
    gram, trace = trace_normalized(gramian)
    kept = None
    if spectrum is not None and float(trace) > 0.0:
        kept = spectrum.scaled(1.0 / trace)
    mean = torch.full((k,), 1.0 / k, dtype=torch.float64)
    g0_norm = float(mean @ gram @ mean) ** 0.5 if float(mean @ gram @ mean) > 0 else 0.0
    weights = mean
    if c != 0.0 and g0_norm != 0.0:
        found = _zero_row_optimum(gram, mean, c * g0_norm, kept)
        weights = _dual_weights(gram, c, mean, c * g0_norm, kept) if found is None else found
    return weights / {"none": 1.0, "c2": 1 + c * c, "c": 1 + c}[rescale]


def _dual_weights(gram: Tensor, c: float, mean: Tensor, radius: float,
                  kept: KeptSpectrum | None) -> Tensor:
    """``1/K + radius·w/‖g_w‖`` from the dual's ``w``; where ``g_w = 0``
    (:func:`_vanishes`) the conflict-free update closest to ``g₀``."""
    w = cagrad_dual(gram, c, factor=None if kept is None else kept.factor(),
                    lifted=None if kept is None else _lifted(gram, kept),
                    rounding=0.0 if kept is None else kept.cut)
    gw_sq = float(w @ gram @ w)
    if not _vanishes(gram, w, gw_sq):
        out: Tensor = mean + (radius / gw_sq**0.5) * w
        return out
    v, step = _projection(gram, mean, kept)
    return v if step <= radius else mean + (radius / step) * (v - mean)


def _zero_row_optimum(gram: Tensor, mean: Tensor, radius: float,
                      kept: KeptSpectrum | None) -> Tensor | None:
    """With a zero row ``0`` lies in the rows' convex hull and the optimum is at most 0; it
    is 0 exactly where ``g₀``'s projection onto the dual cone lies in the ball, and then
    that projection is the update (:func:`_projection`), without the dual. None without a
    zero row, where the projection lies outside the ball, or where one task's half-space
    ``{d : gₖ·d ≥ 0}`` alone lies farther from ``g₀`` than ``radius`` (``−gₖ·g₀/‖gₖ‖``,
    ``O(K²)``: conflicting rows skip the projection)."""
    norms = torch.diagonal(gram).clamp_min(0.0).sqrt()
    live = norms > 0.0
    if bool(live.all()):
        return None
    reach = -(gram[live] @ mean) / norms[live]
    if float(reach.max()) > radius:
        return None
    v, step = _projection(gram, mean, kept)
    return v if step <= radius else None


def _lifted(gram: Tensor, spectrum: KeptSpectrum) -> Tensor | None:
    """``G' + εD²`` for :func:`~._solvers.cagrad_dual`'s lifted start on the cleaned Gramian
    (:meth:`~._denoise.KeptSpectrum.lift` with up to ``LIFT_MAX_NULLITY`` cut), from
    ``INTERIOR_MIN_COLUMNS`` tasks, where its condition number is below
    ``CHOLESKY_MAX_COND`` by ``C' + εI``'s and the norms' spread (wider norms: the search
    would decompose the lift again; the factor's least squares is as fast); else None."""
    lift = spectrum.lift(LIFT_MAX_NULLITY)
    if lift is None or gram.shape[0] < INTERIOR_MIN_COLUMNS:
        return None
    norms = spectrum.norms
    spread = float(norms.max() / norms.min()) ** 2  # D's share of G' + εD²'s conditioning
    if not (float(spectrum.values.max()) + lift) * spread < CHOLESKY_MAX_COND * lift:
        return None
    return gram + torch.diag(lift * norms * norms)


def _projection(gram: Tensor, mean: Tensor, spectrum: KeptSpectrum | None) -> tuple[Tensor, float]:
    """``(v, ‖g_v − g₀‖)``: the weights of ``g₀`` projected onto the dual cone ``{d : gₖ·d ≥
    0}``, ``v = argmin_{v ≥ 1/K} vᵀGv`` (DualProj's problem), where the optimum is 0 the
    update of the ball closest to ``g₀``, and the step's length. The batched active set
    (:func:`~._active_set.box_active_set`) keeps out an entering column dependent within
    the cleaned spectrum's cut (weights a float32 reversal's rounding would decide
    otherwise); where it does not finish, Lawson–Hanson on the factor
    (:func:`~._boxqp.factored_box_qp`)."""
    k = mean.shape[0]
    cut = 0.0 if spectrum is None else spectrum.cut
    found, done = box_active_set(gram, mean[None], QP_TOL, 10 + 3 * k, cut)
    if bool(done[0]):
        v = found[0]
    else:
        factor = psd_factor(gram) if spectrum is None else spectrum.factor()
        v = factored_box_qp(factor, torch.zeros_like(mean), mean, False, None, QP_TOL)
    return v, max(float((v - mean) @ gram @ (v - mean)), 0.0) ** 0.5


def _vanishes(gram: Tensor, w: Tensor, gw_sq: float) -> bool:
    """Whether the dual's ``g_w`` is zero (a zero task gradient, or rows that cancel): then
    the optimum is 0 (:func:`_projection`). Either the zero rows hold all but
    ``ZERO_ROWS_REST`` of the weights, or ``‖g_w‖²`` is at most ``VANISH_RTOL`` times
    ``(Σ wₖ‖gₖ‖)²`` over the weights that matter (at least ``1e-9`` of the largest; weights
    a solver leaves at rounding level on other rows do not count), relative: a combination
    of rows a millionth the longest's (norms 1e-6 … 1e6: ``‖g_w‖² ≈ 1e-24`` of the
    trace-normalised Gramian) is not zero."""
    if gw_sq > VANISH_RTOL:  # the trace-normalised Gramian: Σ wₖ‖gₖ‖ ≤ 1 on the simplex
        return False
    norms = torch.diagonal(gram).clamp_min(0.0).sqrt()
    if float(w[norms == 0.0].sum()) >= (1.0 - ZERO_ROWS_REST) * float(w.sum()):
        return True
    significant = w >= 1e-9 * float(w.max())
    span = float(w[significant] @ norms[significant])
    return span == 0.0 or gw_sq <= VANISH_RTOL * span * span


class CAGrad(Balancer):
    """CAGrad (Liu et al. 2021): ``d = g₀ + c‖g₀‖ g_w/‖g_w‖`` with the dual weights ``w``.

    Within a ball of radius ``c‖g₀‖`` around the mean gradient ``g₀``, the update maximises
    the smallest task improvement ``min_k gₖ·d`` (:func:`cagrad_weights`); ``c = 0`` is the
    mean. The dual is solved exactly on the trace-normalised Gramian.

    Cost in K: 0–3 simplex QPs typically, ``O(K³)`` each, besides the Gramian ``O(K²P)``;
    from 17 tasks copies of a task are solved as one row, ``O(K²)`` to find them; norms
    decades apart: one Cholesky factorisation of the cosine matrix (``O(K³/3)``), then 3–5
    QPs on the weighted simplex, each a few block-pivoting iterations of ``O(|F|³/3)``
    (``F`` the free set), or where the cosine matrix is singular one ``O(K³)``
    eigen-decomposition and Lawson–Hanson on its factor; a singular Gramian (float32 rows:
    one ``O(K³)`` eigen-decomposition to remove the rounding first) from 64 tasks the same
    QPs on its lift where at most half the directions were cut, then one ``O(|S|³)``
    factorisation on the support, else least squares on its factor (``O(K³)`` per
    interior-point step); with a zero task gradient, where no task's half-space lies beyond
    the ball (``O(K²)``), first ``g₀``'s projection onto the dual cone (an active set of
    ``O(K²)`` per addition), the update where it lies in the ball.

    Args:
        c: ball radius factor, ``0 <= c < 1`` (default 0.4, the paper's NYU-v2 setting).
        rescale: ``"none"`` (paper), ``"c2"`` (``/(1+c²)``, authors' code and LibMTL
            default) or ``"c"`` (``/(1+c)``).

    Reference: Liu et al., "Conflict-Averse Gradient Descent for Multi-task Learning",
    NeurIPS 2021, arXiv:2110.14048, eq. 3-4.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import CAGrad
        >>> CAGrad(c=0.5)(torch.eye(2, dtype=torch.float64))  # (1 + c) / 2 per task
        tensor([0.7500, 0.7500], dtype=torch.float64)
    """

    name = "cagrad"
    inverts_gramian = True
    _repr_args = ("num_tasks", "c", "rescale")
    from_gramian = True
    homogeneous = True

    def __init__(
        self, num_tasks: int | None = None, *, c: float = 0.4, rescale: Rescale = "none"
    ) -> None:
        super().__init__(num_tasks)
        c = check_range("c", c, 0.0, 1.0, high_open=True)
        check_choice("rescale", rescale, ("none", "c2", "c"))
        self.c = float(c)
        self.rescale: Rescale = rescale

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        return cagrad_weights(gramian, self.c, self.rescale).to(gramian.device)

    def _rounded_weights(self, gramian: Tensor, losses: Tensor | None, rounding: float,
                         spectrum: KeptSpectrum | None = None) -> Tensor:
        return cagrad_weights(gramian, self.c, self.rescale, spectrum).to(gramian.device)
