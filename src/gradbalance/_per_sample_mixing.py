"""The check that nothing outside the recorded layers mixes the samples of a batch.

The per-sample Gramian takes sample i's gradient at a layer from its output gradient
``Dᵢ = ∂(Σⱼ ℓⱼ)/∂yᵢ``, which is ``∂ℓᵢ/∂yᵢ`` only when no operation after the layer mixes the
samples; a BatchNorm module is refused by name, but ``x − x.mean(0)``, a softmax over the batch
or a hand-written normalisation are plain tensor operations. The check asks the gradients of
``Σᵢ ℓᵢ`` and of ``Σᵢ rᵢ ℓᵢ`` at every recorded output, for each probe ``r`` with every
``rᵢ`` 1 or 2. Where the samples do not mix, every row of a probe's gradient is ``rᵢ`` times
the first's, and exactly so (a power of two commutes with rounding through the per-row linear
operations of a backward); where they mix, row i also carries ``Σⱼ (rⱼ − rᵢ) ∂ℓⱼ/∂yᵢ`` over
the other samples. Probe b takes ``rᵢ = 1 + bit b of i`` (``⌈log₂ B⌉`` probes): every two
samples differ in some probe, so a loss that reads another sample (a pair ``(i, B−1−i)``, a
permutation of the batch) is caught, which one probe misses where it gives both samples the
same ``rᵢ``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> layer = nn.Linear(3, 2)
    >>> y = layer(torch.randn(4, 3))
    >>> losses = (y - y.mean(0)).square().sum(1)  # the batch's mean: the samples mix
    >>> mixed_outputs(losses, None, [("layer", [y])])
    ['layer']
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["MIXING_EPS", "mixed_outputs", "mixing_error"]

#: A row's mismatch accepted, in units of ``eps`` times its size: none where the backward is
#: deterministic; room for kernels whose sums run in a varying order. The ``eps`` is float32's
#: for half-precision gradients (bfloat16 and float16 are exact here too: a power of two
#: commutes with their rounding; their own ``eps``, 2⁻⁷ for bfloat16, let a loss reading
#: another sample with weight 1 pass), plus ``MIXING_EPS`` times the rows' difference between
#: two runs of the same backward, and the underflow of their subnormal range.
MIXING_EPS = 64


def _probes(batch: int, device: torch.device, dtype: torch.dtype) -> list[Tensor]:
    """The probes ``r`` ``[B]``, ``⌈log₂ B⌉`` of them (B ≥ 2): probe b is ``1 + bit b`` of
    each sample's index, so every two samples get different ``rᵢ`` in at least one."""
    index = torch.arange(batch)
    return [(1 + (index >> bit) % 2).to(device=device, dtype=dtype)
            for bit in range((batch - 1).bit_length())]


def _mixes(plain: Tensor, probed: Tensor, r: Tensor, noise: Tensor | None) -> bool | None:
    """Whether ``probed``'s rows differ from ``r`` times ``plain``'s beyond rounding (``noise``
    ``[B]``: the rows' difference between two runs of ``plain``, None: not measured); None if
    either holds a non-finite entry (nothing can be told)."""
    a = plain.reshape(plain.shape[0], -1).double()
    b = probed.reshape(probed.shape[0], -1).double()
    if not bool(torch.isfinite(a).all()) or not bool(torch.isfinite(b).all()):
        return None
    scale = r.double().reshape(-1, 1)
    diff = torch.linalg.vector_norm(b - scale * a, dim=1)
    size = torch.linalg.vector_norm(b, dim=1) + scale.flatten() * torch.linalg.vector_norm(a,
                                                                                          dim=1)
    relative, floor = _rounding(probed.dtype, a.shape[1])
    room = relative * size + floor
    if noise is not None:
        room = room + MIXING_EPS * noise.double() * (1 + scale.flatten())
    return bool((diff > room).any())


def _rounding(dtype: torch.dtype, numel: int) -> tuple[float, float]:
    """A row's room for rounding: relative to its size (``MIXING_EPS`` eps of at least
    float32), and absolute (its subnormal range, where products lose relative precision)."""
    if not dtype.is_floating_point:
        return 0.0, 0.0
    info = torch.finfo(dtype)
    wide = torch.finfo(torch.promote_types(dtype, torch.float32)).eps
    return MIXING_EPS * wide, MIXING_EPS * info.tiny * info.eps * numel ** 0.5


