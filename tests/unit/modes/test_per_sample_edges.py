"""``batch_dim=0`` on trunks, losses and loops outside the main parity suite.

The reference for every accepted case is the matrix route over the same objectives: each
sample's loss (or each sample × task) passed as a task of its own, every micro-batch's
objectives of a step in one call, in float64, compared as full updates (every parameter's
``.grad``) over several steps. Refusals are checked to leave every ``.grad`` as it was.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, Balancer, Sum, UPGrad

LossFn = Callable[[nn.Module, nn.Module, Tensor, Tensor], Tensor]
Batch = tuple[Tensor, Tensor]


@contextmanager
def _float64() -> Iterator[None]:
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


def _grads(params: list[Tensor]) -> Tensor:
    return torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten()
                      for p in params])


def _squared(trunk: nn.Module, heads: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return (heads(trunk(x)) - y).square()  # [B, K]


def _run(build: Callable[[], tuple[nn.Module, nn.Module]], steps: list[list[Batch]],
         per_sample: bool, loss_fn: LossFn = _squared,
         balancer: Callable[[], Balancer] = UPGrad, clip: Any = None,
         **options: Any) -> list[Tensor]:
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
            buf.apply_(weighing, clip=copy.deepcopy(clip))
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


# --- Trunks and loops: parity with the matrix route ---------------------------------------


class _MultiExit(nn.Module):
    """Returns an early and a late feature: task 0's head reads layer 1, tasks 1–2 layer 3."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        a = torch.tanh(self.l1(x))
        return a, self.l3(torch.tanh(self.l2(a)))


class _ExitHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.early, self.late = nn.Linear(6, 1), nn.Linear(6, 2)

    def forward(self, features: tuple[Tensor, Tensor]) -> Tensor:
        return torch.cat([self.early(features[0]), self.late(features[1])], 1)


class _Siamese(nn.Module):
    """One encoder applied to both halves of each sample."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4))
        self.out = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.enc(x[:, :3]), self.enc(x[:, 3:])
        return self.out(torch.cat([a * b, a - b], 1))


class _Functional(nn.Module):
    """Its own weights through ``F.linear`` / ``F.conv1d`` (no outer form: the fallback),
    around a covered Linear inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 2, 3) / 3)
        self.v = nn.Parameter(torch.randn(8, 9) / 3)
        self.inner = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(F.conv1d(x, self.w, stride=2, padding=1)).flatten(1)  # [B, 9]
        return self.inner(torch.tanh(F.linear(h, self.v)))


class _TiedPair(nn.Module):
    """Two Conv1d layers sharing one weight, then one Linear applied twice (depth) and
    a second Linear sharing the first one's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv1d(2, 2, 3, padding=1), nn.Conv1d(2, 2, 3, padding=2, dilation=2)
        self.c2.weight = self.c1.weight
        self.a, self.b = nn.Linear(12, 12), nn.Linear(12, 12)
        self.b.weight = self.a.weight
        self.out = nn.Linear(12, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.c2(torch.tanh(self.c1(x))).flatten(1)  # [B, 12]
        h = torch.tanh(self.a(torch.tanh(self.a(h))))
        return self.out(torch.tanh(self.b(h)))


class _Decoder(nn.Module):
    """A transformer decoder layer (causal mask, a padding mask on the memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.tgt, self.mem = nn.Linear(3, 8), nn.Linear(3, 8)
        self.layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(3, dtype=x.dtype)
        pad = torch.zeros(x.shape[0], 2, dtype=torch.bool)
        pad[0, 1] = True
        out = self.layer(self.tgt(x[:, :3]), self.mem(x[:, 3:]), tgt_mask=mask,
                         memory_key_padding_mask=pad, tgt_is_causal=True)
        return out.mean(1)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mha = nn.Linear(3, 8), nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        return self.mha(h, h, h, need_weights=False)[0].mean(1)


class _Padded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(7, 6, padding_idx=2), nn.Linear(6, 8)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(torch.tanh(self.embed(ids)).mean(1))


class _Bagged(nn.Module):
    """An ``nn.EmbeddingBag`` (a fallback module whose output is an op of its table alone)
    read by two layers: one call, however many nodes read its output."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(7, 6, mode="sum")
        self.a, self.b = nn.Linear(6, 8), nn.Linear(6, 8)

    def forward(self, ids: Tensor) -> Tensor:
        h = torch.tanh(self.bag(ids))
        return self.a(h) + torch.tanh(self.b(h))


class _Lookup(nn.Module):
    """A table indexed by token ids, summed per sample (no layer of the table above)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(7, 6))

    def forward(self, ids: Tensor) -> Tensor:
        return self.table[ids].sum(1)


