"""run_passes: the one implementation of the K passes, into several sinks at once."""

from __future__ import annotations

import pytest
import torch

from gradbalance._roots import TaskRoots
from gradbalance._sinks import RowsSink, StackSink
from gradbalance.taskgrads import ParamLayout, run_passes


@pytest.mark.parametrize("passes", ["loop", "batched"])
def test_gradients_at_an_output_and_at_parameters(passes: str) -> None:
    # y = x Wᵀ; L₁ = ½‖y‖², L₂ = 3·Σy: ∂L₁/∂y = y, ∂L₂/∂y = 3; ∂Lₖ/∂W = (∂Lₖ/∂y)ᵀ x.
    x = torch.tensor([[1.0, 2.0, 0.5], [-1.0, 0.0, 3.0]], dtype=torch.float64)
    w = torch.tensor([[0.5, -1.0, 2.0], [1.0, 1.0, 0.0]], dtype=torch.float64,
                     requires_grad=True)
    unused = torch.ones(2, dtype=torch.float64, requires_grad=True)
    y = x @ w.T
    losses = [0.5 * (y**2).sum(), 3 * y.sum()]
    vector = torch.stack(losses)
    outputs = StackSink([y], 2)
    layout = ParamLayout([w, unused])
    rows = torch.full((2, layout.numel), 7.0, dtype=torch.float64)
    reached = [False, False]
    used = run_passes(TaskRoots(losses, vector, None),
                      [outputs, RowsSink(layout, rows, False, reached)], w.device,
                      passes=passes)  # type: ignore[arg-type]
    assert used == passes
    d1, d2 = y.detach(), torch.full((2, 2), 3.0, dtype=torch.float64)
    stack = outputs.stacks[0]
    assert stack is not None
    torch.testing.assert_close(stack, torch.stack([d1, d2]))
    expected = torch.stack([torch.cat([(d.T @ x).reshape(-1), torch.zeros(2)]) for d in (d1, d2)])
    torch.testing.assert_close(rows, expected.to(torch.float64))
    assert reached == [True, False]  # no task reaches ``unused``: its columns are zeros
