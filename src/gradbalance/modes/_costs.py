"""The cost model of a linear layer's Gramian block, rows or activations: time in flop
equivalents, memory in elements held (docs/performance.md, "Modes", the per-layer choice).

Reference: Bu, Mao & Xu, "Scalable and Efficient Training of Large Convolutional Neural
Networks with Differential Privacy", NeurIPS 2022 (mixed ghost clipping).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FLOPS_PER_BYTE", "LayerCosts", "LinearShape", "flops_per_byte", "layer_costs",
           "rows_cost"]

#: Flops one byte of memory traffic is worth, per device type (a rough machine balance).
FLOPS_PER_BYTE: dict[str, float] = {"cpu": 8.0}
_DEFAULT_FLOPS_PER_BYTE = 32.0


def flops_per_byte(device_type: str) -> float:
    """The machine balance the model uses on ``device_type``."""
    return FLOPS_PER_BYTE.get(device_type, _DEFAULT_FLOPS_PER_BYTE)


@dataclass(frozen=True)
class LinearShape:
    """One linear layer in one micro-batch: ``n`` rows (all its calls), ``i`` in, ``o`` out."""

    n: int
    i: int
    o: int
    weight: bool = True  # the weight is a shared parameter
    bias: bool = True  # the bias is a shared parameter


@dataclass(frozen=True)
class LayerCosts:
    """One layer's two routes: time in flop equivalents, memory in elements held."""

    rows: float
    activations: float
    rows_memory: int
    activations_memory: int

    @property
    def route(self) -> str:
        """``"activations"`` where they are both faster and no heavier, else ``"rows"``."""
        cheaper = self.activations < self.rows
        return "activations" if cheaper and self.activations_memory <= self.rows_memory \
            else "rows"

    @property
    def chosen(self) -> float:
        """The time of :attr:`route`."""
        return self.activations if self.route == "activations" else self.rows


def rows_cost(p: int, k: int, micro: int, byte: float) -> float:
    """What ``p`` parameter values cost on the rows route besides forming them: the Gramian,
    the combine and the memory traffic of ``micro`` micro-batches."""
    return float(k * k * p + 2 * k * p + (3 * micro + 2) * k * p * byte)


def layer_costs(shape: LinearShape, k: int, micro: int = 1, element_size: int = 4,
                flops_per_byte: float = 8.0, total_rows: int | None = None) -> LayerCosts:
    """Both routes of one layer over ``micro`` micro-batches of ``shape.n`` rows (or
    ``total_rows``), K tasks."""
    n = shape.n * micro if total_rows is None else total_rows
    i, o = shape.i, shape.o
    byte = element_size * flops_per_byte
    p = (o * i if shape.weight else 0) + (o if shape.bias else 0)
    rows = rows_cost(p, k, micro, byte)
    activations = float(3 * k * n * o * byte)
    activations_memory = k * n * o
    if shape.weight:
        rows += 2 * k * n * o * i
        activations += (n * n * (i + k * k * o) + 2 * k * k * n * n * byte
                        + 2 * n * o * i + 2 * k * n * o)
        activations_memory += n * i + n * n + k * n * n
    if shape.bias:
        rows += k * n * o
        activations += k * n * o + k * k * o + (0 if shape.weight else 2 * k * n * o)
    return LayerCosts(rows, activations, k * p, activations_memory)
