"""A state through a file, as a checkpoint would carry it."""

from __future__ import annotations

import io
from typing import Any

import torch


def through_a_file(state: Any) -> Any:
    """``state`` saved with ``torch.save`` and read back with ``weights_only=True``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)
