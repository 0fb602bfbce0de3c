"""ExcessMTL: agreement with TorchJD's ExcessMTL after warm-up; the first call; the update."""

from __future__ import annotations

import pytest
import torch
from torchjd.aggregation import ExcessMTLWeighting

from gradbalance.balancers import ExcessMTL


def test_matches_torchjd_with_warmup() -> None:
    # With a warm-up both set the baseline to the warm-up average; TorchJD divides by
    # (baseline + 1e-7), we divide exactly: relative differences ~1e-8 here.
    gen = torch.Generator().manual_seed(0)
    ours, ref = ExcessMTL(n_warmup_steps=2), ExcessMTLWeighting(n_warmup_steps=2)
    for _ in range(7):
        g = torch.randn(4, 40, generator=gen, dtype=torch.float64)
        torch.testing.assert_close(ours.combine(g).weights, ref(g), rtol=1e-6, atol=0)


def test_first_call_is_uniform_then_the_larger_excess_risk_gains_weight() -> None:
    g = torch.tensor([[1.0, 1.0], [2.0, 0.0]], dtype=torch.float64)
    b = ExcessMTL(robust_step_size=0.5)
    w1 = b.combine(g).weights
    torch.testing.assert_close(w1, torch.full((2,), 0.5, dtype=torch.float64))
    # Step 2, by hand: S = 2g², Ê_k = Σ g²/√(2g² + ε) ≈ Σ|g|/√2; baseline Ê⁰ ≈ Σ|g|.
    e0 = (g.square() / torch.sqrt(g.square() + 1e-7)).sum(1)
    e1 = (g.square() / torch.sqrt(2 * g.square() + 1e-7)).sum(1)
    expected = torch.softmax(torch.log(w1) + 0.5 * e1 / e0, 0)
    torch.testing.assert_close(b.combine(g).weights, expected)
    # task 0 keeps a larger gradient while task 1's vanishes: task 0's risk ratio grows.
    w = b.combine(torch.tensor([[3.0, 3.0], [0.0, 0.0]], dtype=torch.float64)).weights
    assert w is not None and float(w[0]) > float(w[1])


def test_invalid_step_size() -> None:
    with pytest.raises(ValueError, match="Invalid robust_step_size: 0"):
        ExcessMTL(robust_step_size=0.0)


@pytest.mark.parametrize("scale", [1e-30, 1e25])
def test_float32_extreme_scales_keep_the_float64_weights(scale: float) -> None:
    # Σ g² / √(S + ε) without forming g² in float32 (under/overflows at 1e-23 / 1e19): the
    # weights equal a float64 run at the same scale (ε makes the method scale-dependent).
    gen = torch.Generator().manual_seed(3)
    mats = [torch.randn(3, 16, generator=gen, dtype=torch.float64) * scale for _ in range(3)]
    ours, ref = ExcessMTL(), ExcessMTL()
    for m in mats:
        w32, w64 = ours.combine(m.float()).weights, ref.combine(m).weights
        torch.testing.assert_close(w32, w64, rtol=1e-5, atol=0)


def test_state_is_the_root_sum_of_squares() -> None:
    g = torch.tensor([[3.0, 4.0], [1.0, 0.0]], dtype=torch.float64)
    a = ExcessMTL()
    a(g)
    a(2 * g)
    state = a.state_dict()
    torch.testing.assert_close(state["_root_sq_sum"], (5 * g * g).sqrt())
