"""The preconditioner of the free-set conjugate-gradient solves: ``(Q⁻¹)_FF``, with ``Q``'s
few outlying eigenvalues deflated.

Not a balancer module (no ``__all__``). :mod:`._pcg` solves ``Q_FF y_F = rhs_F`` with
``(Q⁻¹)_FF`` as the preconditioner, very good where ``Q``'s spectrum is one narrow bulk
(random rows: about 4 steps to ``1e-6``). Rows sharing a direction (conflicting tasks) give
``Q`` one eigenvalue far above the bulk, rows sharing ``m`` directions ``m`` of them, which
the restriction to ``F`` spreads over the preconditioned spectrum (7 steps for one). Here
``Q = B + V C Vᵀ`` (``V`` ``[K, m]`` the top unit eigenvectors, ``λⱼ`` their eigenvalues,
``μ`` the mean of the others, ``C = diag(λⱼ − μ)``), ``B``'s inverse ``B⁻¹ = Q⁻¹ + V diag(1/μ −
1/λⱼ) Vᵀ`` restricted to ``F`` stands for ``B_FF⁻¹``, and the outliers are put back exactly
by the Woodbury identity::

    M⁻¹ = Ĥ − ĤV_F (C⁻¹ + V_FᵀĤV_F)⁻¹ V_FᵀĤ,    Ĥ = (B⁻¹)_FF,

the inverse of ``Ĥ⁻¹ + V_F C V_Fᵀ`` (5 steps for one outlier; Sherman & Morrison 1950,
Woodbury 1950). ``W = L⁻¹ V_FᵀĤ`` (``LLᵀ`` the ``m × m`` Cholesky factor of ``C⁻¹ +
V_FᵀĤV_F``) is ``m`` products per free set, then ``M⁻¹r = Ĥr − Wᵀ(Wr)``: the cost of a step
unchanged but for ``2m`` dot products. For any orthonormal ``V`` and ``λⱼ > μ`` both ``B⁻¹``
and ``M`` are symmetric positive definite, so an inexact ``V`` only slows the solves; ``v₁``
comes from a few power steps, the others, where a bound leaves room for them, from a few
steps of subspace iteration and a Rayleigh–Ritz rotation.

Example:
    >>> import torch
    >>> q = torch.eye(4, dtype=torch.float64) / 8 + torch.full((4, 4), 0.5, dtype=torch.float64)
    >>> pre = deflated(q, torch.linalg.inv(q))  # λ = 2.125 over μ = 0.125: B = I/8, exact
    >>> free = torch.tensor([[True, True, False, True]])
    >>> r = torch.tensor([[1.0, -2.0, 0.0, 0.5]], dtype=torch.float64)
    >>> z = pre.apply(r, free.double(), pre.setup(free.double()))
    >>> sel = free[0]
    >>> torch.allclose(z[0, sel], torch.linalg.solve(q[sel][:, sel], r[0, sel]), rtol=1e-5)
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._cholesky import cholesky_ex
from ._thin_product import thin_product


def row_dot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise inner products (``[B, K]`` → ``[B]``): a product and a sum, twice as fast
    as :func:`torch.linalg.vecdot` in float64 (one thread, ``[900, 1024]``: 1.1 against
    2.3 ms) and as fast in float32."""
    return (a * b).sum(dim=-1)


