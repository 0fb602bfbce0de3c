"""The linear form ``y = x Wᵀ + b`` over rows of ``nn.Linear`` and of ``nn.Conv1d``/``nn.Conv2d``
(``groups=1``, zero padding) over unfolded patches (Bu, Mao & Xu, NeurIPS 2022)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional

__all__ = ["LAYER_TYPES", "linear_form", "rows_grad", "rows_input"]

#: The module types that may have a linear form.
LAYER_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d)


def _conv_geometry(module: nn.Module) -> tuple[tuple[int, int], ...] | None:
    """``(kernel, stride, padding, dilation)`` as 2-d tuples, or None without a linear form."""
    if not isinstance(module, (nn.Conv1d, nn.Conv2d)) or type(module) not in LAYER_TYPES:
        return None
    if module.groups != 1 or module.padding_mode != "zeros":
        return None
    padding = module.padding
    if isinstance(padding, str):
        if padding != "valid":
            return None
        padding = (0,) * len(module.kernel_size)
    kernel, stride, pad, dilation = (tuple(int(v) for v in part) for part in
                                     (module.kernel_size, module.stride, padding,
                                      module.dilation))
    if isinstance(module, nn.Conv1d):  # a height of one
        return (1, kernel[0]), (1, stride[0]), (0, pad[0]), (1, dilation[0])
    return (kernel[0], kernel[1]), (stride[0], stride[1]), (pad[0], pad[1]), \
        (dilation[0], dilation[1])


def linear_form(module: nn.Module) -> tuple[int, int] | None:
    """``(i, o)``, the widths of the layer's linear form, or None where it has none."""
    if type(module) is nn.Linear:
        assert isinstance(module, nn.Linear)
        return module.in_features, module.out_features
    if _conv_geometry(module) is None:
        return None
    assert isinstance(module, (nn.Conv1d, nn.Conv2d))
    return module.in_channels * math.prod(module.kernel_size), module.out_channels


def rows_input(module: nn.Module, x: Tensor) -> Tensor:
    """The layer's input as ``[N, i]`` rows (a convolution's: its unfolded patches)."""
    if type(module) is nn.Linear:
        return x.reshape(-1, x.shape[-1])
    geometry = _conv_geometry(module)
    assert geometry is not None and isinstance(module, (nn.Conv1d, nn.Conv2d))
    spatial = len(module.kernel_size)
    if x.dim() == spatial + 1:  # an unbatched input
        x = x.unsqueeze(0)
    if spatial == 1:
        x = x.unsqueeze(-2)
    kernel, stride, padding, dilation = geometry
    cols = functional.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1])  # [B·L, C·∏k]


def rows_grad(module: nn.Module, d: Tensor, k: int) -> Tensor:
    """The task output gradients ``[K, *output]`` as ``[K, N, o]`` (rows as :func:`rows_input`)."""
    if type(module) is nn.Linear:
        return d.reshape(k, -1, d.shape[-1])
    assert isinstance(module, (nn.Conv1d, nn.Conv2d))
    channel = d.dim() - len(module.kernel_size) - 1
    moved: Tensor = torch.movedim(d, channel, -1)
    return moved.reshape(k, -1, module.out_channels)
