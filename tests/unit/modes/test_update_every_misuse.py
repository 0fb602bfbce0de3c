"""update_every refuses what would reuse wrong weights: a damaged cached state on load, another
balancer object in the middle of a window (docs/loop.md, "update_every")."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Mean, UPGrad
from support.helpers import build, grads_of, losses_of


def _stepped(k: int, seed: int, update_every: int = 3) -> tuple[TaskGradBuffer, Any]:
    """A buffer after one refresh step of an UPGrad; its model, batch and the balancer."""
    model, x, y = build("mlp", num_tasks=k, seed=seed, dtype=torch.float64)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                         update_every=update_every)
    balancer = UPGrad()
    buf.backward(losses_of(model, x, y))
    buf.apply_(balancer)
    return buf, (model, x, y, balancer)


def _damaged(weights: torch.Tensor) -> dict[str, Any]:
    k = weights.shape[0]
    nan, inf = weights.clone(), weights.clone()
    nan[k - 1] = float("nan")
    inf[0] = float("inf")
    return {"more tasks": torch.cat([weights, weights[:1]]), "fewer tasks": weights[:-1],
            "column [K, 1]": weights[:, None], "nan": nan, "inf": inf,
            "integers": torch.ones(k, dtype=torch.int64), "a list": weights.tolist(),
            "empty": weights[:0]}


@pytest.mark.parametrize(("k", "seed"), [(2, 0), (3, 1), (5, 2)])
def test_damaged_cached_weights_are_refused_and_nothing_moves(k: int, seed: int) -> None:
    buf, _ = _stepped(k, seed)
    before = copy.deepcopy(buf.state_dict())
    for label, bad in _damaged(before["weights"]).items():
        with pytest.raises(ValueError, match=r"state_dict\['weights'\]"):
            buf.load_state_dict({**before, "weights": bad})
        after = buf.state_dict()
        assert after["step"] == before["step"], label
        assert torch.equal(after["weights"], before["weights"]), label


@pytest.mark.parametrize("k", [2, 4])
def test_cached_weights_of_another_k_are_refused_by_a_buffer_built_with_k(k: int) -> None:
    saver, _ = _stepped(k + 1, 0)
    model, _, _ = build("mlp", num_tasks=k)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), num_tasks=k,
                         update_every=3)
    with pytest.raises(ValueError, match=f"num_tasks={k}"):
        buf.load_state_dict(saver.state_dict())
    assert buf.state_dict()["weights"] is None


def test_loaded_weights_set_an_unknown_k() -> None:
    """A buffer built without K takes it from the loaded weights: losses of another K are
    refused by backward, before anything moves."""
    saver, _ = _stepped(3, 0)
    model, x, y = build("mlp", num_tasks=4)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), update_every=3)
    buf.load_state_dict(saver.state_dict())
    with pytest.raises(ValueError, match="3"):
        buf.backward(losses_of(model, x, y))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(("k", "seed"), [(2, 0), (3, 4)])
def test_another_balancer_mid_window_is_refused_and_the_step_stays(k: int, seed: int) -> None:
    buf, (model, x, y, first) = _stepped(k, seed)
    twin_buf, (twin, tx, ty, twin_balancer) = _stepped(k, seed)
    for b, m, xx, yy in ((buf, model, x, y), (twin_buf, twin, tx, ty)):
        m.zero_grad(set_to_none=True)
        b.backward(losses_of(m, xx, yy))
    with pytest.raises(ValueError, match="same balancer object"):
        buf.apply_(UPGrad())  # same class, another object
    with pytest.raises(ValueError, match="same balancer object"):
        buf.apply_(Mean())
    assert all(p.grad is None for p in model.shared_parameters())  # nothing written
    stats = buf.apply_(first)  # the step is still there: the right balancer finishes it
    twin_stats = twin_buf.apply_(twin_balancer)
    assert stats.weights_reused and twin_stats.weights_reused
    for g, e in zip(grads_of(model.shared_parameters()), grads_of(twin.shared_parameters())):
        assert torch.equal(g, e)


def test_a_new_balancer_is_taken_at_a_refresh_after_reset_or_after_a_load() -> None:
    buf, (model, x, y, _) = _stepped(3, 0, update_every=2)
    state = buf.state_dict()
    buf.reset()  # a new window: the next step refreshes with whatever balancer it gets
    buf.backward(losses_of(model, x, y))
    assert not buf.apply_(Mean()).weights_reused
    buf.load_state_dict(state)  # loaded weights: the first balancer of a reuse step owns them
    owner = UPGrad()
    buf.backward(losses_of(model, x, y))
    assert buf.apply_(owner).weights_reused
