"""One buffer, one thread per step: a concurrent call, or a call from another thread than the
one that began the step, raises before anything moves (docs/loop.md, "One buffer per loop")."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch

from gradbalance import TaskGradBuffer
from gradbalance.balancers import PCGrad, UPGrad
from support.helpers import build, grads_of, losses_of


def _in_thread(call: Any) -> BaseException | None:
    """Run ``call`` in a new thread; what it raised, or None."""
    raised: list[BaseException] = []

    def body() -> None:
        try:
            call()
        except BaseException as error:  # handed back to the test
            raised.append(error)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(timeout=60)
    return raised[0] if raised else None


@pytest.mark.parametrize(("kind", "k"), [("mlp", 2), ("mlp", 4), ("cnn", 3)])
def test_another_thread_cannot_continue_a_step(kind: str, k: int) -> None:
    model, x, y = build(kind, num_tasks=k, dtype=torch.float64)
    twin = copy.deepcopy(model)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    twin_buf = TaskGradBuffer(twin.shared_parameters(), twin.head_parameters())
    balancer, twin_balancer = UPGrad(), UPGrad()
    buf.backward(losses_of(model, x, y))
    twin_buf.backward(losses_of(twin, x, y))
    heads = [p.grad.clone() for p in model.head_parameters()]
    for call in (lambda: buf.backward(losses_of(model, x, y)), lambda: buf.apply_(balancer)):
        error = _in_thread(call)
        assert isinstance(error, RuntimeError) and "another thread" in str(error)
    assert all(torch.equal(p.grad, h) for p, h in zip(model.head_parameters(), heads))
    assert all(p.grad is None for p in model.shared_parameters())
    buf.apply_(balancer)  # the owning thread finishes the step: as if nothing happened
    twin_buf.apply_(twin_balancer)
    for g, e in zip(grads_of(list(model.parameters())), grads_of(list(twin.parameters()))):
        assert torch.equal(g, e)
    # the step ended: another thread may run the next one
    assert _in_thread(lambda: (buf.backward(losses_of(model, x, y)), buf.apply_(balancer))) \
        is None


def test_reset_frees_a_step_begun_in_another_thread() -> None:
    model, x, y = build("mlp")
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    assert _in_thread(lambda: buf.backward(losses_of(model, x, y))) is None
    buf.reset()
    buf.backward(losses_of(model, x, y))
    buf.apply_(PCGrad())


def test_a_failed_first_check_does_not_claim_the_buffer() -> None:
    model, x, y = build("mlp", num_tasks=3)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), num_tasks=3)
    with pytest.raises(ValueError):
        buf.backward(losses_of(model, x, y)[:2])
    assert _in_thread(lambda: (buf.backward(losses_of(model, x, y)), buf.apply_(PCGrad()))) \
        is None


@pytest.mark.parametrize("call", ["backward", "apply_"])
def test_a_concurrent_call_raises(call: str) -> None:
    """Thread A is inside ``backward`` (held in an autograd hook); B's call raises at once
    and A's step completes unharmed."""
    model, x, y = build("mlp", num_tasks=3, dtype=torch.float64)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    inside, release = threading.Event(), threading.Event()
    feats = model.trunk(x)

    def hold(grad: torch.Tensor) -> torch.Tensor:
        inside.set()
        release.wait(timeout=30)
        return grad

    feats.register_hook(hold)
    losses = torch.stack([torch.nn.functional.mse_loss(h(feats).squeeze(-1), y[:, i])
                          for i, h in enumerate(model.heads)])
    first = threading.Thread(target=lambda: buf.backward(losses))
    first.start()
    assert inside.wait(timeout=30)
    try:
        with pytest.raises(RuntimeError, match="while another thread is inside"):
            if call == "backward":
                buf.backward(losses_of(model, x, y))
            else:
                buf.apply_(PCGrad())
    finally:
        release.set()
        first.join(timeout=60)
    assert buf.matrix is not None  # A's backward went through