class _LookupReadTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lookup, self.out = _Lookup(), nn.Linear(6, 8)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.lookup(ids)
        return self.out(torch.tanh(h)) * torch.sigmoid(h.sum(1, keepdim=True))



class _NeedsTwo(nn.Module):
    """A table lookup whose forward refuses fewer than two samples (a user's shape check,
    raising ``error``): plain backward never sees it; the per-sample route's vectorised rows
    run the forward one sample at a time, so this module's rows come from the masked route."""

    def __init__(self, error: type[Exception]) -> None:
        super().__init__()
        self.error = error
        self.table, self.out = nn.Parameter(torch.randn(7, 6)), nn.Linear(6, 8)

    def forward(self, ids: Tensor) -> Tensor:
        if ids.shape[0] < 2:
            raise self.error(f"expected a batch of at least two samples, got {ids.shape[0]}")
        return self.out(torch.tanh(self.table[ids].sum(1)))

def _frozen_middle() -> nn.Module:
    trunk = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    trunk[2].requires_grad_(False)
    return trunk


def _conv1d(**options: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        conv = nn.Conv1d(2, 3, 3, **options)
        width = conv(torch.zeros(1, 2, 9)).shape[-1]
        return nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(3 * width, 8))
    return build


def _vectors(*shape: int) -> Callable[[int], Tensor]:
    return lambda b: torch.randn(b, *shape)


#: name: (trunk, its heads, the inputs of a batch of b samples).
KINDS: dict[str, tuple[Callable[[], nn.Module], Callable[[], nn.Module],
                       Callable[[int], Tensor]]] = {
    "multi_exit": (_MultiExit, _ExitHeads, _vectors(5)),
    "tied_pair": (_TiedPair, lambda: nn.Linear(8, 3), _vectors(2, 6)),
    "siamese": (_Siamese, lambda: nn.Linear(8, 3), _vectors(6)),
    "functional": (_Functional, lambda: nn.Linear(8, 3), _vectors(2, 6)),
    "decoder_masks": (_Decoder, lambda: nn.Linear(8, 3), _vectors(5, 3)),
    "attention": (_Attention, lambda: nn.Linear(8, 3), _vectors(4, 3)),
    "padding_idx": (_Padded, lambda: nn.Linear(8, 3), lambda b: torch.randint(0, 7, (b, 4))),
    "embedding_bag": (_Bagged, lambda: nn.Linear(8, 3), lambda b: torch.randint(0, 7, (b, 4))),
    "lookup_read_twice": (_LookupReadTwice, lambda: nn.Linear(8, 3),
                          lambda b: torch.randint(0, 7, (b, 4))),
    **{f"needs_two_{error.__name__}": (lambda error=error: _NeedsTwo(error),
                                       lambda: nn.Linear(8, 3),
                                       lambda b: torch.randint(0, 7, (b, 4)))
       for error in (AssertionError, ValueError, RuntimeError)},
    "prelu": (lambda: nn.Sequential(nn.Linear(5, 8), nn.PReLU(), nn.Linear(8, 8), nn.PReLU(8)),
              lambda: nn.Linear(8, 3), _vectors(5)),
    "frozen_middle": (_frozen_middle, lambda: nn.Linear(8, 3), _vectors(5)),
    "conv1d_dilated_strided": (_conv1d(dilation=2, stride=2, padding=2), lambda: nn.Linear(8, 3),
                               _vectors(2, 9)),
    "conv1d_circular": (_conv1d(padding=1, padding_mode="circular"), lambda: nn.Linear(8, 3),
                        _vectors(2, 9)),
    "conv1d_same_replicate": (_conv1d(padding="same", padding_mode="replicate"),
                              lambda: nn.Linear(8, 3), _vectors(2, 9)),
    "linear_4d": (lambda: nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Flatten(1),
                                        nn.Linear(128, 8)),
                  lambda: nn.Linear(8, 3), _vectors(4, 4, 3)),
}



