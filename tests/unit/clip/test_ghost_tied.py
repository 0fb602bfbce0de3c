"""``GhostNorms`` with reused and tied weights: exact, or refused naming the weight.

The reference is a loop of B single-sample backward passes (autograd sums every use of a
weight before the norm). A layer called several times and a weight held by two layers are
exact; a weight used outside its layers' forward or rewritten by a tensor hook is refused
(docs/loop.md). More tied models: ``test_ghost_tied_lm.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional

from gradbalance.clip import GhostNorms


def _loop_norms(model: nn.Module, x: Tensor, y: Tensor, params: list[Tensor]) -> Tensor:
    """``‖∇θ (f(xᵢ) − yᵢ)ₖ²‖₂`` ``[B, K]``, one backward per sample and task."""
    rows = []
    for i in range(x.shape[0]):
        ell = ((model(x[i : i + 1]) - y[i]) ** 2)[0]
        rows.append(torch.stack([torch.linalg.vector_norm(torch.cat([
            g.flatten() for g in torch.autograd.grad(ell[k], params, retain_graph=True)]))
            for k in range(ell.shape[0])]))
    return torch.stack(rows)


class _Tokens(nn.Module):
    """Embedding and linear layers on token ids; ``tie``: the output projection shares the
    embedding's weight; ``repeat``: the embedding and a linear layer are called again."""

    def __init__(self, vocab: int, width: int, tie: bool, repeat: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab)
        self.head = nn.Linear(vocab, 2)
        if tie:
            self.out.weight = self.embed.weight
        self.repeat = repeat

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        for step in range(1, self.repeat):  # the same layers again, on shifted ids
            h = h + torch.tanh(self.mix(self.embed((ids + step) % self.embed.num_embeddings)))
        h = torch.tanh(self.mix(h))
        out: Tensor = self.head(torch.tanh(self.out(h))).mean(dim=1)
        return out  # [B, 2]


def _data(seed: int, batch: int, seq: int, vocab: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(vocab, (batch, seq), generator=gen),
            torch.randn(batch, 2, generator=gen, dtype=torch.float64))


@pytest.mark.parametrize(("seed", "batch", "seq", "repeat", "tie"),
                         [(0, 3, 4, 2, False), (1, 5, 2, 3, False), (2, 4, 6, 2, False),
                          (0, 3, 4, 1, True), (1, 5, 2, 3, True), (2, 4, 6, 2, True)])
def test_layers_called_several_times_and_a_tied_output_are_exact(
        seed: int, batch: int, seq: int, repeat: int, tie: bool) -> None:
    """``tie``: the output projection holds the embedding's weight."""
    torch.manual_seed(seed)
    model = _Tokens(7, 6, tie=tie, repeat=repeat).double()
    x, y = _data(seed, batch, seq, 7)
    expected = _loop_norms(model, x, y, list(model.parameters()))
    ghost = GhostNorms(model)
    torch.testing.assert_close(ghost.norms((model(x) - y) ** 2), expected, rtol=1e-10,
                               atol=1e-12)


class _TwoLayersOneWeight(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.b(torch.tanh(self.a(x)))
        return out


@pytest.mark.parametrize(("seed", "width"), [(0, 2), (1, 5)])
def test_one_weight_in_two_linear_layers_is_exact_with_or_without_it(seed: int,
                                                                      width: int) -> None:
    torch.manual_seed(seed)
    model = _TwoLayersOneWeight(width).double()
    x = torch.randn(4, width, dtype=torch.float64)
    y = torch.randn(4, width, dtype=torch.float64)
    for params in (list(model.parameters()), [model.a.bias, model.b.bias]):
        expected = _loop_norms(model, x, y, params)
        ghost = GhostNorms(model, params=params)
        torch.testing.assert_close(ghost.norms((model(x) - y) ** 2), expected, rtol=1e-10,
                                   atol=1e-12)
        ghost.remove()


class _Outside(nn.Module):
    """A linear layer whose weight a function call uses again, outside its forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(width, width), nn.Linear(width, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        h = h + torch.tanh(functional.linear(h, self.inp.weight))
        out: Tensor = self.out(h)
        return out


@pytest.mark.parametrize("autocast", [False, True])
def test_a_weight_used_outside_its_forward_is_refused_at_norms(autocast: bool) -> None:
    torch.manual_seed(0)
    model = _Outside(3).double() if not autocast else _Outside(3)
    dtype = torch.float64 if not autocast else torch.float32
    x, y = torch.randn(4, 3, dtype=dtype), torch.randn(4, 2, dtype=dtype)
    ghost = GhostNorms(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        losses = (model(x).float() - y) ** 2
    with pytest.raises(RuntimeError, match=r"'inp\.weight'.*used 2 times.*recorded 1"):
        ghost.norms(losses)
    assert all(not layer.outputs for layer in ghost._layers)  # the records are dropped


def test_the_parameters_not_used_outside_stay_exact() -> None:
    torch.manual_seed(1)
    model = _Outside(3).double()
    rest = [model.inp.bias, model.out.weight, model.out.bias]
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    expected = _loop_norms(model, x, y, rest)
    ghost = GhostNorms(model, params=rest)
    torch.testing.assert_close(ghost.norms((model(x) - y) ** 2), expected, rtol=1e-10,
                               atol=1e-12)


def test_a_tensor_hook_on_a_bounded_weight_is_refused() -> None:
    model = _TwoLayersOneWeight(3).double()
    model.b.weight = nn.Parameter(model.b.weight.detach().clone())  # untied
    ghost = GhostNorms(model)
    model.a.weight.register_hook(lambda g: 0.5 * g)
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"'a\.weight'.*tensor hook"):
        ghost.norms((model(x) - y) ** 2)
