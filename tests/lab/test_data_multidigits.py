"""MultiDigits: shapes, disjoint image pools, canvases rebuilt independently, determinism,
the loss-scaled variant."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from gradbalance_lab.data import make_multidigits

sklearn_datasets = pytest.importorskip("sklearn.datasets")


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    raw = sklearn_datasets.load_digits()
    return raw.images / 16.0, raw.target


def test_shapes_names_and_ranges() -> None:
    data = make_multidigits(50, 20, seed=1)
    assert data.x_train.shape == (50, 1, 8, 12) and data.x_test.shape == (20, 1, 8, 12)
    assert data.y_train.shape == (50, 2) and data.y_test.shape == (20, 2)
    assert data.train_index.shape == (50, 2) and data.test_index.shape == (20, 2)
    assert data.task_names == ("left", "right") and data.num_tasks == 2
    assert data.out_features == (10, 10) and data.loss_scales == (1.0, 1.0)
    assert data.x_train.dtype == torch.float32
    assert float(data.x_train.min()) >= 0.0 and float(data.x_train.max()) <= 1.0
    three = make_multidigits(30, 10, seed=1, regression=True, width=14)
    assert three.x_train.shape == (30, 1, 8, 14) and three.y_train.shape == (30, 3)
    assert three.task_names == ("left", "right", "sum")
    assert three.out_features == (10, 10, 1)
    assert three.higher_is_better == (True, True, False)
    assert three.metric_names == ("left_acc", "right_acc", "sum_mae")


def test_train_and_test_pools_are_disjoint(digits) -> None:
    data = make_multidigits(3000, 1500, seed=3)
    train = set(data.train_index.flatten().tolist())
    test = set(data.test_index.flatten().tolist())
    assert not train & test
    # the pools partition the 1797 images: 30 % (539) held out for test by default
    assert len(test) <= 539 and len(train) <= 1797 - 539
    assert len(train) > 1000 and len(test) > 400  # both pools are actually used


def test_labels_and_canvases_rebuilt_from_sklearn(digits) -> None:
    images, target = digits
    data = make_multidigits(40, 10, seed=2, regression=True)
    index = data.train_index.numpy()
    y = data.y_train.numpy()
    np.testing.assert_array_equal(y[:, 0], target[index[:, 0]])
    np.testing.assert_array_equal(y[:, 1], target[index[:, 1]])
    np.testing.assert_allclose(y[:, 2], (target[index[:, 0]] + target[index[:, 1]]) / 18.0,
                               rtol=1e-6)
    x = data.x_train.numpy()[:, 0]
    for n in range(len(index)):
        matches = []
        for offset in (2, 3, 4):  # the right digit's documented columns for width 12
            left = np.zeros((8, 12))
            right = np.zeros((8, 12))
            left[:, :8] = images[index[n, 0]]
            right[:, offset:offset + 8] = images[index[n, 1]]
            matches.append(np.allclose(x[n], np.maximum(left, right), atol=1e-6))
        assert any(matches), f"canvas {n} is not the two digits overlapped"


def test_deterministic_by_seed() -> None:
    a = make_multidigits(64, 16, seed=7, regression=True)
    b = make_multidigits(64, 16, seed=7, regression=True)
    c = make_multidigits(64, 16, seed=8, regression=True)
    for name in ("x_train", "y_train", "x_test", "y_test", "train_index", "test_index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.x_train, c.x_train)
    assert not torch.equal(a.train_index, c.train_index)


def test_scaled_variant_scales_the_right_loss_only() -> None:
    plain = make_multidigits(32, 8, seed=0)
    scaled = make_multidigits(32, 8, seed=0, right_scale=1e-3)
    assert torch.equal(plain.x_train, scaled.x_train)
    assert scaled.loss_scales == (1.0, 1e-3)
    torch.manual_seed(0)
    outputs = [torch.randn(32, 10), torch.randn(32, 10)]
    y = scaled.y_train
    expected = torch.stack([F.cross_entropy(outputs[0], y[:, 0].long()),
                            1e-3 * F.cross_entropy(outputs[1], y[:, 1].long())])
    torch.testing.assert_close(scaled.losses(outputs, y), expected)
    torch.testing.assert_close(scaled.losses(outputs, y, scaled=False),
                               plain.losses(outputs, y))
    assert scaled.metrics(outputs, y) == plain.metrics(outputs, y)


def test_scale_changes_gradient_length_not_direction() -> None:
    # docs/figures.md §5: a constant loss factor scales the task gradient by the same factor
    data = make_multidigits(64, 8, seed=0, right_scale=1e-3)
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(96, 16), torch.nn.ReLU())
    head = torch.nn.Linear(16, 10)
    out = head(trunk(data.x_train))
    grads = []
    for scaled in (False, True):
        loss = data.losses([out, out], data.y_train, scaled=scaled)[1]
        g = torch.autograd.grad(loss, list(trunk.parameters()), retain_graph=True)
        grads.append(torch.cat([t.flatten() for t in g]))
    ratio = grads[1].norm() / grads[0].norm()
    cos = F.cosine_similarity(grads[0], grads[1], dim=0)
    assert ratio.item() == pytest.approx(1e-3, rel=1e-4)
    assert cos.item() == pytest.approx(1.0, abs=1e-5)


def test_metrics_on_hand_values() -> None:
    data = make_multidigits(8, 4, seed=0, regression=True)
    targets = torch.tensor([[1.0, 2.0, 3 / 18], [4.0, 5.0, 9 / 18]])
    logits_left = torch.zeros(2, 10)
    logits_left[0, 1] = logits_left[1, 7] = 1.0  # first right, second wrong
    logits_right = torch.zeros(2, 10)
    logits_right[0, 2] = logits_right[1, 5] = 1.0  # both right
    sums = torch.tensor([[4 / 18], [7 / 18]])  # off by 1 and by 2 digits
    values = data.metrics([logits_left, logits_right, sums], targets)
    assert values == pytest.approx([50.0, 100.0, 1.5])


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [({"n_train": 0}, "Invalid n_train: 0"), ({"width": 9}, "Invalid width: 9"),
     ({"right_scale": 0.0}, "Invalid right_scale: 0.0"),
     ({"test_fraction": 1.0}, "Invalid test_fraction: 1.0")],
)
def test_bad_arguments(kwargs: dict, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        make_multidigits(**{"n_train": 10, "n_test": 5, **kwargs})
