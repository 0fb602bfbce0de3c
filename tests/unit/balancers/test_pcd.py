"""PCD: agreement with TorchJD's PCD over steps, a hand-derived constraint, infeasibility."""

from __future__ import annotations

import pytest
import torch
from torchjd.aggregation import PCDWeighting

from gradbalance.balancers import PCD
from gradbalance.functional import pcd_weights


@pytest.mark.parametrize("tau", [0.02, 0.5])
def test_matches_torchjd_over_steps(tau: float) -> None:
    # TorchJD solves the same QP with a dual active-set method; we enumerate working sets.
    gen = torch.Generator().manual_seed(0)
    ours, ref = PCD(tau=tau, beta=0.9), PCDWeighting(tau=tau, beta=0.9)
    for _ in range(5):
        g = torch.randn(4, 6, generator=gen, dtype=torch.float64)
        g[0] *= 3
        a = g @ g.T
        torch.testing.assert_close(ours.compute_weights(a), ref(a), rtol=1e-9, atol=1e-12)


def test_hand_derived_orthogonal_secondary() -> None:
    # g1 = (2, 0), g2 = (0, 1) (unit normalised Gramian): g2ᵀg1 = 0 < τ‖g2‖², so the
    # constraint is active: d = g1 + μ g2 with g2ᵀd = μ = τ.
    gram = torch.tensor([[4.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(pcd_weights(gram, torch.tensor([0.3], dtype=torch.float64)),
                               torch.tensor([1.0, 0.3], dtype=torch.float64))
    # A satisfied constraint (g2 aligned with g1) stays inactive: d = g1.
    aligned = torch.tensor([[4.0, 2.0], [2.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(pcd_weights(aligned, torch.tensor([0.3],
                                                                     dtype=torch.float64)),
                               torch.tensor([1.0, 0.0], dtype=torch.float64))


def test_infeasible_constraints_fall_back_to_the_primary() -> None:
    g = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, -1.0]], dtype=torch.float64)
    out = PCD(tau=0.1)(g)
    torch.testing.assert_close(out, g[0])


def test_invalid_tau() -> None:
    with pytest.raises(ValueError, match=r"Invalid tau: 1\.5"):
        PCD(tau=1.5)
    with pytest.raises(ValueError, match="secondary tasks"):
        PCD(tau=[0.1, 0.2])(torch.randn(2, 3))


@pytest.mark.parametrize("seed", range(8))
def test_singular_gramian_matches_torchjd(seed: int) -> None:
    # Ten tasks in four dimensions leaning on a common direction: Q is singular (solved as a
    # least-distance program, where an enumeration visited up to 2⁹ working sets); the
    # update is TorchJD's (its weights may differ along Q's null space).
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(10, 4, generator=gen, dtype=torch.float64)
    g = g + 1.5 * torch.randn(4, generator=gen, dtype=torch.float64)
    g[0] *= 3
    a = g @ g.T
    ours, ref = PCD(tau=0.05, beta=0.9), PCDWeighting(tau=0.05, beta=0.9)
    for _ in range(2):
        torch.testing.assert_close(ours.compute_weights(a) @ g, ref(a) @ g, rtol=1e-9,
                                   atol=1e-12)


def test_singular_gramian_with_active_constraints_hand_derived() -> None:
    # g₁ = (1, 0) and twice g₂ = (−1, 1) (a duplicate: Q singular): with τ = 0 the constraint
    # g₂ᵀd ≥ 0 binds, d = g₁ + μ g₂ with g₂ᵀd = −1 + 2μ = 0, so d = (½, ½) whichever way μ
    # splits over the duplicates.
    gram = torch.tensor([[1.0, -1.0, -1.0], [-1.0, 2.0, 2.0], [-1.0, 2.0, 2.0]],
                        dtype=torch.float64)
    w = pcd_weights(gram, torch.zeros(2, dtype=torch.float64))
    rows = torch.tensor([[1.0, 0.0], [-1.0, 1.0], [-1.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(w @ rows, torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert float(w[1:].min()) >= 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_a_certified_gramian_is_not_decomposed_again(seed: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Many well-conditioned secondary tasks (from 64 on the Cholesky certificate classifies
    ``Q``): the box QP takes it as classified, with no eigenvalues of its own, and the
    answer is TorchJD's."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(80, 200, generator=gen, dtype=torch.float64)
    g[0] *= 3
    gram = g @ g.T
    calls = []
    eigvalsh = torch.linalg.eigvalsh
    monkeypatch.setattr(torch.linalg, "eigvalsh",
                        lambda *a, **kw: calls.append(1) or eigvalsh(*a, **kw))
    ours = PCD(tau=0.3, beta=0.9).compute_weights(gram)
    assert not calls
    ref = PCDWeighting(tau=0.3, beta=0.9)(gram)
    torch.testing.assert_close(ours, ref, rtol=1e-7, atol=1e-10)
