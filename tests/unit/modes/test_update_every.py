"""update_every, persistent buffers, and Gramian-form PCGrad against the textbook algorithm."""

from __future__ import annotations

import copy

import pytest
import torch

from gradbalance import BALANCERS, TaskGradBuffer
from gradbalance.balancers import Mean
from support.balancers import textbook_pcgrad
from support.helpers import build, grads_of, losses_of
from support.perf import make_balancer

WEIGHTED_NAME = "upgrad" if "upgrad" in BALANCERS else "mean"


def _run(steps: int, update_every: int, mode: str = "matrix", state=None, start_model=None,
         t0: int = 0):
    """``steps`` SGD steps; returns per-step (stats, trunk grads, expected weighted grads)."""
    model, x, y = build("mlp", dtype=torch.float64) if start_model is None else start_model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    kwargs = {"modules": model.trunk} if mode == "gramian" else {}
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode=mode,
                         update_every=update_every, **kwargs)
    if state is not None:
        buf.load_state_dict(state)
    balancer = make_balancer(WEIGHTED_NAME)
    records = []
    for t in range(t0, t0 + steps):
        xs, ys = x + 0.1 * t, y
        feats = model.trunk(xs)
        losses = torch.stack([
            torch.nn.functional.mse_loss(h(feats).squeeze(-1), ys[:, k])
            for k, h in enumerate(model.heads)
        ])
        cached = buf._cache.weights
        # The reference update of a reused step: the gradient of Σ wₖ Lₖ, independently.
        expected = None
        if cached is not None and buf._cache.reuse_now():
            expected = torch.autograd.grad((cached * losses).sum(), model.shared_parameters(),
                                           retain_graph=True)
        buf.backward(losses, features=feats if mode == "features" else None)
        stats = buf.apply_(balancer)
        records.append((stats, grads_of(model.shared_parameters()), expected))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return records, buf, model


@pytest.mark.parametrize("mode", ["matrix", "gramian", "features"])
def test_update_every_reuses_weights_exactly(mode: str) -> None:
    records, _, _ = _run(7, 3, mode)
    reused = [stats.weights_reused for stats, _, _ in records]
    assert reused == [False, True, True, False, True, True, False]
    for t, (stats, grads, expected) in enumerate(records):
        assert stats.weights is not None
        refresh = records[t - t % 3][0].weights
        assert torch.equal(stats.weights, refresh)  # the very weights of the refresh step
        if stats.weights_reused:
            assert stats.task_norms is None and stats.cosine is None
            assert expected is not None
            for g, e in zip(grads, expected):
                torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)
    # the weights do change at a refresh (the model moved)
    assert not torch.equal(records[0][0].weights, records[3][0].weights)


def test_update_every_resumes_bit_identically() -> None:
    model, x, y = build("mlp", dtype=torch.float64)
    start = (copy.deepcopy(model), x, y)
    full, _, _ = _run(5, 3, start_model=(model, x, y))
    # Run 2 steps, save the buffer, continue 3 more steps in a fresh buffer.
    _, buf, moved = _run(2, 3, start_model=start)
    state = copy.deepcopy(buf.state_dict())
    assert state["step"] == 2 and state["weights"] is not None
    rest, _, _ = _run(3, 3, state=state, start_model=(moved, x, y), t0=2)
    for (a, ga, _), (b, gb, _) in zip(full[2:], rest):
        assert a.weights_reused == b.weights_reused
        assert torch.equal(a.weights, b.weights)
        assert all(torch.equal(u, v) for u, v in zip(ga, gb))


def test_update_every_errors() -> None:
    model, x, y = build("mlp")
    with pytest.raises(ValueError, match="Invalid update_every: 0"):
        TaskGradBuffer(model.shared_parameters(), update_every=0)
    matrix_only = [n for n, c in BALANCERS.items() if not c.from_gramian]
    if matrix_only:
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), update_every=2)
        buf.backward(losses_of(model, x, y))
        with pytest.raises(TypeError, match="not a weighted balancer"):
            buf.apply_(BALANCERS[matrix_only[0]]())
    buf = TaskGradBuffer(model.shared_parameters(), update_every=2)
    with pytest.raises(ValueError, match="update_every=3 but this buffer has update_every=2"):
        buf.load_state_dict({"update_every": 3, "step": 1, "weights": None})


def test_reset_forgets_cached_weights() -> None:
    model, x, y = build("mlp")
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), update_every=4)
    losses = losses_of(model, x, y)
    buf.backward(losses)
    buf.apply_(Mean())
    assert buf.state_dict()["weights"] is not None
    buf.reset()
    # reset() with no step begun counts the batch it abandons: ranks compare the count, and
    # every rank drops the batch together (docs/distributed.md); the K learned stays
    assert buf.state_dict() == {"update_every": 4, "step": 0, "weights": None, "steps_begun": 2,
                                "num_tasks": losses.shape[0]}


@pytest.mark.parametrize("mode", ["matrix", "features"])
def test_persistent_buffer_not_reallocated(mode: str) -> None:
    model, x, y = build("cnn")
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode=mode)
    pointers = []
    for _ in range(3):
        feats = model.trunk(x)
        losses = torch.stack([((h(feats).squeeze(-1) - y[:, k]) ** 2).mean()
                              for k, h in enumerate(model.heads)])
        buf.backward(losses, features=feats if mode == "features" else None)
        buf.apply_(Mean())
        pointers.append(buf._engine.matrix.data_ptr())  # type: ignore[union-attr]
        model.zero_grad(set_to_none=True)
    assert pointers[0] == pointers[1] == pointers[2]


# -- PCGrad in Gramian form against the textbook [K, P] algorithm ---------------------------

@pytest.mark.skipif("pcgrad" not in BALANCERS, reason="PCGrad not in the registry yet")
@pytest.mark.parametrize("mode", ["matrix", "gramian"])
def test_gramian_pcgrad_equals_textbook(mode: str) -> None:
    model, x, y = build("mlp", num_tasks=5, dtype=torch.float64)
    matrix = torch.stack([
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            loss, model.shared_parameters(), retain_graph=True)])
        for loss in losses_of(model, x, y)
    ])
    # The orders PCGrad will draw: one randperm(K) per task from its generator's state.
    probe = torch.Generator().manual_seed(123)
    orders = torch.stack([torch.randperm(5, generator=probe) for _ in range(5)])
    expected = textbook_pcgrad(matrix, orders).sum(dim=0)  # Yu et al. (2020), Algorithm 1
    assert (matrix @ matrix.T < 0).any()  # some conflicts, so projections happen

    seeded = torch.Generator().manual_seed(123)
    balancer = BALANCERS["pcgrad"](generator=seeded)  # type: ignore[call-arg]
    kwargs = {"modules": model.trunk} if mode == "gramian" else {}
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode=mode, **kwargs)
    buf.backward(losses_of(model, x, y))
    buf.apply_(balancer)
    actual = torch.cat([p.grad.reshape(-1) for p in model.shared_parameters()])
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12)
