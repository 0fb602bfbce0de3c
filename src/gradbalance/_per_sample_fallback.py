"""Per-sample parameter gradients of a layer the outer-form identity does not cover.

For a module ``y = f(x; θ)`` that treats the samples of its input independently, sample i's
gradient of ``θ`` is the vector-Jacobian product of ``f(xᵢ; ·)`` with ``Dᵢ = ∂ℓᵢ/∂yᵢ``, the
sample's gradient of the module's output taken from the one backward of ``Σᵢ ℓᵢ``. One
``torch.func.vmap`` over ``torch.func.grad`` gives all B of them at once, ``[B, numel]`` per
parameter (docs/per_sample.md, "Layers").
"""

from __future__ import annotations

import warnings

from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

__all__ = ["per_sample_vjp"]


def per_sample_vjp(module: nn.Module, names: list[str], x: Tensor, d: Tensor) -> list[Tensor]:
    """The per-sample gradients ``[B, numel]`` of ``module``'s own parameters ``names`` for
    one recorded call: input ``x`` ``[B, ...]``, output gradient ``d`` ``[B, ...]``."""
    own = dict(module.named_parameters(recurse=False))
    theta = {name: own[name].detach() for name in names}

    def pulled(params: dict[str, Tensor], xi: Tensor, di: Tensor) -> Tensor:
        out = functional_call(module, params, (xi.unsqueeze(0),))
        total: Tensor = (out * di.unsqueeze(0)).sum()
        return total

    with warnings.catch_warnings():  # ops without a batching rule run lane by lane
        warnings.filterwarnings("ignore", message=".*performance drop.*")
        grads: dict[str, Tensor] = vmap(grad(pulled), in_dims=(None, 0, 0))(theta, x, d)
    return [grads[name].reshape(x.shape[0], -1) for name in names]
