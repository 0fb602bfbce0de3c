"""One training run on MultiDigits with a balancer, a loss weighting or a single task.

The loop is the one a user writes (`docs/loop.md`): forward, per-task losses, the library's
``TaskGradBuffer.backward`` + ``apply_`` (or plain ``backward`` for a single-task baseline),
optional global clipping, ``optimizer.step``, ``zero_grad``. The wall time of each step is
measured from the forward to the end of ``optimizer.step``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gradbalance import RunningStats, StepStats, log_stats
from gradbalance._optional import require
from gradbalance.clip import GhostNorms, PerSampleClip
from gradbalance_lab._mtl_methods import Method, build_weighting
from gradbalance_lab._mtl_progress import Progress
from gradbalance_lab._mtl_step import MethodStep
from gradbalance_lab._per_sample_methods import PER_SAMPLE
from gradbalance_lab.data import MultiDigits
from gradbalance_lab.models import MultiTaskModel, cnn_trunk, mlp_trunk

__all__ = ["RunConfig", "RunResult", "build_model", "check_method", "open_writer", "step_timer",
           "train_run"]


@dataclass(frozen=True)
class RunConfig:
    """Training settings shared by every run of a comparison."""

    epochs: int = 8
    batch_size: int = 128
    lr: float = 1e-3
    optimizer: str = "adam"
    weight_decay: float = 0.0
    trunk: str = "mlp"
    width: int = 64
    depth: int = 2
    max_norm: float | None = None
    per_sample_clip: float | None = None  # DP-SGD's per-sample clip (ghost norms), off if None
    noise_multiplier: float = 0.0  # DP-SGD noise σ (needs per_sample_clip)
    log_every: int = 10


@dataclass
class RunResult:
    """Outcome of one run; ``metrics`` has one entry per task (NaN for tasks not trained)."""

    method: Method
    seed: int
    metrics: list[float]
    history: list[list[float]] = field(default_factory=list)
    step_ms: float = math.nan
    steps: int = 0
    train_losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None  # set when the run raised (metrics are then NaN)


def build_model(data: MultiDigits, cfg: RunConfig, tasks: list[int]) -> MultiTaskModel:
    """A shared trunk (``mlp`` on the flattened canvas, or a small ``cnn``) and linear heads."""
    channels, height, width = data.input_shape
    if cfg.trunk == "mlp":
        trunk: nn.Module = nn.Sequential(
            nn.Flatten(), mlp_trunk(channels * height * width, cfg.width, cfg.depth)
        )
        features = cfg.width
    elif cfg.trunk == "cnn":
        trunk = cnn_trunk(cfg.width // 2, in_channels=channels)
        features = 2 * (cfg.width // 2)
    else:
        raise ValueError(f"Invalid trunk: {cfg.trunk!r} (expected 'mlp' or 'cnn')")
    heads = [nn.Linear(features, data.out_features[k]) for k in tasks]
    return MultiTaskModel(trunk, heads)


def _optimizer(params: list[Tensor], cfg: RunConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    raise ValueError(f"Invalid optimizer: {cfg.optimizer!r} (expected 'adam' or 'sgd')")


def open_writer(path: Path) -> Any:
    """A TensorBoard ``SummaryWriter`` at ``path`` (needs ``gradbalance[tensorboard]``)."""
    require("tensorboard", "tensorboard", "TensorBoard logs", "pass --no-tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(path))


class _Logger:
    """Step statistics into TensorBoard with :func:`gradbalance.log_stats` (and a running
    std window of 50 steps)."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.running = RunningStats(window=50)

    def step(self, stats: StepStats | None, losses: Tensor, step: int, pre_clip: Tensor | None,
             weights: Tensor | None, tasks: list[int | None]) -> None:
        """One step's scalars: the StepStats of a balanced step (with the losses before a
        weighting), else each task's loss (and a weighting's weights)."""
        clip = None if pre_clip is None else float(pre_clip)
        if stats is not None:
            log_stats(self.writer, stats, step, pre_clip=clip, running=self.running)
            return
        for value, task in zip(losses.tolist(), tasks):
            self.writer.add_scalar(f"loss/task{task}", value, step)
        for task, value in enumerate([] if weights is None else weights.tolist()):
            self.writer.add_scalar(f"w/task{task}", value, step)


