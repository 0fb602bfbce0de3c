"""GradDrop: per-coordinate gradient sign dropout.

Chen et al. (2020), *Just Pick a Sign: Optimizing Deep Multitask Models with Gradient Sign
Dropout*, NeurIPS, arXiv:2010.06808 (Algorithm 1, lines 10-15).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .._checks import as_task_vector, check_generator
from .._shard import Shard
from ._base import Balancer, Combination
from ._rng import OptionalGeneratorState

__all__ = ["GradDrop", "graddrop_update"]

#: Columns drawn per call: the draws are a fixed sequence of chunks on every device, so a
#: rank of a sharded trunk can replay the single-process stream in bounded memory.
_DRAW_CHUNK = 1 << 20


def graddrop_uniform(shard: Shard, generator: torch.Generator | None, dtype: torch.dtype,
                     device: torch.device) -> Tensor:
    """The draws ``U ~ U(0, 1)`` of ``shard``'s columns ``[P_local]``, in local order.

    The stream is ``torch.rand`` of consecutive chunks of :data:`_DRAW_CHUNK` columns
    (one call when ``P`` is at most that; on the CPU any chunking gives the same numbers),
    always drawn through all ``P`` columns, so the generator ends where a single process
    leaves it; chunks holding no local column are drawn and dropped. Memory: one chunk.
    """
    if shard.runs == ((0, shard.total),) and shard.total <= _DRAW_CHUNK:
        return torch.rand(shard.total, generator=generator, dtype=dtype, device=device)
    out = torch.empty(shard.size, dtype=dtype, device=device)
    starts = torch.tensor([0, *(n for _, n in shard.runs)]).cumsum(0).tolist()
    order = sorted(range(len(shard.runs)), key=lambda i: shard.runs[i][0])
    pending = [(shard.runs[i][0], shard.runs[i][1], starts[i]) for i in order if shard.runs[i][1]]
    for begin in range(0, shard.total, _DRAW_CHUNK):
        end = min(begin + _DRAW_CHUNK, shard.total)
        chunk = torch.rand(end - begin, generator=generator, dtype=dtype, device=device)
        for start, length, local in pending:
            if start >= end:
                break
            lo, hi = max(start, begin), min(start + length, end)
            if lo < hi:
                out[local + lo - start : local + hi - start] = chunk[lo - begin : hi - begin]
        pending = [run for run in pending if run[0] + run[1] > end]
    return out


def graddrop_update(matrix: Tensor, uniform: Tensor, leak: Tensor | None = None,
             f: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """GradDrop's combined gradient ``[P]`` for given uniform draws ``uniform`` ``[P]``.

    Update rule, per coordinate ``j``:

    * positive sign purity ``Pⱼ = ½ (1 + Σₖ gₖⱼ / Σₖ |gₖⱼ|) = Σₖ max(gₖⱼ, 0) / Σₖ |gₖⱼ|``
      (``½`` where every ``gₖⱼ = 0``);
    * keep mask ``Mₖⱼ = [f(Pⱼ) > Uⱼ]·[gₖⱼ > 0] + [f(Pⱼ) < Uⱼ]·[gₖⱼ < 0]``;
    * ``gⱼ = Σₖ (ℓₖ + (1 − ℓₖ) Mₖⱼ) gₖⱼ`` with leak ``ℓ`` (0 by default).

    So each coordinate keeps only the positive or only the negative task contributions, the
    positive side with probability ``f(Pⱼ)``. Without a leak the update is the kept side's
    sum, four passes over the rows.

    Example:
        >>> import torch
        >>> from gradbalance.functional import graddrop_update
        >>> g = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)  # P = (½, 1)
        >>> graddrop_update(g, torch.tensor([0.75, 0.5]))  # column 0: P < U keeps the −1
        tensor([-1.,  1.], dtype=torch.float64)
    """
    # The kept side of a coordinate is all its positive entries or all its negative ones:
    # without a leak their sums, two passes each over the rows, are the update (no mask).
    positive, negative = matrix.clamp_min(0), matrix.clamp_max(0)
    pos, neg = positive.sum(dim=0), negative.sum(dim=0)
    mass = pos - neg  # Σₖ |gₖⱼ|
    purity = torch.where(mass > 0, pos / torch.where(mass > 0, mass, 1.0), 0.5)  # Σ⁺ / Σ|g|
    fp = purity if f is None else f(purity)
    uniform = uniform.to(dtype=matrix.dtype, device=matrix.device)
    up, down = fp > uniform, fp < uniform
    if leak is None:
        return torch.where(up, pos, torch.where(down, neg, 0.0))
    keep = (up & (matrix > 0)) | (down & (matrix < 0))  # the mask M, summed entry by entry
    lk = leak.to(dtype=matrix.dtype, device=matrix.device).unsqueeze(1)
    return ((lk + (1.0 - lk) * keep.to(matrix.dtype)) * matrix).sum(dim=0)


class GradDrop(OptionalGeneratorState, Balancer):
    """Gradient sign dropout on the rows of ``G`` (a matrix method).

    Applied to the flattened gradient of the shared parameters, as TorchJD does. The paper
    places it after a chosen layer, on the gradient with respect to that layer's activations
    summed over the batch; the rule per coordinate is the same. ``O(K P)``: a few passes over
    the rows, no Gramian.

    Cost in K: ``O(KP)``: elementwise passes over the ``[K, P]`` rows.

    Args:
        num_tasks: K (optional; required when ``leak`` is not given).
        leak: ``ℓₖ ∈ [0, 1]`` per task, how much of each task's gradient always passes
            (default: no leak, ``ℓ = 0``).
        f: monotonically increasing map applied to the purity, elementwise (default:
            identity).
        generator: the source of the uniform draws ``U ~ U(0, 1)ᴾ``; None uses torch's global
            RNG. A given generator's state is saved by :meth:`state_dict`. The draws come in
            chunks of 2²⁰ columns (:func:`graddrop_uniform`).

    Sharded (:meth:`~Balancer.combine` with a ``shard``): the purity is per coordinate, so
    each rank works on its own columns with no collective; it draws the whole single-process
    stream (``P`` numbers, one chunk in memory at a time) and keeps its columns' draws.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import GradDrop
        >>> g = torch.tensor([[1.0, -2.0], [3.0, -1.0]], dtype=torch.float64)
        >>> GradDrop(generator=torch.Generator().manual_seed(0))(g)  # signs agree: the plain sum
        tensor([ 4., -3.], dtype=torch.float64)
    """

    name = "graddrop"
    from_gramian = False
    homogeneous = True

    def __init__(self, num_tasks: int | None = None, leak: Sequence[float] | Tensor | None = None,
                 f: Callable[[Tensor], Tensor] | None = None,
                 generator: torch.Generator | None = None) -> None:
        lk = None
        if leak is not None:
            lk = as_task_vector("leak", leak, num_tasks, low=0.0, high=1.0)
            num_tasks = lk.numel()
        super().__init__(num_tasks)
        self.leak = lk
        self.f = f
        self.generator = check_generator("generator", generator)

    def _combine_matrix(self, matrix: Tensor, losses: Tensor | None) -> Combination:
        return self._combine_matrix_sharded(matrix, losses, None, Shard.whole(matrix.shape[1]))

    def _combine_matrix_sharded(self, matrix: Tensor, losses: Tensor | None,
                                gramian: Tensor | None, shard: Shard) -> Combination:
        where = self.generator.device if self.generator is not None else matrix.device
        uniform = graddrop_uniform(shard, self.generator, matrix.dtype, where)
        return Combination(graddrop_update(matrix, uniform, self.leak, self.f))

    def __repr__(self) -> str:
        leak = None if self.leak is None else self.leak.tolist()
        return f"GradDrop(num_tasks={self.num_tasks}, leak={leak})"
