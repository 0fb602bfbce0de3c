"""The per-sample Gramian's contracted forms (``gradbalance._per_sample_forms``,
``gradbalance._per_sample_eager``).

Each layer is contracted when its output gradients arrive (a hook inside the backward): to
the Gram form's rows or to materialised per-sample gradients, whichever costs less, with
float32 products for float32 inputs; its block added, its forms dropped unless micro-batches
need them. The
references are independent: B separate ``autograd.grad`` calls (their rows' Gram matrix in
float64), and the other form of the same site.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance._per_sample_buffer import PerSampleBuffer
from gradbalance._per_sample_eager import lowest
from gradbalance._per_sample_forms import block, contracted, layer_form
from gradbalance._per_sample_gramian import Parts, PerSampleGramian
from gradbalance.balancers import MGDA
from gradbalance.clip._per_sample_tied import Site, materialised, site_form
from gradbalance.clip._per_sample_tokens import TokenRows

from .per_sample_models import TRUNKS


def _rows(losses: Tensor, params: list[Tensor]) -> Tensor:
    """Each loss's gradient, one ``autograd.grad`` per loss, as float64 rows."""
    return torch.stack([torch.cat([g.flatten() for g in torch.autograd.grad(
        loss, params, retain_graph=True)]) for loss in losses]).double()


def _gramian(trunk: nn.Module, xs: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The route's Gramian over the micro-batches ``xs`` (one forward and backward each)
    and the reference Gram matrix of the per-sample rows."""
    params = list(trunk.parameters())
    engine = PerSampleGramian(trunk, params)
    parts, rows = [], []
    for x in xs:
        losses = trunk(x).pow(2).flatten(1).sum(1)
        grads = torch.autograd.grad(losses.sum(), engine.outputs(), retain_graph=True)
        parts.append(engine.collect(x.shape[0], [list(grads)], keep=len(xs) > 1))
        engine.clear()
        rows.append(_rows(losses, params))
    engine.remove()
    flat = torch.cat(rows)
    return engine.gramian(parts), flat @ flat.T


@pytest.mark.parametrize("name", sorted(TRUNKS))
def test_float32_gramian_equals_per_sample_autograd_at_float32_rounding(name: str) -> None:
    torch.manual_seed(5)
    trunk, inputs = TRUNKS[name]()
    got, want = _gramian(trunk, [inputs(6)])
    assert got.dtype == torch.float64
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max())


def _tokens_trunk() -> nn.Module:
    """A Linear on ``[n, 4, 16]`` tokens: the Gram form for n ≤ 4, materialised above."""
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_micro_batches_with_different_forms_give_the_whole_gramian(dtype: torch.dtype) -> None:
    """Micro-batches of 3 and 7 samples (the first layer kept as Gram-form rows, then as
    materialised gradients) and 5 tokens then 4: the cross blocks between the two forms."""
    torch.manual_seed(6)
    trunk = _tokens_trunk().to(dtype)
    small = contracted((torch.randn(3, 4, 16), torch.randn(3, 4, 16)))
    large = contracted((torch.randn(7, 4, 16), torch.randn(7, 4, 16)))
    assert not isinstance(small, Tensor) and isinstance(large, Tensor)
    got, want = _gramian(trunk, [torch.randn(3, 5, 16, dtype=dtype),
                                 torch.randn(7, 4, 16, dtype=dtype)])
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max())


@pytest.mark.parametrize(("n", "s", "m", "k"), [(3, 4, 16, 16), (9, 4, 16, 16), (5, 7, 3, 2)])
def test_eager_contraction_equals_the_deferred_gram_form(n: int, s: int, m: int,
                                                         k: int) -> None:
    """The block of the contracted forms equals the Gram form of the full rows (float64:
    to 1e-12) and the Gram matrix of the materialised ``Dᵢᵀ Xᵢ`` computed by hand."""
    torch.manual_seed(7)
    d, x = torch.randn(n, s, k, dtype=torch.float64), torch.randn(n, s, m, dtype=torch.float64)
    deferred = block((d, x), (d, x))
    eager = contracted((d, x))
    by_hand = torch.stack([(d[i].T @ x[i]).flatten() for i in range(n)])
    want = by_hand @ by_hand.T
    for got in (deferred, block(eager, eager), block(eager, (d, x))):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * want.abs().max())


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_token_rows_equal_the_one_hot_products(padding_idx: int | None) -> None:
    """A wide vocabulary (token rows): materialised, they equal the one-hot form, padding ids
    included (their rows add nothing); their block is that form's Gram matrix."""
    torch.manual_seed(8)
    emb = nn.Embedding(50, 3, padding_idx=padding_idx).double()
    ids = torch.randint(0, 6, (4, 5))
    d = torch.randn(4, 5, 3, dtype=torch.float64)
    got = layer_form(emb, True, ids, d)
    assert isinstance(got, TokenRows)
    want = materialised([site_form(Site(emb, True), ids, d)], torch.float64)
    assert torch.allclose(got.dense(), want, rtol=1e-15, atol=1e-15)
    assert torch.allclose(block(got, got), want @ want.T, rtol=1e-12, atol=1e-12)
    if padding_idx is not None:
        assert got.dense().reshape(4, 50, 3)[:, padding_idx].abs().max() == 0


class _Tied(nn.Module):
    """One Linear called twice, and a weight tied between two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.twice, self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(4, 8)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.twice(torch.tanh(self.twice(x))))
        return torch.tanh(self.a(h)) + self.b(h * h)


def _trunk(name: str) -> tuple[nn.Module, Callable[[int], Tensor]]:
    if name == "tied":
        return _Tied(), lambda b: torch.randn(b, 4)
    return TRUNKS[name]()


def _grads(params: list[Tensor]) -> Tensor:
    return torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten()
                      for p in params])


@pytest.mark.parametrize("name", ["cnn", "mixed", "tied", "tokens"])
@pytest.mark.parametrize("count", [1, 3])
def test_micro_batches_of_sample_by_task_losses_equal_matrix_route(
        name: str, count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``count`` micro-batches (2, 3, 4 samples) of ``[B, 2]`` losses: the matrix route's
    weights and update over all objectives at once; the first micro-batch's forms are
    recomputed once when the second arrives, never with one micro-batch."""
    replays = []
    original = PerSampleBuffer._first_forms

    def counted(self: PerSampleBuffer) -> Parts:
        replays.append(1)
        return original(self)

    monkeypatch.setattr(PerSampleBuffer, "_first_forms", counted)
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(10)
        trunk, inputs = _trunk(name)
        heads = nn.Linear(8, 2)
        xs = [inputs(b) for b in (2, 3, 4)[:count]]
        ys = [torch.randn(x.shape[0], 2) for x in xs]
        params = [*trunk.parameters(), *heads.parameters()]
        found = []
        for per_sample in (True, False):
            for p in params:
                p.grad = None
            kwargs = {"modules": trunk, "batch_dim": 0} if per_sample else {}
            buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), **kwargs)  # type: ignore[arg-type]
            if per_sample:
                for x, y in zip(xs, ys):
                    buf.backward((heads(trunk(x)) - y) ** 2)
            else:
                buf.backward(torch.cat([((heads(trunk(x)) - y) ** 2).reshape(-1)
                                        for x, y in zip(xs, ys)]))
            stats = buf.apply_(MGDA())
            assert stats.weights is not None
            found.append((stats.weights, _grads(params)))
            if per_sample:
                assert buf._per_sample is not None
                buf._per_sample.gramian.remove()
    finally:
        torch.set_default_dtype(torch.float32)
    assert len(replays) == (count > 1)
    (w_got, got), (w_want, want) = found
    assert torch.allclose(w_got, w_want, rtol=1e-7, atol=1e-10)
    assert torch.allclose(got, want, rtol=1e-8, atol=1e-10 * want.abs().max())


