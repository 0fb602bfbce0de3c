"""The step's state stays consistent after a failure outside the buffer (docs/loop.md, "When a
step fails"): a forward that runs out of memory on micro-batch 2 of a step, the recipe
(``opt.zero_grad(); buf.reset(keep_weights=True)``), and the next steps equal those of a clean
run that never saw the abandoned micro-batch, in every mode, with ``update_every``; a change of
the heads' ``.grad`` under the buffer between two calls of a step is refused before anything
moves, and ``reset()`` puts the heads' ``.grad`` back as before the step.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import UPGrad
from support.step_net import StepNet

MICRO = 2


class Net(StepNet):
    def losses(self, x: Tensor, y: Tensor) -> Tensor:
        return self.task_losses(self.features(x), y, MICRO)


def batches(seed: int, steps: int, d_in: int, num_tasks: int) -> list[list[tuple[Tensor, Tensor]]]:
    g = torch.Generator().manual_seed(seed + 100)
    return [[(torch.randn(6, d_in, generator=g, dtype=torch.float64),
              torch.randn(6, num_tasks, generator=g, dtype=torch.float64))
             for _ in range(MICRO)] for _ in range(steps)]


Recover = Callable[[TaskGradBuffer, torch.optim.Optimizer], None]


def recipe(buf: TaskGradBuffer, opt: torch.optim.Optimizer) -> None:
    """docs/loop.md's recovery from a failed forward."""
    opt.zero_grad()
    buf.reset(keep_weights=True)


def train(shape: tuple[int, int, int], seed: int, mode: str, update_every: int,
          data: list[list[tuple[Tensor, Tensor]]], fail_step: int | None,
          recover: Recover = recipe) -> list[list[Tensor]]:
    """Steps over ``data``; on ``fail_step`` the forward of micro-batch 2 raises and the step
    is skipped by ``recover``. The parameters after each finished step."""
    net = Net(*shape, seed)
    buf = TaskGradBuffer(net.trunk.parameters(), net.heads.parameters(), mode=mode,
                         modules=net.trunk, update_every=update_every)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    balancer = UPGrad()
    after = []
    for step, micro in enumerate(data):
        if step == fail_step:
            net.fail_at = net.calls + 2  # micro-batch 2's forward
        try:
            for x, y in micro:
                buf.backward(net.losses(x, y))
        except torch.OutOfMemoryError:
            recover(buf, opt)
            continue
        buf.apply_(balancer)
        opt.step()
        opt.zero_grad()
        after.append([p.detach().clone() for p in net.parameters()])
    return after


CASES = [((3, 5, 2), 0), ((4, 3, 3), 1), ((2, 6, 4), 2)]


@pytest.mark.parametrize("mode", ["matrix", "gramian", "auto"])
@pytest.mark.parametrize("update_every", [1, 2])
@pytest.mark.parametrize(("shape", "seed"), CASES)
def test_recipe_after_an_out_of_memory_forward_equals_a_clean_run(
        mode: str, update_every: int, shape: tuple[int, int, int], seed: int) -> None:
    data = batches(seed, 5, shape[0], shape[2])
    fail_step = 1 + seed % 2  # a refresh step or a reused one under update_every=2
    faulted = train(shape, seed, mode, update_every, data, fail_step)
    clean = train(shape, seed, mode, update_every, data[:fail_step] + data[fail_step + 1:], None)
    assert len(faulted) == len(clean) == 4
    for got, expected in zip(faulted, clean):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_the_abandoned_micro_batch_would_change_the_next_steps() -> None:
    """The comparison can fail: a loop that skips the batch without the recipe folds the
    abandoned micro-batch into the next step (heads and trunk alike), and the run differs from
    the clean one; with zero_grad() alone the next backward refuses the step."""
    shape, seed = CASES[0]
    data = batches(seed, 4, shape[0], shape[2])
    clean = train(shape, seed, "matrix", 1, data[:1] + data[2:], None)
    leaked = train(shape, seed, "matrix", 1, data, 1, lambda buf, opt: None)
    diff = max(float((a - b).abs().max()) for a, b in zip(leaked[-1], clean[-1]))
    assert diff > 1e-3
    with pytest.raises(RuntimeError, match=r"backward\(\): the .grad of head_params\[0\] .* "
                                           r"was set to None.* 1 micro-batch"):
        train(shape, seed, "matrix", 1, data, 1, lambda buf, opt: opt.zero_grad())


def _one_backward(mode: str = "matrix", heads: bool = True, seed: int = 0
                  ) -> tuple[Net, TaskGradBuffer, list[tuple[Tensor, Tensor]]]:
    net = Net(3, 4, 2, seed)
    buf = TaskGradBuffer(net.trunk.parameters(), net.heads.parameters() if heads else None,
                         mode=mode, modules=net.trunk,
                         other_params="raise" if heads else "ignore")
    micro = batches(seed, 1, 3, 2)[0]
    buf.backward(net.losses(*micro[0]))
    return net, buf, micro


CHANGES: dict[str, tuple[Callable[[nn.Parameter], None], str]] = {
    "zero_grad(set_to_none=True)": (lambda p: setattr(p, "grad", None), "set to None"),
    "zero_grad(set_to_none=False)": (lambda p: p.grad.zero_() if p.grad is not None else None,
                                     r"written in place \(e.g. zeroed\)"),
    "replaced": (lambda p: setattr(p, "grad", None if p.grad is None else p.grad.clone()),
                 "replaced by another tensor"),
}


