"""Which weightings read the losses' values (``LossWeighting.reads_losses``), the helper that
gives data-parallel ranks the global batch's values (``global_losses``), and the refusal of
FAMO by the integrations (it needs the losses after the optimizer step)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradbalance.balancers import Sum
from gradbalance.distributed import global_losses
from gradbalance.integrations._core import BalancedParts
from gradbalance.weighting import WEIGHTINGS, GradNorm, get_weighting

K = 3


def _coefficients(weighting, values: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``∂ Σ weighting(L) / ∂Lₖ`` at the loss values ``values`` (the losses depend on
    ``layer``, which GradNorm reads)."""
    x = torch.ones(1, 2, dtype=torch.float64)
    base = layer(x).sum() ** 2 + 1.0
    losses = values * (base / base.detach())  # the values, on the layer's graph
    out = weighting(losses).sum()
    return torch.autograd.grad(out, losses)[0]


@pytest.mark.parametrize("name", sorted(WEIGHTINGS))
def test_the_flag_marks_the_weightings_whose_coefficients_move_with_the_losses(
        name: str) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(2, 1).double()
    kwargs = {"layer": layer} if WEIGHTINGS[name] is GradNorm else {}
    if name in ("imtl_l", "uncertainty"):
        kwargs["dtype"] = torch.float64
    weighting = get_weighting(name, num_tasks=K, **kwargs)
    # the same state (and random stream) for the second call, GradNorm's layer shared
    other = copy.deepcopy(weighting, memo={id(p): p for p in layer.parameters()})
    first = _coefficients(weighting, torch.tensor([0.5, 2.0, 7.0], dtype=torch.float64), layer)
    second = _coefficients(other, torch.tensor([3.0, 0.25, 1.0], dtype=torch.float64), layer)
    moved = not torch.allclose(first, second, rtol=1e-12, atol=0.0)
    assert moved == WEIGHTINGS[name].reads_losses, (name, first, second)


def test_global_losses_alone_are_the_losses() -> None:
    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor(3.0, requires_grad=True)
    out = global_losses([a * 1.0, b * b])
    assert out.tolist() == [2.0, 9.0]
    out.sum().backward()
    assert (float(a.grad), float(b.grad)) == (1.0, 6.0)
    with pytest.raises(ValueError, match="losses must be"):
        global_losses("x")  # type: ignore[arg-type]


def test_the_integrations_refuse_a_weighting_that_needs_the_losses_after_the_step() -> None:
    famo = get_weighting("famo", num_tasks=K)
    state = copy.deepcopy(famo.state_dict())
    with pytest.raises(ValueError, match=r"FAMO learns from the same batch's losses after"):
        BalancedParts(Sum(), lambda: None, weighting=famo)  # type: ignore[arg-type,return-value]
    assert all(torch.equal(v, state[k]) for k, v in famo.state_dict().items()
               if isinstance(v, torch.Tensor))
    assert [name for name, cls in WEIGHTINGS.items() if cls.needs_losses_after] == ["famo"]
