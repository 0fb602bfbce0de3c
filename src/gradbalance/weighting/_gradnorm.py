"""GradNorm: balance the task-gradient norms at one shared layer (Chen et al., 2018)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .._checks import as_parameter_list, check_bool, check_module, check_positive
from .._types import NonFiniteGradientError
from ..taskgrads import task_gradients_reached
from ._own_optimizer import OptimizerFactory, OwnOptimizerWeighting

__all__ = ["GradNorm", "gradnorm_targets", "last_layer_parameters"]


def last_layer_parameters(module: nn.Module) -> list[Tensor]:
    """Trainable parameters of the last submodule (in registration order) that owns some.

    Example:
        >>> import torch
        >>> from gradbalance.weighting import last_layer_parameters
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
        >>> [tuple(p.shape) for p in last_layer_parameters(net)]
        [(1, 3), (1,)]
    """
    check_module("module", module)
    owners = [m for m in module.modules()
              if any(p.requires_grad for p in m.parameters(recurse=False))]
    if not owners:
        raise ValueError(f"Invalid layer: {type(module).__name__} has no trainable parameters "
                         f"(pass the shared layer whose gradient norms GradNorm balances)")
    return [p for p in owners[-1].parameters(recurse=False) if p.requires_grad]


def gradnorm_targets(norms: Tensor, losses: Tensor, initial_losses: Tensor,
                     alpha: float) -> Tensor:
    """Target norms ``Ḡ·rₖ^α`` ``[K]`` (treated as constants).

    ``norms`` are the weighted norms ``Gₖ = ‖∇_W wₖLₖ‖``, ``Ḡ`` their mean, and
    ``rₖ = L̃ₖ / mean(L̃)`` the relative inverse training rates, ``L̃ₖ = Lₖ(t)/Lₖ(0)``.

    Example:
        >>> import torch
        >>> from gradbalance.functional import gradnorm_targets
        >>> norms, losses = torch.tensor([1.0, 3.0]), torch.tensor([2.0, 1.0])
        >>> gradnorm_targets(norms, losses, torch.ones(2), alpha=1.0)  # 2·(2, 1)/1.5
        tensor([2.6667, 1.3333], dtype=torch.float64)
    """
    ratio = losses.double() / initial_losses.double()
    rate = ratio / ratio.mean()
    return norms.double().mean() * rate.pow(alpha)


class GradNorm(OwnOptimizerWeighting):
    """Learn task weights ``w`` so that the weighted gradient norms train at equal rates.

    At the shared layer ``W`` (default: the last layer of ``layer``), with
    ``Gₖ = wₖ‖∇_W Lₖ‖``::

        L_grad = Σₖ | Gₖ − Ḡ·rₖ^α |,   Ḡ·rₖ^α held constant

    ``L_grad`` is backpropagated into ``w`` **only** (never into the model's ``.grad``), ``w``
    takes one step of its own optimizer (paper: Adam, lr 0.025), then inside ``no_grad`` ``w``
    is clamped to ``>= min_weight`` and rescaled to sum to K (docs/weighting.md;
    ``renormalize=False`` leaves the sum free to drift).

    ``weighting(losses)`` computes ``∇_W Lₖ`` (K small backward passes) and returns ``wₖ Lₖ``
    with ``w`` detached; ``update()`` takes the ``w`` step. ``Lₖ(0)``: the first losses.

    Args:
        layer: the shared layer ``W``: a module (its last parametrised submodule is used,
            e.g. ``model.trunk``) or a list of parameters.
        alpha: asymmetry ``α >= 0`` (paper: 1.5 on NYUv2, 0.12 on its synthetic tasks; 0
            asks for equal norms).
        lr: learning rate of the default Adam on ``w``.
        renormalize: rescale ``w`` to sum to K after every update.
        min_weight: floor that keeps every weight positive.
        optimizer: factory ``params -> torch.optim.Optimizer`` replacing the default Adam.

    Reference: Chen, Badrinarayanan, Lee & Rabinovich, "GradNorm: Gradient Normalization for
    Adaptive Loss Balancing in Deep Multitask Networks", ICML 2018.

    Example:
        >>> import torch
        >>> from gradbalance.weighting import GradNorm
        >>> shared = torch.ones(2, requires_grad=True)
        >>> gradnorm, loss = GradNorm(2, [shared]), shared.sum()  # task 2: twice the gradient
        >>> _ = gradnorm(torch.stack([loss, 2 * loss])); _ = gradnorm.update()
        >>> gradnorm.weights  # one Adam step of lr=0.025 towards equal norms, renormalised
        tensor([1.0250, 0.9750], dtype=torch.float64)
    """

    name = "gradnorm"
    _weights_state = "task_weights"
    _repr_args = ("num_tasks", "alpha", "lr", "renormalize")
    needs_task_gradients = True
    _pending_state = ("_grads",)  # the summed layer gradients [K, P_layer] of this step
    task_weights: Tensor
    _initial: Tensor | None
    last_loss_grad: Tensor | None
    last_norms: Tensor | None

    def __init__(self, num_tasks: int, layer: nn.Module | Iterable[Tensor], *,
                 alpha: float = 1.5, lr: float = 0.025, renormalize: bool = True,
                 min_weight: float = 1e-4,
                 optimizer: OptimizerFactory | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__(num_tasks, device=device)
        self.alpha = check_positive("alpha", alpha, allow_zero=True)
        self.lr = check_positive("lr", lr)
        self.min_weight = check_positive("min_weight", min_weight)
        if self.min_weight >= 1.0:
            raise ValueError(f"Invalid min_weight: {min_weight!r} (expected < 1, the mean "
                             f"weight)")
        self.renormalize = check_bool("renormalize", renormalize)
        if isinstance(layer, nn.Module):
            self.layer_params = last_layer_parameters(layer)
        else:
            self.layer_params = as_parameter_list("layer", layer)
        self._register_trained("task_weights", torch.ones(
            num_tasks, dtype=torch.float64, device=self.device), optimizer)
        self.register_state("_initial", None, optional=True, shape=(num_tasks,),
                            per_task=True)
        self._grads: Tensor | None = None
        # Diagnostics of the last update, for logging.
        self.register_state("last_loss_grad", None, optional=True, persistent=False)
        self.register_state("last_norms", None, optional=True, per_task=True, persistent=False)

    _group_attributes = (("lr", "lr"),)

    def _default_optimizer(self, params: list[Tensor]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=self.lr)

    # -- step ---------------------------------------------------------------------------
    def _layer_gradients(self, losses: Tensor, scaler: Any) -> Tensor:
        scale = None
        if scaler is not None and scaler.is_enabled():
            scale = scaler.scale(torch.ones((), dtype=torch.float32, device=losses.device))
        scaled = losses if scale is None else losses * scale.to(losses.dtype)
        matrix, reached = task_gradients_reached(scaled, self.layer_params, passes="loop",
                                                 retain_graph=True)
        if not any(reached):  # zero norms from this batch: said, not silent
            warnings.warn(
                "GradNorm: no task loss of this batch reaches its layer's parameters, so their "
                "gradient norms count 0 for it: a layer the batch skipped, or one not on the "
                "losses' graph at all (another model's layer, or parameters a wrapper replaced, "
                "such as FSDP2's sharded ones: give GradNorm their gathered copies, "
                "GradNorm(K, gathered_parameters(layer)), docs/distributed.md)",
                RuntimeWarning, stacklevel=4)
        matrix = matrix.double()
        if scale is not None:
            matrix = matrix / scale.to(device=matrix.device, dtype=matrix.dtype)
        return matrix

    def _weighted(self, losses: Tensor, scaler: Any = None, share: float = 1.0) -> Tensor:
        if not losses.requires_grad:
            raise ValueError("losses do not require grad; GradNorm needs the graph to the "
                             "shared layer: call it before backward(), on the model's losses")
        matrix = self._layer_gradients(losses, scaler)
        if share != 1.0:  # one of the step's micro-batches: its share of the mean gradient
            matrix = matrix * share
        self._grads = matrix if self._grads is None else self._grads + matrix
        w = self.task_weights.detach().to(dtype=losses.dtype, device=losses.device)
        return w * losses

    def _apply_update(self, losses: Tensor, losses_after: Tensor | None) -> None:
        assert self._grads is not None
        norms = self._grads.norm(dim=1).to(self.device)
        if not bool(torch.isfinite(norms).all()):
            raise NonFiniteGradientError(
                f"the gradients at GradNorm's layer hold inf or NaN (norms {norms.tolist()}); "
                f"state unchanged. Pass found_inf=True for a skipped step"
            )
        initial = losses if self._initial is None else self._initial
        if not bool((initial > 0).all()):
            raise ValueError(f"Invalid losses: initial losses {initial.tolist()} (GradNorm "
                             f"divides by Lₖ(0): every task loss must be > 0 at the start)")
        if not bool((losses >= 0).all()) or not float(losses.sum()) > 0.0:
            raise ValueError(f"Invalid losses: {losses.tolist()} (GradNorm's training rates "
                             f"Lₖ(t)/Lₖ(0) raised to alpha need losses >= 0, not all zero); "
                             f"state unchanged")
        w = self.task_weights
        weighted_norms = w.detach() * norms
        target = gradnorm_targets(weighted_norms, losses, initial, self.alpha)
        loss_grad = (w * norms - target).abs().sum()
        self.optimizer.zero_grad(set_to_none=True)
        loss_grad.backward(inputs=[w])
        self.optimizer.step()
        w.grad = None
        with torch.no_grad():
            w.clamp_(min=self.min_weight)
            if self.renormalize:
                w.mul_(self.num_tasks / w.sum())
        self._initial = initial.clone()
        self.last_loss_grad = loss_grad.detach()
        self.last_norms = norms

    # -- state --------------------------------------------------------------------------
    @property
    def initial_losses(self) -> Tensor | None:
        """``Lₖ(0)`` ``[K]``, None before the first update."""
        return None if self._initial is None else self._initial.clone()
