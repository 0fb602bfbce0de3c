"""PCD: Priority-Constrained Descent (a primary task and guaranteed secondary progress).

Varam et al., *Not All Objectives Are Born Equal: Priority-Constrained Descent for
Hierarchical Multi-Objective Optimization*, TMLR, openreview HT01yGHLEt (the PCD of TorchJD
0.18, the only gradient balancer of that name in TorchJD or LibMTL).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from .._checks import check_range, check_square, real_values
from ._base import Balancer
from ._boxqp import (
    INTERIOR_MIN_COLUMNS,
    ROUNDING_MULTIPLE,
    CosineSpectrum,
    cosine_spectrum,
    eigen_factor,
    is_well_conditioned,
    ldp,
    solve_box_qp_batched,
)
from ._cholesky import cholesky_ex, cholesky_solve
from ._denoise import KeptSpectrum
from ._min_norm_dual import lifted_cosine
from ._min_norm_groups import collapse
from ._parallel_groups import GROUPS_MIN_SIZE
from ._solvers import solve_box_qp

__all__ = ["PCD", "pcd_weights"]

_ENUMERATE_UP_TO = 4  # below this K, the few working sets are cheaper than the QP solver
#: A lifted answer (:func:`_lifted_weights`) missing a constraint on the given Gramian by
#: more than this times ``√ε`` of its scale is refused.
LIFT_HOLD = 1 / 8


def pcd_weights(gramian: Tensor, taus: Tensor, tol: float = 1e-9,
                rounding: float = 0.0, factor: Tensor | None = None,
                lift: float | None = None) -> Tensor:
    """Weights ``[1, μ₂, …, μ_K]`` of ``d = g₁ + Σⱼ μⱼ gⱼ`` solving PCD's quadratic program.

    ``min_d ½‖d − g₁‖²`` s.t. ``gⱼᵀd ≥ τⱼ‖gⱼ‖²`` (j ≥ 2). Its dual is the non-negative QP
    ``min_{μ≥0} ½ μᵀQμ − bᵀμ`` with ``Q = [gᵢᵀgⱼ]_{i,j≥2}``, ``bⱼ = τⱼ‖gⱼ‖² − gⱼᵀg₁``. Solved
    exactly, at a cost bounded for every input:

    * ``Q`` positive definite (condition number below ``1e10``; the KKT point is unique):
      for ``K ≤ 4`` the ``2^(K−1) ≤ 8`` working sets, smallest first, up to the first KKT
      point, as the paper's reference implementation does; for ``K > 4`` the box-QP solver
      of :mod:`~gradbalance.balancers._boxqp`.
    * ``Q`` singular (``K − 1`` above the gradients' rank, colinear tasks): the primal as a
      least-distance program on a factor of the Gramian (:func:`_ldp_weights`), one
      Lawson–Hanson NNLS of ``K − 1`` variables.

    * From 17 secondary tasks, copies of one another (the same row within the rounding, the
      same ``τ``) are one constraint (:func:`_grouped_weights`), checked on the whole ``Q``.

    No KKT point (the constraints are infeasible, or, for a singular ``Q``, met only by a
    ``d − g₁`` over ``1/√r`` times the constraints' size, ``r`` the larger of ``rounding`` —
    the Gramian's, relative to ``‖gᵢ‖‖gⱼ‖``, :func:`~gradbalance.gramian.products_rounding`
    — and the factor's cut, whose direction rounding would decide): ``g₁`` is returned
    (``[1, 0, …, 0]``). ``factor``: ``F`` with ``G = FFᵀ`` exactly (the cleaned Gramian's,
    :func:`~._denoise.cleaned`), which the singular path then uses as its factor; ``lift``:
    its :meth:`~._denoise.KeptSpectrum.lift`, where the dual QP on ``G + εD²`` is tried first
    (:func:`_lifted_exact`).

    Example:
        >>> import torch
        >>> from gradbalance.functional import pcd_weights
        >>> g = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
        >>> pcd_weights(g @ g.T, torch.tensor([0.5]))  # g₂·(g₁ + g₂) = ½‖g₂‖²
        tensor([1., 1.], dtype=torch.float64)
    """
    check_square("gramian", gramian)
    m = gramian.shape[0]
    out = torch.zeros(m, dtype=gramian.dtype, device=gramian.device)
    out[0] = 1.0
    if m == 1:
        return out
    grouped = _grouped_weights(gramian, taus, tol, rounding)
    if grouped is not None:
        return grouped.to(device=out.device, dtype=out.dtype)
    q = gramian[1:, 1:]
    b = taus * torch.diagonal(q) - gramian[1:, 0]
    trace = float(torch.diagonal(q).sum())
    if not (trace > 0.0 and _definite(q.cpu() / trace) and is_well_conditioned(q.cpu() / trace)):
        given = None if factor is None else factor.cpu()
        out[1:] = _singular_weights(gramian.cpu(), taus.cpu(), rounding, given,
                                    lift).to(out.device)
    elif m <= _ENUMERATE_UP_TO:
        out[1:] = _enumerate_working_sets(gramian, q, b, tol)
    else:
        zeros = torch.zeros(1, m - 1, dtype=torch.float64)  # classified above: no second
        mu = solve_box_qp(q.cpu() / trace, -b.cpu()[None] / trace, zeros,  # decomposition
                          well_conditioned=True)[0]
        out[1:] = mu.to(out.device)
    return out


def _grouped_weights(gramian: Tensor, taus: Tensor, tol: float,
                     rounding: float = 0.0) -> Tensor | None:
    """:func:`pcd_weights` with secondary tasks that are copies of one another (the same row
    within the rounding and the same ``τ``: one constraint) solved as one, its ``μ`` split
    equally (:func:`~._min_norm_groups.collapse`); with every ``τ ≥ 0``, parallel rows of
    one sign and one ``τ`` at any lengths, kept as their longest members (``gⱼ = cu``: ``cuᵀd ≥
    τc²`` is ``uᵀd ≥ τc``, which the longest ``c`` implies; the shorter ones' ``μ`` is 0:
    PCD at K = 1,024 on 512 rows each given twice at norms over 12 decades, 3.5× → 2.3×
    ``compute_gramian``); None where nothing collapses or where the
    answer fails the dual's KKT conditions on the whole Gramian, ``s = Qμ − b ≥ −ηₛ`` and
    ``sⱼ ≤ ηₛ`` where ``μⱼ > 0``, ``ηₛ = (tol + δ)(‖gⱼ‖‖d − g₁‖ + |bⱼ|)`` (``δ`` the
    grouping's deviation). Copies make ``Q`` singular: the least-distance program's
    eigen-decomposition and Lawson–Hanson one column at a time (PCD at K = 1,024 on 512
    Gaussian rows each given twice: 4.1 → 0.3 s)."""
    if gramian.shape[0] - 1 < GROUPS_MIN_SIZE:
        return None  # no copy of the Gramian at the step's K
    gram = gramian.to(device="cpu", dtype=torch.float64)
    labels = taus.to("cpu", torch.float64)
    longest = bool((labels >= 0.0).all())  # copies of one length: the same groups either way
    groups = collapse(gram[1:, 1:], copies_only=not longest, labels=labels, longest=longest,
                      rounding=rounding)
    if groups is None:
        return None
    rows = torch.cat([torch.zeros(1, dtype=torch.int64), groups.kept + 1])
    reduced = pcd_weights(gram[rows][:, rows], taus.cpu()[groups.kept], tol, rounding)
    mu = groups.spread(reduced[1:])
    q = gram[1:, 1:]
    b = taus.to("cpu", torch.float64) * torch.diagonal(q) - gram[1:, 0]
    qmu = q @ mu
    slack = qmu - b
    size = groups.d * abs(float(mu @ qmu)) ** 0.5 + b.abs()
    bound = (tol + groups.delta) * size
    holds = (slack >= -bound) & ((mu <= 0.0) | (slack <= bound)) & (mu >= 0.0)
    if not bool(holds.all() & torch.isfinite(mu).all()):
        return None
    return torch.cat([torch.ones(1, dtype=torch.float64), mu])


def _definite(q: Tensor) -> bool:
    """A Cholesky factorisation of ``Q`` succeeds: the cheap test that rules out a singular
    ``Q`` before the eigenvalues (``is_well_conditioned``) are computed."""
    return int(cholesky_ex(q.to(torch.float64)).info) == 0


def _enumerate_working_sets(gramian: Tensor, q: Tensor, b: Tensor, tol: float) -> Tensor:
    """``μ`` of the first KKT point over the working sets, smallest first (zero if none)."""
    atol = tol * max(float(torch.diagonal(gramian).max()), torch.finfo(gramian.dtype).tiny)
    n = q.shape[0]
    zero = torch.zeros(n, dtype=gramian.dtype, device=gramian.device)
    for size in range(n + 1):
        for subset in itertools.combinations(range(n), size):
            mu = zero.clone()
            if size:
                idx = list(subset)
                mu[idx] = torch.linalg.pinv(q[idx][:, idx]) @ b[idx]
                if bool((mu[idx] < 0).any()):
                    continue
            slack = q @ mu - b
            if size and bool((slack[list(subset)].abs() > atol).any()):
                continue  # b is not in the range of this working set
            if bool((slack >= -atol).all()):
                return mu
    return zero


def _singular_weights(gramian: Tensor, taus: Tensor, rounding: float,
                      factor: Tensor | None = None, lift: float | None = None) -> Tensor:
    """``μ`` ``[K − 1]`` where the secondary Gramian is not well conditioned: from
    ``INTERIOR_MIN_COLUMNS`` tasks on, on the Gramian lifted off its rounding where that
    applies (:func:`_lifted_weights`), else by the least-distance program
    (:func:`_ldp_weights`), one eigen-decomposition of the cosine matrix for both; with an
    exact ``factor`` (a cleaned Gramian), the exact answer from its ``lift`` where that
    applies (:func:`_lifted_exact`), else the least-distance program on the factor."""
    gram = gramian.to(torch.float64)
    large = gram.shape[0] >= INTERIOR_MIN_COLUMNS
    if factor is not None:
        mu = _lifted_exact(gram, taus.to(torch.float64), lift) if large and lift else None
        return _ldp_weights(gram, taus, rounding=rounding, factor=factor) if mu is None else mu
    if not large:
        return _ldp_weights(gram, taus, rounding=rounding)
    spectrum = cosine_spectrum(gram)
    mu = _lifted_weights(gram, taus.to(torch.float64), spectrum)
    return _ldp_weights(gram, taus, spectrum, rounding) if mu is None else mu


def _lifted_exact(gram: Tensor, taus: Tensor, lift: float) -> Tensor | None:
    """``μ`` of PCD's dual QP on an exactly singular (cleaned) Gramian ``G``: solved on
    ``G + εD²`` (:func:`_lifted_dual`), then on ``G`` itself over the lifted answer's
    support (one Cholesky factorisation of ``Q_SS``), kept where it meets the KKT conditions
    on ``G`` (``μ_S > 0``, ``(Qμ − b)_S = 0`` and ``(Qμ − b)ⱼ ≥ 0`` off ``S``, to ``1e-9`` of
    each constraint's size ``‖gⱼ‖‖d − g₁‖ + |bⱼ|``); else None."""
    norms = torch.diagonal(gram).clamp_min(0.0).sqrt()
    if not bool((norms > 0.0).all()):
        return None
    lifted = (gram / torch.outer(norms, norms)).diagonal_scatter(
        torch.full_like(norms, 1.0 + lift))
    mu = _lifted_dual(gram, taus, lifted, lift, norms)
    if mu is None:
        return None
    q = gram[1:, 1:]
    b = taus * torch.diagonal(q) - gram[1:, 0]
    idx = torch.nonzero(mu > 0.0).flatten()
    exact = torch.zeros_like(mu)
    if idx.numel():
        low, info = cholesky_ex(q[idx][:, idx])
        if int(info) != 0:
            return None
        exact[idx] = cholesky_solve(b[idx, None], low)[:, 0]
    residual = q @ exact - b
    size = norms[1:] * abs(float(exact @ q @ exact)) ** 0.5 + b.abs()
    on = torch.zeros_like(mu, dtype=torch.bool)
    on[idx] = True
    held = torch.where(on, residual.abs(), (-residual).clamp_min(0.0)) <= 1e-9 * size
    return exact if bool(held.all()) and bool((exact[idx] > 0.0).all()) else None


def _lifted_weights(gram: Tensor, taus: Tensor, spectrum: CosineSpectrum) -> Tensor | None:
    """``μ`` of PCD's dual QP on the Gramian lifted off its rounding, ``G' = D(C + εI)D``
    (``C`` the cosine matrix, ``ε`` its :func:`~gradbalance.balancers._min_norm_dual.lifted_cosine`:
    a float32 Gramian of rows of which a few are combinations of others), or None where the
    lift does not apply or its answer does not hold on ``G``.

    ``G'`` is within ``1 + ROUNDING_MULTIPLE`` times the given Gramian's distance from the
    rows' exact one (the bound of :func:`_ldp_weights`'s cut) and positive definite: its
    secondary rows are independent and every constraint can be met. Its dual
    ``min_{μ ≥ 0} ½ μᵀQ'μ − b'ᵀμ`` is solved on the cosine scale (``ν = D₂μ``, the matrix
    ``C₂ + εI``, well conditioned by the spectrum) by block principal pivoting. On ``G``
    itself its answer misses a constraint by at most ``ε (1 + τ) dⱼ² μⱼ`` (``G' − G`` is
    ``ε`` on the cosine matrix's diagonal), ``ε`` times its scale ``‖gⱼ‖‖d − g₁‖ + |bⱼ|``
    while ``μ`` stays bounded (K = 64 … 96, ``K/16`` dependent tasks: 0.4–3ε). Where the
    constraints on ``G`` cannot be met (``0`` in the secondary rows' conic hull), ``μ``
    grows as ``1/ε`` along it, ``‖d − g₁‖`` as ``1/√ε``, and the answer misses one by
    about ``√ε`` of its scale (700–1,600ε in the same tests): above ``LIFT_HOLD·√ε`` it is
    refused and the least-distance program decides."""
    got = lifted_cosine(spectrum)
    return None if got is None else _lifted_dual(gram, taus, *got, spectrum.norms)


def _lifted_dual(gram: Tensor, taus: Tensor, lifted: Tensor, lift: float,
                 norms: Tensor) -> Tensor | None:
    """:func:`_lifted_weights` on the lifted cosine matrix ``C + εI`` (``lifted``,
    ``lift``: ``ε``) of ``gram`` with the rows' ``norms``."""
    n = lifted.shape[0]
    d = norms[1:]
    b = taus * (d * d) * (1.0 + lift) - gram[1:, 0]  # G'ⱼⱼ = (1 + ε)dⱼ², G'ⱼ₁ = Gⱼ₁
    c = -b / d
    top = float(c.abs().max())
    if top == 0.0:
        return torch.zeros_like(b)
    scale = top * (n - 1)  # c/scale at most 1/(n − 1), as the trace-1 matrix's entries
    trace = (n - 1) * (1.0 + lift)
    q = lifted[1:, 1:].div(trace)
    zeros = torch.zeros(1, n - 1, dtype=torch.float64)
    nu = solve_box_qp_batched(q, (c / scale)[None], zeros, well_conditioned=True)[0]
    mu = nu * (scale / trace) / d
    qmu = gram[1:, 1:] @ mu
    slack = qmu - b + taus * (d * d) * lift  # on G: gⱼᵀd − τ‖gⱼ‖², d = g₁ + Σ μⱼgⱼ
    size = d * abs(float(mu @ qmu)) ** 0.5 + b.abs()  # ‖gⱼ‖‖d − g₁‖ + |bⱼ|
    return mu if bool((slack >= -LIFT_HOLD * lift**0.5 * size).all()) else None


def _ldp_weights(gramian: Tensor, taus: Tensor, spectrum: CosineSpectrum | None = None,
                 rounding: float = 0.0, factor: Tensor | None = None) -> Tensor:
    """``μ`` ``[K − 1]`` of PCD's primal as a least-distance program (zero if infeasible).

    With the Gramian ``≈ F Fᵀ`` (rows ``fᵢ``, :func:`~gradbalance.balancers._boxqp.psd_factor`
    of the Gramian over its largest diagonal, which leaves ``μ`` unchanged) and
    ``x = d − f₁``, the problem is ``min ½‖x‖²`` s.t. ``fⱼᵀx ≥ bⱼ``: the optimal ``d`` lies in
    the span of the rows, so the factor loses nothing, and ``x = Σⱼ μⱼ fⱼ``
    (:func:`~gradbalance.balancers._boxqp.ldp`). From ``INTERIOR_MIN_COLUMNS`` tasks on the
    factor is cut at ``ROUNDING_MULTIPLE`` times the cosine matrix's most negative eigenvalue
    (:func:`~gradbalance.balancers._boxqp.rounding_cut`): the rounding a float32 Gramian
    carries leaves it about ``K/2`` positive rounding-level eigenvalues, each a dimension more
    for the least-distance program's interior point (``O(K³)`` per Newton step on a factor of
    full rank); the answer is that of a Gramian within ``1 + ROUNDING_MULTIPLE`` times the
    given one's distance from the rows' exact Gramian. ``spectrum``: the cosine matrix's
    :func:`~gradbalance.balancers._boxqp.cosine_spectrum` where the caller has it. The
    program is infeasible where only an ``x`` of ``1/√r`` times its constraints' size meets
    it (:func:`~gradbalance.balancers._boxqp.ldp`'s ``resolution``), ``r`` the larger of the
    factor's cut and the Gramian's ``rounding``.
    """
    gram = gramian.to(torch.float64)
    top = float(torch.diagonal(gram).max())
    if not top > 0.0:
        return torch.zeros(gram.shape[0] - 1, dtype=torch.float64)
    gram = gram / top
    b = taus.to(torch.float64) * torch.diagonal(gram)[1:] - gram[1:, 0]
    if factor is not None:  # G = FFᵀ exactly: over the same largest diagonal
        rows, cut = factor / top**0.5, 0.0
    else:
        multiple = ROUNDING_MULTIPLE if gram.shape[0] >= INTERIOR_MIN_COLUMNS else 0.0
        rows, cut = eigen_factor(gram, multiple, spectrum)
    mu = ldp(rows[1:], b, resolution=max(cut, rounding))
    return torch.zeros_like(b) if mu is None else mu


class PCD(Balancer):
    """Follow task 0's gradient, guaranteeing each other task a share of its own progress.

    ``d̃ = argmin ½‖d − g̃₁‖²`` s.t. ``g̃ⱼᵀd ≥ τ‖g̃ⱼ‖²``, with normalised rows
    ``g̃ᵢ = gᵢ / √(v̂ᵢ + ε)`` (``v̂``: bias-corrected EMA of ``‖gᵢ‖²``, decay ``β``). The update
    is ``d̃`` rescaled to ``‖g₁‖`` (zero when ``g₁ = 0`` or ``d̃ = 0`` up to rounding).

    Not symmetric: row 0 (the first loss) is the primary task. Cost in K: one box QP on the
    ``K − 1`` secondary tasks, ``O(|F|³)`` per pivoting iteration (``O(K³)`` at most); from 17
    secondary tasks, copies with the same ``τ`` are one constraint, ``O(K²)`` to find them;
    a singular secondary Gramian (float32 rows: one ``O(K³)`` eigen-decomposition to remove
    the rounding first) from 64 tasks on its lift where few directions were cut, then one
    ``O(|S|³)`` factorisation on the support, else the least-distance program on its factor
    (``O(K³)`` per interior-point step).

    Args:
        num_tasks: K (optional).
        tau: guaranteed fraction ``τ ∈ [0, 1]``, one number or one per secondary task
            (default 0.02).
        beta: EMA decay ``β ∈ [0, 1)`` (default 0.999).
        eps: ``ε ≥ 0`` (default 1e-8).

    State: the EMA ``[K]`` float64 and the step count (buffers ``_ema``, ``_step``).

    Example:
        >>> import torch
        >>> from gradbalance.balancers import PCD
        >>> g = torch.tensor([[5.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
        >>> PCD(tau=0.75)(g)  # d̃ = (1, ¾) on the normalised rows, rescaled to ‖g₁‖ = 5
        tensor([4.0000, 3.0000], dtype=torch.float64)
    """

    _ema: Tensor | None
    _step: Tensor

    name = "pcd"
    inverts_gramian = True
    from_gramian = True
    homogeneous = False  # ε makes the normalisation scale-dependent

    def __init__(self, num_tasks: int | None = None, tau: float | Sequence[float] = 0.02,
                 beta: float = 0.999, eps: float = 1e-8) -> None:
        super().__init__(num_tasks)
        if isinstance(tau, (int, float)):
            check_range("tau", tau, 0.0, 1.0)
            self.tau: float | Tensor = float(tau)
        else:
            t = real_values("tau", tau)
            if t.dim() != 1 or not bool(((t >= 0) & (t <= 1)).all()):
                raise ValueError(
                    f"Invalid tau: {t.tolist()} (expected 0 <= tau <= 1, one number or one per "
                    f"secondary task)"
                )
            self.tau = t
        self.beta = check_range("beta", beta, 0.0, 1.0, high_open=True)
        self.eps = check_range("eps", eps, 0.0, None)
        self.register_state("_ema", None, optional=True, per_task=True)
        self.register_state("_step", torch.zeros((), dtype=torch.int64))

    def _taus(self, m: int, device: torch.device) -> Tensor:
        if isinstance(self.tau, Tensor):
            if self.tau.numel() != m - 1:
                raise ValueError(
                    f"tau has {self.tau.numel()} values but there are {m - 1} secondary tasks; "
                    f"pass one per task after the first"
                )
            return self.tau.to(device)
        return torch.full((m - 1,), self.tau, dtype=torch.float64, device=device)

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        return self._rounded_weights(gramian, losses, 0.0)

    def _rounded_weights(self, gramian: Tensor, losses: Tensor | None, rounding: float,
                         spectrum: KeptSpectrum | None = None) -> Tensor:
        m = gramian.shape[0]
        factor = None if spectrum is None else spectrum.factor()
        lift = None if spectrum is None else spectrum.lift()
        gram = gramian.to(torch.float64)
        taus = self._taus(m, gram.device)
        sq = torch.diagonal(gram).clamp_min(0)
        ema = torch.zeros(m, dtype=torch.float64, device=gram.device) if self._ema is None \
            else self._ema
        t = int(self._step) + 1
        ema = self.beta * ema + (1.0 - self.beta) * sq
        self._ema, self._step = ema, torch.tensor(t, dtype=torch.int64)
        denom = torch.sqrt(ema / (1.0 - self.beta**t) + self.eps)
        scales = torch.where(denom > 0, 1.0 / torch.where(denom > 0, denom, 1.0), 0.0)
        w = torch.zeros(m, dtype=torch.float64, device=gram.device)
        if not bool(sq[0] > 0):
            return w
        normed = gram * torch.outer(scales, scales)
        mult = pcd_weights(normed, taus, rounding=rounding,
                           factor=None if factor is None else factor * scales[:, None],
                           lift=lift)
        d_sq = mult @ normed @ mult
        magnitude = (mult.abs() @ torch.diagonal(normed).clamp_min(0).sqrt()) ** 2
        if bool(d_sq > 10 * torch.finfo(torch.float64).eps * magnitude):
            w = mult * scales * torch.sqrt(sq[0] / d_sq)
        return w

    def __repr__(self) -> str:
        return f"PCD(num_tasks={self.num_tasks}, tau={self.tau}, beta={self.beta})"