def _kind(name: str) -> Callable[[], tuple[nn.Module, nn.Module]]:
    trunk, heads, _ = KINDS[name]
    return lambda: (trunk(), heads())


def _kind_steps(name: str, sizes: list[list[int]], tasks: int = 3) -> list[list[Batch]]:
    inputs = KINDS[name][2]
    torch.manual_seed(1)
    return [[(inputs(b), torch.randn(b, tasks)) for b in step] for step in sizes]


def _per_sample_sum(trunk: nn.Module, heads: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return _squared(trunk, heads, x, y).sum(1)  # [B]


@pytest.mark.parametrize(("kind", "losses"), [
    *((kind, "BK") for kind in sorted(KINDS)),
    *((kind, "B") for kind in ["multi_exit", "siamese", "functional", "padding_idx",
                               "embedding_bag", "lookup_read_twice",
                               "needs_two_AssertionError"])])
def test_kind_matches_matrix_route(float64: None, kind: str, losses: str) -> None:
    """Two steps: micro-batches of 3 and 2 samples, then one of a single sample (two of 2
    where the trunk refuses one); ``[B, K]`` losses (each sample × task an objective), and
    ``[B]`` (each sample's summed tasks)."""
    steps = _kind_steps(kind, [[3, 2], [2, 2] if kind.startswith("needs_two") else [1]])
    _assert_parity(_kind(kind), steps, loss_fn=_per_sample_sum if losses == "B" else _squared)


@pytest.mark.filterwarnings("error::UserWarning")
def test_fallback_rows_carry_no_graph(float64: None) -> None:
    """A fallback module holding a covered layer: its per-sample rows are values. They were
    computed with the inner layer's live parameters, so they kept a graph back to them (and
    a check converting them to numbers warned)."""
    _assert_parity(_kind("functional"), _kind_steps("functional", [[4]]))


@settings(max_examples=12, deadline=None)
@given(data=st.data(), total=st.integers(2, 7), update_every=st.integers(1, 3),
       tasks=st.integers(1, 2), clip=st.booleans())
def test_micro_batches_with_update_every(data: st.DataObject, total: int, update_every: int,
                                         tasks: int, clip: bool) -> None:
    """Steps of ``total`` objectives split into micro-batches of any sizes (another split on
    every step), ``update_every`` reusing the weights, a row clipper: the matrix route with
    the same ``update_every`` and clipper over the same objectives."""
    from gradbalance.clip import TaskClip

    steps = []
    torch.manual_seed(total)
    with _float64():
        for _ in range(4):
            cuts = sorted(data.draw(st.sets(st.integers(1, total - 1), max_size=2)))
            sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
            steps.append([_batch(b, tasks=tasks) for b in sizes])
    loss_fn = _per_sample_sum if tasks == 1 else _squared
    build = lambda: (nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8)),  # noqa: E731
                     nn.Linear(8, tasks))
    with _float64():
        _assert_parity(build, steps, loss_fn=loss_fn, update_every=update_every,
                       clip=TaskClip(max_norm=0.3) if clip else None)


def test_modules_may_hold_the_heads(float64: None) -> None:
    """``modules`` the whole model (heads' layers recorded too, their parameters in
    ``head_params``) and a trunk layer moved to ``head_params``: the matrix route's update."""

    class Whole(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trunk = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8))
            self.heads = nn.Linear(8, 2)

    torch.manual_seed(0)
    model = Whole()
    x, y = _batch(5)
    got = []
    for per_sample in (True, False):
        model.zero_grad(set_to_none=True)
        kwargs: dict[str, Any] = {"modules": model, "batch_dim": 0} if per_sample else {}
        buf = TaskGradBuffer(model.trunk[0].parameters(),
                             [*model.trunk[2].parameters(), *model.heads.parameters()], **kwargs)
        losses = (model.heads(model.trunk(x)) - y).square()
        buf.backward(losses if per_sample else losses.reshape(-1))
        buf.apply_(UPGrad())
        got.append(_grads(list(model.parameters())))
    torch.testing.assert_close(got[0], got[1], rtol=1e-8, atol=1e-10 * float(got[1].abs().max()))