def _evaluate(model: MultiTaskModel, data: MultiDigits, tasks: list[int]) -> list[float]:
    model.eval()
    with torch.no_grad():
        outputs = model(data.x_test)
    model.train()
    values = [math.nan] * data.num_tasks
    for head, task in enumerate(tasks):
        values[task] = data.task_metric(task, outputs[head], data.y_test[:, task])
    return values


class _Step:
    """The per-method part of the step: returns the raw losses (and stats) of the batch.

    The backward itself is :class:`~gradbalance_lab._mtl_step.MethodStep`'s (the plain sum, a
    loss weighting's one pass or a balancer's buffer); a single-task baseline runs the plain
    backward of its one loss. With per-sample clipping the losses are the clipped ones; a
    per-sample balancer (``compare --per-sample``) gets the ``[B, K]`` losses.
    """

    def __init__(self, method: Method, model: MultiTaskModel, data: MultiDigits,
                 seed: int, cfg: RunConfig | None = None) -> None:
        self.method = method
        self.data = data
        self.model = model
        self.core: MethodStep | None = None
        self.clip: PerSampleClip | None = None
        self.ghost: GhostNorms | None = None
        if cfg is not None and cfg.per_sample_clip is not None:
            if method.kind == PER_SAMPLE:
                raise ValueError("per-sample clipping (--per-sample-clip) and per-sample "
                                 "objectives (--per-sample) cannot be combined; drop one")
            self.clip = PerSampleClip(cfg.per_sample_clip, noise_multiplier=cfg.noise_multiplier,
                                      generator=torch.Generator().manual_seed(10_000 + seed))
            self.ghost = GhostNorms(model)  # hooks before the first forward
        if method.kind != "single":
            self.core = MethodStep(method, model.shared_parameters(), model.head_parameters(),
                                   data.num_tasks, seed,
                                   lambda key: build_weighting(key, data, seed, model.trunk),
                                   trunk=model.trunk)
        self.sample_weights: Tensor | None = None  # a per-sample balancer's, per task [K]

    @property
    def extra_params(self) -> list[Tensor]:
        """A loss weighting's learnable parameters (for the run's optimizer)."""
        return [] if self.core is None else self.core.extra_params

    @property
    def weights(self) -> Tensor | None:
        """A loss weighting's current weights; a per-sample balancer's last weights, the mean
        over the batch per task (1 for the plain mean); None for the other methods."""
        if self.sample_weights is not None:
            return self.sample_weights
        return None if self.core is None else self.core.weights

    def _clipped(self, outputs: list[Tensor], targets: Tensor, tasks: list[int]) -> Tensor:
        """Per-sample-clipped task losses (value: the batch means) for ``tasks``."""
        assert self.clip is not None and self.ghost is not None
        per_sample = self.data.per_sample_losses(outputs, targets, tasks)
        return self.clip(per_sample, self.model.parameters(), norms=self.ghost.norms(per_sample))

    def __call__(self, outputs: list[Tensor], targets: Tensor) -> tuple[Tensor, StepStats | None]:
        data = self.data
        if self.core is None:
            task = self.method.task
            assert task is not None
            loss = (data.task_loss(task, outputs[0], targets[:, task]) if self.clip is None
                    else self._clipped(outputs, targets, [task])[0])
            loss.backward()
            self._add_noise(targets.shape[0])
            return loss.detach().reshape(1), None
        if self.method.kind == PER_SAMPLE:
            return self._per_sample(outputs, targets), None
        losses = (data.losses(outputs, targets) if self.clip is None
                  else self._clipped(outputs, targets, list(range(data.num_tasks))))
        stats = self.core.backward(losses)
        self._add_noise(targets.shape[0])
        return losses.detach(), stats

    def _per_sample(self, outputs: list[Tensor], targets: Tensor) -> Tensor:
        """The balancer over the ``[B, K]`` losses ``ℓᵢₖ / B`` (their sum: the plain mean's
        loss); returns the batch-mean task losses ``[K]``."""
        assert self.core is not None
        batch = targets.shape[0]
        losses = self.data.per_sample_losses(outputs, targets) / batch
        stats = self.core.backward(losses)
        if stats is not None and stats.weights is not None:
            self.sample_weights = stats.weights.detach().reshape(batch, -1).mean(0)
        return losses.detach().sum(0)

    def _add_noise(self, batch: int) -> None:
        if self.clip is not None:
            self.clip.add_noise_(self.model.parameters(), batch_size=batch)

    def after_step(self, xb: Tensor, yb: Tensor) -> None:
        """The weighting's post-step update (before ``zero_grad``)."""
        if self.core is not None:
            self.core.after_step(lambda: self.data.losses(self.model(xb), yb))


