"""``batch_dim=0`` refuses, before anything moves, what would make the update wrong."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, GradDrop, UPGrad


def _grads(model: nn.Module) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _setup(model: nn.Module) -> TaskGradBuffer:
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    return TaskGradBuffer(model.parameters(), modules=model, batch_dim=0)


def _unchanged(model: nn.Module) -> bool:
    return all(p.grad is not None and bool((p.grad == 0.5).all()) for p in model.parameters())


def test_a_layer_output_modified_in_place_is_refused() -> None:
    """An in-place ReLU after a Linear rewrites the recorded output: its gradient would be
    the ReLU's, and the Gramian wrong."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
    buf = _setup(model)
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"output of layer '0' \(Linear\) was modified in "
                                         r"place.*version 0 -> 1.*inplace=False"):
        buf.backward(model(x)[:, 0] ** 2)
    assert _unchanged(model)
    model[1].inplace = False  # the same layers out of place: the step runs
    buf.backward(model(x)[:, 0] ** 2)
    buf.apply_(UPGrad())
    assert not _unchanged(model)


@pytest.mark.parametrize("norm", [nn.BatchNorm1d(8), nn.BatchNorm1d(8, affine=False)])
def test_batchnorm_in_training_mode_is_refused(norm: nn.Module) -> None:
    model = nn.Sequential(nn.Linear(3, 8), norm, nn.Linear(8, 1))
    buf = _setup(model)
    losses = model(torch.randn(4, 3))[:, 0] ** 2
    with pytest.raises(ValueError, match=r"layer '1' \(BatchNorm1d in training mode\).*"
                                         r"GroupNorm or nn.LayerNorm.*eval"):
        buf.backward(losses)
    assert _unchanged(model)
    model.eval()  # eval mode: a per-sample layer; the step now runs
    buf.backward(model(torch.randn(4, 3))[:, 0] ** 2)
    buf.apply_(UPGrad())
    assert not _unchanged(model)


class _Synced(nn.Module):
    """A trunk holding a SyncBatchNorm (its CPU forward needs a process group; the refusal
    reads the modules, not the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)
        self.sync = nn.SyncBatchNorm(1)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


def test_syncbatchnorm_in_training_mode_is_refused() -> None:
    model = _Synced()
    buf = _setup(model)
    with pytest.raises(ValueError, match=r"layer 'sync' \(SyncBatchNorm in training mode\)"):
        buf.backward(model(torch.randn(4, 3))[:, 0])
    assert _unchanged(model)


def test_wrong_loss_shapes_name_the_expected_shape() -> None:
    model = nn.Linear(3, 2)
    buf = _setup(model)
    for bad in (model(torch.randn(4, 3)).unsqueeze(-1), model(torch.randn(4, 3)).sum()):
        with pytest.raises(ValueError, match=r"shape \[B\].*or \[B, K\].*got \("):
            buf.backward(bad)
    with pytest.raises(ValueError, match="got list"):
        buf.backward([model(torch.randn(4, 3)).sum()])
    buf.reset()
    assert _unchanged(model)


def test_batch_mismatch_is_refused() -> None:
    """A layer on the losses' graph whose input has another batch than the losses; a stray
    forward under grad, off that graph, is no mismatch (docs/per_sample.md)."""
    model = nn.Linear(3, 1)
    buf = _setup(model)
    model(torch.randn(5, 3))  # a stray forward under grad: dropped, not refused
    losses = model(torch.randn(5, 3))[:4, 0]
    with pytest.raises(ValueError, match=r"recorded inputs of shapes \[\(5, 3\)\] but the losses "
                                         r"have 4 samples.*no slice"):
        buf.backward(losses)
    assert _unchanged(model)
    buf.backward(model(torch.randn(4, 3))[:, 0])  # the records were dropped


def test_rows_balancers_are_refused() -> None:
    model = nn.Linear(3, 1)
    buf = _setup(model)
    buf.backward(model(torch.randn(4, 3))[:, 0] ** 2)
    with pytest.raises(TypeError, match=r"GradDrop needs the per-sample gradient rows.*without "
                                        r"batch_dim"):
        buf.apply_(GradDrop())
    assert _unchanged(model)
    buf.apply_(MGDA())
    assert not _unchanged(model)


def test_weight_used_outside_its_layer_is_refused() -> None:
    model = nn.Linear(3, 3)
    buf = _setup(model)
    x = torch.randn(4, 3)
    losses = nn.functional.linear(model(x), model.weight).sum(1)
    with pytest.raises(RuntimeError, match=r"'weight' is used 2 times.*recorded 1 calls"):
        buf.backward(losses)
    assert _unchanged(model)


def test_modules_are_required_and_must_hold_the_parameters() -> None:
    model, other = nn.Linear(3, 1), nn.Linear(3, 1)
    with pytest.raises(ValueError, match="batch_dim=0 needs modules="):
        TaskGradBuffer(model.parameters(), batch_dim=0)
    with pytest.raises(ValueError, match=r"held by no module of modules"):
        TaskGradBuffer([*model.parameters(), *other.parameters()], modules=model, batch_dim=0)
    with pytest.raises(ValueError, match="batch_dim must be 0"):
        TaskGradBuffer(model.parameters(), modules=model, batch_dim=1)


def test_a_sequence_first_attention_is_refused() -> None:
    """``batch_first=False``: the batch is dim 1 of the inputs, so no row is one sample."""
    attention = nn.MultiheadAttention(4, 2)
    buf = _setup(attention)
    x = torch.randn(2, 3, 4)  # [T, B, E]
    losses = attention(x, x, x)[0].pow(2).sum((0, 2))
    with pytest.raises(ValueError, match=r"layer '' recorded inputs of shapes \[\(2, 3, 4\)\] "
                                         r"but the losses have 3 samples"):
        buf.backward(losses)
    assert _unchanged(attention)


def test_a_used_output_without_the_batch_first_is_refused() -> None:
    """A GRU's final state ``[layers, B, H]`` reaching the losses cannot be split by sample."""
    gru = nn.GRU(3, 4, batch_first=True)
    buf = _setup(gru)
    _, last = gru(torch.randn(5, 2, 3))
    with pytest.raises(ValueError, match=r"layer '' \(GRU\) returned an output of shape "
                                         r"\(1, 5, 4\).*batch_first=True"):
        buf.backward(last[0].pow(2).sum(1))
    assert _unchanged(gru)


