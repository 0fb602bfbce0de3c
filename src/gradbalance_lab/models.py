"""Small multitask models: a shared trunk and one head per task.

Used by the tests, the benchmarks and ``gradbalance compare``; also a template for users.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "MultiTaskModel",
    "cnn_trunk",
    "make_heads",
    "mlp_trunk",
    "regression_losses",
    "transformer_trunk",
]


class MultiTaskModel(nn.Module):
    """``heads[k](trunk(x))`` for every task ``k``.

    ``shared_parameters()`` and ``head_parameters()`` are the two lists a
    :class:`~gradbalance.TaskGradBuffer` takes.
    """

    def __init__(self, trunk: nn.Module, heads: Sequence[nn.Module]) -> None:
        super().__init__()
        self.trunk = trunk
        self.heads = nn.ModuleList(heads)

    def forward(self, x: Tensor) -> list[Tensor]:
        feats = self.trunk(x)
        return [head(feats) for head in self.heads]

    def shared_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.trunk.parameters() if p.requires_grad]

    def head_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.heads.parameters() if p.requires_grad]


def mlp_trunk(in_features: int = 256, width: int = 512, depth: int = 3) -> nn.Sequential:
    """``depth`` Linear+ReLU layers of ``width`` units; output ``[B, width]``."""
    layers: list[nn.Module] = []
    size = in_features
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    return nn.Sequential(*layers)


def cnn_trunk(channels: int = 32, in_channels: int = 1) -> nn.Sequential:
    """Three 3×3 conv layers with ReLU and pooling on ``[B, 1, 28, 28]``; output ``[B, 2c]``."""
    c = channels
    return nn.Sequential(
        nn.Conv2d(in_channels, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    )


class _MeanPool(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1)


def transformer_trunk(
    d_model: int = 128,
    num_layers: int = 2,
    nhead: int = 4,
    dropout: float = 0.0,
    dim_feedforward: int | None = None,
) -> nn.Sequential:
    """A ``num_layers`` transformer encoder on ``[B, S, d_model]``, mean-pooled to ``[B, d]``.

    The feed-forward width is ``dim_feedforward`` (default ``2 * d_model``);
    ``transformer_trunk(128, 2, 4, dropout=0.1, dim_feedforward=2048)`` is PyTorch's
    ``nn.TransformerEncoderLayer`` with its own defaults.
    """
    layer = nn.TransformerEncoderLayer(
        d_model,
        nhead,
        dim_feedforward=2 * d_model if dim_feedforward is None else dim_feedforward,
        dropout=dropout,
        batch_first=True,
    )
    encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
    return nn.Sequential(encoder, _MeanPool())


def make_heads(in_features: int, num_tasks: int, out_features: int = 1) -> list[nn.Module]:
    """One linear head per task."""
    return [nn.Linear(in_features, out_features) for _ in range(num_tasks)]


def regression_losses(outputs: Sequence[Tensor], targets: Tensor) -> Tensor:
    """Per-task MSE batch means ``[K]`` for ``targets`` ``[B, K]``."""
    return torch.stack([
        nn.functional.mse_loss(out.squeeze(-1), targets[:, k]) for k, out in enumerate(outputs)
    ])
