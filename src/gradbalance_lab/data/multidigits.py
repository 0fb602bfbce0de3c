"""MultiDigits: a two-digit (optionally three-task) benchmark built from scikit-learn's digits.

Every sample is a canvas ``[1, 8, W]`` (default ``W = 12``) holding two 8×8 handwritten
digits from :func:`sklearn.datasets.load_digits` (1797 images, bundled, no download): one
flush left, one shifted right by a random offset so that the two overlap by 4 to 6 columns
(pixel-wise maximum where they overlap). The tasks:

* ``left``: class of the left digit (10 classes, cross-entropy, accuracy %, higher is better);
* ``right``: class of the right digit (10 classes, cross-entropy, accuracy %, higher is better);
* ``sum`` (``regression=True``): the sum of the two digits divided by 18 (MSE on targets in
  ``[0, 1]``; metric: mean absolute error in digit units, lower is better).

Train and test canvases are drawn from **disjoint pools of source images** (a seeded
permutation of the 1797 images), so a test canvas never shows a digit image seen in training.
Everything is deterministic given ``seed``.

The *scaled* variant (``right_scale=1e-3``) multiplies the right task's loss by 1/1000: a
constant loss scale changes the length of that task's gradient, never its direction
(`docs/figures.md`, §5), which is what separates scale-robust balancers from the plain sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor
from torch.nn import functional as F

from gradbalance._optional import require

__all__ = ["MultiDigits", "load_digit_images", "make_multidigits"]

_DIGIT = 8  # side of a source image
_NUM_IMAGES = 1797


@lru_cache(maxsize=1)
def load_digit_images() -> tuple[Tensor, Tensor]:
    """The 1797 bundled 8×8 digits as ``([1797, 8, 8]`` float32 in [0, 1], ``[1797]`` int64).

    Cached; treat the tensors as read-only.
    """
    datasets = require("sklearn.datasets", "data", "MultiDigits (scikit-learn's bundled digits)")
    digits = datasets.load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float32) / 16.0
    labels = torch.as_tensor(digits.target, dtype=torch.int64)
    return images, labels


@dataclass(frozen=True)
class MultiDigits:
    """Tensors and task metadata of one MultiDigits build (see the module docstring).

    Attributes:
        x_train, x_test: canvases ``[N, 1, 8, W]`` float32 in [0, 1].
        y_train, y_test: targets ``[N, T]`` float32 (class labels stored as whole numbers).
        train_index, test_index: source-image indices ``[N, 2]`` (left, right) of each canvas.
        task_names: ``("left", "right")`` or ``("left", "right", "sum")``.
        loss_scales: constant factor applied to each task's loss by :meth:`losses`.
    """

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    train_index: Tensor
    test_index: Tensor
    task_names: tuple[str, ...]
    loss_scales: tuple[float, ...]

    @property
    def num_tasks(self) -> int:
        return len(self.task_names)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.x_train.shape[1:])  # type: ignore[return-value]

    @property
    def is_classification(self) -> tuple[bool, ...]:
        return tuple(name != "sum" for name in self.task_names)

    @property
    def out_features(self) -> tuple[int, ...]:
        """Head output size per task: 10 logits or 1 regression value."""
        return tuple(10 if cls else 1 for cls in self.is_classification)

    @property
    def higher_is_better(self) -> tuple[bool, ...]:
        """Direction of each task's metric (accuracy up, mean absolute error down)."""
        return self.is_classification

    @property
    def metric_names(self) -> tuple[str, ...]:
        return tuple(
            f"{name}_acc" if cls else f"{name}_mae"
            for name, cls in zip(self.task_names, self.is_classification)
        )

    def task_loss(self, task: int, output: Tensor, target: Tensor,
                  reduction: str = "mean") -> Tensor:
        """Unscaled loss of ``task``: cross-entropy, or MSE for ``sum``; the batch mean, or
        ``[B]`` per-sample losses with ``reduction='none'``."""
        if self.is_classification[task]:
            return F.cross_entropy(output, target.long(), reduction=reduction)
        return F.mse_loss(output.squeeze(-1), target, reduction=reduction)

    def task_metric(self, task: int, output: Tensor, target: Tensor) -> float:
        """Accuracy in % (classification) or mean absolute error in digit units (``sum``)."""
        if self.is_classification[task]:
            return 100.0 * float((output.argmax(dim=-1) == target.long()).double().mean())
        return 18.0 * float((output.squeeze(-1) - target).abs().double().mean())

    def losses(self, outputs: Sequence[Tensor], targets: Tensor, scaled: bool = True) -> Tensor:
        """Per-task batch-mean losses ``[T]``, times :attr:`loss_scales` when ``scaled``."""
        parts = []
        for k, out in enumerate(outputs):
            loss = self.task_loss(k, out, targets[:, k])
            if scaled and self.loss_scales[k] != 1.0:
                loss = loss * self.loss_scales[k]
            parts.append(loss)
        return torch.stack(parts)

    def per_sample_losses(self, outputs: Sequence[Tensor], targets: Tensor,
                          tasks: Sequence[int] | None = None, scaled: bool = True) -> Tensor:
        """Per-sample losses ``[B, len(tasks)]`` (all tasks by default), times the loss
        scales when ``scaled``: the input of per-sample clipping."""
        tasks = list(range(len(outputs))) if tasks is None else list(tasks)
        parts = []
        for out, k in zip(outputs, tasks):
            loss = self.task_loss(k, out, targets[:, k], reduction="none")
            parts.append(loss * self.loss_scales[k] if scaled and self.loss_scales[k] != 1.0
                         else loss)
        return torch.stack(parts, dim=1)

    def metrics(self, outputs: Sequence[Tensor], targets: Tensor) -> list[float]:
        """Per-task test metrics (see :meth:`task_metric`)."""
        return [self.task_metric(k, out, targets[:, k]) for k, out in enumerate(outputs)]


