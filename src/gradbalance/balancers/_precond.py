"""The preconditioner of the free-set conjugate-gradient solves: ``(Q⁻¹)_FF``, with ``Q``'s
one outlying eigenvalue deflated.

Not a balancer module (no ``__all__``). :mod:`._pcg` solves ``Q_FF y_F = rhs_F`` with
``(Q⁻¹)_FF`` as the preconditioner, very good where ``Q``'s spectrum is one narrow bulk
(random rows: about 4 steps to ``1e-6``). Rows sharing a direction (conflicting tasks) give
``Q`` one eigenvalue ``λ`` far above the bulk, which the restriction to ``F`` spreads over the
preconditioned spectrum (7 steps). Here ``Q = B + c vvᵀ`` (``v`` the top unit eigenvector,
``μ = (tr Q − λ)/(K − 1)`` the mean of the other eigenvalues, ``c = λ − μ``), ``B``'s inverse
``B⁻¹ = Q⁻¹ + (1/μ − 1/λ) vvᵀ`` restricted to ``F`` stands for ``B_FF⁻¹``, and the outlier is
put back exactly by Sherman–Morrison::

    M⁻¹ = Ĥ − Ĥv_F (1/c + v_FᵀĤv_F)⁻¹ v_FᵀĤ,    Ĥ = (B⁻¹)_FF,

the inverse of ``Ĥ⁻¹ + c v_F v_Fᵀ`` (5 steps; Sherman & Morrison 1950). ``u = Ĥv_F / √(1/c +
v_FᵀĤv_F)`` is one product per free set, then ``M⁻¹r = Ĥr − u (uᵀr)``: the cost of a step
unchanged. For any unit ``v`` and ``λ > μ`` both ``B⁻¹`` and ``M`` are symmetric positive
definite, so an inexact ``v`` only slows the solves; ``v`` comes from a few power steps.

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

_dot = torch.linalg.vecdot

#: ``λ`` is deflated only where it is at least this many times ``μ`` (else the bulk is one).
OUTLIER_RATIO = 10.0
#: Power steps for ``v`` (their error shrinks by ``λ₂/λ`` each: below ``1/OUTLIER_RATIO``).
POWER_STEPS = 6


@dataclass(frozen=True)
class Preconditioner:
    """``inverse`` ``[K, K]``: ``Q⁻¹``; ``h``: ``B⁻¹`` (``inverse`` itself when none is
    deflated), in the dtype of the preconditioning products; ``v`` ``[K]`` (unit) and ``c``
    the deflated eigen-direction and its excess (None, 0: plain ``(Q⁻¹)_FF``)."""

    inverse: Tensor
    h: Tensor
    v: Tensor | None = None
    c: float = 0.0

    @classmethod
    def plain(cls, inverse: Tensor) -> Preconditioner:
        """``(Q⁻¹)_FF``, nothing deflated."""
        return cls(inverse, inverse)

    def product(self, r: Tensor) -> Tensor:
        """``r h`` in the dtype of ``h`` (float32 for float64 solves: half the cost of the
        product; rounding there only bends the search directions, the residual stays exact)."""
        return r @ self.h if r.dtype == self.h.dtype else (r.to(self.h.dtype) @ self.h).to(r.dtype)

    def setup(self, f: Tensor) -> Tensor | None:
        """``u`` ``[B, K]`` of the free sets ``f`` (0/1, the solves' dtype), None without
        an outlier: one product."""
        if self.v is None:
            return None
        vf = self.v.to(f.dtype) * f
        hv = self.product(vf).mul_(f)
        return hv.div_((1.0 / self.c + _dot(vf, hv)).clamp_min(1e-300).sqrt()[:, None])

    def apply(self, r: Tensor, f: Tensor, u: Tensor | None) -> Tensor:
        """``M⁻¹ r`` per row (``r`` zero off ``F``; ``u`` from :meth:`setup`)."""
        z = self.product(r).mul_(f)
        if u is not None:
            z.addcmul_(u, _dot(u, r)[:, None], value=-1.0)
        return z


def deflated(q: Tensor, h: Tensor) -> Preconditioner:
    """The preconditioner of ``q`` (float64, ``h = Q⁻¹``), in float32: deflated where the top
    eigenvalue (from ``POWER_STEPS`` power steps, started at ``q``'s longest column) is at
    least ``OUTLIER_RATIO`` times the mean of the others."""
    k = q.shape[0]
    v = q[:, int(_dot(q, q, dim=0).argmax())]
    for _ in range(POWER_STEPS):
        v = q @ (v / torch.linalg.vector_norm(v))
    v = v / torch.linalg.vector_norm(v)
    lam = float(v @ q @ v)
    mu = (float(torch.trace(q)) - lam) / max(k - 1, 1)
    h32 = h.float()
    if not (mu > 0.0 and lam >= OUTLIER_RATIO * mu):
        return Preconditioner.plain(h32)
    hb = h + (1.0 / mu - 1.0 / lam) * torch.outer(v, v)
    return Preconditioner(h32, hb.float(), v.float(), lam - mu)