@pytest.mark.parametrize("zeroed", ["some", "all"])
def test_samples_with_zero_loss_and_constant_weights(float64: None, zeroed: str) -> None:
    """Losses weighted by fixed constants per task (``reduction="none"`` then ``* c``), some
    samples' losses (or all) multiplied by 0: their gradients are zero rows of the Gramian."""
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0]) if zeroed == "some" else torch.zeros(4)

    def weighted(trunk: nn.Module, heads: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        losses = F.mse_loss(heads(trunk(x)), y, reduction="none") * torch.tensor([1.0, 3.0])
        return losses * mask[: x.shape[0], None]

    torch.manual_seed(3)
    steps = [[_batch(4)], [_batch(4), _batch(2)]]
    for balancer in (UPGrad, MGDA):
        _assert_parity(_mlp, steps, loss_fn=weighted, balancer=balancer)


# --- Refusals: nothing moves ----------------------------------------------------------------


def test_a_non_finite_sample_moves_nothing() -> None:
    """NaN in one sample's loss, with no scaler: ``NonFiniteGradientError`` naming the fix,
    every ``.grad`` (filled before the step) and the balancer's state as they were, and with
    ``update_every`` the next step is the first step of an uninterrupted run."""
    from gradbalance import NonFiniteGradientError
    from gradbalance.balancers import GradVac

    torch.manual_seed(0)
    trunk, heads = _mlp()
    params = [*trunk.parameters(), *heads.parameters()]
    for p in params:
        p.grad = torch.full_like(p, 0.25)
    balancer = GradVac()
    balancer.compute_weights(torch.eye(8, dtype=torch.float64))  # some state to keep
    state = copy.deepcopy(balancer.state_dict())
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0,
                         update_every=2)
    x, y = _batch(4)
    losses = (heads(trunk(x)) - y).square() * torch.tensor([1.0, float("nan"), 1.0, 1.0])[:, None]
    buf.backward(losses)
    with pytest.raises(NonFiniteGradientError, match="inf or NaN"):
        buf.apply_(balancer)
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25)) for p in params)
    assert str(balancer.state_dict()) == str(state)
    # the refused step was no step: the next one computes weights (no reuse of any)
    trunk.zero_grad(set_to_none=True)
    heads.zero_grad(set_to_none=True)
    buf.backward((heads(trunk(x)) - y).square())
    stats = buf.apply_(UPGrad())
    assert not stats.weights_reused
    assert all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)



class _CheckedLookup(_Lookup):
    """:class:`_Lookup` with a hook on the table's use that raises on its first call only
    (a user's check, an injected failure)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def _check(self, grad: Tensor) -> None:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected: the model's own check failed")

    def forward(self, ids: Tensor) -> Tensor:
        table = self.table * 1.0
        table.register_hook(self._check)
        return table[ids].sum(1)


def test_a_hooks_own_error_raises_as_under_plain_backward(float64: None) -> None:
    """A hook inside a fallback module that raises once: plain backward raises it, and so does
    the per-sample route (not swallowed by its vectorised rows, whose masked route would call
    the hook again), every ``.grad`` as it was; the next step, the hook quiet, is the
    matrix route's."""
    def build() -> tuple[nn.Module, nn.Module]:
        return nn.Sequential(_CheckedLookup(), nn.Tanh(), nn.Linear(6, 8)), nn.Linear(8, 3)

    torch.manual_seed(0)
    steps = [[(torch.randint(0, 7, (4, 4)), torch.randn(4, 3))]]
    trunk, heads = build()
    (x, y), = steps[0]
    with pytest.raises(RuntimeError, match="injected"):
        _squared(trunk, heads, x, y).sum().backward()
    trunk.zero_grad(set_to_none=True)
    heads.zero_grad(set_to_none=True)
    trunk[0].calls = 0
    params = [*trunk.parameters(), *heads.parameters()]
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    try:
        with pytest.raises(RuntimeError, match=r"^injected: the model's own check failed$"):
            buf.backward(_squared(trunk, heads, x, y))
        assert all(p.grad is None for p in params)
        buf.backward(_squared(trunk, heads, x, y))  # the step dropped: this one starts anew
        buf.apply_(Sum())
        got = _grads(params)
    finally:
        buf._per_sample.gramian.remove()
    for p in params:
        p.grad = None
    _squared(trunk, heads, x, y).sum().backward()
    torch.testing.assert_close(got, _grads(params), rtol=1e-10, atol=1e-12)

    def quiet() -> tuple[nn.Module, nn.Module]:
        trunk, heads = build()
        trunk[0].calls = 1
        return trunk, heads

    _assert_parity(quiet, steps)

