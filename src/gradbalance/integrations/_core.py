"""The balanced step the framework integrations share (Lightning, Hugging Face, Accelerate).

:class:`BalancedParts` owns what lives across the calls of a training run — the balancer, the
:class:`~gradbalance.TaskGradBuffer`, an optional loss weighting and row clipper — runs one
micro-batch's backward and one step's balance, and saves and restores all of them as one
state (:func:`~gradbalance.capture_state` without the global random generators, which the
frameworks save themselves).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._amp import no_autocast
from .._checks import check_int
from .._coverage import check_other_params
from .._pickling import unshare_tensors
from ..balancers._base import Balancer
from ..balancers._checks import check_balancer
from ..checkpoint import capture_state, restore_state
from ..clip._checks import check_row_clipper
from ..clip._protocol import RowClipper
from ..distributed import global_losses, resolve_process_group, sync_weighting_
from ..modes import ENGINES
from ..monitor import task_labels
from ..stats import StepStats
from ..step import TaskGradBuffer
from ..weighting._base import LossWeighting
from ._sharded import gather_rank_states, own_rank_state

__all__ = ["BalancedParts", "check_buffer_options", "divide_losses", "stats_scalars",
           "unshare_tensors"]


def check_buffer_options(name: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``options``, the keyword arguments an integration passes to the
    :class:`~gradbalance.TaskGradBuffer` it builds at the first step, checked when the
    integration is built: a mapping whose keys are the buffer's keyword arguments but
    ``num_tasks`` (the balancer's) and ``batch_dim`` (the per-sample route: refused), ``mode``
    one of the modes (``gramian`` with its
    ``modules``) and ``other_params`` one of its values (the buffer checks the others when it
    is built).

    >>> check_buffer_options("buffer_options", {"mode": "auto", "update_every": 2})
    {'mode': 'auto', 'update_every': 2}
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"Invalid {name}: a {type(options).__name__} (expected a mapping of "
                        f"TaskGradBuffer's keyword arguments, e.g. {{'mode': 'auto'}})")
    _refuse_unknown(name, options)
    found = dict(options)
    if found.get("batch_dim") is not None:
        raise ValueError(
            f"Invalid {name}: batch_dim={found['batch_dim']!r}: the per-sample route (B x K "
            f"objectives) is not available through the framework helpers (its buffer must be "
            f"built before each forward it records, and its statistics are per objective); "
            f"write the loop with TaskGradBuffer(..., modules=trunk, batch_dim=0) "
            f"(docs/per_sample.md), or leave batch_dim out for the K task losses")
    mode = found.get("mode", "matrix")
    if not isinstance(mode, str) or mode not in ENGINES:
        raise ValueError(f"Invalid {name}: mode={mode!r} (expected one of "
                         f"{', '.join(ENGINES)})")
    if mode == "gramian" and found.get("modules") is None:
        raise ValueError(f"Invalid {name}: mode='gramian' needs modules=...: the module(s) "
                         f"owning the shared parameters, e.g. {{'mode': 'gramian', "
                         f"'modules': model.trunk}}")
    if "other_params" in found:
        check_other_params(found["other_params"])
    return found


def stats_scalars(stats: StepStats, task_names: Sequence[str] | None = None
                  ) -> dict[str, Tensor | float]:
    """The scalars of one step, as tensors (no host sync): losses, norms, weights, cosines,
    each task named by ``task_names`` (``loss/depth``; default ``loss/task0``, ...).

    Example:
        >>> import torch
        >>> from gradbalance import StepStats
        >>> from gradbalance.integrations.lightning import stats_scalars
        >>> stats = StepStats(torch.tensor([0.5, 2.0]), torch.tensor([3.0, 4.0]), None, None, None)
        >>> stats_scalars(stats, ["depth", "seg"])  # tensors: no host sync
        {'loss/depth': tensor(0.5000), 'size/depth': tensor(3.), 'loss/seg': tensor(2.),
         'size/seg': tensor(4.), 'amp_skipped': 0.0}
    """
    out: dict[str, Tensor | float] = {}
    k = stats.num_tasks
    names = task_labels(task_names, k)
    for t, name in enumerate(names):
        out[f"loss/{name}"] = stats.losses[t]
        if stats.task_norms is not None:
            out[f"size/{name}"] = stats.task_norms[t]
        if stats.weights is not None:
            out[f"w/{name}"] = stats.weights[t]
    if stats.cosine is not None:
        for i in range(k):
            for j in range(i + 1, k):
                out[f"cos/{names[i]}_{names[j]}"] = stats.cosine[i, j]
    if stats.update_norm is not None:
        out["update_norm"] = stats.update_norm
    out["amp_skipped"] = 1.0 if stats.found_inf else 0.0
    return out


def divide_losses(losses: Tensor | Sequence[Tensor], n: int) -> Tensor | Sequence[Tensor]:
    """``losses / n`` for a ``[K]`` tensor or a list of K scalars (unchanged for n = 1)."""
    if n == 1:
        return losses
    if isinstance(losses, Tensor):
        return losses / n
    return [loss / n for loss in losses]


def _total(losses: Tensor | Sequence[Tensor]) -> Tensor:
    """The detached sum of the task losses (what a framework reports as "the loss")."""
    vector = losses if isinstance(losses, Tensor) else torch.stack(list(losses))
    return vector.detach().sum()


def _refuse_unknown(name: str, options: Mapping[str, Any]) -> None:
    """Raise where a key of ``options`` is not a keyword argument of the buffer's the
    integration leaves to the caller."""
    accepted = [p.name for p in inspect.signature(TaskGradBuffer).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "num_tasks"]
    unknown = [key for key in options if key not in accepted]
    if unknown:
        extra = ("; num_tasks is the balancer's (pass num_tasks= to the balancer)"
                 if "num_tasks" in unknown else "")
        raise TypeError(f"Invalid {name}: {', '.join(map(repr, unknown))} (expected "
                        f"TaskGradBuffer's keyword arguments: {', '.join(accepted)}){extra}")


def _checked_names(task_names: Sequence[str] | None, num_tasks: int | None
                   ) -> list[str] | None:
    """``task_names`` as a list, checked now (:func:`~gradbalance.monitor.task_labels`): their
    count too where K is known, else their form (the count at the first step)."""
    if task_names is None:
        return None
    if isinstance(task_names, str):
        task_labels(task_names, 0)  # raises, naming the string
    names = list(task_names)
    task_labels(names, len(names) if num_tasks is None else num_tasks)
    return names


class BalancedParts:
    """The stateful parts of a balanced step and the two calls that use them.

    Args:
        balancer: any :class:`~gradbalance.Balancer`.
        buffer: the :class:`~gradbalance.TaskGradBuffer`, or a callable that builds it on
            first use (after a framework has put the model on its device).
        weighting: optional :class:`~gradbalance.LossWeighting` applied to the losses of every
            micro-batch and updated once per step.
        clip: optional row clipper (e.g. :class:`~gradbalance.TaskAutoClip`).
        task_names: the tasks' names in the logged tags (``loss/depth``); default ``task0``, ...
    """

    def __init__(
        self,
        balancer: Balancer,
        buffer: TaskGradBuffer | Callable[[], TaskGradBuffer],
        *,
        weighting: LossWeighting | None = None,
        clip: RowClipper | None = None,
        task_names: Sequence[str] | None = None,
    ) -> None:
        check_balancer("balancer", balancer)
        self.task_names = _checked_names(task_names, balancer.num_tasks)
        check_row_clipper("clip", clip)
        if weighting is not None and not isinstance(weighting, LossWeighting):
            raise TypeError(
                f"Invalid weighting: a {type(weighting).__name__} (expected a LossWeighting "
                f"object, e.g. gradbalance.get_weighting('dwa', num_tasks=K), or None)"
            )
        if weighting is not None and weighting.needs_losses_after:
            raise ValueError(
                f"Invalid weighting: {type(weighting).__name__} learns from the same batch's "
                f"losses after the optimizer step (update(losses_after)), which the framework's "
                f"step does not compute; use it in a hand-written loop (docs/weighting.md) or "
                f"choose another weighting"
            )
        self.balancer = balancer
        self.weighting = weighting
        self.clip = clip
        self._buffer = buffer if isinstance(buffer, TaskGradBuffer) else None
        self._make_buffer = None if isinstance(buffer, TaskGradBuffer) else buffer
        self._initial = capture_state(rng=False, **self._parts())  # restart()'s

    def _parts(self) -> dict[str, Any]:
        """The stateful parts but the buffer, by name."""
        parts: dict[str, Any] = {"balancer": self.balancer}
        if self.weighting is not None:
            parts["weighting"] = self.weighting
        if self.clip is not None and callable(getattr(self.clip, "state_dict", None)):
            parts["clip"] = self.clip
        return parts

    def restart(self) -> None:
        """A new model (a framework's ``model_init``): the buffer is built again on it at its
        first use, and the balancer, the weighting and the clipper start from the state they
        were given in."""
        if self._make_buffer is None:
            raise RuntimeError("this BalancedParts holds a buffer built on one model; pass a "
                               "callable that builds it to restart on a new model")
        self._buffer = None
        restore_state(self._initial, **self._parts())

    def replace_buffer(self, buffer: TaskGradBuffer) -> None:
        """Use ``buffer`` from now on (built over the same parameters after they moved to
        another dtype or device, the last one's state loaded)."""
        self._buffer = buffer

    def drop_step(self) -> None:
        """Drop a step left unfinished (a micro-batch raised, and the framework starts
        training again, zeroing the model's gradients): the buffer's step (its
        ``update_every`` weights kept), the weighting's pending observation and its
        ``.grad``."""
        if self.built and self.buffer.in_step:
            self.buffer.reset(keep_weights=True)
        if self.weighting is not None:
            if self.weighting.pending_tensors():
                self.weighting.update(found_inf=True)  # drops the observation, state kept
            self.clear_weighting_grads()

    def clear_weighting_grads(self) -> None:
        """``.grad = None`` on the weighting's parameters (a framework that zeroes only the
        model's gradients between steps would add them up across steps)."""
        if isinstance(self.weighting, nn.Module):
            for p in self.weighting.parameters():
                p.grad = None

    @property
    def buffer(self) -> TaskGradBuffer:
        """The buffer (built now if it was given as a callable)."""
        if self._buffer is None:
            assert self._make_buffer is not None
            self._buffer = self._make_buffer()
        return self._buffer

    @property
    def built(self) -> bool:
        """Whether the buffer exists yet."""
        return self._buffer is not None

    def backward(self, losses: Tensor | Sequence[Tensor], divisor: int, scaler: Any) -> Tensor:
        """Weight the K losses as one of ``divisor`` micro-batches (``micro_batches=``: the
        weighting's share of the step's objective), else divide them by ``divisor``, and add
        their task gradients; returns their detached sum."""
        check_int("divisor", divisor, 1, ", the number of micro-batches of the step")
        buffer = self.buffer
        if self.weighting is not None:
            if self.weighting.reads_losses:  # weights of the global batch's values
                losses = global_losses(losses, buffer.process_group)
            losses = self.weighting(losses, scaler=scaler, micro_batches=divisor)
        else:
            losses = divide_losses(losses, divisor)
        if buffer.sharded and isinstance(losses, Tensor):
            # FSDP2 gathers the parameters for the backward in a hook on the model's outputs;
            # each task's pass must run through them (the k-th scalar of the vector), not
            # start past them at the stack that built a vector of losses inside the forward
            losses = list(losses.unbind())
        buffer.backward(losses, scaler=scaler)
        return _total(losses)

    def step(self, scaler: Any) -> StepStats:
        """Balance the step's task gradients into ``.grad`` and update the weighting.

        Runs with autocast off (a framework may call it inside its autocast region). The
        weighting learns from the full batch (averaged over the ranks); on a step the scaler
        will skip (``StepStats.found_inf``) it keeps its state.
        """
        buffer = self.buffer
        with no_autocast(buffer.layout.device):
            stats = buffer.apply_(self.balancer, scaler=scaler, clip=self.clip)
            if self.weighting is not None:
                if not stats.found_inf:
                    sync_weighting_(self.weighting, buffer.process_group)
                self.weighting.update(found_inf=stats.found_inf)
        return stats

    def scalars(self, stats: StepStats) -> dict[str, Tensor | float]:
        """:func:`stats_scalars`, plus the weighting's weights as ``weighting/<task>``."""
        out = stats_scalars(stats, self.task_names)
        if self.weighting is not None:
            names = task_labels(self.task_names, stats.num_tasks)
            for name, w in zip(names, self.weighting.weights):
                out[f"weighting/{name}"] = w
        return out

    def objects(self) -> dict[str, Any]:
        """The stateful parts by name (a clipper without ``state_dict`` is left out)."""
        return {"buffer": self.buffer, **self._parts()}

    def state_dict(self) -> dict[str, Any]:
        """Every part's ``state_dict`` (the buffer, the balancer, the weighting, the clipper).

        On a sharded trunk (FSDP2) a matrix balancer's state holds this rank's columns: the
        state is every rank's, gathered over the buffer's group (``{"ranks": [...]}``; a
        collective, for a checkpoint one process writes)."""
        state = capture_state(rng=False, **self.objects())
        if self.buffer.sharded:
            return gather_rank_states(state, resolve_process_group(self.buffer.process_group))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output: all parts or none (``CheckpointError``); on a
        sharded trunk this rank's entry."""
        if self.buffer.sharded:
            group = resolve_process_group(self.buffer.process_group)
            state_dict = own_rank_state(state_dict, group)
        restore_state(state_dict, **self.objects())
