"""The balanced step: equivalence with the plain step, micro-batches, stats, errors."""

from __future__ import annotations

import math

import pytest
import torch

from gradbalance import TaskGradBuffer, balanced_backward
from gradbalance.balancers import Constant, Mean, Sum
from support.helpers import (
    TRUNKS,
    assert_close_lists,
    assert_rel_close_lists,
    build,
    grads_of,
    losses_of,
)


def plain_grads(kind: str, scale: float = 1.0, weights: list[float] | None = None,
                dtype: torch.dtype = torch.float32):
    """Reference: the unbalanced step sum(losses).backward() on a fresh model."""
    model, x, y = build(kind, dtype=dtype)
    losses = losses_of(model, x, y)
    w = torch.ones(3, dtype=dtype) if weights is None else torch.tensor(weights, dtype=dtype)
    (scale * (w * losses).sum()).backward()
    return grads_of(model.shared_parameters()), grads_of(model.head_parameters())


@pytest.mark.parametrize("kind", TRUNKS)
@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)],
                         ids=["f64", "f32"])
def test_sum_equals_plain_backward(kind: str, dtype: torch.dtype, rtol: float) -> None:
    # float32: the K rows are summed in another order than autograd's accumulation, a few
    # ulps per entry (1.6e-6 relative seen on the CNN); float64 checks the algebra tightly.
    model, x, y = build(kind, dtype=dtype)
    balanced_backward(losses_of(model, x, y), Sum(), shared_params=model.shared_parameters(),
                      head_params=model.head_parameters())
    trunk_ref, heads_ref = plain_grads(kind, dtype=dtype)
    assert_rel_close_lists(grads_of(model.shared_parameters()), trunk_ref, rtol=rtol)
    assert_rel_close_lists(grads_of(model.head_parameters()), heads_ref, rtol=rtol)


@pytest.mark.parametrize("kind", TRUNKS)
def test_two_micro_batches_equal_full_batch(kind: str) -> None:
    # float64: in float32 the two routes differ by reduction-order rounding (~4e-6).
    model, x, y = build(kind, dtype=torch.float64)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        buf.backward(losses_of(model, xs, ys) / 2)
    stats = buf.apply_(Sum())
    trunk_ref, heads_ref = plain_grads(kind, dtype=torch.float64)
    assert_close_lists(grads_of(model.shared_parameters()), trunk_ref)
    assert_close_lists(grads_of(model.head_parameters()), heads_ref)
    assert stats.num_backward == 2
    full = losses_of(*build(kind, dtype=torch.float64)).detach()
    torch.testing.assert_close(stats.losses, full, rtol=1e-6, atol=1e-7)


def test_mean_and_constant_weights() -> None:
    model, x, y = build("mlp")
    balanced_backward(losses_of(model, x, y), Constant([0.5, 2.0, -1.0]),
                      shared_params=model.shared_parameters(),
                      head_params=model.head_parameters())
    trunk_ref, _ = plain_grads("mlp", weights=[0.5, 2.0, -1.0])
    assert_close_lists(grads_of(model.shared_parameters()), trunk_ref)

    model, x, y = build("mlp")
    stats = balanced_backward(losses_of(model, x, y), Mean(),
                              shared_params=model.shared_parameters(),
                              head_params=model.head_parameters())
    trunk_ref, _ = plain_grads("mlp", scale=1 / 3)
    assert_close_lists(grads_of(model.shared_parameters()), trunk_ref)
    assert stats.weights is not None
    torch.testing.assert_close(stats.weights, torch.full((3,), 1 / 3, dtype=torch.float64))


def test_adds_into_existing_grad_and_never_steps() -> None:
    model, x, y = build("mlp")
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    balanced_backward(losses_of(model, x, y), Sum(), shared_params=model.shared_parameters(),
                      head_params=model.head_parameters())
    trunk_ref, heads_ref = plain_grads("mlp")
    assert_close_lists(grads_of(model.shared_parameters()), [g + 1 for g in trunk_ref])
    assert_close_lists(grads_of(model.head_parameters()), [g + 1 for g in heads_ref])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_buffer_is_reused_and_reset_between_steps() -> None:
    model, x, y = build("mlp")
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    buf.backward(losses_of(model, x, y))
    buf.apply_(Sum())
    storage = buf._engine.matrix.data_ptr()  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    buf.backward(losses_of(model, x, y))
    buf.apply_(Sum())
    assert buf._engine.matrix.data_ptr() == storage  # type: ignore[union-attr]
    trunk_ref, _ = plain_grads("mlp")
    assert_close_lists(grads_of(model.shared_parameters()), trunk_ref)


