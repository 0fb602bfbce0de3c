"""``GhostNorms`` on tied and reused weights is exact: language models whose output
projection shares the embedding's weight, one weight in two linear layers, layers applied
twice.

The reference is independent of the ghost form: per-sample gradients from
``torch.func.vmap(jacrev(...))`` over ``functional_call`` (the tied weight is one entry, so
autograd sums its sites before the norm). Both routes of the tied form are hit: the Gram form
(few rows, wide weight) and the materialised per-sample gradient (many rows), and p-norms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

from gradbalance.clip import GhostNorms

#: A model, or the same model called with other parameters (``functional_call``).
Model = Callable[[Tensor], Any]
#: Per-sample losses ``[B, K]`` of a model on inputs and targets.
LossOf = Callable[[Model, Tensor, Tensor], Tensor]


class TiedLM(nn.Module):
    """Embedding, a LayerNorm + MLP block, an output projection tied to the embedding, and a
    regression head; ``twice``: the embedding and the block run again on shifted ids."""

    def __init__(self, vocab: int, width: int, pad: int | None, bias: bool,
                 twice: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=pad)
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.out = nn.Linear(width, vocab, bias=bias)
        self.out.weight = self.embed.weight
        self.head = nn.Linear(width, 1)
        self.twice = twice

    def block(self, h: Tensor) -> Tensor:
        out: Tensor = h + self.down(torch.tanh(self.up(self.norm(h))))
        return out

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        h = self.block(self.embed(ids))
        if self.twice:
            h = self.block(h + self.embed((ids + 1) % self.embed.num_embeddings))
        return self.out(h), self.head(h.mean(dim=1))[:, 0]


def lm_losses(model: Model, ids: Tensor, target: Tensor) -> Tensor:
    """``[B, 2]``: next-token cross-entropy (summed over positions) and a regression."""
    logits, value = model(ids)
    nll = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:],
                                      reduction="none").sum(dim=1)
    return torch.stack([nll, (value - target) ** 2], dim=1)


def reference_norms(model: nn.Module, loss_of: LossOf, x: Tensor, y: Tensor,
                    norm_type: float = 2.0) -> Tensor:
    """``[B, K]`` norms of every (sample, task) gradient, from ``vmap(jacrev)``."""
    params = {name: p.detach() for name, p in model.named_parameters()}

    def one(params: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        def call(ids: Tensor) -> Any:
            return functional_call(model, params, (ids,))

        return loss_of(call, xi.unsqueeze(0), yi.unsqueeze(0))[0]

    jac = vmap(jacrev(one), in_dims=(None, 0, 0))(params, x, y)  # name: [B, K, *shape]
    flat = torch.cat([g.flatten(2) for g in jac.values()], dim=2)
    norms: Tensor = torch.linalg.vector_norm(flat, norm_type, dim=2)
    return norms


CASES = [  # (seed, batch, seq, vocab, width, pad, bias, twice): Gram or materialised route
    (0, 3, 5, 11, 4, None, False, False),
    (1, 4, 3, 50, 8, 0, True, False),
    (2, 2, 8, 9, 16, 3, False, True),
    (3, 5, 2, 64, 12, 1, True, True),
]


def _lm(case: tuple[int, int, int, int, int, int | None, bool, bool], dtype: torch.dtype
        ) -> tuple[TiedLM, Tensor, Tensor]:
    seed, batch, seq, vocab, width, pad, bias, twice = case
    torch.manual_seed(seed)
    model = TiedLM(vocab, width, pad, bias, twice).to(dtype)
    ids = torch.randint(vocab, (batch, seq))
    if pad is not None:
        ids[:, 0] = pad  # the padding row gets no gradient from the embedding site
    return model, ids, torch.randn(batch, dtype=dtype)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_a_tied_embedding_and_output_is_exact(case: tuple[int, int, int, int, int, int | None,
                                                          bool, bool],
                                              dtype: torch.dtype, rtol: float) -> None:
    model, ids, target = _lm(case, dtype)
    expected = reference_norms(model, lm_losses, ids, target)
    ghost = GhostNorms(model)
    got = ghost.norms(lm_losses(model, ids, target))
    torch.testing.assert_close(got, expected, rtol=rtol, atol=1e-6 * rtol)
    untied = GhostNorms(model, params=[p for n, p in model.named_parameters()
                                       if n != "embed.weight"])
    without = untied.norms(lm_losses(model, ids, target))
    assert (without < got * (1 - 10 * rtol)).any()  # the tied weight counts


@pytest.mark.parametrize("case", CASES[:3])
@pytest.mark.parametrize("norm_type", [1.5, 3.0])
def test_p_norms_and_one_norm_per_sample(case: tuple[int, int, int, int, int, int | None,
                                                     bool, bool], norm_type: float) -> None:
    model, ids, target = _lm(case, torch.float64)
    expected = reference_norms(model, lm_losses, ids, target, norm_type)
    got = GhostNorms(model, norm_type=norm_type).norms(lm_losses(model, ids, target))
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)

    def joint(m: Model, x: Tensor, y: Tensor) -> Tensor:
        return lm_losses(m, x, y).sum(dim=1, keepdim=True)

    expected = reference_norms(model, joint, ids, target, norm_type)[:, 0]
    got = GhostNorms(model, norm_type=norm_type, per_task=False).norms(
        lm_losses(model, ids, target))
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


class SharedLinear(nn.Module):
    """Two linear layers holding one weight (their biases their own); ``twice``: the second
    runs twice."""

    def __init__(self, width: int, twice: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.b.weight = self.a.weight
        self.out = nn.Linear(width, 2)
        self.twice = twice

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        if self.twice:
            h = torch.tanh(self.b(h))
        out: Tensor = self.out(h)
        return out


def square_losses(model: Model, x: Tensor, y: Tensor) -> Tensor:
    out: Tensor = (model(x) - y) ** 2
    return out


@pytest.mark.parametrize(("seed", "batch", "width", "seq", "twice"),
                         [(0, 4, 3, None, False), (1, 3, 5, 4, True), (2, 6, 2, 7, False),
                          (3, 2, 9, 2, True)])
def test_one_weight_in_two_linear_layers_is_exact(seed: int, batch: int, width: int,
                                                  seq: int | None, twice: bool) -> None:
    torch.manual_seed(seed)
    model = SharedLinear(width, twice).double()
    shape = (batch, width) if seq is None else (batch, seq, width)
    x = torch.randn(*shape, dtype=torch.float64)
    y = torch.randn(*shape[:-1], 2, dtype=torch.float64)

    def per_sample(m: Model, xs: Tensor, ys: Tensor) -> Tensor:
        loss = square_losses(m, xs, ys)
        return loss if seq is None else loss.sum(dim=1)

    expected = reference_norms(model, per_sample, x, y)
    got = GhostNorms(model).norms(per_sample(model, x, y))
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_a_tied_weight_also_held_by_a_refused_layer_is_refused_naming_it() -> None:
    model = TiedLM(7, 4, None, False, False)
    model.embed.scale_grad_by_freq = True  # couples the samples: no ghost form
    with pytest.raises(ValueError, match=r"'embed\.weight'.*refused layers: embed "
                                         r"\(scale_grad_by_freq"):
        GhostNorms(model)
    assert all(not m._forward_hooks for m in model.modules())  # nothing stays hooked


def test_a_tied_weight_with_a_tensor_hook_is_refused() -> None:
    model, ids, target = _lm(CASES[0], torch.float64)
    ghost = GhostNorms(model)
    model.embed.weight.register_hook(lambda g: g * 0.5)  # type: ignore[no-untyped-call]
    with pytest.raises(RuntimeError, match=r"'embed\.weight'.*tensor hook"):
        ghost.norms(lm_losses(model, ids, target))


class SharedNormsAndBiases(nn.Module):
    """Two LayerNorms holding one weight and one bias, two linear layers holding one bias:
    the dense (LayerNorm weight) and bias sites of a tied parameter."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        with torch.no_grad():
            self.n1.weight.uniform_(0.5, 1.5)
            self.n1.bias.uniform_(-0.5, 0.5)
        self.n2.weight, self.n2.bias = self.n1.weight, self.n1.bias
        self.b.bias = self.a.bias
        self.out = nn.Linear(width, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(self.n1(x)))
        out: Tensor = self.out(self.b(self.n2(h)))
        return out


