"""``update_every`` and checkpoints with ``batch_dim=0`` (docs/per_sample.md): a step between
refreshes reuses the last weights (the same number of objectives, else refused before
anything moves) and equals the matrix route with the same ``update_every``; a run split by
a save and a load equals the uninterrupted run bit for bit."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, NashMTL, UPGrad
from gradbalance.clip import TaskClip

from .per_sample_runs import batches, close, losses_of, models, run

pytestmark = pytest.mark.usefixtures("float64")


@pytest.mark.parametrize("name", ["mlp", "cnn", "tokens"])
@pytest.mark.parametrize("tasks", [1, 3])
@pytest.mark.parametrize("balancer", [UPGrad, NashMTL])
def test_update_every_equals_matrix_route(name: str, tasks: int, balancer: type) -> None:
    trunk, heads, inputs = models(name, tasks, 3)
    data = batches(inputs, [4] * 5, tasks)
    got, got_stats = run(trunk, heads, data, balancer(), True, update_every=3)
    want, want_stats = run(trunk, heads, data, balancer(), False, update_every=3)
    assert close(got, want)
    assert [s.weights_reused for s in got_stats] == [False, True, True, False, True]
    assert [s.weights_reused for s in want_stats] == [False, True, True, False, True]
    for step in (1, 2, 4):  # the reused weights are the last refresh's
        assert got_stats[step].weights is not None and got_stats[step - 1].weights is not None
        assert torch.equal(got_stats[step].weights, got_stats[3 * (step // 3)].weights)
        assert got_stats[step].task_norms is None and got_stats[step].update_norm is None


def test_update_every_with_a_row_clipper_equals_matrix_route() -> None:
    """A reused step has no per-objective norms: the cached weights act on the unclipped
    gradients there, as on the matrix route."""
    trunk, heads, inputs = models("mlp", 2, 4)
    data = batches(inputs, [5] * 4, 2)
    got, _ = run(trunk, heads, data, MGDA(), True, clip=TaskClip(max_norm=0.2), update_every=2)
    want, _ = run(trunk, heads, data, MGDA(), False, clip=TaskClip(max_norm=0.2),
                  update_every=2)
    assert close(got, want)


def test_another_number_of_objectives_is_refused_on_a_reused_step() -> None:
    trunk, heads, inputs = models("mlp", 1, 5)
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0,
                         update_every=2)
    balancer = UPGrad()
    buf.backward(losses_of(trunk, heads, inputs(6), torch.randn(6, 1)))
    buf.apply_(balancer)
    params = [*trunk.parameters(), *heads.parameters()]
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    buf.backward(losses_of(trunk, heads, inputs(4), torch.randn(4, 1)))
    with pytest.raises(ValueError, match=r"reuses the 6 weights.*has 4 objectives.*reset\(\)"):
        buf.apply_(balancer)
    # refused before anything moves: the trunk's .grad as before, the heads' as the step's
    # backward left them (as a plain backward does); reset() puts the heads' back
    assert all(bool((p.grad == 0.5).all()) for p in trunk.parameters())
    assert all(not bool((p.grad == 0.5).all()) for p in heads.parameters())
    buf.reset()  # drops the cached weights too: the next step recomputes them
    assert all(bool((p.grad == 0.5).all()) for p in params)
    buf.backward(losses_of(trunk, heads, inputs(4), torch.randn(4, 1)))
    stats = buf.apply_(balancer)
    assert not stats.weights_reused and stats.weights is not None
    assert stats.weights.shape == (4,)


def test_a_reused_step_under_no_heads_and_another_balancer() -> None:
    trunk, _, inputs = models("mlp", 1, 6)
    buf = TaskGradBuffer(trunk.parameters(), modules=trunk, batch_dim=0, update_every=2)
    balancer = UPGrad()
    buf.backward(trunk(inputs(3)).pow(2).sum(1))
    buf.apply_(balancer)
    for p in trunk.parameters():
        p.grad = None
    buf.backward(trunk(inputs(3)).pow(2).sum(1))
    with pytest.raises(ValueError, match="another object than the UPGrad"):
        buf.apply_(UPGrad())
    assert all(p.grad is None for p in trunk.parameters())
    stats = buf.apply_(balancer)  # the step was left as it was
    assert stats.weights_reused and stats.per_task is not None
    assert stats.per_task.task_norms is None and stats.per_task.weights is not None


def _state(trunk: nn.Module, heads: nn.Module, opt: torch.optim.Optimizer,
           buf: TaskGradBuffer, balancer: NashMTL) -> bytes:
    out = io.BytesIO()
    torch.save({"trunk": trunk.state_dict(), "heads": heads.state_dict(),
                "opt": opt.state_dict(), "buf": buf.state_dict(),
                "balancer": balancer.state_dict()}, out)
    return out.getvalue()


def _training(steps: range, data: list[tuple[Tensor, Tensor]],
              saved: bytes | None) -> tuple[list[Tensor], bytes]:
    """Steps ``steps`` of a run (from ``saved`` when given, else from the seed); the
    parameters after each step and the checkpoint at the end."""
    trunk, heads, _ = models("mlp", 2, 7)
    opt = torch.optim.Adam([*trunk.parameters(), *heads.parameters()], lr=0.01)
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0,
                         update_every=3)
    balancer = NashMTL()
    if saved is not None:
        state: dict[str, Any] = torch.load(io.BytesIO(saved), weights_only=False)
        trunk.load_state_dict(state["trunk"])
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["opt"])
        buf.load_state_dict(state["buf"])
        balancer.load_state_dict(state["balancer"])
    after = []
    for step in steps:
        x, y = data[step]
        buf.backward(losses_of(trunk, heads, x, y))
        buf.apply_(balancer)
        opt.step()
        opt.zero_grad()
        after.append(torch.cat([p.detach().flatten() for p in
                                [*trunk.parameters(), *heads.parameters()]]))
    assert buf._per_sample is not None
    buf._per_sample.gramian.remove()
    return after, _state(trunk, heads, opt, buf, balancer)


@pytest.mark.parametrize("split", [2, 4])
def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(split: int) -> None:
    torch.manual_seed(8)
    data = batches(models("mlp", 2, 7)[2], [5] * 7, 2)
    whole, _ = _training(range(7), data, None)
    first, saved = _training(range(split), data, None)
    second, _ = _training(range(split, 7), data, saved)
    assert len(first + second) == len(whole)
    assert all(torch.equal(a, b) for a, b in zip(first + second, whole))


def test_state_dict_holds_the_counter_and_the_weights() -> None:
    model = nn.Linear(3, 1)
    buf = TaskGradBuffer(model.parameters(), modules=model, batch_dim=0, update_every=2)
    assert buf.state_dict() == {"update_every": 2, "step": 0, "weights": None,
                                "steps_begun": 0}
    buf.backward(model(torch.randn(4, 3))[:, 0] ** 2)
    assert buf.state_dict()["steps_begun"] == 0  # a step in progress is not counted
    stats = buf.apply_(UPGrad())
    state = buf.state_dict()
    assert state["step"] == 1 and state["steps_begun"] == 1 and stats.weights is not None
    assert torch.equal(state["weights"], stats.weights)
    with pytest.raises(ValueError, match="update_every=2 but this buffer has update_every=3"):
        TaskGradBuffer(model.parameters(), modules=model, batch_dim=0,
                       update_every=3).load_state_dict(state)
    with pytest.raises(ValueError, match=r"keys \['mode'\].*keeps no state but "
                                         r"update_every's"):
        buf.load_state_dict({**state, "mode": "matrix"})
    with pytest.raises(ValueError, match=r"state_dict\['weights'\].*inf/NaN"):
        buf.load_state_dict({**state, "weights": torch.tensor([1.0, float("nan")])})
    assert buf.state_dict()["step"] == 1  # the refused loads changed nothing


def test_scaled_reused_steps_equal_matrix_route() -> None:
    """Under a ``GradScaler`` the reused steps write ``s·∇ Σ wᵢ ℓᵢ`` as the matrix route does;
    a non-finite reused step is skipped and does not advance the counter."""
    trunk, heads, inputs = models("mlp", 1, 12)
    data = batches(inputs, [4] * 3, 1)
    params = [*trunk.parameters(), *heads.parameters()]
    results = []
    for per_sample in (True, False):
        kwargs: dict[str, Any] = {"modules": trunk, "batch_dim": 0} if per_sample else {}
        buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), update_every=2, **kwargs)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6)
        balancer, updates = MGDA(), []
        for x, y in data:
            for p in params:
                p.grad = None
            losses = losses_of(trunk, heads, x, y)
            buf.backward(losses if per_sample else losses.reshape(-1), scaler)
            stats = buf.apply_(balancer, scaler)
            assert not stats.found_inf
            updates.append(torch.cat([p.grad.flatten() for p in params if p.grad is not None]))
        results.append(updates)
        if per_sample:
            for p in params:
                p.grad = None
            step = buf.state_dict()["step"]
            buf.backward(losses_of(trunk, heads, *data[0]) * float("inf"), scaler)
            stats = buf.apply_(balancer, scaler)
            assert stats.found_inf and stats.weights_reused
            assert buf.state_dict()["step"] == step
            assert all(not bool(torch.isfinite(p.grad).all()) for p in params
                       if p.grad is not None)
            assert buf._per_sample is not None
            buf._per_sample.gramian.remove()
    assert close(results[0], results[1])
