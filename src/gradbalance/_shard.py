"""A rank's columns of the task-gradient matrix under a sharded trunk (docs/balancers.md,
"Sharded trunks")."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .gramian import _scale_rows, _work_dtype, compute_gramian, unit_rows

__all__ = ["Shard", "dim0_runs"]


def _identity(value: Tensor) -> Tensor:
    return value.clone()


@dataclass(frozen=True)
class Shard:
    """A rank's columns of the task-gradient matrix under a sharded trunk.

    Attributes:
        runs: ``(global start, length)`` pairs in single-process flat order, in the order of
            the local columns (FSDP2 shards each parameter on dim 0, so each parameter gives
            one run; empty runs are allowed).
        total: ``P``, the columns of the full matrix.
        reduce: the sum over ranks of a tensor (a new tensor, identical on every rank), e.g.
            an ``all_reduce`` of a copy; the identity on one process.

    Example:
        >>> from gradbalance.balancers import Shard, dim0_runs
        >>> runs = dim0_runs([(4, 3), (5,)], rank=1, world_size=2)
        >>> runs
        ((6, 6), (15, 2))
        >>> Shard(runs, total=17).size
        8
    """

    runs: tuple[tuple[int, int], ...]
    total: int
    reduce: Callable[[Tensor], Tensor] = field(default=_identity, compare=False)

    def __post_init__(self) -> None:
        runs = tuple((int(s), int(n)) for s, n in self.runs)
        object.__setattr__(self, "runs", runs)
        if int(self.total) < 0:
            raise ValueError(f"Shard total must be >= 0 columns, got {self.total}")
        object.__setattr__(self, "total", int(self.total))
        end = 0
        for start, length in sorted(r for r in runs if r[1] > 0):
            if start < end:
                raise ValueError(
                    f"Shard runs {list(runs)} overlap at column {start}; give each local "
                    f"column once, as (global start, length) pairs"
                )
            end = start + length
        bad = [r for r in runs if r[0] < 0 or r[1] < 0 or r[0] + r[1] > self.total]
        if bad:
            raise ValueError(
                f"Shard runs {bad} lie outside the {self.total} columns of the full matrix; "
                f"each run needs 0 <= start and start + length <= total"
            )

    @classmethod
    def whole(cls, total: int) -> Shard:
        """Every column on one process (``reduce`` the identity)."""
        return cls(((0, total),) if total else (), total)

    @property
    def size(self) -> int:
        """``P_local``: the number of local columns."""
        return sum(length for _, length in self.runs)

    def pieces(self, start: int, stop: int) -> Iterator[tuple[int, int]]:
        """``(local start, length)`` of the local columns whose global index is in
        ``[start, stop)``, in local order."""
        local = 0
        for begin, length in self.runs:
            lo, hi = max(begin, start), min(begin + length, stop)
            if lo < hi:
                yield local + lo - begin, hi - lo
            local += length

    def sum(self, value: Tensor) -> Tensor:
        """:attr:`reduce`, checked: same shape and dtype back, a new tensor."""
        out = self.reduce(value)
        if not isinstance(out, Tensor) or out.shape != value.shape or out.dtype != value.dtype:
            found = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise TypeError(
                f"Shard.reduce must return a tensor shaped like its input {tuple(value.shape)}"
                f" ({value.dtype}), got {found}; pass the sum over ranks, e.g. all_reduce "
                f"of a copy"
            )
        return out


def dim0_runs(shapes: Sequence[Sequence[int]], rank: int, world_size: int
              ) -> tuple[tuple[int, int], ...]:
    """FSDP2's runs: each parameter (in flat order) split on dim 0 into chunks of
    ``c = ceil(n / world_size)`` rows, rank ``r`` holding rows ``[r·c, min((r+1)·c, n))``
    (possibly none; a 0-d parameter counts as one row).

    Example:
        >>> from gradbalance.balancers import dim0_runs
        >>> dim0_runs([(4, 3), (5,)], rank=0, world_size=2)  # rows 0-1 of 4, rows 0-2 of 5
        ((0, 6), (12, 3))
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    runs, offset = [], 0
    for shape in shapes:
        rows = int(shape[0]) if len(shape) else 1
        numel = math.prod(int(n) for n in shape)
        per_row = numel // rows if rows else 0
        chunk = -(-rows // world_size)
        lo, hi = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
        runs.append((offset + lo * per_row, (hi - lo) * per_row))
        offset += numel
    return tuple(runs)


def full_gramian(matrix: Tensor, shard: Shard | None = None) -> Tensor:
    """The full ``[K, K]`` Gramian (float64) of ``matrix``, summed over the ranks with ``shard``."""
    gram = compute_gramian(matrix)
    return gram if shard is None else shard.sum(gram)


def sharded_unit_rows(matrix: Tensor, shard: Shard) -> tuple[Tensor, Tensor, Tensor]:
    """``(U, s, n)``: the sharded :func:`~gradbalance.gramian.unit_rows`, ``s`` chosen from the
    full rows' norms ``n`` (one reduce), so that every rank scales a row alike."""
    local_unit, local_scale = unit_rows(matrix)  # the local squares, summed scale-safe
    squares = local_unit.pow(2).sum(dim=1, dtype=torch.float64) * local_scale * local_scale
    norms = shard.sum(squares).clamp_min(0).sqrt()
    part = matrix.to(_work_dtype(matrix.dtype))
    unit, scale = _scale_rows(part, part is not matrix, norms)
    return unit, scale, norms
