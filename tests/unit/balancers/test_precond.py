"""The conjugate-gradient preconditioner with ``Q``'s outlying eigenvalues deflated.

``apply`` (Woodbury on each free set) against the explicit matrix it stands for,
``(Ĥ_FF)⁻¹ + V_F C V_Fᵀ`` built and solved densely in float64, on rows sharing one to three
directions; on ``Q = μI + Σⱼ cⱼvⱼvⱼᵀ`` (where the deflated ``B`` is ``μI``) against ``Q_FF⁻¹``
itself, with every planted outlier found; no deflation without an outlier.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import _precond
from gradbalance.balancers._precond import (
    MAX_DEFLATED,
    SetupCache,
    deflated,
    sparse_count,
    sparse_product,
)
from gradbalance.balancers._solvers import trace_normalized

F64 = torch.float64


def _masks(k: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random free sets ``[k, k]`` (each with at least one index) and residuals zero off them."""
    free = torch.rand(k, k, generator=gen) < 0.5
    free[:, 0] = True
    return free, torch.randn(k, k, generator=gen, dtype=F64) * free


def shared_rows(k: int, directions: int, gen: torch.Generator) -> Tensor:
    """``[k, 4k]`` rows ``Σⱼ wⱼ aᵢⱼ sⱼ + nᵢ/2`` (``w = 1, 0.7, 0.4``): one outlying eigenvalue
    of the Gramian per shared direction ``sⱼ``."""
    weights = torch.tensor([1.0, 0.7, 0.4], dtype=F64)[:directions]
    a = torch.randn(k, directions, generator=gen, dtype=F64) * weights
    s = torch.randn(directions, 4 * k, generator=gen, dtype=F64)
    return a @ s + 0.5 * torch.randn(k, 4 * k, generator=gen, dtype=F64)


@settings(max_examples=10, deadline=None)
@given(st.integers(8, 32), st.integers(1, 3), st.integers(0, 2**16))
def test_apply_is_the_inverse_of_the_deflated_matrix(k: int, directions: int,
                                                     seed: int) -> None:
    """Rows sharing 1–3 directions: ``M⁻¹ r`` from ``W`` equals the dense solve with ``M_F =
    (Ĥ_FF)⁻¹ + V_F C V_Fᵀ``, symmetric positive definite; ``V`` orthonormal, ``C > 0``."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = trace_normalized((rows := shared_rows(k, directions, gen)) @ rows.T)
    pre = deflated(q, torch.linalg.inv(q))
    assert pre.v is not None and pre.c is not None and bool((pre.c > 0).all())
    v, c, h = pre.v.to(F64), pre.c.to(F64), pre.h.to(F64)
    assert torch.allclose(v.T @ v, torch.eye(v.shape[1], dtype=F64), atol=1e-5)
    free, r = _masks(k, gen)
    f = free.to(F64)
    z = pre.apply(r, f, pre.setup(f))
    for i in range(k):
        sel = free[i]
        m = torch.linalg.inv(h[sel][:, sel]) + (v[sel] * c) @ v[sel].T
        expected = torch.linalg.solve(m, r[i, sel])
        assert bool((z[i, ~sel] == 0).all())
        err = torch.linalg.vector_norm(z[i, sel] - expected)
        assert float(err) <= 1e-4 * float(torch.linalg.vector_norm(expected))
        assert float(z[i] @ r[i]) > 0


@settings(max_examples=12, deadline=None)
@given(st.integers(1, MAX_DEFLATED), st.integers(0, 36), st.integers(0, 2**16))
def test_exact_on_a_bulk_of_one_eigenvalue(m: int, extra: int, seed: int) -> None:
    """``Q = I + Σⱼ cⱼvⱼvⱼᵀ`` (``cⱼ = 60, 57, …``, ``v`` orthonormal): all ``m`` outliers are
    deflated and the preconditioner is ``Q_FF⁻¹`` exactly (up to its float32 products),
    whatever the free set."""
    k = m + 3 + extra
    gen = torch.Generator().manual_seed(seed)
    v = torch.linalg.qr(torch.randn(k, m, generator=gen, dtype=F64)).Q
    c = 60.0 - 3.0 * torch.arange(m, dtype=F64)
    q = torch.eye(k, dtype=F64) + (v * c) @ v.T
    pre = deflated(q, torch.linalg.inv(q))
    assert pre.v is not None and pre.v.shape == (k, m)
    free, r = _masks(k, gen)
    z = pre.apply(r, free.to(F64), pre.setup(free.to(F64)))
    for i in range(k):
        sel = free[i]
        expected = torch.linalg.solve(q[sel][:, sel], r[i, sel])
        err = torch.linalg.vector_norm(z[i, sel] - expected)
        assert float(err) <= 1e-5 * float(torch.linalg.vector_norm(expected))


def test_no_deflation_without_an_outlier() -> None:
    """Random rows (one Marchenko–Pastur bulk): plain ``(Q⁻¹)_FF``, ``h`` is ``Q⁻¹``."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 1000, generator=gen, dtype=F64)
    q, _ = trace_normalized(rows @ rows.T)
    pre = deflated(q, torch.linalg.inv(q))
    assert pre.v is None and pre.h is pre.inverse


