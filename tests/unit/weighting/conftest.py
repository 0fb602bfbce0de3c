"""Loss-weighting tests run with one intra-op thread: their training loops compare runs bit
for bit, and a second thread changes reduction order when the other core is busy."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
