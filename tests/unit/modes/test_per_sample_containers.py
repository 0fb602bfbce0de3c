"""``batch_dim=0`` with parameters a module does not use in its own calls
(docs/per_sample.md, "Layers"): parameters held in ``nn.ParameterList`` / ``nn.ParameterDict``
and read by the module holding them, parametrized layers (weight and spectral norm), a
fallback module called on its own output, and a fallback module's parameter read outside its
calls.

The reference is a second implementation: the matrix route over the same objectives, each
sample × task loss passed as a task of its own (one backward each), in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.utils import parametrizations

from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, Balancer, UPGrad

from .per_sample_runs import run

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class _Listed(nn.Module):
    """Two weights in a ``ParameterList`` and a gain in a ``ParameterDict``, used by the
    holder's forward, after a covered layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.ws = nn.ParameterList([nn.Parameter(0.4 * torch.randn(6, 7)),
                                    nn.Parameter(0.4 * torch.randn(7, 8))])
        self.gains = nn.ParameterDict({"out": nn.Parameter(1 + 0.1 * torch.randn(8))})

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(torch.tanh(self.inp(x)) @ self.ws[0])
        return torch.tanh(h @ self.ws[1]) * self.gains["out"]


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(8))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gain


class _ReadOutside(nn.Module):
    """A fallback module (``_Scale``, no outer form) whose parameter the holder also reads
    outside its call."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.scale = _Scale()

    def forward(self, x: Tensor) -> Tensor:
        h = self.scale(torch.tanh(self.inp(x)))
        return h + torch.sin(h * self.scale.gain)


class _CalledTwice(nn.Module):
    """The same fallback module called twice in a row, its second input its first output."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.scale = _Scale()

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.scale(torch.tanh(self.scale(self.inp(x)))))


class _DropScale(nn.Module):
    """A gain after dropout: vmap cannot draw the masks, so the recorded graph's products."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(8))
        self.drop = nn.Dropout(0.3)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(x) * self.gain


class _DroppedTwice(nn.Module):
    """``_DropScale`` called twice in a row (the masked route per call)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.scale = _DropScale()

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.scale(torch.tanh(self.scale(self.inp(x)))))


class _WeightNormed(nn.Module):
    """A weight-normed layer (its parameters below it, its weight computed on each read)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = parametrizations.weight_norm(nn.Linear(5, 8))
        self.out = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.inp(x)))


class _SpectralNormed(nn.Module):
    """A spectral-normed layer: its forward also moves its power-iteration buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.out = parametrizations.spectral_norm(nn.Linear(8, 8))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.out(torch.tanh(self.inp(x))))


def _both(make: type[nn.Module], seed: int, batch: int, tasks: int,
          balancer: type[Balancer]) -> tuple[Tensor, Tensor]:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(seed)
        trunk, heads = make(), nn.Linear(8, tasks)
        x, y = torch.randn(batch, 5), torch.randn(batch, tasks)
        state = torch.get_rng_state()  # the same dropout masks on both routes
        twins = copy.deepcopy((trunk, heads))  # the same buffers before each route's forward
        (got,), _ = run(trunk, heads, [(x, y)], balancer(), True)
        torch.set_rng_state(state)
        (want,), _ = run(*twins, [(x, y)], balancer(), False)
    finally:
        torch.set_default_dtype(torch.float32)
    # the buffers, moved by the forward alone
    return (torch.cat([got, *(b.flatten() for b in trunk.buffers())]),
            torch.cat([want, *(b.flatten() for b in twins[0].buffers())]))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(2, 7), tasks=st.integers(1, 3),
       balancer=st.sampled_from([UPGrad, MGDA]),
       make=st.sampled_from([_Listed, _CalledTwice, _DroppedTwice, _WeightNormed,
                             _SpectralNormed]))
def test_parameters_read_by_their_holder_match_the_matrix_route(
        seed: int, batch: int, tasks: int, balancer: type[Balancer],
        make: type[nn.Module]) -> None:
    """A container's parameters are the holder's (one fallback through its forward), and a
    fallback module called on its own output has each call's gradient once (by vmap, or by
    the recorded graph cut at the call's arguments where dropout runs): the matrix route's
    update; a parametrized layer is one fallback through its forward, and the trunk's
    buffers are those of the plain step."""
    got, want = _both(make, seed, batch, tasks, balancer)
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12 * float(want.abs().max()))


def test_a_fallback_parameter_read_outside_its_module_is_refused() -> None:
    """The holder reads the gain outside the module's call: the fallback's rows would miss
    that use, so the step is refused before any ``.grad`` moves."""
    torch.manual_seed(0)
    trunk, heads = _ReadOutside(), nn.Linear(8, 2)
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    losses = (heads(trunk(torch.randn(4, 5))) - torch.randn(4, 2)) ** 2
    with pytest.raises(RuntimeError, match=r"'scale\.gain' is used 2 times.*recorded 1 calls"):
        buf.backward(losses)
    assert all(p.grad is None for p in [*trunk.parameters(), *heads.parameters()])


def test_a_parameter_passed_to_a_fallback_module_is_no_use_inside_it() -> None:
    """A trunk parameter given to a fallback module as an argument is used by the caller,
    not by the module: refused where the caller has no record of it."""

    class _Caller(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = _Scale()

        def forward(self, x: Tensor) -> Tensor:
            return x[:, :1] * self.scale(self.scale.gain.expand(x.shape[0], 8))

    torch.manual_seed(1)
    trunk, heads = _Caller(), nn.Linear(8, 1)
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    losses = (heads(trunk(torch.randn(3, 5))) - 1.0).pow(2)[:, 0]
    with pytest.raises(RuntimeError, match=r"'scale\.gain' is used 2 times.*recorded 1 calls"):
        buf.backward(losses)


def test_unchanged_uses_of_a_plain_step_check_the_fallback() -> None:
    """Without the cut at the call's inputs the graph below a fallback module's output holds
    the covered layer's uses too: the count stays the module's own."""
    from torch.autograd.graph import get_gradient_edge

    from gradbalance._graph import leaf_uses, uses_below

    torch.manual_seed(2)
    lin, scale = nn.Linear(3, 8), _Scale()
    x = torch.randn(2, 3)
    h = lin(x)
    out = scale(F.relu(h))
    inner = uses_below([out.grad_fn], {get_gradient_edge(F.relu(h)).node, h.grad_fn},
                       [lin.weight, scale.gain])
    assert inner[id(scale.gain)] == 1 and inner[id(lin.weight)] == 0
    assert leaf_uses(out.sum(), [lin.weight])[id(lin.weight)] == 1