class _SeqFirstAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mha = nn.Linear(3, 8), nn.MultiheadAttention(8, 2)  # batch_first=False

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x).transpose(0, 1)  # [S, B, 8]
        return self.mha(h, h, h, need_weights=False)[0].transpose(0, 1).mean(1)


@pytest.mark.parametrize("length", [5, 4])
def test_sequence_first_attention_is_refused(length: int) -> None:
    """``nn.MultiheadAttention(batch_first=False)`` gets ``[S, B, E]``: refused by the batch
    check where S ≠ B, and by the mixing check where S = B (its dim 0 is the positions)."""
    torch.manual_seed(0)
    trunk, heads = _SeqFirstAttention(), nn.Linear(8, 2)
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    x, y = torch.randn(4, length, 3), torch.randn(4, 2)
    match = "recorded inputs of shapes" if length != 4 else "mixes the samples"
    with pytest.raises(ValueError, match=match):
        buf.backward((heads(trunk(x)) - y).square())
    assert all(p.grad is None for p in trunk.parameters())


def test_a_head_tied_to_a_trunk_weight_is_refused() -> None:
    """An output layer reading the trunk's embedding table (``f @ embed.weight.T``): that
    use is outside the embedding's recorded calls, refused by name."""

    class Trunk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.mix = nn.Embedding(6, 8), nn.Linear(8, 8)

        def forward(self, ids: Tensor) -> Tensor:
            return torch.tanh(self.mix(self.embed(ids).mean(1)))

    torch.manual_seed(0)
    trunk = Trunk()
    buf = TaskGradBuffer(trunk.parameters(), modules=trunk, batch_dim=0)
    logits = trunk(torch.randint(0, 6, (4, 3))) @ trunk.embed.weight.T
    with pytest.raises(RuntimeError, match=r"'embed.weight' is used 2 times.*recorded 1 calls"):
        buf.backward(F.cross_entropy(logits, torch.randint(0, 6, (4,)), reduction="none"))
    assert all(p.grad is None for p in trunk.parameters())