def check_method(data: MultiDigits, method: Method, cfg: RunConfig) -> None:
    """Build ``method`` for ``data`` once; raises its ValueError/TypeError if it cannot run."""
    tasks = [method.task] if method.kind == "single" else list(range(data.num_tasks))
    _Step(method, build_model(data, cfg, [t for t in tasks if t is not None]), data, 0, cfg)


def train_run(data: MultiDigits, method: Method, seed: int, cfg: RunConfig,
              progress: Progress | None = None, tb_dir: Path | None = None) -> RunResult:
    """Train one model and return its test metrics, per-epoch history and step time."""
    start = time.perf_counter()
    tasks = [method.task] if method.kind == "single" else list(range(data.num_tasks))
    torch.manual_seed(seed)
    model = build_model(data, cfg, [t for t in tasks if t is not None])
    step_fn = _Step(method, model, data, seed, cfg)
    opt = _optimizer(list(model.parameters()) + step_fn.extra_params, cfg)
    writer = open_writer(tb_dir) if tb_dir is not None else None
    log = _Logger(writer) if writer is not None else None
    gen = torch.Generator().manual_seed(seed)
    n = data.x_train.shape[0]
    per_epoch = math.ceil(n / cfg.batch_size)
    times: list[float] = []
    scales = torch.tensor(data.loss_scales, dtype=torch.float64)
    history: list[list[float]] = []
    epoch_losses: list[float] = []
    step = 0
    try:
        for epoch in range(cfg.epochs):
            order = torch.randperm(n, generator=gen)
            sums = torch.zeros(data.num_tasks, dtype=torch.float64)
            if method.kind == "single":
                sums.fill_(math.nan)
                sums[method.task] = 0.0
            for b in range(per_epoch):
                idx = order[b * cfg.batch_size:(b + 1) * cfg.batch_size]
                xb, yb = data.x_train[idx], data.y_train[idx]
                t0 = time.perf_counter()
                losses, stats = step_fn(model(xb), yb)
                pre_clip = None
                if cfg.max_norm is not None:
                    pre_clip = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
                opt.step()
                step_fn.after_step(xb, yb)
                opt.zero_grad(set_to_none=True)
                times.append(time.perf_counter() - t0)
                if method.kind == "single":
                    sums[method.task] += float(losses[0])
                else:
                    sums += losses.double() / scales
                if log is not None and step % cfg.log_every == 0:
                    log.step(stats, losses, step, pre_clip, step_fn.weights, tasks)
                step += 1
                if progress is not None:
                    progress.advance()
            history.append(_evaluate(model, data, [t for t in tasks if t is not None]))
            epoch_losses = (sums / per_epoch).tolist()
            if writer is not None:
                for task, name in enumerate(data.metric_names):
                    if not math.isnan(history[-1][task]):
                        writer.add_scalar(f"test/{name}", history[-1][task], epoch + 1)
    finally:
        if writer is not None:
            writer.close()
    warm = times[min(5, len(times) - 1):] if times else [math.nan]
    return RunResult(method, seed, history[-1], history, 1000.0 * statistics.median(warm),
                     step, epoch_losses, time.perf_counter() - start)


def step_timer(data: MultiDigits, method: Method, seed: int,
               cfg: RunConfig) -> Callable[[], None]:
    """One training step of ``method`` on seed ``seed``'s first batch, as a callable to time:
    forward, the method's backward, the global clip, ``optimizer.step``, the weighting's
    update and ``zero_grad``, exactly as :func:`train_run` takes it."""
    tasks = [method.task] if method.kind == "single" else list(range(data.num_tasks))
    torch.manual_seed(seed)
    model = build_model(data, cfg, [t for t in tasks if t is not None])
    step_fn = _Step(method, model, data, seed, cfg)
    opt = _optimizer(list(model.parameters()) + step_fn.extra_params, cfg)
    idx = torch.randperm(data.x_train.shape[0],
                         generator=torch.Generator().manual_seed(seed))[:cfg.batch_size]
    xb, yb = data.x_train[idx], data.y_train[idx]

    def step() -> None:
        step_fn(model(xb), yb)
        if cfg.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
        opt.step()
        step_fn.after_step(xb, yb)
        opt.zero_grad(set_to_none=True)
    return step
