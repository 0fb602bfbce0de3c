"""capture_state is a snapshot: training on after the capture does not change it, and restoring
it brings the captured values back (as save_checkpoint/load_checkpoint do on disk)."""

from __future__ import annotations

import pytest
import torch

from gradbalance import capture_state, restore_state
from gradbalance.balancers import GradVac


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("width", [3, 8])
def test_restore_after_training_on_brings_the_captured_values_back(seed: int, width: int) -> None:
    torch.manual_seed(seed)
    model = torch.nn.Linear(width, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    balancer = GradVac()

    def train(steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, width)).pow(2).sum().backward()
            opt.step()
            balancer(torch.randn(2, width, dtype=torch.float64))

    train(2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_moment = opt.state_dict()["state"][0]["exp_avg"].clone()
    expected_balancer = {k: v.clone() for k, v in balancer.state_dict().items()
                         if isinstance(v, torch.Tensor)}
    snapshot = capture_state(model=model, optimizer=opt, balancer=balancer)
    train(3)  # in place: parameters, Adam's moments and GradVac's targets all move
    assert not torch.equal(model.weight, expected["weight"])
    restore_state(snapshot, model=model, optimizer=opt, balancer=balancer)
    for key, value in expected.items():
        assert torch.equal(model.state_dict()[key], value), key
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], expected_moment)
    for key, value in expected_balancer.items():
        assert torch.equal(balancer.state_dict()[key], value), key