def test_stats_from_hand_built_gradients() -> None:
    # Two tasks on w = (a, b): L1 = 3a + 4b, L2 = -4a + 3b -> orthogonal rows of norm 5.
    w = torch.zeros(2, requires_grad=True)
    losses = torch.stack([w @ torch.tensor([3.0, 4.0]), w @ torch.tensor([-4.0, 3.0])])
    stats = balanced_backward(losses, Sum(), shared_params=[w])
    torch.testing.assert_close(stats.task_norms, torch.tensor([5.0, 5.0], dtype=torch.float64))
    torch.testing.assert_close(stats.cosine, torch.eye(2, dtype=torch.float64))
    torch.testing.assert_close(stats.update_norm, torch.tensor(math.sqrt(50), dtype=torch.float64))
    torch.testing.assert_close(stats.cosine_to_update,
                               torch.full((2,), 1 / math.sqrt(2), dtype=torch.float64))
    assert torch.equal(w.grad, torch.tensor([-1.0, 7.0]))
    assert not stats.found_inf


def test_clip_after_step_behaves_as_seed_003() -> None:
    w = torch.tensor([3.0, 4.0], requires_grad=True)
    loss = (w * torch.tensor([30.0, 40.0])).sum()
    balanced_backward([loss], Sum(), shared_params=[w])
    assert torch.equal(w.grad, torch.tensor([30.0, 40.0]))
    before = torch.nn.utils.clip_grad_norm_([w], max_norm=1.0)
    assert before.item() == 50.0
    torch.testing.assert_close(w.grad, torch.tensor([0.6, 0.8]))


# -- errors --------------------------------------------------------------------------------

def _w() -> torch.Tensor:
    return torch.ones(2, requires_grad=True)


def test_error_losses_not_vector() -> None:
    w = _w()
    with pytest.raises(ValueError, match=r"losses must be a 1-D tensor.*shape \(2, 2\)"):
        balanced_backward(torch.stack([w, w]), Sum(), shared_params=[w])
    with pytest.raises(ValueError, match=r"losses\[1\] must be a scalar tensor, got \(2,\)"):
        balanced_backward([w.sum(), w * 2], Sum(), shared_params=[w])
    with pytest.raises(ValueError, match="got float"):
        balanced_backward(1.0, Sum(), shared_params=[w])  # type: ignore[arg-type]


def test_error_task_count_changes_between_calls() -> None:
    w = _w()
    buf = TaskGradBuffer([w])
    buf.backward([w.sum(), (2 * w).sum()])
    with pytest.raises(ValueError, match="losses has 3 tasks but 2 were expected"):
        buf.backward([w.sum(), w.sum(), w.sum()])


def test_error_parameter_shared_and_head() -> None:
    w, h = _w(), _w()
    with pytest.raises(ValueError, match=r"head_params\[1\].*also in shared_params"):
        TaskGradBuffer([w], head_params=[h, w])


def test_error_empty_parameter_lists() -> None:
    with pytest.raises(ValueError, match="shared_params is empty"):
        TaskGradBuffer([])


def test_error_apply_before_backward() -> None:
    buf = TaskGradBuffer([_w()])
    with pytest.raises(RuntimeError, match=r"apply_\(\) called before any backward\(\)"):
        buf.apply_(Sum())


def test_error_balancer_built_for_other_k() -> None:
    w = _w()
    with pytest.raises(ValueError, match="losses has 2 tasks but 3 were expected"):
        balanced_backward([w.sum(), w.sum()], Mean(num_tasks=3), shared_params=[w])


def test_nonfinite_without_scaler_raises_and_leaves_grad() -> None:
    from gradbalance import NonFiniteGradientError

    w = _w()
    w.grad = torch.full((2,), 7.0)
    loss = (w * torch.tensor([float("inf"), 1.0])).sum()
    with pytest.raises(NonFiniteGradientError, match="inf or NaN"):
        balanced_backward([loss, w.sum()], Sum(), shared_params=[w])
    assert torch.equal(w.grad, torch.full((2,), 7.0))


def test_constant_rejects_bad_weights() -> None:
    with pytest.raises(ValueError, match=r"Invalid weights: \[1.0, nan\]"):
        Constant([1.0, float("nan")])


def test_balanced_backward_forwards_every_buffer_option() -> None:
    import inspect

    # update_every needs a next step, which a one-shot call does not have; modules serves
    # mode="gramian", whose hooks must exist before the forward (refused here), and
    # batch_dim=0, which takes the rows route here (docs/per_sample.md).
    per_step = {"shared_params", "head_params", "num_tasks", "update_every", "modules",
                "batch_dim"}
    options = set(inspect.signature(TaskGradBuffer).parameters) - per_step
    assert options <= set(inspect.signature(balanced_backward).parameters)
    w = _w()
    with pytest.raises(ValueError, match="Invalid process_group: 'global'"):
        balanced_backward([w.sum()], Sum(), shared_params=[w], process_group="global")
    balanced_backward([(3 * w).sum()], Sum(), shared_params=[w], process_group="local")
    assert torch.equal(w.grad, torch.full((2,), 3.0))


def test_loss_scale_is_kept_as_a_tensor() -> None:
    w = _w()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**7)
    assert scaler.is_enabled()
    stats = balanced_backward([(3 * w).sum()], Sum(), shared_params=[w], scaler=scaler)
    assert isinstance(stats.loss_scale_tensor, torch.Tensor)
    assert stats.loss_scale == 2.0**7
    assert torch.equal(w.grad, torch.full((2,), 3.0 * 2**7))
