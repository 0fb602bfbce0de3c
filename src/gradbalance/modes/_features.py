"""``features`` mode: balance the task gradients of the shared representation, not the trunk.

``Z = [∂Lₖ/∂f]ₖ`` ``[K, B·D]`` for the trunk's output ``f`` (K passes through the heads only,
plus one for the heads' plain gradient), combined by any balancer into ``z``, then one
backward of ``z`` through the trunk. A different, cheaper method than ``matrix`` (equal only
for linear balancers): MGDA-UB, Sener & Koltun, "Multi-Task Learning as Multi-Objective
Optimization", NeurIPS 2018, §3.3.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..balancers._base import Balancer
from ..gramian import compute_gramian, is_finite_gramian
from ..stats import StepStats, build_stats
from ..taskgrads import ParamLayout, TaskRoots
from ._common import RowsMode, StepInput, combine_or_skip, heads_backward_

__all__ = ["FeaturesMode"]


class FeaturesMode(RowsMode):
    """Holds the feature gradients of one micro-batch until ``apply``."""

    features: Tensor | None = None

    def backward(self, roots: TaskRoots, features: Tensor | None) -> None:
        if not isinstance(features, Tensor) or not features.requires_grad:
            raise ValueError(
                "mode='features' needs features=<the trunk's output tensor> (requiring "
                "grad), e.g. feats = model.trunk(x); buf.backward(losses, features=feats)"
            )
        layout = ParamLayout([features])
        dtype = torch.promote_types(layout.dtype, torch.float32)  # autocast: fp16 features
        k = roots.num_tasks
        if self.matrix is None or self.matrix.shape != (k, layout.numel) or (
            self.matrix.dtype != dtype
        ):
            self.matrix = torch.empty(k, layout.numel, dtype=dtype, device=layout.device)
        heads_backward_(roots, self.head_params)
        self.compute(roots, layout, self.matrix, accumulate=False, retain_graph=True)
        self.features = features

    def apply(self, balancer: Balancer, step: StepInput) -> StepStats:
        matrix, features, losses, scale = self.matrix, self.features, step.losses, step.scale
        assert matrix is not None and features is not None
        self.features = None
        if scale is not None:
            matrix.div_(scale.to(matrix.dtype))
        gram = compute_gramian(matrix)
        finite = bool(is_finite_gramian(gram))  # host sync: the balancer must not see inf/NaN
        result = combine_or_skip(balancer, matrix, losses, gram, finite, scale)
        grad = result.vector if scale is None else result.vector * scale.to(matrix.dtype)
        torch.autograd.backward(features, grad.view_as(features).to(features.dtype),
                                inputs=self.layout.params)
        return build_stats(gram, losses, finite, matrix=matrix, update=result.vector,
                           weights=result.weights, scale=scale, num_backward=step.count,
                           mode="features")

    def clear(self) -> None:
        self.features = None
