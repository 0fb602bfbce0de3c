"""MoCo: the first step by hand, LibMTL's softmax variant, and convergence to MGDA's weights."""

from __future__ import annotations

import pytest
import torch

from gradbalance.balancers import MoCo


def _simplex_2(v: torch.Tensor) -> torch.Tensor:
    """Projection onto the 2-simplex: shift both entries equally, then clip to [0, 1]."""
    a = ((v[0] - v[1] + 1) / 2).clamp(0, 1)
    return torch.stack([a, 1 - a])


def test_first_two_steps_by_hand() -> None:
    g1 = torch.tensor([[1.0, 0.0, 2.0], [0.0, -1.0, 1.0]], dtype=torch.float64)
    g2 = torch.tensor([[0.5, 1.0, 0.0], [1.0, 1.0, -1.0]], dtype=torch.float64)
    beta, gamma, rho = 0.5, 0.1, 0.2
    b = MoCo(beta=beta, gamma=gamma, rho=rho)
    # step 1: y = β g1 (y₀ = 0), λ = Π(½·1 - γ (y yᵀ + ρ I) ½·1)
    y = beta * g1
    lam = _simplex_2(torch.full((2,), 0.5, dtype=torch.float64)
                     - gamma * (y @ y.T + rho * torch.eye(2, dtype=torch.float64))
                     @ torch.full((2,), 0.5, dtype=torch.float64))
    torch.testing.assert_close(b(g1), lam @ y)
    # step 2: β₂ = β/√2, γ₂ = γ/√2
    b2, c2 = beta / 2**0.5, gamma / 2**0.5
    y = y - b2 * (y - g2)
    lam = _simplex_2(lam - c2 * (y @ y.T + rho * torch.eye(2, dtype=torch.float64)) @ lam)
    torch.testing.assert_close(b(g2), lam @ y)


def test_libmtl_variant_softmax_and_normalized_grads() -> None:
    # LibMTL: h_k = L_k g_k / (‖g_k‖ + 1e-8), λ = softmax(λ - γ (y yᵀ + ρ I) λ).
    g = torch.tensor([[3.0, 4.0], [0.0, 2.0]], dtype=torch.float64)
    losses = torch.tensor([2.0, 0.5], dtype=torch.float64)
    b = MoCo(lambda_update="softmax", normalize_grads=True)
    h = g / g.norm(dim=1, keepdim=True) * losses.unsqueeze(1)
    y = 0.5 * h
    lam = torch.softmax(torch.full((2,), 0.5, dtype=torch.float64)
                        - 0.1 * (y @ y.T) @ torch.full((2,), 0.5, dtype=torch.float64), 0)
    torch.testing.assert_close(b(g, losses), lam @ y, rtol=1e-7, atol=1e-9)
    with pytest.raises(ValueError, match="reads the task losses"):
        b(g)


def test_fixed_gradients_converge_to_mgda_weights() -> None:
    # With G fixed, y -> G and λ follows projected gradient steps on ½ λᵀ G Gᵀ λ: the
    # min-norm point of the hull. g1 = (1, 0), g2 = (0, 2): λ* = (0.8, 0.2), d* = (0.8, 0.4).
    g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    b = MoCo(gamma=0.5)
    for _ in range(3000):
        out = b(g)
    torch.testing.assert_close(out, torch.tensor([0.8, 0.4], dtype=torch.float64),
                               rtol=0, atol=2e-3)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="Invalid beta: 0"):
        MoCo(beta=0.0)
    with pytest.raises(ValueError, match="Invalid lambda_update"):
        MoCo(lambda_update="adam")  # type: ignore[arg-type]


@pytest.mark.parametrize("scale", [1e-30, 1e30])
def test_normalized_grads_at_extreme_float32_scales(scale: float) -> None:
    # h_k = L_k g_k/‖g_k‖ from the power-of-two scaled rows: float32 rows of norm 1e-30
    # (‖g‖² underflows) or 1e30 (overflows) give the unit-scale answer.
    g = torch.tensor([[3.0, 4.0], [0.0, 2.0]], dtype=torch.float64)
    losses = torch.tensor([2.0, 0.5], dtype=torch.float64)
    expected = MoCo(normalize_grads=True)(g, losses)
    out = MoCo(normalize_grads=True)((g * scale).float(), losses)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=0)


def test_simplex_step_far_outside_projects_to_a_vertex() -> None:
    # γ‖g‖² ≈ 1e18: the step's entries differ by far more than 1; before the shifted
    # projection this raised from project_simplex (row norms ≳ 1.7e9 in float64).
    g = torch.tensor([[1e10, 0.0], [0.0, 2e10]], dtype=torch.float64)
    b = MoCo()
    b(g)
    torch.testing.assert_close(b.state_dict()["_lambda"],
                               torch.tensor([1.0, 0.0], dtype=torch.float64))


@pytest.mark.parametrize("entries", [1, 5, 40, 2**19])
def test_row_blocks_track_as_the_formula(entries: int) -> None:
    """``y ← y − β_t (y − h)`` with the passes in blocks of ``entries`` (one row each at 1,
    one block at 2**19): the formula's value on the whole rows, entry for entry, and
    ``λ``'s projected step on their Gramian written out (``Π_Δ`` of a point already in the
    simplex is itself: ``γ`` small)."""
    from gradbalance.balancers import _row_blocks
    from gradbalance.functional import moco_step

    gen = torch.Generator().manual_seed(entries)
    y = torch.randn(7, 11, generator=gen, dtype=torch.float64)
    h = torch.randn(7, 11, generator=gen, dtype=torch.float64)
    lam = torch.full((7,), 1 / 7, dtype=torch.float64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_row_blocks, "ROW_BLOCK_ENTRIES", entries)
        new_y, new_lam = moco_step(y, lam, h, beta_t=0.3, gamma_t=1e-4, rho=0.0)
    expected = y - 0.3 * (y - h)
    assert torch.equal(new_y, expected)
    step = lam - 1e-4 * (expected @ expected.T) @ lam
    torch.testing.assert_close(new_lam, step - (step.sum() - 1) / 7, rtol=1e-12, atol=1e-12)
