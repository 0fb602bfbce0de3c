"""The blocks of ``gramian`` mode's trunk (a module with shared parameters of its own, with its
sub-modules) and what each holds for a step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .._graph import own_output
from ..taskgrads import ParamLayout
from ._costs import LayerCosts, LinearShape, flops_per_byte, layer_costs
from ._layers import LAYER_TYPES, linear_form

__all__ = ["Block", "Call", "find_blocks"]


@dataclass
class Call:
    """One recorded forward: its rows; input and output where it may take the activations."""

    n: int
    input: Tensor | None = None
    output: Tensor | None = None
    versions: tuple[int, int] = (0, 0)
    loop: bool = True  # the loop's rule would have kept them too (``_routes.keeps``)
    exact: bool = True  # the layer's own parameters and output (``Block.exact_call``)


@dataclass
class Block:
    module: nn.Module
    name: str
    params: list[Tensor]
    form: tuple[int, int] | None  # (i, o) of a layer with a linear form, else None
    calls: list[Call] = field(default_factory=list)  # recorded since the last backward
    route: str = "rows"  # this step's route, "rows" or "activations"
    # activations route, the step so far: the inputs [N, i] and output gradients [K, N, o]
    inputs: list[Tensor] = field(default_factory=list)
    output_grads: list[Tensor] = field(default_factory=list)
    # rows route: the rows [K, P_b] of the step (None: none yet), in ``buffer`` (kept across
    # steps), and whether some task reached each of ``params``
    rows: Tensor | None = None
    buffer: Tensor | None = None
    reached: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layout = ParamLayout(self.params)

    @property
    def linear(self) -> bool:
        """Whether the block is a layer of linear form (``nn.Linear``, a convolution)."""
        return self.form is not None

    def forget(self) -> None:
        self.calls.clear()
        self.inputs.clear()
        self.output_grads.clear()
        self.rows = None
        self.reached = []

    def rows_buffer(self, k_total: int) -> Tensor:
        """The persistent ``[K, P_b]`` storage of the rows."""
        if self.buffer is None or self.buffer.shape[0] != k_total:
            self.buffer = torch.empty(k_total, self.layout.numel, dtype=self.layout.dtype,
                                      device=self.layout.device)
        return self.buffer

    def module_layer(self) -> nn.Linear | nn.Conv1d | nn.Conv2d:
        """The layer of linear form (only for a block that is one)."""
        mod = self.module
        assert isinstance(mod, LAYER_TYPES)
        return mod

    def linear_params(self) -> tuple[bool, bool]:
        """Whether the layer's weight and its bias are among the shared parameters."""
        mod = self.module_layer()
        ids = {id(p) for p in self.params}
        return id(mod.weight) in ids, mod.bias is not None and id(mod.bias) in ids

    def exact_call(self, hook_id: int) -> bool:
        """Whether a forward now gives the linear form of the block's parameters: each one is
        the layer's ``weight`` or ``bias`` during the call (not swapped by
        ``torch.func.functional_call``, nor the source of a weight a pre-hook computes, as
        ``torch.nn.utils.prune``), and no forward hook ran before ``hook_id`` (the recorder's)
        to replace the output."""
        mod = self.module_layer()
        own = (mod.weight, mod.bias)
        if not all(any(p is q for q in own) for p in self.params):
            return False
        return own_output(mod, hook_id)

    def called_rows(self) -> int:
        """The rows of the forwards recorded since the last backward."""
        return sum(call.n for call in self.calls)

    def shape(self, n: int) -> LinearShape:
        """The layer over ``n`` rows, for the cost model."""
        assert self.form is not None
        return LinearShape(n, *self.form, *self.linear_params())

    def costs(self, n: int, k_total: int, micro: int) -> LayerCosts:
        """Both routes' costs over the step's ``n`` rows (:func:`._costs.layer_costs`)."""
        return layer_costs(self.shape(n), k_total, micro, self.layout.params[0].element_size(),
                           flops_per_byte(self.layout.device.type), total_rows=n)

    def operands(self) -> tuple[Tensor, Tensor | None]:
        """``x`` ``[N, i]`` and ``D`` ``[K, N, o]`` of the step so far, in at least float32."""
        if not self.output_grads:
            return torch.empty(0), None
        dtype = torch.promote_types(self.module_layer().weight.dtype, torch.float32)
        xs = [x.to(dtype) for x in self.inputs]
        ds = [d.to(dtype) for d in self.output_grads]
        if len(ds) == 1:
            return xs[0], ds[0]
        return torch.cat(xs), torch.cat(ds, dim=1)

    def linear_grad(self, p: Tensor, x: Tensor, d: Tensor) -> Tensor:
        """The gradient at ``p`` (weight: ``Dᵀx``, bias: ``Σₙ D``) of ``D`` ``[..., N, o]``."""
        if p is self.module_layer().weight:
            return torch.matmul(d.transpose(-1, -2), x)
        return d.sum(dim=-2)

    def to_rows(self, k_total: int) -> None:
        """Move to rows for the rest of the step: ``Dₖᵀx``, ``Σₙ Dₖ`` of the operands so far."""
        x, d = self.operands()
        buffer = self.rows_buffer(k_total)
        for p, (_, start, stop) in zip(self.params, self.layout.slices()):
            part = buffer[:, start:stop]
            if d is None:
                part.zero_()
            else:
                part.copy_(self.linear_grad(p, x, d).reshape(k_total, -1))
        self.rows = buffer
        self.reached = [d is not None] * len(self.params)
        self.route = "rows"
        self.inputs.clear()
        self.output_grads.clear()


def find_blocks(roots: Sequence[nn.Module], params: Sequence[Tensor]) -> list[Block]:
    """The blocks of ``roots`` holding ``params``, each parameter in one."""
    wanted = {id(p) for p in params}
    blocks: list[Block] = []
    seen: set[int] = set()
    claimed: set[int] = set()

    def visit(module: nn.Module, name: str) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if any(id(p) in wanted for p in module.parameters(recurse=False)):
            # a parameter tied to an earlier block stays there: each parameter in one block
            own: list[Tensor] = [p for p in module.parameters()
                                 if id(p) in wanted and id(p) not in claimed]
            claimed.update(map(id, own))
            if own:
                blocks.append(Block(module, name or type(module).__name__, own,
                                    linear_form(module)))
            return
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    for i, root in enumerate(roots):
        visit(root, "" if len(roots) == 1 else f"modules[{i}]")
    for i, p in enumerate(params):
        if id(p) not in claimed:
            raise ValueError(
                f"shared_params[{i}] (shape {tuple(p.shape)}) is not a parameter of any module "
                f"in modules; mode='gramian' needs the trunk module(s) owning every shared "
                f"parameter, e.g. modules=model.trunk"
            )
    return blocks