@settings(max_examples=10, deadline=None)
@given(st.integers(20, 48), st.integers(1, 3), st.integers(0, 2**16))
def test_setup_cache_after_moves_equals_a_fresh_setup(k: int, directions: int,
                                                      seed: int) -> None:
    """A :class:`SetupCache` taken through free sets that move few indices (the product of
    the moved ones only) and many (a fresh product): each ``W`` equals the preconditioner's
    own setup of the same free sets, to float32 rounding, and so does ``M⁻¹r``. The sparse
    products are allowed at these sizes (``SPARSE_MIN_COLUMNS`` lowered)."""
    monkey = pytest.MonkeyPatch()
    monkey.setattr(_precond, "SPARSE_MIN_COLUMNS", 1)
    try:
        _cache_through_moves(k, directions, seed)
    finally:
        monkey.undo()


def _cache_through_moves(k: int, directions: int, seed: int) -> None:
    """The body of :func:`test_setup_cache_after_moves_equals_a_fresh_setup`."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = trace_normalized((rows := shared_rows(k, directions, gen)) @ rows.T)
    pre = deflated(q, torch.linalg.inv(q))
    cache = SetupCache(pre, k, k)
    free, _ = _masks(k, gen)
    for moves in (k, 1, 2, k // 2, 1):
        rows_ = torch.randperm(k, generator=gen)[: max(2, k // 2)]
        flip = torch.zeros(len(rows_), k, dtype=torch.bool)
        flip.scatter_(1, torch.rand(len(rows_), k, generator=gen).argsort(dim=1)[:, :moves], True)
        free[rows_] ^= flip
        free[:, 0] = True
        f = free[rows_].to(F64)
        got, expected = cache.setup(rows_, f), pre.setup(f)
        assert got is not None and expected is not None
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
        r = torch.randn(len(rows_), k, generator=gen, dtype=F64) * f
        z, z0 = pre.apply(r, f, got), pre.apply(r, f, expected)
        assert torch.allclose(z, z0, rtol=1e-4, atol=1e-5 * float(z0.abs().max()))


@pytest.mark.parametrize(("k", "per_row"), [(512, 0), (512, 1), (512, 3), (512, 400),
                                             (256, 1), (256, 3), (32, 1)])
def test_sparse_product_is_the_product(k: int, per_row: int) -> None:
    """``a M`` through the sparse copy (few non-zero entries: under 1/16 with ``M`` wide, at
    most one per row with ``M`` narrow), the gather of single entries or the dense product,
    contiguous or not; a row with a single non-zero entry bit for bit; :func:`sparse_count`
    says which."""
    gen = torch.Generator().manual_seed(per_row)
    m = torch.randn(k, k, generator=gen, dtype=F64)
    a = torch.zeros(50, k, dtype=F64)
    a.scatter_(1, torch.rand(50, k, generator=gen).argsort(dim=1)[:, :per_row],
               torch.randn(50, per_row, generator=gen, dtype=F64))
    expected = per_row < k / 16 if k >= 512 else (k >= 64 and per_row <= 1)
    assert (sparse_count(a, k) is not None) == expected
    if expected:
        assert sparse_count(a, k) == 50 * per_row
    for right in (m, m.T):
        got = sparse_product(a, right)
        assert got.shape == (50, k) and got.layout == torch.strided
        assert torch.allclose(got, a @ right, atol=1e-12)
        if per_row <= 1:
            assert torch.equal(got, a @ right)


@pytest.mark.parametrize("seed", range(6))
def test_single_entry_rows_need_every_row_single(seed: int) -> None:
    """At most as many entries as rows, spread over rows of zero, one and two entries: the
    gathered rows of ``M`` added into place give the product, single-entry rows bit for
    bit (their other terms are zeros)."""
    gen = torch.Generator().manual_seed(seed)
    k, b = 96, 40
    m = torch.randn(k, k, generator=gen, dtype=F64)
    per_row = torch.randint(0, 2, (b,), generator=gen)
    per_row[0], per_row[1] = 0, 2  # one empty and one double row: at most b entries
    a = torch.zeros(b, k, dtype=F64)
    for i, n in enumerate(per_row.tolist()):
        cols = torch.randperm(k, generator=gen)[:n]
        a[i, cols] = torch.randn(n, generator=gen, dtype=F64)
    nonzeros = int(per_row.sum())
    assert nonzeros <= b
    got = sparse_product(a, m, nonzeros)
    assert torch.allclose(got, a @ m, atol=1e-12)
    single = per_row <= 1
    assert torch.equal(got[single], (a @ m)[single])
    only_single = a * single[:, None]
    got_single = sparse_product(only_single, m, int(per_row[single].sum()))
    assert torch.equal(got_single, only_single @ m)
    zero = torch.zeros(b, k, dtype=F64)
    assert torch.equal(sparse_product(zero, m, 0), zero)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), seed=st.integers(0, 2**16),
       broadcast=st.booleans())
def test_either_is_where_on_boolean_masks(rows: int, cols: int, seed: int,
                                          broadcast: bool) -> None:
    """``either(mask, a, b)`` is ``torch.where(mask, a, b)`` on boolean tensors, with the mask
    broadcast over a row (``[B, 1]``) or element-wise."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, 1 if broadcast else cols, generator=gen) < 0.5
    a = torch.rand(rows, cols, generator=gen) < 0.5
    b = torch.rand(rows, cols, generator=gen) < 0.5
    assert torch.equal(_precond.either(mask, a, b), torch.where(mask, a, b))
