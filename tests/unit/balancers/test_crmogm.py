"""CR-MOGM: TorchJD 0.18 agreement, a hand-derived average, state and argument checks."""

from __future__ import annotations

import pytest
import torch
import torchjd.aggregation as tjd

import gradbalance
from gradbalance.balancers import CRMOGM, IMTLG, MGDA, GradVac, MoDo, TrimmedMean, UPGrad
from support.balancers import random_matrix


def _gramians(steps: int, k: int = 4, p: int = 9) -> list[torch.Tensor]:
    return [(g := random_matrix(seed, k, p)) @ g.T for seed in range(steps)]


@pytest.mark.parametrize("beta", [0.0, 0.7, 1.0])
def test_matches_torchjd_with_a_stateless_inner(beta: float) -> None:
    ours, ref = CRMOGM(IMTLG(), beta=beta), tjd.CRMOGMWeighting(tjd.IMTLGWeighting(), alpha=beta)
    for gram in _gramians(5):
        torch.testing.assert_close(ours.compute_weights(gram), ref(gram), rtol=1e-8, atol=1e-10)


def test_matches_torchjd_with_a_stateful_inner_and_initial_weights() -> None:
    init = [0.4, 0.3, 0.2, 0.1]
    ours = CRMOGM(MoDo(gamma=0.01, rho=0.1), beta=0.9, initial_weights=init)
    ref = tjd.CRMOGMWeighting(tjd.MoDoWeighting(gamma=0.01, rho=0.1), alpha=0.9,
                              initial_weights=torch.tensor(init, dtype=torch.float64))
    for gram in _gramians(6):
        torch.testing.assert_close(ours.compute_weights(gram), ref(gram), rtol=0, atol=1e-12)


def test_hand_derived_average_of_mgda_weights() -> None:
    # Orthogonal rows of norms a, b: MGDA's min-norm weights are (b², a²)/(a² + b²).
    # (1,0),(0,2) -> (0.8, 0.2); (2,0),(0,1) -> (0.2, 0.8).
    g1 = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    g2 = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    b = CRMOGM(MGDA(), beta=0.5)
    torch.testing.assert_close(b.combine(g1).weights, torch.tensor([0.8, 0.2], dtype=torch.float64))
    out = b.combine(g2)  # λ₂ = ½(0.8, 0.2) + ½(0.2, 0.8)
    torch.testing.assert_close(out.weights, torch.tensor([0.5, 0.5], dtype=torch.float64))
    torch.testing.assert_close(out.vector, torch.tensor([1.0, 0.5], dtype=torch.float64))
    c = CRMOGM(MGDA(), beta=0.5, initial_weights=[1.0, 0.0])
    torch.testing.assert_close(c.combine(g1).weights, torch.tensor([0.9, 0.1], dtype=torch.float64))


def test_beta_schedule_between_steps() -> None:
    g1 = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    g2 = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    b = CRMOGM(MGDA(), beta=0.5)
    b.combine(g1)
    b.beta = 1.0  # frozen: the second step keeps the first weights
    torch.testing.assert_close(b.combine(g2).weights, torch.tensor([0.8, 0.2], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"Invalid beta: 1\.5"):
        b.beta = 1.5


def test_resume_with_a_stateful_inner_is_bit_identical() -> None:
    a = CRMOGM(MoDo(num_tasks=4, gamma=0.01), beta=0.8)
    grams = _gramians(6)
    for gram in grams[:3]:
        a.compute_weights(gram)
    saved = a.state_dict()
    assert set(saved) == {"_extra_state", "_lambda", "inner._extra_state", "inner._lambda"}
    fresh = CRMOGM(MoDo(num_tasks=4, gamma=0.01), beta=0.8)
    fresh.load_state_dict(saved)
    for gram in grams[3:]:
        assert torch.equal(fresh.compute_weights(gram), a.compute_weights(gram))
    a.reset()
    assert a.state_dict() == {"_extra_state": {"_type": "CRMOGM"},
                              "inner._extra_state": {"_type": "MoDo"}}  # None: no entry
    with pytest.raises(ValueError, match="no dict under '_extra_state'"):
        fresh.load_state_dict({"weights": None, "lambda": None})


def test_flags_follow_the_inner_balancer() -> None:
    assert "crmogm" in gradbalance.BALANCERS
    assert not CRMOGM(MoDo()).homogeneous and CRMOGM(UPGrad()).homogeneous
    b = CRMOGM(MGDA(normalization="loss"))
    assert b.needs_losses
    with pytest.raises(ValueError, match="losses"):
        b(random_matrix(0, 2, 3))


def test_invalid_arguments() -> None:
    default = CRMOGM(num_tasks=3)
    assert isinstance(default.inner, MGDA) and default.inner.num_tasks == 3
    with pytest.raises(ValueError, match="Invalid num_tasks: 2"):
        CRMOGM(MGDA(num_tasks=3), num_tasks=2)
    for inner in (TrimmedMean(), GradVac(groups=[2, 1]), "mgda"):
        with pytest.raises(ValueError, match="Invalid inner"):
            CRMOGM(inner)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Invalid beta: -0\.1"):
        CRMOGM(MGDA(), beta=-0.1)
    with pytest.raises(ValueError, match="Invalid initial_weights"):
        CRMOGM(MGDA(num_tasks=3), initial_weights=[0.5, 0.5])
    b = CRMOGM(MGDA())
    b(random_matrix(0, 3, 4))
    with pytest.raises(ValueError, match="tracks weights for 3 tasks"):
        b(random_matrix(0, 4, 4))
