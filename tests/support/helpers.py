"""Shared test fixtures: the three standard trunks with K regression heads."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance_lab.models import (
    MultiTaskModel,
    cnn_trunk,
    make_heads,
    mlp_trunk,
    regression_losses,
    transformer_trunk,
)

TRUNKS = ("mlp", "cnn", "transformer")


def build(kind: str, num_tasks: int = 3, batch: int = 8, seed: int = 0,
          dtype: torch.dtype = torch.float32) -> tuple[MultiTaskModel, Tensor, Tensor]:
    """A small model of ``kind``, an input batch and regression targets ``[B, K]``."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if kind == "mlp":
        trunk, width = mlp_trunk(16, 32, 3), 32
        x = torch.randn(batch, 16, generator=gen)
    elif kind == "cnn":
        trunk, width = cnn_trunk(4), 8
        x = torch.randn(batch, 1, 28, 28, generator=gen)
    elif kind == "transformer":
        trunk, width = transformer_trunk(d_model=16, num_layers=2, nhead=2), 16
        x = torch.randn(batch, 6, 16, generator=gen)
    else:
        raise ValueError(kind)
    model = MultiTaskModel(trunk, make_heads(width, num_tasks)).to(dtype)
    targets = torch.randn(batch, num_tasks, generator=gen).to(dtype)
    return model, x.to(dtype), targets


def losses_of(model: MultiTaskModel, x: Tensor, targets: Tensor) -> Tensor:
    return regression_losses(model(x), targets)


def grads_of(params: list[nn.Parameter]) -> list[Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]


def assert_close_lists(actual: list[Tensor], expected: list[Tensor], rtol: float = 1e-6,
                       atol: float = 1e-7) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol)


def assert_rel_close_lists(actual: list[Tensor], expected: list[Tensor],
                           rtol: float = 1e-6) -> None:
    """Each tensor within ``rtol`` of its reference in relative norm ‖a − e‖ / ‖e‖.

    Robust to float32 reduction-order rounding in single entries near zero, which an
    elementwise tolerance turns into spurious failures.
    """
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        scale = float(e.norm())
        error = float((a - e).norm())
        assert error <= rtol * max(scale, 1e-30), f"relative error {error / scale:.3g} > {rtol}"


class ItemInBackward(torch.autograd.Function):
    """Doubles its input; the backward reads a Python number, which vmap cannot batch."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return 2 * x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return grad * (float(grad.abs().sum().item() >= 0) * 2.0)


class Unbatchable(nn.Module):
    """:class:`ItemInBackward` as a module: a trunk layer the batched passes cannot cross."""

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = ItemInBackward.apply(x)
        return out


def optimizer_step(opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    """``scaler.step`` + ``scaler.update`` (or ``opt.step``), then ``zero_grad``."""
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)


def forced_buffer(model: MultiTaskModel, mode: str, passes: str, force: object = None
                  ) -> TaskGradBuffer:
    """A buffer over ``model`` in ``mode`` with ``passes``; in ``gramian`` mode, ``force`` (if
    given) pins every layer's route on its recorder."""
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode=mode,
                         passes=passes,  # type: ignore[arg-type]
                         **({"modules": model.trunk} if mode == "gramian" else {}))
    if force is not None:
        buf._engine.recorder.force = force  # type: ignore[attr-defined]
    return buf