def _noise(root: Tensor, scale: Tensor | None, outputs: list[Tensor],
           plain: Sequence[Tensor | None]) -> list[Tensor | None]:
    """Each half-precision output's rows' difference between ``plain`` and a second run of
    the same backward (kernels whose sums run in a varying order); None elsewhere (float32
    and float64 rows have ``MIXING_EPS`` of their own ``eps``)."""
    if not any(y.dtype.is_floating_point and torch.finfo(y.dtype).bits <= 16 for y in outputs):
        return [None] * len(outputs)
    again = _gradients(root, scale, outputs)
    return [None if a is None or g is None
            else torch.linalg.vector_norm((g.double() - a.double()).reshape(g.shape[0], -1), dim=1)
            for a, g in zip(plain, again)]


def _batch_outputs(records: Sequence[tuple[str, Sequence[Tensor]]],
                   batch: int) -> list[tuple[str, Tensor]]:
    """The recorded outputs on a graph with the batch along dim 0, each with its name."""
    return [(name, y) for name, outputs in records for y in outputs
            if y.requires_grad and y.dim() > 0 and y.shape[0] == batch]


def mixed_outputs(losses: Tensor, scale: Tensor | None,
                  records: Sequence[tuple[str, Sequence[Tensor]]]) -> list[str] | None:
    """The names of the records (``(name, outputs)``) whose output gradients mix the samples
    of ``losses`` (``[B]`` or ``[B, K]``, the loss scale ``scale`` applied as in the step's
    passes); None when nothing could be told (no output with the batch along dim 0 on the
    graph, or a non-finite gradient). ``1 + ⌈log₂ B⌉`` ``autograd.grad`` calls, the graph
    retained."""
    batch = losses.shape[0]
    named = _batch_outputs(records, batch)
    if batch < 2 or not named:
        return None
    columns = losses.reshape(batch, -1)
    outputs = [y for _, y in named]
    probes = _probes(batch, columns.device, columns.dtype)
    plain = _gradients(columns.sum(), scale, outputs)
    noise = _noise(columns.sum(), scale, outputs, plain)
    mixing: list[str] = []
    for r in probes:
        probed = _gradients((columns * r[:, None]).sum(), scale, outputs)
        found = _mixing_names([name for name, _ in named], plain, probed, r, noise)
        if found is None:
            return None
        mixing += [name for name in found if name not in mixing]
    return list(dict.fromkeys(name for name, _ in named if name in mixing))  # in call order


def _gradients(root: Tensor, scale: Tensor | None,
               outputs: list[Tensor]) -> Sequence[Tensor | None]:
    """The gradients of ``root`` (times ``scale``) at ``outputs``, the graph retained."""
    if scale is not None:
        root = root * scale.to(root.dtype)
    return torch.autograd.grad(root, outputs, retain_graph=True, allow_unused=True)


def _mixing_names(names: list[str], plain: Sequence[Tensor | None],
                  probed: Sequence[Tensor | None], r: Tensor,
                  noise: Sequence[Tensor | None]) -> list[str] | None:
    """The names (once each, in order) whose two gradients differ beyond rounding; None if
    some gradient is not finite. An output off the graph (None) tells nothing."""
    mixing: list[str] = []
    for name, a, b, n in zip(names, plain, probed, noise):
        if a is None or b is None:
            continue
        verdict = _mixes(a, b, r, n)
        if verdict is None:
            return None
        if verdict and name not in mixing:
            mixing.append(name)
    return mixing


def mixing_error(names: list[str], fix: str) -> ValueError:
    """The refusal of a trunk whose output gradients after the layers ``names`` mix the
    samples; ``fix``: the user's alternative."""
    return ValueError(
        f"the trunk mixes the samples of the batch after layer(s) {names}: their output "
        f"gradients for one sample depend on the other samples' losses (an operation across "
        f"dim 0 after them, e.g. x - x.mean(0), a softmax over the batch or a hand-written "
        f"normalisation), so per-sample gradients are not defined: compute it per sample, "
        f"or {fix} (docs/per_sample.md, \"Refused, before anything moves\")"
    )
