"""``batch_dim=0`` on trunks, losses and loops outside the main parity suite.

The reference for every accepted case is the matrix route over the same objectives: each
sample's loss (or each sample × task) passed as a task of its own, every micro-batch's
objectives of a step in one call, in float64, compared as full updates (every parameter's
``.grad``) over several steps. Refusals are checked to leave every ``.grad`` as it was.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Balancer, UPGrad

LossFn = Callable[[nn.Module, nn.Module, Tensor, Tensor], Tensor]
Batch = tuple[Tensor, Tensor]


def _grads(params: list[Tensor]) -> Tensor:
    return torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten()
                      for p in params])


def _squared(trunk: nn.Module, heads: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return (heads(trunk(x)) - y).square()  # [B, K]


def _run(build: Callable[[], tuple[nn.Module, nn.Module]], steps: list[list[Batch]],
         per_sample: bool, loss_fn: LossFn = _squared,
         balancer: Callable[[], Balancer] = UPGrad, **options: Any) -> list[Tensor]:
    """The update of each step (``.grad`` of every parameter, zeroed before each step); the
    matrix route gets all of a step's objectives in one call."""
    torch.manual_seed(0)
    trunk, heads = build()
    params = list(dict.fromkeys([*trunk.parameters(), *heads.parameters()]))
    shared = [p for p in trunk.parameters() if p.requires_grad]
    kwargs: dict[str, Any] = {"modules": trunk, "batch_dim": 0} if per_sample else {}
    buf = TaskGradBuffer(shared, heads.parameters(), **kwargs, **options)
    weighing = balancer()
    updates = []
    try:
        for micro_batches in steps:
            for p in params:
                p.grad = None
            if per_sample:
                for x, y in micro_batches:
                    buf.backward(loss_fn(trunk, heads, x, y))
            else:
                if "update_every" not in options:  # B may change between steps
                    buf = TaskGradBuffer(shared, heads.parameters())
                buf.backward(torch.cat([loss_fn(trunk, heads, x, y).reshape(-1)
                                        for x, y in micro_batches]))
            buf.apply_(weighing, clip=copy.deepcopy(options.get("_clip")))
            updates.append(_grads(params))
            with torch.no_grad():  # move the model so that later steps differ
                for p in params:
                    if p.grad is not None:
                        p -= 0.1 * p.grad
    finally:
        if buf._per_sample is not None:
            buf._per_sample.gramian.remove()
    return updates


def _assert_parity(build: Callable[[], tuple[nn.Module, nn.Module]], steps: list[list[Batch]],
                   **options: Any) -> None:
    got = _run(build, steps, True, **options)
    want = _run(build, steps, False, **options)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10 * float(b.abs().max()))


def _mlp() -> tuple[nn.Module, nn.Module]:
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Linear(8, 2)


def _batch(b: int, width: int = 5, tasks: int = 2) -> Batch:
    return torch.randn(b, width), torch.randn(b, tasks)


# --- Samples mixed by a loss or a trunk that reads another given sample -------------------


class _PairTrunk(nn.Module):
    """Adds sample ``B−1−i``'s hidden features to sample i's: every sample's output reads
    its mirror sample."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(5, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.first(x)
        return self.second(torch.tanh(h + h.flip(0)))


@pytest.mark.parametrize("where", ["loss", "trunk"])
@pytest.mark.parametrize("batch", [4, 6, 8])
def test_pairs_within_the_batch_are_refused(float64: None, where: str, batch: int) -> None:
    """A loss ``ℓᵢ + ℓ_{B−1−i}`` (or a trunk mixing the pairs) has no per-sample gradient;
    a single probe ``r`` that gives both samples of each pair the same ``rᵢ`` missed it
    (B = 4: ``r = (1, 2, 2, 1)``) and the update was off by 4 %."""
    torch.manual_seed(0)
    trunk = _PairTrunk() if where == "trunk" else nn.Sequential(nn.Linear(5, 8), nn.Tanh(),
                                                                 nn.Linear(8, 8))
    heads = nn.Linear(8, 2)
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    x, y = _batch(batch)
    losses = (heads(trunk(x)) - y).square()
    if where == "loss":
        losses = losses + losses.flip(0)
    with pytest.raises(ValueError, match="mixes the samples of the batch"):
        buf.backward(losses)
    assert all(p.grad is None for p in [*trunk.parameters(), *heads.parameters()])


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(2, 12), data=st.data(), tasks=st.integers(1, 2))
def test_a_loss_reading_one_other_sample_is_refused(batch: int, data: st.DataObject,
                                                    tasks: int) -> None:
    """``ℓ'ᵢ = ℓᵢ + c·ℓ_{π(i)}`` for a permutation π that moves some sample: refused
    whatever π, B and c (every two samples differ in one of the probes)."""
    perm = data.draw(st.permutations(range(batch)).filter(
        lambda p: any(i != j for i, j in enumerate(p))))
    c = data.draw(st.sampled_from([0.5, 1.0, -1.0, 3.0]))
    torch.manual_seed(batch)
    trunk, heads = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Linear(8, tasks)
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    x, y = _batch(batch, tasks=tasks)
    losses = (heads(trunk(x)) - y).square()
    losses = losses + c * losses[list(perm)]
    with pytest.raises(ValueError, match="mixes the samples of the batch"):
        buf.backward(losses[:, 0] if tasks == 1 else losses)
    assert all(p.grad is None for p in trunk.parameters())


def test_ghost_norms_refuse_pairs_within_the_batch() -> None:
    """``GhostNorms`` runs the same check: the mirrored pairs are refused there too."""
    from gradbalance.clip import GhostNorms

    torch.manual_seed(0)
    trunk = _PairTrunk()
    ghost = GhostNorms(trunk)
    with pytest.raises(ValueError, match="mixes the samples"):
        ghost.norms(trunk(torch.randn(4, 5)).square().sum(1))


# --- A covered layer called without a batch (dim 0 equal to B by chance) --------------------


class _Unbatched(nn.Module):
    """``layer`` called on a learned tensor of its unbatched shape, whose dim 0 is 4: the
    same number as the batch below."""

    def __init__(self, layer: nn.Module, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.const = nn.Parameter(torch.randn(*shape))
        self.layer, self.first = layer, nn.Linear(5, 8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.first(x)) * self.layer(self.const).reshape(-1)[:1]


@pytest.mark.parametrize(("layer", "shape"), [
    (lambda: nn.Linear(4, 3), (4,)), (lambda: nn.Conv1d(4, 2, 3), (4, 6)),
    (lambda: nn.Conv2d(4, 2, 1), (4, 2, 2)), (lambda: nn.LayerNorm((4, 3)), (4, 3))])
def test_an_unbatched_call_is_refused_by_name(layer: Callable[[], nn.Module],
                                              shape: tuple[int, ...]) -> None:
    """A Linear on a ``[4]`` vector (or a Conv on ``[C, L]``, a LayerNorm on its normalised
    shape) with B = 4 passed the batch check and failed later inside the Gramian with a
    reshape error; it is refused by the batch check, naming the layer, before anything
    moves."""
    torch.manual_seed(0)
    trunk, heads = _Unbatched(layer(), shape), nn.Linear(8, 2)
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    with pytest.raises(ValueError, match=r"layer 'layer' recorded inputs of shapes .* but the "
                                         r"losses have 4 samples.*at least \d dims"):
        buf.backward((heads(trunk(torch.randn(4, 5))) - 1).square())
    assert all(p.grad is None for p in [*trunk.parameters(), *heads.parameters()])
