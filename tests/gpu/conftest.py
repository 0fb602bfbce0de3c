"""The device of the GPU tests: CUDA where torch finds it, else every test skips.

``GRADBALANCE_GPU_TESTS_DEVICE`` overrides the choice: ``cpu`` runs the device-agnostic parts
on the CPU (so their logic is checked on a machine without a GPU), ``cuda`` demands CUDA and
fails instead of skipping without it (``.ci/gpu_check.sh`` sets it, so that a run on a GPU
machine cannot pass by skipping). On CUDA, TF32 is off for the test: the tolerances are those
of float32 arithmetic (docs/performance.md, "GPU check").
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

ENV = "GRADBALANCE_GPU_TESTS_DEVICE"
_CHOICES = ("cpu", "cuda")


def wanted_device() -> str:
    """The value of ``GRADBALANCE_GPU_TESTS_DEVICE``: ``""`` (unset), ``"cpu"`` or ``"cuda"``."""
    value = os.environ.get(ENV, "")
    if value not in ("", *_CHOICES):
        raise pytest.UsageError(
            f"Invalid {ENV}: {value!r} (expected 'cpu', 'cuda' or unset: unset runs the GPU "
            f"tests on CUDA when torch finds a device and skips them otherwise)"
        )
    return value


@pytest.fixture
def device() -> Iterator[torch.device]:
    """The device of the test (see the module docstring); skips without CUDA unless asked."""
    wanted = wanted_device()
    if wanted == "cpu":
        yield torch.device("cpu")
        return
    if not torch.cuda.is_available():
        reason = ("no CUDA device: torch.cuda.is_available() is False "
                  f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
        if wanted == "cuda":
            pytest.fail(f"{ENV}=cuda but {reason}")
        pytest.skip(f"{reason}; set {ENV}=cpu to run the device-agnostic parts on the CPU")
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield torch.device("cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn
