"""Fixtures of the mode tests."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def float64() -> Iterator[None]:
    """float64 as torch's default dtype for the test (float32 again after it)."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)