def test_a_fallback_call_without_a_tensor_argument_is_refused() -> None:
    class Bias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = nn.Parameter(torch.ones(3))

        def forward(self, batch: int) -> Tensor:
            return self.b.expand(batch, 3)

    model = Bias()
    buf = _setup(model)
    with pytest.raises(ValueError, match=r"\(Bias\) was called with no tensor argument.*dim 0 "
                                         r"of a tensor argument"):
        buf.backward(model(4).pow(2).sum(1))
    assert _unchanged(model)


def test_failed_apply_leaves_balancer_and_grads() -> None:
    model = nn.Linear(3, 1)
    buf = _setup(model)
    buf.backward(model(torch.randn(4, 3))[:, 0] ** 2)
    balancer = UPGrad(num_tasks=5)  # 4 samples: refused by the balancer's own check
    with pytest.raises(ValueError):
        buf.apply_(balancer)
    assert _unchanged(model)


def test_options_of_the_task_route_are_refused() -> None:
    model = nn.Linear(3, 1)
    for option in ({"mode": "gramian"}, {"num_tasks": 4}, {"other_params": "sum"},
                   {"passes": "loop"}):
        with pytest.raises(ValueError, match=rf"\['{next(iter(option))}'\] are not available "
                                             r"with batch_dim=0"):
            TaskGradBuffer(model.parameters(), modules=model, batch_dim=0, **option)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Invalid process_group: 'world'"):
        TaskGradBuffer(model.parameters(), modules=model, batch_dim=0, process_group="world")
    buf = _setup(model)
    with pytest.raises(ValueError, match="features= is for mode='features'"):
        buf.backward(model(torch.randn(4, 3))[:, 0], features=torch.ones(4, 3))
    assert buf.mode == "per_sample" and buf.state_dict() == {"steps_begun": 0}
    buf.load_state_dict({})
    with pytest.raises(ValueError, match=r"keys \['count'\].*keeps no state"):
        buf.load_state_dict({"count": 3})
    buf.load_state_dict({"steps_begun": 3})
    assert buf.state_dict() == {"steps_begun": 3}
    buf.load_state_dict({"steps_begun": 0})
    buf.backward(model(torch.randn(4, 3))[:, 0])
    with pytest.raises(ValueError, match=r"clip=.*not available with batch_dim=0"):
        buf.apply_(UPGrad(), clip=object())  # type: ignore[arg-type]
    assert _unchanged(model)


def test_a_parameter_in_neither_list_is_refused() -> None:
    model, extra = nn.Linear(3, 1), nn.Parameter(torch.ones(1))
    buf = _setup(model)
    with pytest.raises(ValueError, match="neither"):
        buf.backward(model(torch.randn(4, 3))[:, 0] * extra)
    assert _unchanged(model) and extra.grad is None


def test_the_buffers_properties_read_with_batch_dim() -> None:
    """``matrix`` and ``layer_routes`` read None with ``batch_dim=0`` (no ``[K, P]`` rows, no
    gramian-mode routes), before and during a step, instead of an ``AttributeError``."""
    model = nn.Linear(3, 1)
    buf = TaskGradBuffer(model.parameters(), modules=model, batch_dim=0)
    assert buf.matrix is None and buf.layer_routes is None and buf.mode == "per_sample"
    buf.backward(model(torch.randn(4, 3))[:, 0] ** 2)
    assert buf.matrix is None and buf.layer_routes is None


def test_a_refused_first_backward_begins_no_step_and_a_failed_one_counts() -> None:
    """``steps_begun`` (compared across data-parallel ranks) counts a step from its first
    ``backward`` past the checks, as the task buffer does: a first micro-batch refused by the
    mixing check begins none (the call is repeated, fixed), one that failed in its passes
    counts, dropped (the batch is gone, as on a rank where it failed elsewhere)."""
    model = nn.Linear(3, 1)
    buf = TaskGradBuffer(model.parameters(), modules=model, batch_dim=0)
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="mix"):
        out = model(x)
        buf.backward((out - out.mean(0))[:, 0] ** 2)
    out = model(x)

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("hook failed")

    out.register_hook(fail)
    assert buf.state_dict() == {"steps_begun": 0}
    with pytest.raises(RuntimeError, match="hook failed"):
        buf.backward(out[:, 0] ** 2)
    assert buf.state_dict() == {"steps_begun": 1}
    buf.backward(model(x)[:, 0] ** 2)
    buf.apply_(UPGrad())
    assert buf.state_dict() == {"steps_begun": 2}
