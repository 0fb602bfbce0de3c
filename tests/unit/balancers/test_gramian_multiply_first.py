"""``compute_gramian`` multiplies first on the CPU and scales only when the unscaled product's
diagonal shows an overflow or an underflow risk: rows of mixed scales (1e-30 … 3e19), zero
rows and rows whose squares all underflow, against the float64 product of the same rows
(every float32 product is exact in float64). Tolerance: ``1e-6 √(dᵢ dⱼ)`` per entry (float32
rounding; ``dₖ = ‖gₖ‖²``)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradbalance import gramian as symmetric
from gradbalance.gramian import compute_gramian

F64 = torch.float64


def check_exact(g: torch.Tensor, block: int) -> None:
    g64 = g.to(F64)
    expected = g64 @ g64.T
    got = compute_gramian(g, block=block)
    norms = torch.diagonal(expected).sqrt()
    bound = 1e-6 * norms[:, None] * norms[None, :]
    assert bool(torch.isfinite(got).all())
    assert bool(((got - expected).abs() <= bound).all()), (got, expected)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(k=st.integers(1, 12), p=st.integers(1, 200), seed=st.integers(0, 10_000),
       exponents=st.lists(st.sampled_from([-30.0, -25.0, -20.0, -1.0, 0.0, 3.0, 17.0, 19.4]),
                          min_size=12, max_size=12),
       zero_row=st.booleans(), block=st.sampled_from([5, 64, 1 << 20]))
def test_mixed_row_scales_exact(k: int, p: int, seed: int, exponents: list[float],
                                zero_row: bool, block: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.tensor(exponents[:k], dtype=F64)
    g64 = torch.randn(k, p, generator=gen, dtype=F64) / p**0.5 * scale[:, None]
    if zero_row:
        g64[0] = 0.0
    check_exact(g64.to(torch.float32), block)


def test_row_whose_squares_all_underflow_next_to_a_zero_row() -> None:
    # 1e-25² = 1e-50 underflows float32: the unscaled diagonal reads 0 for a non-zero row
    g = torch.tensor([[1e-25, -2e-25, 3e-25], [0.0, 0.0, 0.0], [1.0, 2.0, -1.0]])
    gram = compute_gramian(g)
    assert abs(float(gram[0, 0]) - 14e-50) <= 1e-6 * 14e-50
    assert abs(float(gram[0, 2]) - (1e-25 - 4e-25 - 3e-25)) <= 1e-6 * 6e-25
    assert float(gram[1].abs().sum()) == 0.0
    assert float(gram[2, 2]) == 6.0


def test_diagonal_overflowing_float32_is_rescaled() -> None:
    # ‖g₀‖² = 2·(3e19)² = 1.8e39 > float32 max; the product overflows unscaled
    g = torch.tensor([[3e19, 3e19], [1.0, -2.0]])
    gram = compute_gramian(g)
    assert abs(float(gram[0, 0]) - 2 * float(torch.tensor(3e19)) ** 2) <= 1e-6 * 1.8e39
    assert abs(float(gram[0, 1]) + float(torch.tensor(3e19))) <= 1e-6 * 3e19


@settings(max_examples=12, deadline=None, derandomize=True)
@given(k=st.sampled_from([127, 128, 129, 200, 300, 513]), p=st.integers(1, 90),
       seed=st.integers(0, 10_000), scaled=st.booleans(), dtype=st.sampled_from(["32", "64"]))
def test_blocks_above_the_diagonal_give_the_gramian(k: int, p: int, seed: int, scaled: bool,
                                                     dtype: str) -> None:
    """From 128 rows the CPU product takes the row blocks on and above the diagonal only
    (``symmetric_product``): exactly symmetric, and within the float32 rounding of the
    float64 product of the same rows (``1e-6 √(dᵢ dⱼ)``), for rows of one scale and of
    mixed scales (1e-30 … 3e19, the rescaled path); float64 rows to ``1e-14``."""
    gen = torch.Generator().manual_seed(seed)
    g64 = torch.randn(k, p, generator=gen, dtype=F64)
    if scaled:
        g64 *= 10.0 ** torch.tensor([-30.0, 0.0, 19.4], dtype=F64)[torch.arange(k) % 3, None]
    g = g64.to(torch.float32) if dtype == "32" else g64
    got = compute_gramian(g)
    assert torch.equal(got, got.T) or k < symmetric.SYMMETRIC_MIN_ROWS
    exact = g.to(F64) @ g.to(F64).T
    norms = torch.diagonal(exact).sqrt()
    tol = 1e-6 if dtype == "32" else 1e-14
    assert bool(((got - exact).abs() <= tol * norms[:, None] * norms[None, :]).all())
    if scaled:  # the raw float32 product overflows there: compute_gramian rescales
        return
    product = symmetric.symmetric_product(g)
    assert torch.equal(product, product.T) or k < symmetric.SYMMETRIC_MIN_ROWS
    assert bool(((product.to(F64) - exact).abs() <= tol * norms[:, None] * norms[None, :]).all())
