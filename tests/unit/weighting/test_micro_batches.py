"""``weighting(losses, micro_batches=M)``: the M calls of a step's micro-batches give the
gradient and the state of one call on the full batch (their mean losses), for every
weighting whose weights do not read the call's losses; for those that do (GLS, SI, STCH,
FAMO), where the micro-batches' losses are equal. Reference: the single call on the full
batch, in float64."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradbalance.weighting import WEIGHTINGS, GradNorm, get_weighting

K = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"trunk": nn.Linear(4, 6), "heads": nn.Linear(6, K)}).double()


def _losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model["heads"](torch.tanh(model["trunk"](x)))
    return ((out - y) ** 2).mean(dim=0)  # [K]: each task's mean over the samples


def _weighting(name: str, model: nn.Module) -> nn.Module:
    kwargs = {"layer": model["trunk"]} if WEIGHTINGS[name] is GradNorm else {}
    if name in ("imtl_l", "uncertainty"):
        kwargs["dtype"] = torch.float64
    return get_weighting(name, num_tasks=K, **kwargs)


def _step(name: str, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Gradients of the model and the weighting, then the weighting's state after two steps
    (the second from the first's state), with the batches as one step's micro-batches."""
    model = _model()
    weighting = _weighting(name, model)
    out: list[torch.Tensor] = []
    for _ in range(2):
        m = len(batches)
        for x, y in batches:
            losses = _losses(model, x, y)
            given = {"micro_batches": m} if m > 1 else {}
            weighting(losses, **given).sum().backward()
        params = [*model.parameters(), *weighting.parameters()]
        out += [p.grad.clone() for p in params if p.grad is not None]
        with torch.no_grad():
            after = torch.stack([_losses(model, x, y) for x, y in batches]).mean(dim=0) * 0.9
        weighting.update(after if weighting.needs_losses_after else None)
        for p in params:
            p.grad = None
        out += [t.clone() for t in weighting.state_dict().values() if isinstance(t, torch.Tensor)]
    return out


@pytest.mark.parametrize("name", sorted(WEIGHTINGS))
@pytest.mark.parametrize("m", [2, 4])
def test_micro_batches_give_the_full_batchs_gradient_and_state(name: str, m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(8, K, generator=gen, dtype=torch.float64) * torch.tensor(
        [1.0, 4.0, 0.3], dtype=torch.float64)
    if WEIGHTINGS[name].reads_losses:  # the same micro-batch M times: equal losses
        x, y = x[: 8 // m].repeat(m, 1), y[: 8 // m].repeat(m, 1)
    size = 8 // m
    parts = [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]) for i in range(m)]
    full, split = _step(name, [(x, y)]), _step(name, parts)
    assert len(full) == len(split) > 0
    for a, b in zip(full, split):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), (name, a, b)


def test_without_micro_batches_the_contract_recipe_is_off_for_the_regularisers() -> None:
    """The reason for the argument: ``weighting(losses / M)`` adds Uncertainty weighting's
    regulariser M times (its log-variance gradient differs from the full batch's)."""
    model = _model()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=gen, dtype=torch.float64), torch.randn(
        8, K, generator=gen, dtype=torch.float64)
    full = _weighting("uncertainty", model)
    full(_losses(model, x, y)).sum().backward()
    divided = copy.deepcopy(_weighting("uncertainty", model))
    for i in range(2):
        divided(_losses(model, x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]) / 2).sum().backward()
    grad_full = next(full.parameters()).grad
    grad_divided = next(divided.parameters()).grad
    assert not torch.allclose(grad_full, grad_divided, rtol=1e-3)


def test_micro_batches_is_checked_before_anything_moves() -> None:
    weighting = get_weighting("dwa", num_tasks=K)
    with pytest.raises(ValueError, match=r"Invalid micro_batches: 0 \(expected an int >= 1"):
        weighting(torch.ones(K), micro_batches=0)
    assert weighting.pending_tensors() == []