@pytest.mark.parametrize(("seed", "batch", "seq", "width"), [(0, 3, 4, 5), (1, 5, 2, 3)])
@pytest.mark.parametrize("norm_type", [2.0, 1.5])
def test_tied_layernorms_and_biases_are_exact(seed: int, batch: int, seq: int, width: int,
                                              norm_type: float) -> None:
    torch.manual_seed(seed)
    model = SharedNormsAndBiases(width).double()
    x = torch.randn(batch, seq, width, dtype=torch.float64)
    y = torch.randn(batch, seq, 2, dtype=torch.float64)

    def per_sample(m: Model, xs: Tensor, ys: Tensor) -> Tensor:
        return square_losses(m, xs, ys).sum(dim=1)

    expected = reference_norms(model, per_sample, x, y, norm_type)
    got = GhostNorms(model, norm_type=norm_type).norms(per_sample(model, x, y))
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


class MatmulOutputLM(TiedLM):
    """The output projection as a matrix product with the embedding's weight, outside any
    layer: the use is not recorded, so the weight is refused."""

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        h = self.block(self.embed(ids))
        return h @ self.embed.weight.T, self.head(h.mean(dim=1))[:, 0]


def test_an_output_projection_outside_any_layer_is_refused_naming_the_weight() -> None:
    torch.manual_seed(0)
    model = MatmulOutputLM(9, 4, None, False, False).double()
    del model.out  # the projection is the matrix product
    ids, target = torch.randint(9, (3, 5)), torch.randn(3, dtype=torch.float64)
    ghost = GhostNorms(model)
    with pytest.raises(RuntimeError, match=r"'embed\.weight'.*used 2 times.*recorded 1 calls"):
        ghost.norms(lm_losses(model, ids, target))
    assert all(not layer.outputs for layer in ghost._layers)  # the records are dropped
