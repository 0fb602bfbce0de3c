"""ExcessMTL's excess risks and weights at many tasks against the update rule in float64.

The reference forms ``Êₖ = Σⱼ gₖⱼ² / √(Sₖⱼ + ε)`` directly in float64 from float32 rows (every
float32 square is a normal float64, so the reference is exact to float64 rounding) and runs
the exponentiated-gradient update of He et al. (ICML 2024, eqs. 6-9) step by step. Inputs:
conflicting random rows, near-duplicate tasks, row scales from 1e-30 to 1e19 (float64:
1e-100 to 1e100), zero rows and
``ε = 0``. Tolerance: risks within 1e-5 relative on float32 rows (1e-12 on float64 rows);
on float64 rows the weights within 1e-9 relative and the update ``cos ≥ 0.999999`` and norm within
1e-6 relative (the many-task criterion, docs/performance.md "Many tasks").
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import ExcessMTL, _row_blocks
from gradbalance.functional import excessmtl_risks

F64 = torch.float64


def float32_rows(k: int, p: int, seed: int, low: float, high: float,
                 dtype: torch.dtype = torch.float32) -> Tensor:
    """``[K, P]`` conflicting rows (float32 unless ``dtype``), each scaled by ``10**x``,
    ``x ∈ [low, high]``; a near-duplicate pair and a zero row when ``K ≥ 4``."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(k, 1, generator=gen, dtype=F64) * torch.randn(p, generator=gen, dtype=F64)
    g = g + 0.5 * torch.randn(k, p, generator=gen, dtype=F64)
    if k >= 4:
        g[1] = g[0] * (1 + 1e-6)
        g[3] = 0.0
    exponents = low + (high - low) * torch.rand(k, 1, generator=gen, dtype=F64)
    return (g * 10.0**exponents).to(dtype)


def reference_risks(g: Tensor, sq_sum: Tensor, eps: float) -> Tensor:
    """``Σⱼ gⱼ² / √(Sⱼ + ε)`` in float64 (0 where the denominator is 0)."""
    g64 = g.to(F64)
    h = torch.sqrt(sq_sum + eps)
    return torch.where(h > 0, g64 * g64 / torch.where(h > 0, h, 1.0), 0.0).sum(dim=1)


def reference_weights(steps: list[Tensor], eta: float, eps: float) -> Tensor:
    """α after the steps (no warm-up): baseline = first risks, ``α ∝ α exp(η Ê/Ê⁰)``."""
    k = steps[0].shape[0]
    sq_sum = torch.zeros(steps[0].shape, dtype=F64)
    weights = torch.full((k,), 1.0 / k, dtype=F64)
    baseline = None
    for g in steps:
        sq_sum = sq_sum + g.to(F64) ** 2
        risks = reference_risks(g, sq_sum, eps)
        baseline = risks if baseline is None else baseline
        ratios = torch.where(baseline > 0, risks / torch.where(baseline > 0, baseline, 1.0), 0.0)
        # α exp(η r) / Σ, normalised at each step (a weight that underflows stays 0)
        exponent = torch.log(weights) + eta * ratios
        weights = torch.exp(exponent - exponent.max())
        weights = weights / weights.sum()
    return weights


def assert_close_relative(a: Tensor, b: Tensor, rtol: float) -> None:
    assert bool(torch.isfinite(a).all())
    assert bool(((a - b).abs() <= rtol * b.abs()).all()), (a, b)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(k=st.integers(1, 64), p=st.integers(1, 300), seed=st.integers(0, 10_000),
       low=st.floats(-30, 18), span=st.floats(0, 12), eps=st.sampled_from([0.0, 1e-7, 1.0]))
def test_risks_match_the_float64_formula(k: int, p: int, seed: int, low: float, span: float,
                                         eps: float) -> None:
    past = float32_rows(k, p, seed + 1, low, min(low + span, 19.0))
    g = float32_rows(k, p, seed, low, min(low + span, 19.0))
    root = torch.hypot(past, g)  # R = √(g_past² + g²), as the balancer keeps it
    sq_sum = past.to(F64) ** 2 + g.to(F64) ** 2
    expected = reference_risks(g, sq_sum, eps)
    got = excessmtl_risks(g, root, eps)
    assert got.dtype == F64
    assert_close_relative(got, expected, 1e-5)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(k=st.integers(1, 64), p=st.integers(1, 300), seed=st.integers(0, 10_000),
       low=st.floats(-100, 90), span=st.floats(0, 12))
def test_float64_risks_match_the_formula(k: int, p: int, seed: int, low: float,
                                         span: float) -> None:
    past = float32_rows(k, p, seed + 1, low, min(low + span, 100.0), F64)
    g = float32_rows(k, p, seed, low, min(low + span, 100.0), F64)
    expected = reference_risks(g, past**2 + g**2, 1e-7)
    assert_close_relative(excessmtl_risks(g, torch.hypot(past, g), 1e-7), expected, 1e-12)