def test_bfloat16_autocast_with_a_scaler_equals_the_matrix_route() -> None:
    """A float32 model under CPU bfloat16 autocast and ``GradScaler("cpu")``, micro-batches
    of 3 and 4 samples: the matrix route's scaled update, to bfloat16 rounding."""
    got = []
    for per_sample in (True, False):
        torch.manual_seed(0)
        trunk, heads = KINDS["padding_idx"][0](), nn.Linear(8, 2)
        params = [*trunk.parameters(), *heads.parameters()]
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        assert scaler.is_enabled()
        kwargs: dict[str, Any] = {"modules": trunk, "batch_dim": 0} if per_sample else {}
        buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), **kwargs)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for b in (3, 4):
            ids, y = torch.randint(0, 7, (b, 4), generator=gen), torch.randn(b, 2, generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = (heads(trunk(ids)).float() - y).square()
            if per_sample:
                buf.backward(loss, scaler)
            losses.append(loss.reshape(-1))
        if not per_sample:
            buf.backward(torch.cat(losses), scaler)
        stats = buf.apply_(UPGrad(), scaler)
        assert not stats.found_inf and stats.loss_scale == 2.0**8
        got.append(_grads(params))
    torch.testing.assert_close(got[0], got[1], rtol=2e-2, atol=2e-2 * float(got[1].abs().max()))
    assert float(got[1].abs().max()) > 10  # written scaled


class _BatchStatistics(nn.Module):
    """An affine normalisation by the batch's statistics of its input (no parameter below
    it, so each sample's loss has a gradient of its own); one sample alone has no ``std``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.rand(width) + 0.5)
        self.shift = nn.Parameter(torch.randn(width))

    def forward(self, x: Tensor) -> Tensor:
        return self.gain * (x - x.mean(0)) / (x.std(0) + 1e-3) + self.shift


@pytest.mark.filterwarnings("error::UserWarning")
def test_a_fallback_undefined_on_one_sample_takes_the_masked_route(float64: None) -> None:
    """The vectorised rows (each sample called alone) are NaN; they were accepted by the
    check that they add up (NaN compares false) and the step raised
    ``NonFiniteGradientError`` where the matrix route is finite."""
    build = lambda: (nn.Sequential(_BatchStatistics(5), nn.Linear(5, 8), nn.Tanh(),  # noqa: E731
                                   nn.Linear(8, 8)), nn.Linear(8, 2))
    torch.manual_seed(4)
    with pytest.warns(UserWarning, match="degrees of freedom"):  # the step's own forward
        build()[0](torch.randn(1, 5))
    _assert_parity(build, [[_batch(4)], [_batch(5)]])  # the buffer's one-sample calls: silent


@pytest.mark.parametrize("value", [0.0, True, 1])
def test_batch_dim_is_the_int_zero(value: object) -> None:
    """``batch_dim=0.0`` compared equal to 0 and was taken; like ``True`` it is refused by
    name, in the buffer and in the one-shot call, before anything moves."""
    from gradbalance import balanced_backward

    trunk = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=rf"batch_dim must be 0.*got {value!r}"):
        TaskGradBuffer(trunk.parameters(), modules=trunk, batch_dim=value)  # type: ignore[arg-type]
    losses = trunk(torch.randn(4, 3)).sum(1)
    with pytest.raises(ValueError, match=rf"batch_dim must be 0.*got {value!r}"):
        balanced_backward(losses, UPGrad(), shared_params=trunk.parameters(), modules=trunk,
                          batch_dim=value)  # type: ignore[arg-type]
    assert all(p.grad is None for p in trunk.parameters())


# --- The mixing check in half precision -----------------------------------------------------


def _half_step(dtype: torch.dtype, autocast: bool, mixing: float) -> None:
    """One ``backward`` of a trunk whose hidden features get ``mixing`` times their batch
    mean, in a ``dtype`` model or a float32 model under bfloat16 autocast."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 8)).to(dtype)
    heads = nn.Linear(8, 2).to(dtype)
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    x = torch.randn(8, 5, dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        h = trunk[0](x)
        out = heads(trunk[2](torch.tanh(h + mixing * h.mean(0))))
    buf.backward((out.float() - 1).square())


@pytest.mark.parametrize("mixing", [1.0, 0.05])
@pytest.mark.parametrize(("dtype", "autocast"), [(torch.float32, True), (torch.bfloat16, False),
                                                 (torch.float16, False)])
def test_half_precision_mixing_is_refused(dtype: torch.dtype, autocast: bool,
                                          mixing: float) -> None:
    """Under bfloat16 autocast the recorded outputs' gradients are bfloat16, and 64 of its
    eps (2⁻⁷) let a trunk adding its batch mean pass (at weight 1 as at 0.05): refused now."""
    with pytest.raises(ValueError, match="mixes the samples of the batch"):
        _half_step(dtype, autocast, mixing)


@pytest.mark.parametrize("kind", ["attention", "padding_idx", "tied_pair", "multi_exit"])
@pytest.mark.parametrize(("dtype", "autocast"), [(torch.float32, True), (torch.bfloat16, False),
                                                 (torch.float16, False)])
def test_half_precision_trunks_that_keep_the_samples_apart_pass(kind: str, dtype: torch.dtype,
                                                                autocast: bool) -> None:
    """The same check accepts every trunk kind above in half precision (no false refusal:
    the probes are exact there too, up to the subnormal range)."""
    _half_step(dtype, autocast, 0.0)
    torch.manual_seed(0)
    trunk, heads = KINDS[kind][0]().to(dtype), KINDS[kind][1]().to(dtype)
    shared = [p for p in trunk.parameters() if p.requires_grad]
    buf = TaskGradBuffer(shared, heads.parameters(), modules=trunk, batch_dim=0)
    x = KINDS[kind][2](8)
    x = x.to(dtype) if x.is_floating_point() else x
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = heads(trunk(x))
    buf.backward((out.float() - 1).square())
    stats = buf.apply_(UPGrad())
    assert stats.weights is not None and bool(torch.isfinite(stats.weights).all())


class _SharedTable(nn.Module):
    """A fallback module reading a shared ``[B, 8]`` table (not per sample) whose dim 0
    equals the batch: the vectorised route splits it by sample, wrongly."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 8) / 2)

    def forward(self, x: Tensor, table: Tensor) -> Tensor:
        return torch.tanh(x @ self.w + table.sum(0))


class _TableTrunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _SharedTable()

    def forward(self, x: Tensor) -> Tensor:
        table = torch.linspace(-1, 1, x.shape[0] * 8, dtype=x.dtype).reshape(x.shape[0], 8)
        return self.block(x, table)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_half_precision_fallback_rows_are_exact(dtype: torch.dtype) -> None:
    """In bfloat16 the rows' check (256 of its eps) accepted the wrong split and the trunk's
    update was 50–80 % off the matrix route's; now within bfloat16's rounding."""
    got = []
    for per_sample in (True, False):
        torch.manual_seed(0)
        trunk, heads = _TableTrunk().to(dtype), nn.Linear(8, 2).to(dtype)
        x, y = torch.randn(4, 5, dtype=dtype), torch.randn(4, 2, dtype=dtype)
        kwargs: dict[str, Any] = {"modules": trunk, "batch_dim": 0} if per_sample else {}
        buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), **kwargs)
        losses = (heads(trunk(x)) - y).square()
        buf.backward(losses if per_sample else losses.reshape(-1))
        buf.apply_(MGDA())
        got.append(_grads(list(trunk.parameters())).double())
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got[0], got[1], rtol=tol, atol=tol * float(got[1].abs().max()))


def test_bfloat16_fallback_rows_gramian_in_float32() -> None:
    """A bfloat16 model whose attention is a fallback module: its rows' Gramian ran in
    bfloat16 (every product rounded to 8 bits), and UPGrad's update was 8.5 times its own
    size off the float64 model's, where the matrix route's is 7 % off; the products now run
    in float32 (the table layers' rule), and both routes are alike. Reference: the matrix
    route on the float64 copy of the model (the same data, rounded to bfloat16 first)."""
    trunk_of, heads_of, inputs = KINDS["attention"]
    errors = {}
    for route in ("per_sample", "matrix", "float64"):
        torch.manual_seed(1)
        dtype = torch.float64 if route == "float64" else torch.bfloat16
        trunk, heads = trunk_of().to(dtype), heads_of().to(dtype)
        torch.manual_seed(11)
        x, y = inputs(6).bfloat16().to(dtype), torch.randn(6, 3).bfloat16().to(dtype)
        kwargs: dict[str, Any] = ({"modules": trunk, "batch_dim": 0} if route == "per_sample"
                                  else {})
        buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), **kwargs)
        losses = (heads(trunk(x)) - y).square()
        buf.backward(losses if route == "per_sample" else losses.reshape(-1))
        buf.apply_(UPGrad())
        errors[route] = _grads(list(trunk.parameters())).double()
    reference = errors.pop("float64")
    rel = {k: float((v - reference).norm() / reference.norm()) for k, v in errors.items()}
    assert rel["matrix"] < 0.15  # bfloat16's own rounding
    assert rel["per_sample"] < 2 * rel["matrix"] + 0.02


class _MixesWhenLarge(nn.Module):
    """Centres its hidden features over the batch only from 6 samples on."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(5, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.first(x)
        return self.second(torch.tanh(h - h.mean(0) if h.shape[0] >= 6 else h))


@pytest.mark.parametrize("ghost", [False, True])
def test_a_new_batch_size_is_checked_again(float64: None, ghost: bool) -> None:
    """A trunk that mixes the samples only at some batch size: the check of the structure
    at B = 4 does not vouch for B = 8, which is refused before anything moves."""
    torch.manual_seed(0)
    trunk, heads = _MixesWhenLarge(), nn.Linear(8, 2)
    if ghost:
        from gradbalance.clip import GhostNorms

        norms = GhostNorms(trunk)
        for batch, refused in [(4, False), (4, False), (8, True)]:
            x, y = _batch(batch)
            losses = (heads(trunk(x)) - y).square().sum(1)
            if refused:
                with pytest.raises(ValueError, match="mixes the samples of the batch"):
                    norms.norms(losses)
            else:
                norms.norms(losses)
        return
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    for batch in (4, 4):
        x, y = _batch(batch)
        buf.backward((heads(trunk(x)) - y).square())
        buf.apply_(MGDA())
    before = [p.grad.clone() for p in trunk.parameters()]
    x, y = _batch(8)
    with pytest.raises(ValueError, match="mixes the samples of the batch"):
        buf.backward((heads(trunk(x)) - y).square())
    assert all(torch.equal(p.grad, b) for p, b in zip(trunk.parameters(), before))


@pytest.mark.parametrize("per_sample", [False, True])
def test_losses_without_grad_are_refused_alike(per_sample: bool) -> None:
    """Losses computed under ``torch.no_grad()``: both routes refuse them by the same message,
    which names the cause, every ``.grad`` as it was."""
    torch.manual_seed(0)
    trunk, heads = _mlp()
    params = [*trunk.parameters(), *heads.parameters()]
    for p in params:
        p.grad = torch.full_like(p, 0.25)
    kwargs: dict[str, Any] = {"modules": trunk, "batch_dim": 0} if per_sample else {}
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), **kwargs)
    x, y = _batch(4)
    with torch.no_grad():
        losses = (heads(trunk(x)) - y).square()
    try:
        with pytest.raises(ValueError, match=r"^losses do not require grad; .*torch\.no_grad"):
            buf.backward(losses if per_sample else losses.mean(0))
    finally:
        if buf._per_sample is not None:
            buf._per_sample.gramian.remove()
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25)) for p in params)


