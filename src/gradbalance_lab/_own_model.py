"""The user's own model and data, as a comparison problem (:func:`gradbalance_lab.compare.compare`).

The contract: ``build_model()`` returns an ``nn.Module`` whose ``forward(batch)`` returns the
K task losses of a batch (a ``[K]`` tensor or a list of K scalars, batch means); ``shared``
names its shared trunk (an attribute, or a callable ``model -> parameters``); every other
trainable parameter is a head's. ``make_batches(seed)`` returns an iterable of batches
(anything ``forward`` takes), started again when it runs out. ``evaluate(model)``, optional,
returns one metric per task; without it the metric is each task's mean training loss over
the last tenth of the steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gradbalance.weighting import WEIGHTINGS
from gradbalance_lab._mtl_methods import Method, build_weighting_from
from gradbalance_lab._mtl_runner import RunResult, open_writer
from gradbalance_lab._mtl_step import MethodStep

__all__ = ["OwnProblem", "make_weighting", "metrics", "own_run", "own_step_timer", "task_losses"]

Optimizer = Callable[[list[Tensor]], torch.optim.Optimizer]


@dataclass(frozen=True)
class OwnProblem:
    """The user's model, data and settings (module docstring)."""

    build_model: Callable[[], nn.Module]
    make_batches: Callable[[int], Iterable[Any]]
    shared: str | Callable[[nn.Module], Iterable[Tensor]]
    steps: int
    optimizer: Optimizer
    evaluate: Callable[[nn.Module], Sequence[float]] | None
    num_tasks: int
    log_every: int = 10

    def model(self, seed: int) -> tuple[nn.Module, list[Tensor], list[Tensor]]:
        """The model of ``seed`` (built after ``torch.manual_seed(seed)``), its shared and its
        head parameters."""
        torch.manual_seed(seed)
        model = self.build_model()
        if not isinstance(model, nn.Module):
            raise TypeError(f"Invalid build_model: it returned a {type(model).__name__} "
                            "(expected an nn.Module whose forward(batch) returns the K losses)")
        shared = list(_shared_of(model, self.shared))
        ids = {id(p) for p in shared}
        heads = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
        return model, shared, heads

    def batches(self, seed: int) -> Iterator[Any]:
        """``make_batches(seed)`` without end (started again when it runs out)."""
        while True:
            empty = True
            for batch in self.make_batches(seed):
                empty = False
                yield batch
            if empty:
                raise ValueError(f"Invalid make_batches: make_batches({seed}) gave no batch "
                                 "(expected an iterable of at least one batch)")


def _shared_of(model: nn.Module, shared: str | Callable[[nn.Module], Iterable[Tensor]]
               ) -> Iterable[Tensor]:
    if callable(shared):
        return [p for p in shared(model) if p.requires_grad]
    module = getattr(model, shared, None)
    if not isinstance(module, nn.Module):
        names = [name for name, _ in model.named_children()]
        raise ValueError(f"Invalid shared: {type(model).__name__} has no submodule {shared!r} "
                         f"(its submodules: {names}); pass shared='<name of the trunk>' or "
                         "shared=lambda model: model.<trunk>.parameters()")
    return [p for p in module.parameters() if p.requires_grad]


def task_losses(model: nn.Module, batch: Any, num_tasks: int | None = None) -> Tensor:
    """``model(batch)`` as a ``[K]`` tensor; a clear error for anything else."""
    out = model(batch)
    if isinstance(out, (list, tuple)) and all(isinstance(t, Tensor) for t in out) and out:
        out = torch.stack([t.reshape(()) if t.numel() == 1 else t for t in out])
    if not isinstance(out, Tensor) or out.dim() != 1 or out.numel() < 1:
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"Invalid model output: forward(batch) returned {shape} (expected the "
                         "K task losses: a [K] tensor or a list of K scalar tensors)")
    if num_tasks is not None and out.numel() != num_tasks:
        raise ValueError(f"Invalid model output: {out.numel()} losses, but the first batch "
                         f"gave {num_tasks}; return one loss per task on every batch")
    return out


def make_weighting(problem: OwnProblem, model: nn.Module, key: str, seed: int) -> Any:
    """Loss weighting ``key``, its shared ``layer`` (GradNorm) the model's trunk."""
    layer = getattr(model, problem.shared, None) if isinstance(problem.shared, str) else None
    return build_weighting_from(WEIGHTINGS[key], problem.num_tasks, seed,
                                layer=layer if layer is not None else model)


class _Run:
    """A model, its method's step and its optimizer, for one (method, seed)."""

    def __init__(self, problem: OwnProblem, method: Method, seed: int) -> None:
        self.problem = problem
        self.model, shared, heads = problem.model(seed)
        self.step_fn = MethodStep(method, shared, heads, problem.num_tasks, seed,
                                  lambda key: make_weighting(problem, self.model, key, seed))
        self.opt = problem.optimizer([*self.model.parameters(), *self.step_fn.extra_params])

    def step(self, batch: Any) -> Tensor:
        losses = task_losses(self.model, batch, self.problem.num_tasks)
        self.step_fn.backward(losses)
        self.opt.step()
        self.step_fn.after_step(lambda: task_losses(self.model, batch))
        self.opt.zero_grad(set_to_none=True)
        return losses.detach()


def metrics(problem: OwnProblem, model: nn.Module, recent: list[Tensor]) -> list[float]:
    if problem.evaluate is None:
        return torch.stack(recent).double().mean(0).tolist()
    model.eval()
    with torch.no_grad():
        values = [float(v) for v in problem.evaluate(model)]
    model.train()
    if len(values) != problem.num_tasks:
        raise ValueError(f"Invalid evaluate: it returned {len(values)} metrics (expected one "
                         f"per task, {problem.num_tasks})")
    return values


def own_run(problem: OwnProblem, method: Method, seed: int,
            tb_dir: Path | None = None) -> RunResult:
    """Train ``method`` for ``problem.steps`` steps; metrics, a history of ten evaluations
    and the median wall time of a step (the forward and the method's step, as timed by
    ``--timing-rounds``' rounds)."""
    start = time.perf_counter()
    run = _Run(problem, method, seed)
    batches = problem.batches(seed)
    every = max(1, problem.steps // 10)
    writer = open_writer(tb_dir) if tb_dir is not None else None
    recent: list[Tensor] = []
    history: list[list[float]] = []
    times = []
    try:
        for step in range(problem.steps):
            batch = next(batches)
            begun = time.perf_counter()
            losses = run.step(batch)
            times.append(time.perf_counter() - begun)
            recent = [*recent[-(every - 1):], losses] if every > 1 else [losses]
            if writer is not None and step % problem.log_every == 0:
                for k, value in enumerate(losses.tolist()):
                    writer.add_scalar(f"loss/task{k}", value, step)
            if (step + 1) % every == 0 or step + 1 == problem.steps:
                history.append(metrics(problem, run.model, recent))
    finally:
        if writer is not None:
            writer.close()
    train = torch.stack(recent).double().mean(0).tolist()
    return RunResult(method, seed, history[-1], history, 1e3 * statistics.median(times),
                     problem.steps, train, time.perf_counter() - start)


def own_step_timer(problem: OwnProblem, method: Method, seed: int) -> Callable[[], None]:
    """One step of ``method`` on the first batch of ``seed``, as a callable to time."""
    run = _Run(problem, method, seed)
    batch = next(problem.batches(seed))

    def step() -> None:
        run.step(batch)
    return step
