"""``update_every=T``: recompute the balancer's weights every T steps, reuse them in between.

On a refresh step the full method runs (K backward passes, the Gramian, the weights). On the
``T - 1`` steps in between, the cached weights ``w`` give the update with one backward pass of
``Σₖ wₖ Lₖ``, the cost of a plain step (Navon et al., "Multi-Task Learning as a Bargaining
Game", ICML 2022, §5.4, update the weights every few steps). Only weighted balancers
(``from_gramian = True``) can be amortised: their update is a weighted sum of the rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._checks import check_int
from ..distributed import all_reduce_grads_and_losses_
from ..stats import StepStats
from ..taskgrads import TaskRoots
from ._engine import StepInput, heads_backward_

__all__ = ["WeightCache"]


class WeightCache:
    """The cached weights and the step counter of ``update_every``.

    ``step`` counts the finished steps; step ``t`` refreshes when ``t % T == 0`` or no weights
    are cached. A refresh step that found inf/NaN stores nothing and does not advance, so the
    next step refreshes again.
    """

    def __init__(self, update_every: int = 1) -> None:
        self.update_every = check_int("update_every", update_every, 1,
                                      "; 1 recomputes the weights every step")
        self.step = 0
        self.weights: Tensor | None = None

    @property
    def active(self) -> bool:
        return self.update_every > 1

    def reuse_now(self) -> bool:
        """True when this step reuses the cached weights."""
        return self.active and self.weights is not None and self.step % self.update_every != 0

    def refreshed(self, weights: Tensor | None) -> None:
        """A refresh step finished with finite gradients and these weights."""
        if self.active:
            self.weights = None if weights is None else weights.detach().clone()
        self.step += 1

    def reused(self) -> None:
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "update_every": self.update_every,
            "step": self.step,
            "weights": None if self.weights is None else self.weights.clone(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = {"update_every", "step", "weights"} - set(state_dict)
        if missing:
            raise ValueError(
                f"state_dict misses {sorted(missing)}; pass the output of "
                f"TaskGradBuffer.state_dict()"
            )
        if state_dict["update_every"] != self.update_every:
            raise ValueError(
                f"Invalid state_dict: update_every={state_dict['update_every']} but this buffer "
                f"has update_every={self.update_every}; build it with the saved value"
            )
        weights = state_dict["weights"]
        self.step = int(state_dict["step"])
        self.weights = None if weights is None else torch.as_tensor(weights).clone()

    def reset(self) -> None:
        self.step = 0
        self.weights = None


def backward_weighted(weights: Tensor, roots: TaskRoots, shared: Sequence[Tensor],
                      head_params: Sequence[Tensor]) -> None:
    """A step reusing cached weights: heads ``.grad += ∂(Σₖ Lₖ)``, trunk ``+= ∂(Σₖ wₖ Lₖ)``."""
    heads_backward_(roots, head_params)
    scaled = roots.scaled
    total = (weights.to(dtype=scaled.dtype, device=scaled.device) * scaled).sum()
    torch.autograd.backward(total, inputs=list(shared))


def reused_stats(cache: WeightCache, step: StepInput, params: Sequence[Tensor],
                 mode: str) -> StepStats:
    """Finish a reused step: mean of ``.grad`` over the ranks; no task gradient to report."""
    cache.reused()
    losses = step.losses
    if step.group is not None:  # the weighted backward wrote each rank's own gradients
        losses = all_reduce_grads_and_losses_(params, losses, step.group)
    return StepStats(losses=losses, task_norms=None, cosine=None, cosine_to_update=None,
                     update_norm=None, weights=cache.weights, loss_scale_tensor=step.scale,
                     num_backward=step.count, mode=mode, weights_reused=True)
