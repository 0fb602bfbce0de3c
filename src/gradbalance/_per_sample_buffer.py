"""``TaskGradBuffer(..., batch_dim=0)``: every sample (or sample × task) an objective.

``backward(losses)`` takes the unreduced losses ``[B]`` or ``[B, K]`` and, from one backward
of ``Σᵢ ℓᵢ`` per task column (K of them; no weight-gradient kernel runs), builds the
per-sample Gramian ``[N, N]`` (``N = B·K``, objective ``(i, k)`` at ``i·K + k``) with
:class:`~gradbalance._per_sample_gramian.PerSampleGramian`. ``apply_(balancer)`` takes the
weights ``w`` of a weighted balancer from it and writes the trunk's ``.grad`` with one
backward of ``Σ wᵢₖ ℓᵢₖ`` through the kept graph; the heads get their plain gradient of
``Σ ℓᵢₖ``. Micro-batches: each ``backward`` adds its objectives, the Gramian of all of them
(cross terms included) is built in ``apply_``. The update equals the matrix route over the
same N objectives (each passed as a task). Reference: Quinton & Rey, "Jacobian Descent for
Multi-Objective Optimization" (arXiv:2406.16232), instance-wise risk minimisation
(docs/per_sample.md).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from ._amp import finite_step, nonfinite_error, poison_, scale_of, unscaled_gramian
from ._checks import as_parameter_list
from ._coverage import Coverage, _module_names
from ._per_sample_gramian import Parts, PerSampleGramian
from ._step_inputs import refuse_complex
from .balancers._base import Balancer
from .balancers._checks import check_balancer
from .distributed import resolve_process_group
from .stats import StepStats, build_stats

__all__ = ["PerSampleBuffer"]


def check_per_sample_losses(losses: object) -> Tensor:
    """``[B]`` or ``[B, K]`` unreduced losses on the graph (else ``ValueError`` naming both)."""
    if not isinstance(losses, Tensor) or losses.dim() not in (1, 2) or losses.numel() == 0:
        found = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
        raise ValueError(
            f"losses must be the unreduced per-sample losses, shape [B] (each sample an "
            f"objective) or [B, K] (each sample x task), with batch_dim=0; got {found}. "
            f"Compute them with reduction='none' (torch.stack K task columns along dim 1)"
        )
    if not losses.requires_grad:
        raise ValueError("losses does not require grad; compute them from this step's forward")
    return losses


class PerSampleBuffer:
    """The per-sample route of :class:`~gradbalance.TaskGradBuffer` (``batch_dim=0``).

    Args:
        shared_params: the trunk's parameters, each held by a module of ``modules``.
        head_params: parameters that get their plain gradient of ``Σ ℓ`` (``+=``).
        modules: the trunk (module or list of modules); hooks record its layers' calls.
        batch_dim: 0, the samples' dimension of every trunk layer's input and of ``losses``.

    Micro-batches: every ``backward`` before :meth:`apply_` adds its objectives to the step's
    Gramian, cross terms included (its layer rows and its graph are kept until ``apply_``);
    :meth:`reset` drops the step.

    Example:
        >>> import torch
        >>> from gradbalance import TaskGradBuffer
        >>> from gradbalance.balancers import UPGrad
        >>> _ = torch.manual_seed(0)
        >>> trunk = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
        ...                             torch.nn.Linear(8, 1))
        >>> buf = TaskGradBuffer(trunk.parameters(), modules=trunk, batch_dim=0)
        >>> x, y = torch.randn(6, 4), torch.randn(6)
        >>> losses = (trunk(x)[:, 0] - y) ** 2             # [B], reduction='none'
        >>> buf.backward(losses)
        >>> stats = buf.apply_(UPGrad())
        >>> stats.weights.shape, stats.mode
        (torch.Size([6]), 'per_sample')
    """

    def __init__(self, shared_params: Iterable[Tensor], head_params: Iterable[Tensor] | None
                 = None, *, modules: Any = None, batch_dim: int = 0,
                 unsupported: dict[str, bool] | None = None) -> None:
        given = [name for name, set_ in (unsupported or {}).items() if set_]
        if given:
            raise ValueError(
                f"{given} are not available with batch_dim=0 (each sample an objective); "
                f"leave them at their defaults, or use TaskGradBuffer without batch_dim "
                f"(docs/per_sample.md)"
            )
        if batch_dim != 0 or isinstance(batch_dim, bool):
            raise ValueError(f"batch_dim must be 0 (the samples' dimension), got {batch_dim!r}")
        if modules is None:
            raise ValueError(
                "batch_dim=0 needs modules=...: the module(s) owning shared_params, e.g. "
                "TaskGradBuffer(trunk.parameters(), modules=trunk, batch_dim=0)"
            )
        self.shared = as_parameter_list("shared_params", shared_params)
        self.head_params = as_parameter_list("head_params", head_params, allow_empty=True)
        names = _module_names(modules)
        refuse_complex("shared_params", self.shared, names)
        refuse_complex("head_params", self.head_params, names)
        if resolve_process_group(None) is not None:
            raise ValueError(
                "batch_dim=0 runs in one process: the objectives of several data-parallel "
                "ranks do not form one Gramian here yet; use TaskGradBuffer without batch_dim "
                "under torch.distributed"
            )
        self._coverage = Coverage(self.shared, self.head_params, "raise", modules)
        self.gramian = PerSampleGramian(modules, self.shared)
        self._losses: list[Tensor] = []  # the step's micro-batches, graphs kept
        self._parts: list[Parts] = []
        self._heads: list[Tensor | None] = [None] * len(self.head_params)
        self._scaler: Any = None
        self._scale: Tensor | None = None

    def backward(self, losses: Tensor | Sequence[Tensor], scaler: Any = None,
                 features: Tensor | None = None) -> None:
        """Add this micro-batch's objectives, ``losses`` ``[B]`` or ``[B, K]``; their rows
        join the step's Gramian (cross terms with the earlier micro-batches included), and
        their graph is kept until :meth:`apply_`. With a ``GradScaler`` (the same one to
        every call and to :meth:`apply_`) the scaled losses are differentiated."""
        if features is not None:
            raise ValueError("features= is for mode='features'; with batch_dim=0 pass only "
                             "the per-sample losses")
        vector = check_per_sample_losses(losses)
        if self._losses and scaler is not self._scaler:
            raise ValueError(
                "scaler differs from the one given to the earlier backward() of this step; "
                "pass the same GradScaler (or None) to every backward() and to apply_()"
            )
        columns = vector.reshape(vector.shape[0], -1)
        try:
            self._coverage.check(vector)
        except ValueError:
            self.gramian.clear()
            raise
        self.gramian.check(vector)
        scale = scale_of(scaler, vector.device)
        outputs = self.gramian.outputs()
        heads: list[Tensor | None] = [None] * len(self.head_params)
        tasks = []
        try:
            for k in range(columns.shape[1]):
                root = columns[:, k].sum() if scale is None else columns[:, k].sum() * scale
                grads = torch.autograd.grad(root, [*outputs, *self.head_params],
                                            retain_graph=True, allow_unused=True)
                tasks.append(grads[: len(outputs)])
                heads = [_add(h, g) for h, g in zip(heads, grads[len(outputs):])]
            part = self.gramian.collect(columns.shape[0], tasks)
        finally:
            self.gramian.clear()
        self._losses.append(vector)
        self._parts.append(part)
        self._heads = [_add(h, g) for h, g in zip(self._heads, heads)]
        self._scaler, self._scale = scaler, scale

    def apply_(self, balancer: Balancer, scaler: Any = None, clip: Any = None) -> StepStats:
        """Weights from the Gramian of the step's objectives, one weighted backward per
        micro-batch into the trunk's ``.grad``; the heads' plain gradients.

        With a scaler the Gramian is unscaled (``/ s²``) before the balancer and the update
        written scaled (``s·g``), as ``scaler.scale(loss).backward()`` would; a non-finite
        step sets ``StepStats.found_inf``, leaves the balancer's state and makes every
        ``.grad`` of the step non-finite so that ``scaler.step`` skips it. Without one it
        raises ``NonFiniteGradientError`` and nothing moves."""
        self._check_apply(balancer, scaler, clip)
        saved = copy.deepcopy(balancer.state_dict())
        scale = self._scale
        try:
            gram = unscaled_gramian(scale, gramian=self.gramian.gramian(self._parts))
            flat = torch.cat([v.detach().reshape(-1) for v in self._losses])
            finite = finite_step(gram, scale, [h for h in self._heads if h is not None], None)
            if finite:
                w = balancer.compute_weights(gram, flat)
                trunk = self._weighted_grads(w if scale is None else w * scale.double())
                finite = bool(torch.stack([torch.isfinite(g).all() for g in trunk]).all())
            if not finite and scale is None:
                raise nonfinite_error()
        except BaseException:
            balancer.load_state_dict(saved)
            self.reset()
            raise
        count = len(self._losses)
        if not finite:
            balancer.load_state_dict(saved)
            self._skip()
            return build_stats(gram, flat, False, scale=scale, mode="per_sample",
                               num_backward=count)
        self._write(trunk)
        return build_stats(gram, flat, True, weights=w, scale=scale, mode="per_sample",
                           num_backward=count)

    def _check_apply(self, balancer: Balancer, scaler: Any, clip: Any) -> None:
        if not self._losses:
            raise RuntimeError("apply_() called before backward(); call buf.backward(losses)")
        check_balancer("balancer", balancer)
        if not balancer.from_gramian:
            raise TypeError(
                f"{type(balancer).__name__} needs the per-sample gradient rows, not only their "
                f"Gramian; with batch_dim=0 use a weighted balancer (UPGrad, MGDA, IMTL-G, "
                f"Nash-MTL, Mean...), or pass each sample's loss as a task: TaskGradBuffer "
                f"without batch_dim, mode='matrix'"
            )
        if scaler is not self._scaler:
            raise ValueError(
                "scaler differs from the one given to backward(); pass the same GradScaler "
                "(or None) to backward() and apply_()"
            )
        if clip is not None:
            raise ValueError(
                f"clip={clip!r}: per-task clipping is not available with batch_dim=0; clip "
                f"the per-sample gradients with gradbalance.clip.PerSampleClip, or the update "
                f"with torch.nn.utils.clip_grad_norm_ after apply_()"
            )

    def _write(self, trunk: list[Tensor]) -> None:
        """The trunk's update and the heads' gradients into ``.grad``; the step ends."""
        for p, g in zip(self.shared, trunk):
            _accumulate(p, g)
        for p, h in zip(self.head_params, self._heads):
            if h is not None:
                _accumulate(p, h)
        self.reset()

    def _skip(self) -> None:
        """A skipped step under a scaler: every ``.grad`` it would write made non-finite."""
        written = [p for p, h in zip(self.head_params, self._heads) if h is not None]
        self._write([torch.zeros_like(p) for p in self.shared])
        poison_([p.grad for p in [*self.shared, *written]])

    def _weighted_grads(self, w: Tensor) -> list[Tensor]:
        """``∇ Σ wᵢₖ ℓᵢₖ`` of the trunk, one backward per micro-batch (its graph freed)."""
        total = [torch.zeros_like(p) for p in self.shared]
        at = 0
        for losses in self._losses:
            part = w[at: at + losses.numel()].reshape(losses.shape).to(losses.dtype)
            at += losses.numel()
            grads = torch.autograd.grad(losses, self.shared, part, allow_unused=True)
            total = [t if g is None else t + g for t, g in zip(total, grads)]
        return total

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accept the empty state of :meth:`TaskGradBuffer.state_dict` (nothing to restore)."""
        if dict(state_dict):
            raise ValueError(
                f"state_dict has keys {sorted(state_dict)}, but a batch_dim=0 buffer keeps no "
                f"state: pass the state_dict() of a batch_dim=0 buffer (empty)"
            )

    def reset(self) -> None:
        """Drop the step (the records and the pending Gramian)."""
        self._losses = []
        self._parts = []
        self._heads = [None] * len(self.head_params)
        self._scaler, self._scale = None, None
        self.gramian.clear()


def _add(total: Tensor | None, part: Tensor | None) -> Tensor | None:
    if part is None:
        return total
    return part if total is None else total + part


def _accumulate(p: Tensor, g: Tensor) -> None:
    """``.grad = g`` where there was none, ``.grad += g`` elsewhere."""
    if p.grad is None:
        p.grad = g.detach().clone()
    else:
        p.grad.add_(g)
