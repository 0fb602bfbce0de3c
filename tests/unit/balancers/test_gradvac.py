"""GradVac: TorchJD 0.18 agreement over steps, the closed-form cosine lift, state, groups."""

from __future__ import annotations

import pytest
import torch
import torchjd.aggregation as tjd

from gradbalance import NonFiniteGradientError
from gradbalance.balancers import GradVac, PCGrad
from gradbalance.balancers._gradvac import gradvac_coefficients
from support.balancers import random_matrix


def unit_trace(g: torch.Tensor) -> torch.Tensor:
    # TorchJD adds eps = 1e-8 to raw-scale denominators, ours to the trace-normalised ones:
    # identical when tr(G) = ‖J‖_F² = 1.
    return g / g.norm()


def test_agrees_with_torchjd_over_steps() -> None:
    ours = GradVac(beta=0.5, generator=torch.Generator().manual_seed(7))
    ref = tjd.GradVac(beta=0.5)
    torch.manual_seed(7)
    for step in range(6):
        g = unit_trace(random_matrix(step, 4, 6))
        torch.testing.assert_close(ours(g), ref(g), rtol=1e-9, atol=1e-12)


def test_first_step_two_tasks_equals_pcgrad() -> None:
    # Targets start at 0: lifting a negative cosine to 0 is PCGrad's projection (eps = 0 so
    # that the denominators are the exact ones).
    g = unit_trace(random_matrix(1, 2, 5))
    assert float(g[0] @ g[1]) < 0
    torch.testing.assert_close(GradVac(eps=0.0)(g), PCGrad()(g), rtol=1e-12, atol=1e-14)


def test_lift_reaches_the_target_cosine() -> None:
    g = unit_trace(random_matrix(2, 2, 5))
    targets = torch.tensor([[0.0, 0.6], [0.3, 0.0]], dtype=torch.float64)
    orders = torch.tensor([[1], [0]])
    # max_step large: the closed form unclamped (the default bound would stop at ‖g₀‖).
    coef, new = gradvac_coefficients(g @ g.T, orders, targets, beta=0.25, eps=0.0,
                                     max_step=1e6)
    rows = coef @ g
    cos01 = rows[0] @ g[1] / (rows[0].norm() * g[1].norm())
    cos10 = rows[1] @ g[0] / (rows[1].norm() * g[0].norm())
    torch.testing.assert_close(cos01, targets[0, 1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cos10, targets[1, 0], rtol=1e-12, atol=1e-12)
    phi = g[0] @ g[1] / (g[0].norm() * g[1].norm())
    torch.testing.assert_close(new[0, 1], 0.75 * targets[0, 1] + 0.25 * phi)


def test_resume_is_bit_identical_and_nonfinite_keeps_state() -> None:
    a = GradVac(num_tasks=3, beta=0.3, generator=torch.Generator().manual_seed(1))
    mats = [random_matrix(i, 3, 7) for i in range(6)]
    for m in mats[:3]:
        a(m)
    saved = a.state_dict()
    bad = mats[0].clone()
    bad[1, 2] = float("inf")
    with pytest.raises(NonFiniteGradientError):
        a(bad)
    assert torch.equal(a.state_dict()["targets"], saved["targets"])
    tail = [a(m) for m in mats[3:]]
    b = GradVac(beta=0.3)
    b.load_state_dict(saved)
    assert b.num_tasks == 3
    for m, expected in zip(mats[3:], tail):
        assert torch.equal(b(m), expected)
    a.reset()
    assert torch.equal(a.targets, torch.zeros(3, 3, dtype=torch.float64))


@pytest.mark.parametrize("num_tasks", [3, None])
@pytest.mark.parametrize("rows", [2, 4])
def test_targets_not_square_are_refused_at_load(num_tasks: int | None, rows: int) -> None:
    # [rows, 3] targets: one entry per task along dim -1 only; the step needs [K, K].
    source = GradVac(num_tasks=3, generator=torch.Generator().manual_seed(0))
    for i in range(2):
        source(random_matrix(i, 3, 7))
    state = source.state_dict()
    targets = state["targets"]
    state["targets"] = targets[:rows] if rows < 3 else torch.cat([targets, targets[:1]])
    fresh = GradVac(num_tasks=num_tasks)
    before = fresh.state_dict()
    with pytest.raises(ValueError, match=r"targets.*\[\.\.\., K, K\]"):
        fresh.load_state_dict(state)
    after = fresh.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[key], value) for key, value in before.items()
               if isinstance(value, torch.Tensor))
    assert fresh.num_tasks == num_tasks


def test_groups() -> None:
    g = random_matrix(3, 3, 10)
    whole = GradVac(beta=0.5, generator=torch.Generator().manual_seed(0))
    one = GradVac(beta=0.5, groups=[10], generator=torch.Generator().manual_seed(0))
    assert not one.from_gramian
    torch.testing.assert_close(one(g), whole(g), rtol=1e-12, atol=1e-12)
    # Two groups = two independent GradVacs on the column blocks with the same orders.
    two = GradVac(beta=0.5, groups=[4, 6], generator=torch.Generator().manual_seed(0))
    left = GradVac(beta=0.5, generator=torch.Generator().manual_seed(0))
    right = GradVac(beta=0.5, generator=torch.Generator().manual_seed(0))
    for step in range(3):
        m = random_matrix(10 + step, 3, 10)
        expected = torch.cat([left(m[:, :4]), right(m[:, 4:])])
        torch.testing.assert_close(two(m), expected, rtol=1e-12, atol=1e-12)
    assert two.state_dict()["targets"].shape == (2, 3, 3)
    with pytest.raises(ValueError, match="groups sum"):
        two(random_matrix(0, 3, 11))


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="beta"):
        GradVac(beta=1.5)
    with pytest.raises(ValueError, match="groups"):
        GradVac(groups=[3, 0])


def test_default_beta_is_the_papers_slow_average() -> None:
    # β = 1e-2 (Wang et al. 2021). g1 = (1, 0), g2 = (1, 1): cos = 1/√2 ≥ the zero target, so
    # nothing is lifted and each target moves from 0 to β/√2.
    b = GradVac(num_tasks=2, generator=torch.Generator().manual_seed(0))
    g = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(b(g), g.sum(dim=0))
    expected = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=torch.float64) * 0.01 / 2**0.5
    assert b.targets is not None
    torch.testing.assert_close(b.targets, expected, rtol=1e-7, atol=0)  # eps = 1e-8
