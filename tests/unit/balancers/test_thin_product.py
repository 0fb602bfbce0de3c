"""``thin_product`` (``_thin_product``) against numpy's product, and UPGrad's projections of
per-sample rows (class directions deflated: the transposed products on their path) against
the optimality conditions of each projection."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradbalance.balancers import _mixed, _projected
from gradbalance.balancers._solvers import project_dual_cone, trace_normalized
from gradbalance.balancers._thin_product import THIN_COLUMNS, thin_product
from support.balancers import classifier_rows

pytestmark = pytest.mark.usefixtures("one_thread")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 300), st.integers(1, 20),
       st.sampled_from([torch.float32, torch.float64]), st.booleans(), st.integers(0, 2**16))
def test_matches_numpy_product(rows: int, inner: int, cols: int, dtype: torch.dtype,
                               transposed_a: bool, seed: int) -> None:
    """Every shape and layout of ``a`` (row-major or a transposed view): numpy's float64
    product, to the product's rounding (``√K·eps`` of ``|a||b|`` entry by entry)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, inner, generator=gen, dtype=dtype)
    if transposed_a:
        a = torch.randn(inner, rows, generator=gen, dtype=dtype).T
    b = torch.randn(inner, cols, generator=gen, dtype=dtype)
    got = thin_product(a, b)
    expected = a.double().numpy() @ b.double().numpy()
    scale = np.abs(a.double().numpy()) @ np.abs(b.double().numpy())
    eps = torch.finfo(dtype).eps
    assert got.shape == (rows, cols) and got.dtype == dtype
    assert np.all(np.abs(got.double().numpy() - expected) <= 4 * inner**0.5 * eps * scale)


def test_transposed_for_few_columns_only() -> None:
    """The transposed layout (a view of a column-major result) for 2 … 15 columns, the plain
    row-major product for one column and from 16 on."""
    a = torch.randn(8, 32)
    for cols in range(1, 20):
        out = thin_product(a, torch.randn(32, cols))
        assert out.is_contiguous() == (cols not in THIN_COLUMNS), cols


def test_per_sample_projections_optimal(monkeypatch: pytest.MonkeyPatch) -> None:
    """UPGrad's projections of per-sample rows of a 6-class linear head at K = 112 (five
    class directions deflated: :mod:`._projected`'s prox and :mod:`._mixed`'s preconditioner
    take the transposed products, counted): each ``v ≥ eᵢ``, its multipliers ``Gv``
    non-negative and zero where ``v`` is above its bound, to 1e-8 of ``‖v‖_G`` per row."""
    seen: dict[str, int] = {}

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if b.shape[1] in THIN_COLUMNS:
            name = sys._getframe(1).f_code.co_name
            seen[name] = seen.get(name, 0) + 1
        return thin_product(a, b)

    for module in (_projected, _mixed):
        monkeypatch.setattr(module, "thin_product", spy)
    k = 112
    rows = classifier_rows(k, 6, 80, 3)
    gram, _ = trace_normalized(rows @ rows.T)
    u = torch.eye(k, dtype=torch.float64)
    v = project_dual_cone(gram, u)
    assert {"_step", "_prox_many", "apply"} <= set(seen)
    mult = v @ gram
    size = torch.einsum("bk,bk->b", v, mult).clamp_min(0).sqrt()[:, None]
    diag = gram.diagonal().sqrt()[None, :]
    assert bool((v >= u).all())
    assert bool((mult >= -1e-8 * size * diag).all())
    above = v > u + 1e-9
    assert bool((mult.abs() <= 1e-8 * size * diag)[above].all())
