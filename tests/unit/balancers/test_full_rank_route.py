"""The dual-cone projections' certified full-rank route (``_boxqp.full_rank_inverse``).

Where the conjugate-gradient path would factorise ``Q`` anyway (two or more box problems,
``K ≥ CG_MIN_SIZE``) and the factorisation proves every eigenvalue at least
``FULL_RANK_MIN_EIGEN`` times their mean, the low-rank route and the parallel groups are not
tried and the inverse goes to the solve. Checked: the certificate against the eigenvalues
(``torch.linalg.eigvalsh``, an independent decomposition) on spectra with and without small
eigenvalues; that rank-deficient float32 Gramians and parallel rows never take it; and that
UPGrad's projections through it are scipy's (``nnls_dual_cone``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import _boxqp, _cone, _low_rank
from gradbalance.balancers._solvers import project_dual_cone, trace_normalized
from support.balancers import nnls_dual_cone
from support.many_kinds import assert_same_update

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")  # K ≤ 100: one thread is faster


def _spectrum_matrix(k: int, low: float, seed: int) -> Tensor:
    """``U diag(λ) Uᵀ``, ``λ`` log-uniform in ``[10**low, 1]``, scaled to trace ``k``."""
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=F64))
    lam = 10.0 ** (low * torch.rand(k, generator=gen, dtype=F64))
    q = (basis * lam) @ basis.T
    q = (q + q.T) / 2
    return q * (k / float(torch.trace(q)))


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 96), st.floats(-9.0, 0.0), st.integers(0, 2**16))
def test_the_certificate_holds_on_the_eigenvalues(k: int, low: float, seed: int) -> None:
    """Returned: ``Q⁻¹`` (``Q h = I``) and ``λ_min ≥ FULL_RANK_MIN_EIGEN · tr Q / K``;
    refused where ``λ_min`` is far below that (100×: the bound is Gershgorin's, within a
    factor ``K`` of ``λ_min``, so in between either may happen)."""
    q = _spectrum_matrix(k, low, seed)
    lam = torch.linalg.eigvalsh(q)
    mean = float(torch.trace(q)) / k
    h = _boxqp.full_rank_inverse(q)
    if h is not None:
        assert float(lam[0]) >= _boxqp.FULL_RANK_MIN_EIGEN * mean * (1 - 1e-9)
        torch.testing.assert_close(q @ h, torch.eye(k, dtype=F64), rtol=0, atol=1e-8)
    if float(lam[0]) < 1e-2 * _boxqp.FULL_RANK_MIN_EIGEN * mean:
        assert h is None
    if float(lam[0]) >= mean * 0.5 and k <= 8:
        assert h is not None  # a spectrum within 2× of its mean, few tasks: certified


def _float32_span_gram(k: int, r: int, seed: int) -> Tensor:
    """The trace-normalised float64 copy of a float32 Gramian of rows in a rank-``r`` span."""
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(k, r, generator=gen) @ torch.randn(r, 400, generator=gen)).float()
    return trace_normalized((g @ g.T).double())[0]


@settings(max_examples=20, deadline=None)
@given(st.integers(64, 128), st.integers(1, 40), st.integers(0, 2**16))
def test_low_rank_and_parallel_rows_are_refused(k: int, r: int, seed: int) -> None:
    """A float32 Gramian of rank ``r < K`` (its rounding in the other eigenvalues), and
    conflicting rows with two of them parallel, are not certified."""
    assert _boxqp.full_rank_inverse(_float32_span_gram(k, min(r, k // 2), seed)) is None
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(k, 1, generator=gen, dtype=F64) * torch.randn(3 * k, generator=gen,
                                                                   dtype=F64)
    g = g + 0.5 * torch.randn(k, 3 * k, generator=gen, dtype=F64)
    g[1] = -3.0 * g[0]
    assert _boxqp.full_rank_inverse(trace_normalized(g @ g.T)[0]) is None


def _calls(mp: pytest.MonkeyPatch) -> list[str]:
    """The routes :func:`~._cone._routed` tries, recorded."""
    seen: list[str] = []
    low_rank = _low_rank.low_rank_projection

    def spy(*args: object) -> object:
        seen.append("low_rank")
        return low_rank(*args)  # type: ignore[arg-type]

    mp.setattr(_cone, "low_rank_projection", spy)
    return seen


@settings(max_examples=8, deadline=None)
@given(st.integers(64, 96), st.integers(0, 2**16), st.sampled_from([1.0, 1e3]))
def test_conflicting_rows_take_the_route_with_scipys_projections(k: int, seed: int,
                                                                  spread: float) -> None:
    """Conflicting rows, ``P = 20K`` (norms equal, or spread over ``spread``): no low-rank
    test where the bound certifies, and every eighth UPGrad projection scipy's (cosine ≥
    0.999999, norm within 1e-6).
    With ``P = 3K`` the Gramian's smallest eigenvalues are about a fifth of the mean
    (Marchenko–Pastur) and Gershgorin's bound may leave them uncertified: the old routes."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(k, 1, generator=gen, dtype=F64) * torch.randn(20 * k, generator=gen,
                                                                   dtype=F64)
    g = g + 0.5 * torch.randn(k, 20 * k, generator=gen, dtype=F64)
    g = g * torch.logspace(0, torch.log10(torch.tensor(spread)).item(), k, dtype=F64)[:, None]
    gram, trace = trace_normalized(g @ g.T)
    u = torch.eye(k, dtype=F64) / k
    with pytest.MonkeyPatch.context() as mp:
        seen = _calls(mp)
        v = project_dual_cone(gram, u)
    # no low-rank test where the cosine matrix meets the documented bound (Gershgorin's
    # 1/‖C⁻¹‖_∞ at least FULL_RANK_MIN_EIGEN of the mean eigenvalue), computed here with its
    # own inverse; a draw may miss it (K = 64, seed 1, spread 1e3), then the routes are tried
    d = torch.diagonal(gram).sqrt()
    cosine = gram / torch.outer(d, d)
    bound = 1.0 / float(torch.linalg.inv(cosine).abs().sum(dim=1).max())
    assert not seen or bound < _boxqp.FULL_RANK_MIN_EIGEN * float(cosine.trace()) / k
    unit = g / trace.sqrt()
    for i in range(0, k, max(1, k // 8)):
        assert_same_update(v[i] @ g, nnls_dual_cone(unit, u[i]) * trace.sqrt(), g)


@settings(max_examples=6, deadline=None)
@given(st.integers(64, 96), st.integers(2, 12), st.integers(0, 2**16))
def test_span_rows_still_take_the_low_rank_route(k: int, r: int, seed: int) -> None:
    """Rows in a rank-``r`` span (float32 products): the low-rank route is tried."""
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(k, r, generator=gen) @ torch.randn(r, 300, generator=gen)).float()
    gram = trace_normalized((g @ g.T).double())[0]
    with pytest.MonkeyPatch.context() as mp:
        seen = _calls(mp)
        project_dual_cone(gram, torch.eye(k, dtype=F64) / k)
    assert seen == ["low_rank"]