@pytest.mark.parametrize("balancer", [Sum, UPGrad])
def test_an_input_that_requires_grad_is_refused_then_a_head(float64: None,
                                                          balancer: Callable[[], Balancer]
                                                          ) -> None:
    """An input with ``requires_grad`` (input gradients, adversarial examples): plain
    backward gives it the gradient of ``Σ losses``. The per-sample route refuses it before
    anything moves, naming the way that exists there (``head_params``; ``other_params`` is
    the task route's); listed in ``head_params`` it gets plain backward's gradient."""
    torch.manual_seed(0)
    trunk, heads = _mlp()
    x, y = _batch(5)
    x.requires_grad_()
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    try:
        with pytest.raises(ValueError, match="with batch_dim=0 head_params is the way") as caught:
            buf.backward(_squared(trunk, heads, x, y))
        assert "other_params" not in str(caught.value)
        assert x.grad is None and all(p.grad is None for p in trunk.parameters())
    finally:
        buf._per_sample.gramian.remove()
    buf = TaskGradBuffer(trunk.parameters(), [*heads.parameters(), x], modules=trunk,
                         batch_dim=0)
    try:
        buf.backward(_squared(trunk, heads, x, y))
        buf.apply_(balancer())
    finally:
        buf._per_sample.gramian.remove()
    got = x.grad.clone()
    x.grad = None
    _squared(trunk, heads, x, y).sum().backward()
    torch.testing.assert_close(got, x.grad, rtol=1e-12, atol=1e-14)
