"""One rule for "this clipper scales whole rows by their 2-norm": ``mode="gramian"`` (which
clips ``G Gᵀ``) and a sharded trunk (which clips each rank's columns) accept the same row
clippers, those declaring ``norm_type = 2.0`` and ``coefficients(norms)``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gradbalance.balancers import UPGrad
from gradbalance.clip import TaskAutoClip, TaskClip
from gradbalance.clip._protocol import scales_whole_rows
from gradbalance.modes._gramian import GramianMode
from gradbalance.modes._sharded import check_sharded_clip
from gradbalance.taskgrads import ParamLayout


class Rows:
    """A row clipper with the given attributes (``coefficients`` halves every row)."""

    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)

    def __call__(self, matrix: Tensor) -> Tensor:
        norms = matrix.norm(dim=1)
        matrix.mul_(0.5)
        return norms


def _halve(norms: Tensor) -> Tensor:
    return torch.full_like(norms, 0.5)


#: (clipper, whether it scales whole rows by their 2-norm), decided by hand from what it
#: declares: both ``norm_type == 2`` and ``coefficients`` are needed.
CASES = [
    (TaskClip(1.0), True),
    (TaskClip(1.0, norm_type=float("inf")), False),
    (TaskClip(1.0, norm_type=1.0), False),
    (TaskAutoClip(), True),
    (TaskAutoClip(norm_type=1.0), False),
    (Rows(coefficients=_halve, norm_type=2.0), True),
    (Rows(coefficients=_halve), False),  # no norm_type: which norm it clips is unknown
    (Rows(norm_type=2.0), False),  # no coefficients: the rows themselves are needed
    (Rows(coefficients=0.5, norm_type=2.0), False),  # not callable
    (Rows(), False),
]


def _gramian_accepts(clip: Any) -> bool:
    trunk = nn.Linear(3, 2)
    mode = GramianMode(ParamLayout(list(trunk.parameters())), [], "loop", modules=trunk)
    try:
        mode.check_apply(UPGrad(), clip)
    except ValueError:
        return False
    return True


def _sharded_accepts(clip: Any) -> bool:
    try:
        check_sharded_clip(clip)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("clip", "expected"), CASES, ids=range(len(CASES)))
def test_gramian_mode_and_sharded_trunk_agree(clip: Any, expected: bool) -> None:
    assert scales_whole_rows(clip) is expected
    assert _gramian_accepts(clip) is expected
    assert _sharded_accepts(clip) is expected
