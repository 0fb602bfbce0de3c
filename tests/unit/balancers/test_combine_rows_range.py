"""``combine_rows`` with weights outside the matrix dtype's range: the float64 path.

Expected values are closed forms (``wⱼ`` times a row with one non-zero entry) or properties
that do not come from the code under test: the same balancer on the float64 copy of the rows
(weights and rows both float64: the plain product), and the dual cone's defining
inequalities ``gⱼ·d ≥ 0`` for UPGrad and DualProj.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from gradbalance.balancers import BALANCERS, _base
from gradbalance.functional import combine_rows

F64 = torch.float64


def _wide_rows(k: int, seed: int = 0) -> torch.Tensor:
    """``[K, 300]`` float32 rows whose norms span ``1e-30 … 1e19``."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(k, 300, generator=gen, dtype=F64) / math.sqrt(300)
    return (rows * torch.logspace(-30, 19, k, dtype=F64)[:, None]).float()


def test_a_weight_above_float32s_range_times_a_tiny_row() -> None:
    rows = torch.tensor([[1e-30, 0.0], [0.0, 1.0]])
    out = combine_rows(torch.tensor([1e45, 2.0], dtype=F64), rows)
    assert out.dtype == torch.float32
    expected = torch.tensor([1e45 * float(rows[0, 0]), 2.0], dtype=F64)  # the row as stored
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=0.0)


def test_a_weight_below_float32s_normal_range_times_a_long_row() -> None:
    rows = torch.tensor([[1e30, 0.0], [0.0, 1.0]])
    out = combine_rows(torch.tensor([1e-40, 1.0], dtype=F64), rows)
    expected = torch.tensor([1e-40 * float(rows[0, 0]), 1.0], dtype=F64)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=0.0)


def test_ordinary_weights_keep_the_plain_product_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(6, 40, generator=gen)
    w = torch.rand(6, generator=gen, dtype=F64)
    assert torch.equal(combine_rows(w, rows), w.float() @ rows)


def test_integer_weights_keep_the_plain_product() -> None:
    rows = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert torch.equal(combine_rows(torch.tensor([1, 3]), rows), torch.tensor([10.0, 14.0]))


@pytest.mark.parametrize("small", [64, 0])  # the range read in Python, or by tensor reductions
def test_the_wide_path_in_blocks_of_columns(monkeypatch: pytest.MonkeyPatch, small: int) -> None:
    monkeypatch.setattr(_base, "WIDE_BLOCK_ENTRIES", 8)  # 2 columns per block of 3 rows
    monkeypatch.setattr(_base, "SMALL_WEIGHTS", small)
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(3, 11, generator=gen)
    w = torch.tensor([1e40, -3.0, 0.5], dtype=F64)
    expected = (w @ rows.double()).float()
    torch.testing.assert_close(combine_rows(w, rows), expected, rtol=1e-6, atol=0.0)


def test_half_precision_rows_with_weights_above_its_range() -> None:
    rows = torch.tensor([[1e-4, 0.0], [0.0, 1.0]], dtype=torch.float16)
    out = combine_rows(torch.tensor([1e6, 1.0], dtype=F64), rows)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), torch.tensor([1e6 * float(rows[0, 0]), 1.0],
                                                          dtype=F64), rtol=1e-3, atol=0.0)


WEIGHTED = sorted(name for name, cls in BALANCERS.items()
                  if cls.from_gramian and name not in {"random"})


@pytest.mark.parametrize("name", WEIGHTED)
@pytest.mark.parametrize("k", [8, 32])
def test_every_weighted_balancer_is_finite_on_norms_spanning_1e_minus_30_to_1e19(
        name: str, k: int) -> None:
    rows = _wide_rows(k, seed=k)
    losses = torch.linspace(0.5, 1.5, k)
    cls = BALANCERS[name]
    balancer = cls(torch.full((k,), 1.0 / k)) if name == "constant" else cls()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FairGrad / Nash-MTL: no exact solution on such rows
        out = balancer.combine(rows, losses if balancer.needs_losses else None)
    assert torch.isfinite(out.vector).all()


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
@pytest.mark.parametrize("k", [8, 32])
def test_dual_cone_updates_on_norms_spanning_1e_minus_30_to_1e19(name: str, k: int) -> None:
    rows = _wide_rows(k, seed=k)
    out = BALANCERS[name]().combine(rows).vector.double()
    weights = BALANCERS[name]().combine(rows).weights
    assert weights is not None and float(weights.max()) > 3.4e38
    reference = BALANCERS[name]().combine(rows.double()).vector  # float64 rows: plain product
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=0.0)
    dots = rows.double() @ out  # the dual cone: no task's gradient is opposed
    norms = rows.double().norm(dim=1)
    assert bool((dots >= -1e-5 * norms * out.norm()).all())


@pytest.mark.parametrize("small", [64, 0])  # the bound read in Python, or by tensor reductions
def test_terms_past_the_range_that_cancel_take_the_float64_product(
        monkeypatch: pytest.MonkeyPatch, small: int) -> None:
    # w = (1e10, −1e10) on rows (1e30, 1) and (1e30, 0): each term's first entry is 1e40
    # (past float32's 3.4e38) and they cancel exactly: w·G = (0, 1e10), a closed form.
    monkeypatch.setattr(_base, "SMALL_WEIGHTS", small)
    rows = torch.tensor([[1e30, 1.0], [1e30, 0.0]])
    w = torch.tensor([1e10, -1e10], dtype=F64)
    norms = rows.double().norm(dim=1)
    out = combine_rows(w, rows, norms)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.tensor([0.0, 1e10]))


def test_an_update_past_the_range_is_inf_not_nan() -> None:
    # MGDA's "loss" normalisation divides rows of norm ~1e30 by losses 1e-30: weights ~1e29,
    # an update ~1e59 per entry, past float32. Each entry must be the float64 product rounded
    # to float32 (±inf where past the range), not inf − inf.
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(3, 10, generator=gen) * 1e30
    out = BALANCERS["mgda"](normalization="loss").combine(rows, torch.full((3,), 1e-30))
    assert out.weights is not None
    expected = (out.weights @ rows.double()).float()  # float64 product of the same weights
    assert not bool(out.vector.isnan().any())
    assert torch.equal(out.vector, expected)


def test_norms_within_the_range_keep_the_plain_product_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(6, 40, generator=gen)
    w = torch.rand(6, generator=gen, dtype=F64)
    assert torch.equal(combine_rows(w, rows, rows.double().norm(dim=1)), w.float() @ rows)