def _check(name: str, value: object, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"Invalid {name}: {value!r} (expected {expected})")


def _canvases(images: Tensor, index: Tensor, offsets: Tensor, width: int) -> Tensor:
    n = index.shape[0]
    canvas = torch.zeros(n, 1, _DIGIT, width)
    canvas[:, 0, :, :_DIGIT] = images[index[:, 0]]
    right = torch.zeros(n, _DIGIT, width)
    for offset in offsets.unique().tolist():
        rows = (offsets == offset).nonzero().squeeze(1)
        right[rows, :, offset:offset + _DIGIT] = images[index[rows, 1]]
    canvas[:, 0] = torch.maximum(canvas[:, 0], right)
    return canvas


def make_multidigits(
    n_train: int = 6000,
    n_test: int = 2000,
    *,
    seed: int = 0,
    right_scale: float = 1.0,
    regression: bool = False,
    width: int = 12,
    test_fraction: float = 0.3,
) -> MultiDigits:
    """Build MultiDigits deterministically from ``seed``.

    Args:
        n_train, n_test: number of canvases in each split (drawn with replacement from their
            image pools; the pair of digits and the offset vary).
        seed: seeds the pool split, the pairing and the offsets.
        right_scale: factor on the right task's loss; ``1e-3`` is the scaled variant.
        regression: add the third task ``sum`` (regression of the digit sum).
        width: canvas width, 10 to 16; the right digit starts at a random column in
            ``[width - 10, width - 8]`` (at least 1), so the digits overlap.
        test_fraction: share of the 1797 source images reserved for the test pool.
    """
    _check("n_train", n_train, isinstance(n_train, int) and n_train >= 1, "an int >= 1")
    _check("n_test", n_test, isinstance(n_test, int) and n_test >= 1, "an int >= 1")
    _check("width", width, isinstance(width, int) and 10 <= width <= 16, "an int in [10, 16]")
    _check("test_fraction", test_fraction, 0.05 <= test_fraction <= 0.95,
           "0.05 <= test_fraction <= 0.95")
    _check("right_scale", right_scale, float(right_scale) > 0 and right_scale != float("inf"),
           "a finite number > 0, e.g. 1e-3 for the scaled variant")
    images, labels = load_digit_images()
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(_NUM_IMAGES, generator=gen)
    n_pool_test = round(test_fraction * _NUM_IMAGES)
    pools = {"test": perm[:n_pool_test], "train": perm[n_pool_test:]}
    low, high = max(1, width - 10), width - _DIGIT

    def split(pool: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
        index = pool[torch.randint(len(pool), (n, 2), generator=gen)]
        offsets = torch.randint(low, high + 1, (n,), generator=gen)
        x = _canvases(images, index, offsets, width)
        pair = labels[index].float()
        targets = [pair[:, 0], pair[:, 1]]
        if regression:
            targets.append(pair.sum(dim=1) / 18.0)
        return x, torch.stack(targets, dim=1), index

    x_train, y_train, i_train = split(pools["train"], n_train)
    x_test, y_test, i_test = split(pools["test"], n_test)
    names = ("left", "right", "sum") if regression else ("left", "right")
    scales = (1.0, float(right_scale)) + ((1.0,) if regression else ())
    return MultiDigits(x_train, y_train, x_test, y_test, i_train, i_test, names, scales)
