"""MGDA's min-norm point on rows of widely spread norms and in planted spans: against scipy's
NNLS of the least-distance program over the unit rows, and MGDA's optimality conditions on
the rows and on a float32 Gramian, with tolerances from the problem (the cosine matrix's
rounding and the factor's cut, docs/balancers.md "Solvers")."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers._low_rank import ROUNDING_MULTIPLE
from gradbalance.balancers._solvers import min_norm_simplex, trace_normalized
from gradbalance.gramian import compute_gramian

F64 = torch.float64
KINDS = ["wide", "span", "wide_span"]
#: (K from 3 to 64, kind, rank of a span from 1 to K + 3, seed).
CASES = st.tuples(st.integers(3, 64), st.sampled_from(KINDS), st.integers(1, 67),
                  st.integers(0, 2**16))


pytestmark = pytest.mark.usefixtures("one_thread")  # K ≤ 100: one thread is faster


def _rows(kind: str, k: int, rank: int, seed: int) -> Tensor:
    """``[K, 2K + 3]`` float64: conflicting rows (``aᵢ s + nᵢ/2``) scaled by a shuffled
    ``logspace(-6, 6, K)`` (``wide``), rows in a random span of ``rank`` (``span``), or
    those scaled the same way (``wide_span``)."""
    gen = torch.Generator().manual_seed(seed)
    p = 2 * k + 3
    if kind == "wide":
        shared = torch.randn(p, generator=gen, dtype=F64)
        g = (torch.randn(k, 1, generator=gen, dtype=F64) * shared
             + 0.5 * torch.randn(k, p, generator=gen, dtype=F64))
    else:
        r = min(rank, k + 3)
        g = (torch.randn(k, r, generator=gen, dtype=F64)
             @ torch.randn(r, p, generator=gen, dtype=F64))
    if kind != "span":
        scales = torch.logspace(-6, 6, k, dtype=F64)[torch.randperm(k, generator=gen)]
        g = g * scales[:, None]
    return g


def _scipy_min_norm(g: Tensor) -> Tensor:
    """The min-norm point of the hull of the rows by scipy's NNLS (Lawson & Hanson 1974,
    Ch. 23) of ``min ‖z‖`` s.t. ``ĝᵢᵀz ≥ min‖g‖/‖gᵢ‖`` over the unit rows ``ĝᵢ``: ``x* =
    z/‖z‖²`` in the units of ``gᵢᵀz ≥ 1``; zero where the program is infeasible (``0`` in the
    hull: the residual vanishes)."""
    from scipy.optimize import nnls

    d = g.norm(dim=1)
    e = torch.cat([(g / d[:, None]).T, (d.min() / d)[None]]).numpy()
    f = np.zeros(e.shape[0])
    f[-1] = 1.0
    u, _ = nnls(e, f, maxiter=100 * e.shape[1])
    rho = e @ u - f
    if float(np.linalg.norm(rho)) < 1e-8:
        return torch.zeros(g.shape[1], dtype=F64)
    z = torch.from_numpy(-rho[:-1] / rho[-1]) / float(d.min())
    return z / (z @ z)


@settings(max_examples=60, deadline=None)
@given(CASES)
def test_min_norm_point_is_scipys_and_meets_kkt(case: tuple[int, str, int, int]) -> None:
    """float64 rows: the update is scipy's min-norm point (cosine ≥ 0.999999, norm within
    1e-6; or both below ``1e-6 min‖gᵢ‖`` where ``0`` is in the hull), and
    ``gᵢᵀx ≥ ‖x‖² − 1e-9 ‖gᵢ‖‖x‖`` with equality on the support (scale-free per row)."""
    k, kind, rank, seed = case
    g = _rows(kind, k, rank, seed)
    w = min_norm_simplex(trace_normalized(g @ g.T)[0])
    assert float(w.min()) >= 0.0 and abs(float(w.sum()) - 1.0) <= 1e-12
    x, ref = w @ g, _scipy_min_norm(g)
    d = g.norm(dim=1)
    nx, nr = float(x.norm()), float(ref.norm())
    if nr == 0.0:
        assert nx <= 1e-6 * float(d.min())
        return
    assert float(x @ ref) / (nx * nr) >= 0.999999
    assert abs(nx - nr) <= 1e-6 * nr
    gap = (g @ x - nx * nx) / (d * nx)
    assert float(gap.min()) >= -1e-9
    assert float(gap[w > 0].abs().max()) <= 1e-9


@settings(max_examples=40, deadline=None)
@given(CASES)
def test_float32_rows_meet_kkt_within_the_rounding(case: tuple[int, str, int, int]) -> None:
    """float32 rows (K = 64 one case in two: the factor is cut at the rounding from 64 tasks
    on): with ``u = Dw`` (``D = diag(G)^{1/2}``) and the cosine matrix ``C`` of the Gramian,
    the solved ``C'`` is within ``δ = (1 + ROUNDING_MULTIPLE)|λ_min(C)| + 4 eps K λ_max(C)``
    of ``C``, so ``(Gw)ᵢ − wᵀGw = dᵢ(Cu)ᵢ − uᵀCu`` is at least ``−δ(dᵢ‖u‖ + ‖u‖²)``, and
    within that of 0 on the support (plus ``1e-9 dᵢ‖x‖``: the solver's tolerance)."""
    k, kind, rank, seed = case
    k = 64 if seed % 2 else k
    rows = _rows(kind, k, rank, seed).to(torch.float32)
    gram = compute_gramian(rows).to(F64)
    gram = 0.5 * (gram + gram.T)  # the solvers' Gramian: its symmetric part
    w = min_norm_simplex(trace_normalized(gram)[0])
    assert float(w.min()) >= 0.0 and abs(float(w.sum()) - 1.0) <= 1e-12
    d = torch.diagonal(gram).sqrt()
    lam = torch.linalg.eigvalsh(gram / torch.outer(d, d))
    delta = ((1 + ROUNDING_MULTIPLE) * max(-float(lam[0]), 0.0)
             + 4 * torch.finfo(F64).eps * k * float(lam[-1]))
    u = d * w
    value = float(w @ gram @ w)
    unorm = float(u.norm())
    bound = 2 * delta * (d * unorm + unorm**2) + 1e-9 * d * max(value, 0.0) ** 0.5
    gap = gram @ w - value
    assert bool((gap >= -bound).all())
    assert bool((gap.abs() <= bound)[w > 0].all())
