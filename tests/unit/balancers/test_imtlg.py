"""IMTL-G, Aligned-MTL and ConFIG: closed forms and TorchJD 0.18 agreement."""

from __future__ import annotations

import pytest
import torch
import torchjd.aggregation as tjd
from hypothesis import given, settings
from hypothesis import strategies as st

from gradbalance.balancers import IMTLG, AlignedMTL, ConFIG
from support.balancers import random_matrix

CASES = [(2, 5, 0), (3, 7, 1), (5, 30, 2), (6, 40, 3), (4, 2, 4)]


@pytest.mark.parametrize(("k", "p", "seed"), CASES)
def test_agree_with_torchjd(k: int, p: int, seed: int) -> None:
    g = random_matrix(seed, k, p)
    torch.testing.assert_close(IMTLG()(g), tjd.IMTLG()(g), rtol=1e-8, atol=1e-10)
    # TorchJD's Aligned-MTL combines with 1/K; ours defaults to the authors' sum (pref = 1).
    torch.testing.assert_close(AlignedMTL(pref=[1 / k] * k)(g), tjd.AlignedMTL()(g),
                               rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(AlignedMTL()(g), k * tjd.AlignedMTL()(g), rtol=1e-8, atol=1e-10)
    for mode in ("median", "rmse"):
        torch.testing.assert_close(AlignedMTL(pref=[1 / k] * k, scale_mode=mode)(g),
                                   tjd.AlignedMTL(scale_mode=mode)(g), rtol=1e-8, atol=1e-10)
    if k <= p:  # ConFIG's pinv thresholds differ on rank-deficient input
        torch.testing.assert_close(ConFIG()(g), tjd.ConFIG()(g), rtol=1e-8, atol=1e-10)


def test_imtlg_orthogonal_closed_form() -> None:
    # Orthogonal g1 = (3,0), g2 = (0,1): equal projections need w ∝ (1/3, 1), Σw = 1.
    g = torch.tensor([[3.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    w = IMTLG().combine(g).weights
    torch.testing.assert_close(w, torch.tensor([0.25, 0.75], dtype=torch.float64))


def test_alignedmtl_aligned_gradients_are_orthonormal_up_to_scale() -> None:
    # ĝ = Bᵀ J: with scale_mode="min", ĝ ĝᵀ = λ_min · I on full-rank input.
    g = random_matrix(6, 3, 8)
    from gradbalance.balancers._alignedmtl import alignedmtl_weights

    basis = torch.stack([alignedmtl_weights(g @ g.T, pref=e) for e in torch.eye(3)])
    aligned = basis.T @ g  # row i = Σ_k B[k, i] g_k ... with B symmetric
    gram = aligned @ aligned.T
    lam_min = float(torch.linalg.eigvalsh(g @ g.T).min())
    torch.testing.assert_close(gram, lam_min * torch.eye(3, dtype=torch.float64),
                               rtol=1e-8, atol=1e-8 * lam_min)


def test_config_two_orthogonal_tasks() -> None:
    # u = (1,0),(0,1): g_u = (1,1), ĝ = (1,1)/√2, length = (3+1)/√2 -> g = (2, 2).
    g = torch.tensor([[3.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(ConFIG()(g), torch.tensor([2.0, 2.0], dtype=torch.float64))


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="scale_mode"):
        AlignedMTL(scale_mode="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pref"):
        ConFIG(pref=[float("nan"), 1.0])


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 24), st.integers(4, 13), st.integers(0, 2**16))
def test_equal_projections_with_norms_decades_apart(k: int, decades: int, seed: int) -> None:
    # IMTL-G's defining property on independent rows: g·uₖ the same for every unit task
    # gradient uₖ, g = Σ wₖgₖ with Σ wₖ = 1 (one solution). Norms spread over up to 13
    # decades make the Gramian's eigenvalues span 1e26; its pseudo-inverse at rtol 1e-12
    # dropped the short rows' directions (projections 8 against 67 at 12 decades).
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-decades / 2, decades / 2, k, dtype=torch.float64)
    rows = torch.randn(k, 3 * k + 5, generator=gen, dtype=torch.float64)
    rows = rows * scales[torch.randperm(k, generator=gen)][:, None]
    out = IMTLG().combine(rows)
    assert out.weights is not None
    assert float(out.weights.sum()) == pytest.approx(1.0, abs=1e-12)
    torch.testing.assert_close(out.vector, out.weights @ rows, rtol=1e-12, atol=0.0)
    projections = (rows / rows.norm(dim=1, keepdim=True)) @ out.vector
    spread = float((projections - projections.mean()).abs().max() / projections.abs().max())
    assert spread <= 1e-9