@pytest.mark.parametrize("mode", ["matrix", "gramian", "auto"])
@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("call", ["backward", "apply_"])
def test_a_change_of_the_heads_grad_between_calls_is_refused_before_anything_moves(
        mode: str, change: str, call: str) -> None:
    net, buf, micro = _one_backward(mode)
    edit, match = CHANGES[change]
    for p in net.heads.parameters():
        edit(p)
    heads = [None if p.grad is None else p.grad.clone() for p in net.heads.parameters()]
    matrix = None if buf.matrix is None else buf.matrix.clone()
    with pytest.raises(RuntimeError, match=rf"{call}\(\): the .grad of head_params\[0\] "
                                           rf"\(shape \(1, 4\)\) was {match}.*buf.reset\(\)"):
        if call == "backward":
            buf.backward(net.losses(*micro[1]))
        else:
            buf.apply_(UPGrad())
    for p, before in zip(net.heads.parameters(), heads):
        assert (p.grad is None) if before is None else torch.equal(p.grad, before)
    assert all(p.grad is None for p in net.trunk.parameters())
    if matrix is not None:
        assert buf.matrix is not None and torch.equal(buf.matrix, matrix)
    buf.reset()  # the recovery: the heads as before the step (None here), nothing held
    assert all(p.grad is None for p in net.parameters())
    assert buf.matrix is None


@pytest.mark.parametrize("seed", [0, 1])
def test_the_trunk_grad_may_change_between_calls(seed: int) -> None:
    """The trunk's part of the step is in the buffer, not in its ``.grad``: a trunk
    ``.grad`` cleared between the calls (no heads) drops what it held before the step only;
    the step's update is that of a run that never had it."""
    runs = []
    for cleared in (False, True):
        net, buf, micro = _one_backward(heads=False, seed=seed)
        buf.backward(net.losses(*micro[1]))
        if cleared:
            first = next(net.trunk.parameters())
            first.grad = torch.full_like(first, 7.0)  # an earlier step's gradient...
            first.grad.zero_()  # ...zeroed in place before apply_
            first.grad = None
        buf.apply_(UPGrad())
        runs.append([p.grad for p in net.trunk.parameters()])
    for a, b in zip(*runs):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["matrix", "gramian", "auto"])
@pytest.mark.parametrize("seed", [0, 1])
def test_reset_puts_the_heads_grad_back_as_before_the_step(mode: str, seed: int) -> None:
    net = Net(3, 4, 3, seed)
    buf = TaskGradBuffer(net.trunk.parameters(), net.heads.parameters(), mode=mode,
                         modules=net.trunk)
    g = torch.Generator().manual_seed(seed)
    before = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in net.heads.parameters()]
    for p, b in zip(net.heads.parameters(), before):
        p.grad = b.clone()
    held = [p.grad for p in net.heads.parameters()]
    for x, y in batches(seed, 1, 3, 3)[0]:
        buf.backward(net.losses(x, y))
    assert not torch.equal(held[0], before[0])  # the backward added into them
    buf.reset()
    for p, b, same in zip(net.heads.parameters(), before, held):
        assert p.grad is same  # the same tensors, their values as before the step
        assert torch.equal(p.grad, b)
    assert all(p.grad is None for p in net.trunk.parameters())
    assert buf.matrix is None


def test_reset_keep_weights_keeps_the_window_and_reset_drops_it() -> None:
    net = Net(3, 4, 2, 0)
    buf = TaskGradBuffer(net.trunk.parameters(), net.heads.parameters(), update_every=3)
    micro = batches(0, 1, 3, 2)[0]
    buf.backward(net.losses(*micro[0]))
    buf.apply_(UPGrad())
    buf.backward(net.losses(*micro[1]))
    buf.reset(keep_weights=True)
    state = buf.state_dict()
    assert state["step"] == 1 and state["weights"] is not None
    buf.reset()
    assert buf.state_dict()["weights"] is None
    with pytest.raises(ValueError, match="Invalid keep_weights: 1"):
        buf.reset(keep_weights=1)  # type: ignore[arg-type]


def test_a_leaf_given_the_plain_gradient_is_watched_as_a_head() -> None:
    """``other_params="sum"``: a learnable scale in neither list gets ``.grad +=`` its plain
    gradient in each ``backward``, so a change of it between the calls is refused too."""
    net = Net(3, 4, 2, 0)
    scale = nn.Parameter(torch.ones((), dtype=torch.float64))
    buf = TaskGradBuffer(net.trunk.parameters(), net.heads.parameters(), other_params="sum")
    micro = batches(0, 1, 3, 2)[0]
    x, y = micro[0]
    buf.backward(net.task_losses(net.features(x) * scale, y))
    assert scale.grad is not None
    scale.grad = None
    with pytest.raises(RuntimeError, match=r"the .grad of 'a parameter' \(other_params='sum'\) "
                                           r"\(shape \(\)\) was set to None"):
        buf.apply_(UPGrad())
    buf.reset()
    assert scale.grad is None and all(p.grad is None for p in net.parameters())