def test_risks_hand_case() -> None:
    # g = [3, 4], S = [9 + 16, 16 + 0] = [25, 16], ε = 0: 9/5 + 16/4 = 5.8
    g = torch.tensor([[3.0, 4.0]])
    root = torch.tensor([[5.0, 4.0]])
    assert abs(float(excessmtl_risks(g, root, 0.0)[0]) - 5.8) < 1e-6


@settings(max_examples=15, deadline=None, derandomize=True)
@given(k=st.integers(2, 64), p=st.integers(1, 200), seed=st.integers(0, 10_000),
       low=st.floats(-30, 15), eta=st.sampled_from([0.1, 1.0, 3.0]),
       eps=st.sampled_from([0.0, 1e-7]), block=st.sampled_from([2**19, 1, 150, 1000]))
def test_weights_and_update_match_the_update_rule(k: int, p: int, seed: int, low: float,
                                                  eta: float, eps: float, block: int) -> None:
    """Row blocks of ``block`` entries (one row each at 1; one block at 2**19)."""
    steps = [float32_rows(k, p, seed + t, low, low + 4.0, F64) for t in range(3)]
    balancer = ExcessMTL(robust_step_size=eta, eps=eps)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_row_blocks, "ROW_BLOCK_ENTRIES", block)
        for g in steps:
            result = balancer.combine(g)
    expected = reference_weights(steps, eta, eps)
    assert_close_relative(result.weights, expected, 1e-9)
    update = expected @ steps[-1].to(F64)
    got = result.vector.to(F64)
    norm = float(update.norm())
    if norm > 0:
        cos = float(got @ update) / (float(got.norm()) * norm)
        assert cos >= 0.999999
        assert abs(float(got.norm()) - norm) <= 1e-6 * norm


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), low=st.floats(-45, 30), span=st.floats(0, 40),
       eps=st.sampled_from([0.0, 1e-7, 1.0, 1e-30]),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_hypot_with_constant_is_torch_hypot_bit_for_bit(seed: int, low: float, span: float,
                                                        eps: float, dtype: torch.dtype) -> None:
    """Across ratios ``r/√ε`` from 0 to far past ``2⁶³`` (the subnormal squares), the lifted
    form equals ``torch.hypot`` exactly and is within one float32 ulp of ``√(r² + ε)`` formed
    in float64 (float64 rows: four ulps, the reference's own roundings)."""
    from gradbalance.balancers._excessmtl import hypot_with_constant

    gen = torch.Generator().manual_seed(seed)
    exponents = low + min(span, 38.0 - low) * torch.rand(64, 50, generator=gen, dtype=F64)
    r64 = torch.rand(64, 50, generator=gen, dtype=F64) * 10.0**exponents
    r64[0, :5] = 0.0
    r = r64.to(dtype)
    c = eps**0.5
    got = hypot_with_constant(r, c)
    assert got.dtype == dtype and torch.equal(got, torch.hypot(r, r.new_tensor(c)))
    rr = r.to(F64)
    big = torch.maximum(rr, torch.full_like(rr, c))
    exact = big * torch.sqrt(1.0 + (torch.minimum(rr, torch.full_like(rr, c)) / big) ** 2)
    exact = torch.where(big > 0, exact, 0.0)
    ulp = torch.finfo(dtype).eps * (1.0 if dtype == torch.float32 else 4.0)
    assert bool(((got.to(F64) - exact).abs() <= ulp * exact).all())


@settings(max_examples=50, deadline=None, derandomize=True)
@given(k=st.integers(1, 300), p=st.integers(0, 3000), entries=st.integers(1, 5000))
def test_row_blocks_cover_the_rows_in_order(k: int, p: int, entries: int) -> None:
    """Consecutive, non-empty, whole rows, each block within ``entries`` unless one row is."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_row_blocks, "ROW_BLOCK_ENTRIES", entries)
        blocks = _row_blocks.row_blocks(k, p)
    assert [b.start for b in blocks] == [0] + [b.stop for b in blocks[:-1]]
    assert blocks[-1].stop == k
    rows = [b.stop - b.start for b in blocks]
    assert all(r >= 1 for r in rows)
    assert all(r * p <= entries or r == 1 for r in rows)


def test_row_blocks_are_one_block_off_the_cpu() -> None:
    """On an accelerator (here the meta device) every row is one block: no per-block launches."""
    assert _row_blocks.row_blocks(300, 10**5, torch.device("meta")) == [slice(0, 300)]
    assert len(_row_blocks.row_blocks(300, 10**6, torch.device("cpu"))) == 300
