"""task_gradients: loop and batched passes against per-task .backward() results."""

from __future__ import annotations

import pytest
import torch

from gradbalance import TaskGradBuffer, task_gradients, taskgrads
from support.helpers import TRUNKS, ItemInBackward, build, losses_of


def reference_matrix(kind: str, num_tasks: int = 3) -> torch.Tensor:
    """Row k from an independent route: a fresh model, L_k.backward(), read .grad."""
    rows = []
    for k in range(num_tasks):
        model, x, y = build(kind, num_tasks)
        losses_of(model, x, y)[k].backward()
        rows.append(torch.cat([
            (torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
            for p in model.shared_parameters()
        ]))
    return torch.stack(rows)


@pytest.mark.parametrize("kind", TRUNKS)
@pytest.mark.parametrize("passes", ["loop", "batched", "auto"])
def test_matches_per_task_backward(kind: str, passes: str) -> None:
    model, x, y = build(kind)
    matrix = task_gradients(losses_of(model, x, y), model.shared_parameters(), passes=passes)
    torch.testing.assert_close(matrix, reference_matrix(kind), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", TRUNKS)
def test_loop_equals_batched(kind: str) -> None:
    model, x, y = build(kind)
    losses = losses_of(model, x, y)
    loop = task_gradients(losses, model.shared_parameters(), passes="loop", retain_graph=True)
    batched = task_gradients(losses, model.shared_parameters(), passes="batched")
    torch.testing.assert_close(batched, loop, rtol=1e-6, atol=1e-7)


def test_leaves_grad_untouched() -> None:
    model, x, y = build("mlp")
    task_gradients(losses_of(model, x, y), model.shared_parameters())
    assert all(p.grad is None for p in model.parameters())


def test_unreached_parameter_gets_zeros() -> None:
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    b = torch.tensor([3.0], requires_grad=True)
    matrix = task_gradients([(a * a).sum(), 5 * b.sum()], [a, b])
    expected = torch.tensor([[2.0, 4.0, 0.0], [0.0, 0.0, 5.0]])
    assert torch.equal(matrix, expected)


def test_keeps_dtype_float64() -> None:
    model, x, y = build("mlp", dtype=torch.float64)
    matrix = task_gradients(losses_of(model, x, y), model.shared_parameters())
    assert matrix.dtype == torch.float64
    assert matrix.shape == (3, sum(p.numel() for p in model.shared_parameters()))


def test_rejects_parameter_without_grad() -> None:
    frozen = torch.ones(2)
    live = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"params\[1\].*does not require grad"):
        task_gradients([(live * 2).sum()], [live, frozen])


def test_rejects_bad_passes() -> None:
    w = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match="Invalid passes: 'fast'"):
        task_gradients([w.sum()], [w], passes="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["matrix", "features", "gramian"])
def test_buffer_rejects_bad_passes_at_construction(mode: str) -> None:
    trunk = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="Invalid passes: 'fast'"):
        TaskGradBuffer(trunk.parameters(), mode=mode, modules=trunk,  # type: ignore[arg-type]
                       passes="fast")  # type: ignore[arg-type]


def test_batched_falls_back_to_loop_without_batching_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)

    def losses() -> list[torch.Tensor]:
        h = ItemInBackward.apply(w)
        return [(h**2).sum(), h.sum()]

    with pytest.raises(RuntimeError, match="passes='batched' failed"):
        task_gradients(losses(), [w], passes="batched")
    # "auto" on a device that prefers batching (as on a GPU) falls back to the loop.
    monkeypatch.setitem(taskgrads.AUTO_PREFERENCE, "cpu", "batched")
    with pytest.warns(RuntimeWarning, match="falling back"):
        matrix = task_gradients(losses(), [w], passes="auto")
    expected = torch.stack([8 * w.detach(), torch.full((3,), 2.0)])
    torch.testing.assert_close(matrix, expected)


@pytest.mark.parametrize("form", ["list", "stacked", "divided", "cloned"])
def test_every_form_of_losses_gives_the_same_rows(form: str) -> None:
    # A list, a torch.stack, or a stack through elementwise ops (here ·3 / 3 then a float32
    # cast) start each pass at the task's own loss, with the chain rule's factor; any other
    # [K] tensor (here a clone) is backpropagated entry by entry. The rows must not depend
    # on the route.
    model, x, y = build("cnn")
    feats = model.trunk(x)
    parts = [torch.nn.functional.mse_loss(h(feats).squeeze(-1), y[:, k])
             for k, h in enumerate(model.heads)]
    losses = {"list": parts, "stacked": torch.stack(parts),
              "divided": (torch.stack(parts).double() * 3 / 3).float(),
              "cloned": torch.stack(parts).clone()}[form]
    matrix = task_gradients(losses, model.shared_parameters(), passes="loop")
    torch.testing.assert_close(matrix, reference_matrix("cnn"), rtol=1e-6, atol=1e-7)


def test_stack_of_leaf_losses_falls_back_to_entries() -> None:
    # A stacked leaf has no graph of its own to start from: the entries are used instead.
    a = torch.tensor(2.0, requires_grad=True)
    matrix = task_gradients(torch.stack([a, 3 * a]), [a])
    assert torch.equal(matrix, torch.tensor([[1.0], [3.0]]))


def test_elementwise_factor_reaches_each_row() -> None:
    # v = stack(L) * (2, -1) / 4: row k is c_k ∂L_k/∂w with c = (0.5, -0.25).
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    stacked = torch.stack([(3 * w).sum(), (w * w).sum()])
    matrix = task_gradients(stacked * torch.tensor([2.0, -1.0]) / 4, [w])
    expected = torch.tensor([[1.5, 1.5], [-0.5, -1.0]])
    assert torch.equal(matrix, expected)