@pytest.mark.parametrize("name", [*sorted(TRUNKS), "tied"])
@pytest.mark.parametrize("tasks", [1, 2])
def test_contraction_inside_the_backward_equals_the_deferred_one(name: str,
                                                                 tasks: int) -> None:
    """``passes`` (each layer contracted in its output's hook) gives the Gramian of
    ``collect`` over every output gradient at once (float64, to 1e-12) and the heads'
    gradients of a plain ``autograd.grad``."""
    torch.manual_seed(11)
    torch.set_default_dtype(torch.float64)
    try:
        trunk, inputs = _trunk(name)
        head = nn.Linear(8, tasks)
        engine = PerSampleGramian(trunk, list(trunk.parameters()))
        losses = head(trunk(inputs(4))).pow(2)
        roots = [losses[:, k].sum() for k in range(tasks)]
        deferred = engine.collect(4, [list(torch.autograd.grad(
            root, engine.outputs(), retain_graph=True, allow_unused=True)) for root in roots])
        eager, heads = engine.passes(4, roots, list(head.parameters()))
        want_heads = [torch.autograd.grad(root, list(head.parameters()), retain_graph=True)
                      for root in roots]
        engine.remove()
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.allclose(eager.gram, deferred.gram, rtol=1e-12,
                          atol=1e-12 * deferred.gram.abs().max())
    for got, want in zip(heads, want_heads):
        assert all(g is not None and torch.equal(g, w) for g, w in zip(got, want))


def test_only_the_lowest_outputs_are_asked_of_autograd() -> None:
    """A chain of three Linear layers: only the first one's output lies below no other; two
    parallel branches are both lowest; an output off the graph counts as lowest."""
    layers = [nn.Linear(3, 3) for _ in range(4)]
    x = torch.randn(2, 3)
    first = layers[0](x)
    second = layers[1](torch.tanh(first))
    third = layers[2](second)
    off = layers[3](x)
    assert lowest([third.sum()], [first, second, third, off]) == [True, False, False, True]
    left, right = layers[0](x), layers[1](x)
    top = layers[2](left * right)
    assert lowest([top.sum()], [top, left, right]) == [False, True, True]


class _TiedLM(nn.Module):
    """An embedding table tied to the output layer (token rows and an outer form of one
    parameter): ``[B, S]`` ids to ``[B, S, V]`` logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(40, 3, padding_idx=1), nn.Linear(3, 40)
        self.out.weight = self.embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(torch.tanh(self.embed(ids)))


@pytest.mark.parametrize("sizes", [(5,), (3, 4)])
def test_tied_embedding_token_rows_give_the_per_sample_gramian(sizes: tuple[int, ...]) -> None:
    """One micro-batch and two (the cross terms between token rows and outer forms)."""
    torch.manual_seed(12)
    trunk = _TiedLM().double()
    got, want = _gramian(trunk, [torch.randint(0, 6, (n, 7)) for n in sizes])
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-10 * want.abs().max())