def either(mask: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``torch.where(mask, a, b)`` for boolean ``a`` and ``b`` (broadcast), by bit operations:
    on one thread ``torch.where`` (and ``masked_fill``) over ``[1024, 1024]`` took 5–6 ms,
    the bit operations 0.4–0.5 ms (UPGrad's pivoting tests, every iteration)."""
    return (mask & a) | (b & ~mask)


def symmetrized(m: Tensor, in_place: bool = False) -> Tensor:
    """``(M + Mᵀ)/2`` (``[K, K]``) through a contiguous copy of ``Mᵀ``: a blocked transpose,
    where the strided reads of ``M + M.T`` miss the cache (one thread, ``K = 1,024``, float64:
    3 against 9 ms); ``in_place``: written into ``M`` (the caller's own), one temporary
    fewer. The copy is always a copy: a column-major ``M`` (a transposed Gramian converted
    with its strides) has a contiguous ``Mᵀ``, which ``contiguous()`` would return as a view
    of ``M`` itself."""
    transposed = m.T.clone(memory_format=torch.contiguous_format)
    return m.add_(transposed).mul_(0.5) if in_place else torch.add(m, transposed).mul_(0.5)


#: :func:`sparse_product` multiplies a sparse copy while the non-zero entries are fewer than
#: this fraction of them (one thread, ``[1000, 1024] × [1024, 1024]``: 5–15 ms in float32 up
#: to 70 per row, 25–30 ms the dense product; about 2.5× that in float64) where ``M`` has at
#: least ``SPARSE_MIN_COLUMNS`` columns; below, only while they are at most one per row of
#: ``a`` (UPGrad's bounds: 0.3 against 1.1 ms at ``K = 256``; a handful per row there, the
#: copy's passes over ``a`` made UPGrad about 10 % slower); below ``DENSE_BELOW_COLUMNS``
#: never (the count alone costs more than the product: UPGrad 3–7 % slower at ``K ≤ 16``).
SPARSE_FRACTION = 1 / 16
SPARSE_MIN_COLUMNS = 512
DENSE_BELOW_COLUMNS = 64


def sparse_count(a: Tensor, columns: int) -> int | None:
    """The number of non-zero entries of ``a`` where ``a M`` (``M`` of ``columns`` columns) is
    cheaper through them (``SPARSE_FRACTION``, ``SPARSE_MIN_COLUMNS``,
    ``DENSE_BELOW_COLUMNS``), else None (one dense product); one pass over ``a`` from
    ``DENSE_BELOW_COLUMNS`` on."""
    if columns < DENSE_BELOW_COLUMNS:
        return None
    limit = SPARSE_FRACTION * a.numel() if columns >= SPARSE_MIN_COLUMNS else a.shape[0]
    count = int(torch.count_nonzero(a))
    return count if count <= limit else None


def sparse_product(a: Tensor, m: Tensor, nonzeros: int | None = -1) -> Tensor:
    """``a M`` (``[B, K] × [K, N]``, strided) through the ``nonzeros`` non-zero entries of ``a``
    (``-1``: :func:`sparse_count` decides; None: one dense product): none, a zero product;
    at most one per row of ``a``, a gather of rows of ``M`` added into their rows
    (``aᵢⱼ Mⱼ``: with one entry in a row bit for bit the dense product's for ``M`` finite, the
    other terms are zeros; 2–4 ms against 4–9 ms by ``argmax`` or a sparse copy at ``K =
    1,024``); else a sparse (COO) copy of ``a``."""
    if nonzeros == -1:
        nonzeros = sparse_count(a, m.shape[1])
    if nonzeros is None:
        return a @ m
    if nonzeros == 0:
        return a.new_zeros((a.shape[0], m.shape[1]))
    if nonzeros <= a.shape[0]:  # a row of M per entry, added into its row
        at = torch.nonzero(a)
        rows, cols = at[:, 0], at[:, 1]
        terms = m.index_select(0, cols).mul_(a[rows, cols][:, None])
        if rows.numel() == a.shape[0] and bool((rows == torch.arange(a.shape[0])).all()):
            return terms  # one entry in every row (a scaled permutation): the terms in order
        return a.new_zeros((a.shape[0], m.shape[1])).index_add_(0, rows, terms)
    out: Tensor = torch.sparse.mm(a.to_sparse(), m)
    return out


#: Which leading eigenvalues are deflated (:func:`_outliers`): the ``m`` before the largest
#: gap ``λ_m ≥ GAP_RATIO · λ_{m+1}`` among those at least ``LOOSE_RATIO`` times the mean
#: ``μ`` of the eigenvalues below them, up to ``MAX_DEFLATED`` (per-sample gradients of a
#: classifier of ``C`` classes: its ``C − 1`` directions, ``many_tasks.py --kinds
#: per_sample``: nine, the ninth 9.6 times the mean below it at K = 256 and 3.2 times the
#: next); where no gap is that large, up to ``FIRST_WIDTH`` of those at least
#: ``OUTLIER_RATIO`` times their ``μ``. A spectrum that falls without a gap (the top of a
#: heavy-tailed bulk: a transformer's per-sample cosine matrix has 18 eigenvalues 10–13
#: times the mean below them, each within 1.1 of the next) is not deflated further: each
#: one costs the free sets' setups a product and a Cholesky row, and deflating sixteen of
#: them took UPGrad there 0.31 → 0.64 s.
OUTLIER_RATIO = 10.0
LOOSE_RATIO = 5.0
GAP_RATIO = 2.0
#: At most this many eigenvalues are deflated (the width of the subspace iteration): the
#: classes of a classifier up to 17 (``O(K m)`` per problem and step, ``m`` products per
#: free set's setup).
MAX_DEFLATED = 16
#: From ``NARROW_FROM`` tasks on the subspace iteration's first width is ``FIRST_WIDTH`` (and
#: one), widened to ``MAX_DEFLATED`` (and one) only where all of those are outliers (one or a
#: few shared directions pay for four, not sixteen: about 20 ms at K = 1,024); below it the mean
#: of the eigenvalues past four may be an outlier's, not the bulk's, and the iteration is cheap:
#: ``MAX_DEFLATED`` at once.
FIRST_WIDTH = 4
NARROW_FROM = 128
#: Subspace-iteration steps for ``V`` (the error of ``vⱼ`` shrinks by ``λ_{w+1}/λⱼ`` each, ``w``
#: the width: below ``1/GAP_RATIO`` for a deflated one, far below for most).
POWER_STEPS = 6


@dataclass(frozen=True)
class Preconditioner:
    """``inverse`` ``[K, K]``: ``Q⁻¹``; ``h``: ``B⁻¹`` (``inverse`` itself when none is
    deflated), in the dtype of the preconditioning products; ``v`` ``[K, m]`` (orthonormal)
    and ``c`` ``[m]`` the deflated eigen-directions and their excesses (None: plain
    ``(Q⁻¹)_FF``)."""

    inverse: Tensor
    h: Tensor
    v: Tensor | None = None
    c: Tensor | None = None
    #: ``1/c`` of a single deflated direction (``m = 1``), as a number.
    inv_c1: float = 0.0
    #: ``λ₁(Q)`` from the power steps (0: not estimated).
    top: float = 0.0

    @classmethod
    def plain(cls, inverse: Tensor, top: float = 0.0) -> Preconditioner:
        """``(Q⁻¹)_FF``, nothing deflated (``top``: ``λ₁(Q)`` where estimated)."""
        return cls(inverse, inverse, top=top)

    def setup(self, f: Tensor) -> Tensor | None:
        """``W`` ``[B, m, K]`` of the free sets ``f`` (0/1, the solves' dtype; ``[B, K]`` for
        ``m = 1``), None without an outlier: ``m`` products and ``B`` Cholesky factors of
        ``m × m``."""
        if self.v is None:
            return None
        return self.finish(self.spread(f), f)

    def spread(self, f: Tensor) -> Tensor:
        """``V_Fᵀ h`` unmasked (``[B, m, K]``, ``[B, K]`` for ``m = 1``; the dtype of ``h``):
        the product :meth:`setup` needs, ``m`` rows of ``[B, K] × [K, K]``."""
        assert self.v is not None
        b, k = f.shape
        vf = self.v.T.to(self.h.dtype)[None] * f.to(self.h.dtype)[:, None, :]
        out = sparse_product(vf.reshape(-1, k), self.h)
        return out.reshape(b, k) if self.v.shape[1] == 1 else out.reshape(vf.shape)

    def finish(self, spread: Tensor, f: Tensor) -> Tensor:
        """:meth:`setup`'s ``W`` from :meth:`spread`'s product on the free sets ``f``."""
        assert self.v is not None and self.c is not None
        if spread.dim() == 2:  # Sherman–Morrison: a square root, no factorisation
            v1 = self.v[:, 0].to(f.dtype) * f
            hv1 = spread.to(f.dtype).mul_(f)
            return hv1.div_((self.inv_c1 + row_dot(v1, hv1)).clamp_min(1e-300).sqrt()[:, None])
        vf = self.v.T.to(f.dtype)[None] * f[:, None, :]  # [B, m, K]: V_Fᵀ
        hv = spread.to(f.dtype).mul_(f[:, None, :])
        s = torch.bmm(vf, hv.transpose(1, 2))  # V_FᵀĤV_F, [B, m, m]
        s.diagonal(dim1=1, dim2=2).add_((1.0 / self.c).to(f.dtype))
        return _forward_solve(_small_cholesky(s), hv)

    def apply(self, r: Tensor, f: Tensor, u: Tensor | None) -> Tensor:
        """``M⁻¹ r`` per row (``r`` zero off ``F``; ``u``, ``W``, from :meth:`setup`), the
        product ``r h`` in the dtype of ``h`` (float32 for float64 solves: half the cost;
        rounding there only bends the search directions, the residual stays exact)."""
        z = (r.to(self.h.dtype) @ self.h).mul(f)  # the mask converts back: one pass
        if u is not None and u.dim() == 2:
            z.addcmul_(u, row_dot(u, r)[:, None], value=-1.0)
        elif u is not None:
            coef = torch.bmm(u, r[:, :, None])  # W r, [B, m, 1]
            z.sub_(torch.bmm(coef.transpose(1, 2), u)[:, 0])
        return z


class SetupCache:
    """Each problem's last :meth:`Preconditioner.spread` and the free set it was made for:
    a new free set that moves few indices from it takes the product of the moved ones only
    (:func:`sparse_product`; the pivoting's later iterations move a handful), the others a
    fresh product. ``B`` problems, ``K`` indices."""

    def __init__(self, pre: Preconditioner, b: int, k: int) -> None:
        self.pre = pre
        self.f = torch.zeros(b, k, dtype=pre.h.dtype)
        self.spread: Tensor | None = None

    def setup(self, rows: Tensor, f: Tensor) -> Tensor | None:
        """:meth:`Preconditioner.setup` of the free sets ``f`` of the problems ``rows``."""
        pre = self.pre
        if pre.v is None:
            return None
        new = f.to(self.f.dtype)
        moved = new - self.f[rows]
        kept = self.spread
        nonzeros = None if kept is None else sparse_count(moved, pre.h.shape[1])
        if kept is None or nonzeros is None:
            spread = pre.spread(new)
        elif nonzeros == 0:
            spread = kept[rows]
        else:
            spread = kept[rows] + pre.spread(moved)
        if self.spread is None:
            self.spread = spread.new_zeros((self.f.shape[0], *spread.shape[1:]))
        self.spread[rows], self.f[rows] = spread, new
        return pre.finish(spread, f)


def _small_cholesky(s: Tensor) -> list[list[Tensor]]:
    """The lower Cholesky factor ``L`` of the ``[B, m, m]`` positive definite ``s`` (small
    ``m``), entry by entry as ``[B]`` tensors: ``m²/2`` elementwise operations for all ``B``
    (a batched LAPACK call per tiny block costs more)."""
    m = s.shape[1]
    low: list[list[Tensor]] = [[] for _ in range(m)]
    for j in range(m):
        for i in range(j, m):
            acc = s[:, i, j] - sum((low[i][t] * low[j][t] for t in range(j)),
                                   torch.zeros_like(s[:, i, j]))
            low[i].append(acc.clamp_min(1e-300).sqrt() if i == j else acc / low[j][j])
    return low


def _forward_solve(low: list[list[Tensor]], hv: Tensor) -> Tensor:
    """``L⁻¹ hv`` (``hv`` ``[B, m, K]``, ``L`` from :func:`_small_cholesky`) by forward
    substitution, row by row."""
    rows: list[Tensor] = []
    for i, li in enumerate(low):
        acc = hv[:, i].clone()
        for t in range(i):
            acc.addcmul_(li[t][:, None], rows[t], value=-1.0)
        rows.append(acc.div_(li[i][:, None]))
    return torch.stack(rows, dim=1)


def _top_one(q: Tensor) -> tuple[Tensor, Tensor]:
    """The leading eigenpair of ``q`` ``([λ], [K, 1])`` from ``POWER_STEPS`` power steps
    started at ``q``'s longest column (``λ`` its Rayleigh quotient)."""
    v = q[:, int(torch.linalg.vecdot(q, q, dim=0).argmax())]
    for _ in range(POWER_STEPS):
        v = q @ (v / torch.linalg.vector_norm(v))
    v = v / torch.linalg.vector_norm(v)
    return (v @ q @ v)[None], v[:, None]


def _room_for_more(q: Tensor, lam: float, trace: float, k: int) -> bool:
    """Whether a second eigenvalue may be an outlier: ``s = (‖Q‖²_F − λ₁²)^{1/2}`` bounds
    ``λ₂`` (``λ₁`` from below: its Rayleigh quotient), and ``λ₂ ≥ LOOSE_RATIO · μ₂`` needs
    ``s ≥ LOOSE_RATIO (tr Q − λ₁ − s)/(K − 2)``. A bulk of ``K − 1`` eigenvalues near their
    mean ``μ`` has ``s ≈ μ√(K − 1)``: no room below about 25 tasks, so the subspace
    iteration (:func:`_top_eigen`) runs only where it may find more."""
    if k < 3:
        return False
    s: float = max(float(torch.linalg.vector_norm(q)) ** 2 - lam * lam, 0.0) ** 0.5
    return s >= LOOSE_RATIO * (trace - lam - s) / (k - 2)


def _top_eigen(q: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """The ``width`` leading Ritz pairs of ``q`` ``(λ ↓, V)`` from ``POWER_STEPS`` steps of
    subspace iteration started at ``q``'s longest columns, then one Rayleigh–Ritz rotation."""
    cols = torch.linalg.vecdot(q, q, dim=0).topk(width).indices
    v = torch.linalg.qr(q[:, cols]).Q
    for _ in range(POWER_STEPS):
        v = torch.linalg.qr(thin_product(q, v)).Q
    lam, rot = torch.linalg.eigh(v.T @ thin_product(q, v))
    return lam.flip(0), (v @ rot).flip(1)


def _outliers(lam: list[float], trace: float, k: int) -> tuple[int, float]:
    """``(m, μ)``: how many of the leading eigenvalues ``lam`` (decreasing; one more than may
    be deflated, so that the last one's gap is known) are deflated, and ``μ``, the mean of
    the ``K − m`` others (``0``: none): the ``m ≤ MAX_DEFLATED`` before the largest gap
    ``λ_m ≥ GAP_RATIO · λ_{m+1}`` with ``λ_m ≥ LOOSE_RATIO · μ_m``, else the largest ``m ≤
    FIRST_WIDTH`` with ``λ_m ≥ OUTLIER_RATIO · μ_m``."""
    mus, head = [], 0.0
    for j, value in enumerate(lam[: k - 1]):
        head += value
        mus.append((trace - head) / (k - j - 1))
    usable = min(len(mus), MAX_DEFLATED)
    gaps = [(lam[j] / lam[j + 1], j + 1) for j in range(min(usable, len(lam) - 1))
            if lam[j + 1] > 0.0 and mus[j] > 0.0 and lam[j] >= LOOSE_RATIO * mus[j]
            and lam[j] >= GAP_RATIO * lam[j + 1]]
    if gaps:
        m = max(gaps)[1]
    else:
        m = max((j + 1 for j in range(min(usable, FIRST_WIDTH))
                 if mus[j] > 0.0 and lam[j] >= OUTLIER_RATIO * mus[j]), default=0)
    return m, (mus[m - 1] if m else 0.0)


#: A ``Q`` whose smallest eigenvalue is below ``SHIFT_BELOW`` times its mean eigenvalue
#: ``tr Q / K`` is preconditioned through ``(Q + δI)⁻¹``, ``δ = SHIFT · tr Q / K``, not
#: ``Q⁻¹`` (:func:`preconditioner_inverse`). On a free set ``F`` the exact ``(Q⁻¹)_FF`` is the
#: inverse of the Schur complement ``Q_FF − Q_FB Q_BB⁻¹ Q_BF``, not of ``Q_FF``: where ``Q``
#: has small eigenvalues the two blocks are nearly dependent and the preconditioned system
#: has eigenvalues ``1/(1 − σ²)`` for their canonical correlations ``σ → 1``. The shift
#: bounds what the small eigenvalues contribute. UPGrad's projections, one thread: rows
#: ``C B`` with ``C`` a random ``[K, K]`` mixing (condition number 1e5 at K = 256, 9e6 at
#: 512), 0.33 → 0.07 s and 7.5 → 0.4 s; a ``Q`` with smallest eigenvalue 0.02 of the mean
#: is as fast either way at shifts up to 0.01, slower at 0.1, hence the gate.
SHIFT_BELOW = 1e-3
SHIFT = 0.1


def shifted(q: Tensor, delta: float) -> Tensor:
    """``Q + δI`` (a new tensor)."""
    return q + torch.diag(q.new_full((q.shape[0],), delta))


def shifted_inverse(q: Tensor, delta: float = 0.0) -> Tensor | None:
    """``(Q + δI)⁻¹`` (``Q⁻¹`` for ``δ = 0``) from a Cholesky factorisation; None if it
    fails."""
    chol, info = cholesky_ex(shifted(q, delta) if delta else q)
    return torch.cholesky_inverse(chol) if int(info) == 0 else None


def preconditioner_inverse(q: Tensor, h: Tensor) -> Tensor:
    """The matrix the conjugate-gradient preconditioner of ``q`` is built from (``h = Q⁻¹``):
    ``h``, or ``(Q + δI)⁻¹`` (:data:`SHIFT`) where the power steps on ``h`` show ``λ_min(Q)``
    below ``SHIFT_BELOW · tr Q / K`` (their Rayleigh quotient bounds ``λ_max(Q⁻¹)`` from
    below, so ``λ_min`` is at most its estimate: never shifted on a mere rounding of it).
    ``O(K²)`` per power step; one more factorisation where shifted."""
    k = q.shape[0]
    mean = float(torch.trace(q)) / k
    if k < 2 or not mean > 0.0:
        return h
    top, _ = _top_one(h)
    if float(top[0]) * SHIFT_BELOW * mean <= 1.0:
        return h
    shifted = shifted_inverse(q, SHIFT * mean)
    return h if shifted is None else shifted


def deflated(q: Tensor, h: Tensor) -> Preconditioner:
    """The preconditioner of ``q`` (float64, ``h = Q⁻¹`` or ``(Q + δI)⁻¹``:
    :func:`preconditioner_inverse`), in float32: the leading ``m ≤
    MAX_DEFLATED`` eigenvalues deflated, those before the largest gap of the spectrum's top
    (:func:`_outliers`); the top one by power steps, the others by
    subspace iteration where there is room for them (:func:`_room_for_more`), of width
    ``FIRST_WIDTH`` and again of width ``MAX_DEFLATED`` where all of those are outliers
    (``MAX_DEFLATED`` at once below ``NARROW_FROM`` tasks)."""
    k = q.shape[0]
    h32 = h.float().contiguous()  # row-major: the sparse products read its rows
    if k < 2:
        return Preconditioner.plain(h32)
    trace = float(torch.trace(q))
    width = min(MAX_DEFLATED + 1, k - 1)  # one more than deflated: the last one's gap
    lam, v = _top_one(q)
    if _room_for_more(q, float(lam[0]), trace, k):
        lam, v = _top_eigen(q, width if k < NARROW_FROM else min(FIRST_WIDTH + 1, width))
    m, mu = _outliers(lam.tolist(), trace, k)
    if m >= FIRST_WIDTH and lam.shape[0] < width:  # all four: there may be more
        lam, v = _top_eigen(q, width)
        m, mu = _outliers(lam.tolist(), trace, k)
    top = float(lam[0])
    if m == 0:
        return Preconditioner.plain(h32, top)
    lam, v = lam[:m], v[:, :m]
    v32 = v.float()
    hb = torch.addmm(h32, v32 * (1.0 / mu - 1.0 / lam).float(), v32.T)  # in float32: its dtype
    c = (lam - mu).float()
    return Preconditioner(h32, hb, v32, c, 1.0 / float(c[0]) if m == 1 else 0.0, top)
