"""Module state and gradient layouts as plain PyTorch leaves them.

A ``BatchNorm`` inside ``torch.utils.checkpoint(..., use_reentrant=False)`` is recomputed in
every backward through it: plain ``sum(losses).backward()`` counts one recomputation, the
loop's K passes counted K (its running mean 0.8 of its size off at K = 3), and a refused
``passes="batched"`` try moved it before raising. A new ``.grad`` takes the parameter's
strides in plain PyTorch (channels-last, transposed leaves): the step wrote them row-major.
The reference is plain ``backward`` on an identical model (docs/loop.md, "Inputs plain
PyTorch takes").
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gradbalance import TaskGradBuffer, balanced_backward
from gradbalance._recompute import LARGEST_COPIED
from gradbalance.balancers import Sum, UPGrad

K = 3
ROUTES = [("matrix", "loop"), ("matrix", "batched"), ("matrix", "measure"),
          ("gramian", "loop"), ("gramian", "batched"), ("auto", "auto")]


class Net(nn.Module):
    """A trunk whose first block, a linear layer, a BatchNorm and ``extra``, runs under a
    non-reentrant checkpoint; K linear heads; float64."""

    def __init__(self, extra: nn.Module | None = None, twice: bool = False,
                 bn_last: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        tail = [] if bn_last else [extra or nn.Identity(), nn.Tanh()]
        # bn_last: torch's early stop ends each recomputation inside the BatchNorm's call
        self.block = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), *tail)
        self.out = nn.Linear(8, 5)
        self.heads = nn.ModuleList(nn.Linear(5, 1) for _ in range(K))
        self.twice = twice  # the block run twice inside the segment
        self.double()

    def segment(self, x: Tensor) -> Tensor:
        y = self.block(x)
        return self.block(y[:, :6]) if self.twice else y

    def losses(self, seed: int) -> list[Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(6, 6, generator=g, dtype=torch.float64)
        y = torch.randn(6, K, generator=g, dtype=torch.float64)
        f = self.out(checkpoint(self.segment, x, use_reentrant=False))
        return [((h(f)[:, 0] - y[:, k]) ** 2).mean() for k, h in enumerate(self.heads)]

    def trunk(self) -> list[nn.Parameter]:
        return [*self.block.parameters(), *self.out.parameters()]


def _buffers(net: Net) -> dict[str, Tensor]:
    return {n: b.clone() for n, b in net.named_buffers()}


def _assert_same(got: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), (name, got[name], value)


def _plain(steps: int, micro: int, **net: object) -> tuple[dict[str, Tensor], list[Tensor]]:
    model = Net(**net)  # type: ignore[arg-type]
    for step in range(steps):
        for m in range(micro):
            sum(model.losses(10 * step + m)).backward()
    return _buffers(model), [p.grad.clone() for p in model.trunk()]


@pytest.mark.parametrize(("mode", "passes"), ROUTES)
@pytest.mark.parametrize(("steps", "micro", "every"), [(1, 1, 1), (1, 2, 1), (3, 1, 2),
                                                       (2, 3, 2)])
@pytest.mark.parametrize("bn_last", [False, True])
def test_a_checkpointed_batchnorm_counts_one_recomputation(mode: str, passes: str,
                                                           steps: int, micro: int,
                                                           every: int, bn_last: bool) -> None:
    expected, grads = _plain(steps, micro, bn_last=bn_last)
    model = Net(bn_last=bn_last)
    buf = TaskGradBuffer(model.trunk(), model.heads.parameters(), mode=mode, passes=passes,
                         modules=model, update_every=every)
    for step in range(steps):
        for m in range(micro):
            buf.backward(model.losses(10 * step + m))
        buf.apply_(Sum())
    _assert_same(_buffers(model), expected)  # the running statistics, the count
    for got, want in zip([p.grad for p in model.trunk()], grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("twice", [False, True])
def test_the_one_shot_call_and_a_block_run_twice_count_as_plain(twice: bool) -> None:
    expected, _ = _plain(1, 1, twice=twice)
    model = Net(twice=twice)
    balanced_backward(model.losses(0), UPGrad(), shared_params=model.trunk(),
                      head_params=model.heads.parameters(), passes="loop")
    _assert_same(_buffers(model), expected)


def test_a_refused_batched_pass_leaves_the_running_statistics() -> None:
    # vmap refuses the dropout inside the segment after the BatchNorm was recomputed
    model = Net(extra=nn.Dropout(0.1))
    losses = model.losses(0)
    before = _buffers(model)
    buf = TaskGradBuffer(model.trunk(), model.heads.parameters(), passes="batched")
    with pytest.raises(RuntimeError, match="passes='batched' failed"):
        buf.backward(losses)
    _assert_same(_buffers(model), before)
    assert all(p.grad is None for p in model.parameters())


def test_a_failed_step_puts_the_recomputed_state_back() -> None:
    model = Net()
    losses = model.losses(0)
    before = _buffers(model)
    buf = TaskGradBuffer(model.trunk(), model.heads.parameters(), passes="loop")

    calls = []

    def fail_on_second(grad: Tensor) -> Tensor:
        calls.append(1)
        if len(calls) == 2:  # the second task's pass, after the first recomputed the block
            raise RuntimeError("injected")
        return grad

    handle = model.out.weight.register_hook(fail_on_second)
    with pytest.raises(RuntimeError, match="injected"):
        buf.backward(losses)
    handle.remove()
    _assert_same(_buffers(model), before)


class Counter(nn.Module):
    """Counts its calls in a buffer (in place, or by replacing it: ``replace``)."""

    def __init__(self, replace: bool = False) -> None:
        super().__init__()
        self.replace = replace
        self.register_buffer("n", torch.zeros((), dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        if self.replace:
            self.n = self.n + 1
        else:
            self.n.add_(1)
        return x


@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("micro", [1, 2])
def test_the_per_sample_route_counts_one_recomputation(replace: bool, micro: int) -> None:
    def make() -> tuple[nn.Module, Counter]:
        torch.manual_seed(0)
        counter = Counter(replace)
        return nn.ModuleDict({"l1": nn.Linear(6, 8), "c": counter,
                              "l2": nn.Linear(8, 1)}).double(), counter

    def losses(net: nn.Module, seed: int) -> Tensor:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(6, 6, generator=g, dtype=torch.float64)
        f = checkpoint(lambda z: torch.tanh(net["c"](net["l1"](z))), x, use_reentrant=False)
        return net["l2"](f)[:, 0] ** 2

    plain, plain_counter = make()
    for m in range(micro):
        losses(plain, m).sum().backward()
    net, counter = make()
    buf = TaskGradBuffer(net.parameters(), modules=net, batch_dim=0)
    for m in range(micro):
        buf.backward(losses(net, m))
    buf.apply_(Sum())
    assert float(counter.n) == float(plain_counter.n) == 2 * micro
    for got, want in zip(net.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["spectral", "old_spectral", "hooked"])
@pytest.mark.parametrize("passes", ["loop", "batched"])
def test_a_forward_that_reads_its_buffers_recomputes_as_plain(kind: str, passes: str) -> None:
    # spectral norm's power iteration reads and moves u: each task's recomputation starts
    # from the state plain PyTorch's one recomputation started from (the later passes
    # started from the first pass's state: .grad 5e-3 off); a module's own forward hook
    # that moves a buffer is put back too
    from torch.nn.utils import parametrizations, spectral_norm

    def make() -> nn.ModuleDict:
        torch.manual_seed(0)
        mid = nn.Linear(8, 8)
        if kind == "spectral":
            mid = parametrizations.spectral_norm(mid)
        elif kind == "old_spectral":
            mid = spectral_norm(mid)
        else:
            mid.register_buffer("n", torch.zeros(()))
            mid.register_forward_hook(lambda m, a, o: m.n.add_(1) and None)
        return nn.ModuleDict({"mid": mid,
                              "heads": nn.ModuleList(nn.Linear(8, 1) for _ in range(K))}).double()

    def losses(m: nn.ModuleDict) -> list[Tensor]:
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        f = checkpoint(lambda z: torch.tanh(m["mid"](z)), x, use_reentrant=False)
        return [h(f).pow(2).mean() for h in m["heads"]]

    plain = make()
    sum(losses(plain)).backward()
    model = make()
    if passes == "batched" and kind == "old_spectral":
        pytest.skip("vmap has no rule for the old spectral norm's in-place power iteration")
    buf = TaskGradBuffer(model["mid"].parameters(), model["heads"].parameters(), passes=passes)
    buf.backward(losses(model))
    buf.apply_(Sum())
    for a, b in zip(model.buffers(), plain.buffers()):
        assert torch.equal(a, b)
    for a, b in zip(model["mid"].parameters(), plain["mid"].parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)


class Fixed(nn.Module):
    """Adds a buffer that cannot be written in place (expanded, or an inference tensor), or
    a large one it changes (``grow``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "expanded":
            self.register_buffer("b", torch.ones(1, dtype=torch.float64).expand(8))
        elif kind == "inference":
            with torch.inference_mode():
                self.register_buffer("b", torch.ones(8, dtype=torch.float64))
        else:
            self.register_buffer("b", torch.zeros(LARGEST_COPIED + 1, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "grow":
            self.b.add_(1.0)
            return x
        return x + self.b[:8]


@pytest.mark.parametrize("kind", ["expanded", "inference"])
def test_buffers_that_cannot_be_written_are_left_alone(kind: str) -> None:
    expected, _ = _plain(1, 1, extra=Fixed(kind))
    model = Net(extra=Fixed(kind))
    buf = TaskGradBuffer(model.trunk(), model.heads.parameters(), passes="loop")
    buf.backward(model.losses(0))  # a raw torch error before: the copy into them
    buf.apply_(Sum())
    _assert_same(_buffers(model), expected)


def test_a_large_buffer_a_recomputation_changes_is_named() -> None:
    model = Net(extra=Fixed("grow"))
    losses = model.losses(0)
    before = _buffers(model)
    buf = TaskGradBuffer(model.trunk(), model.heads.parameters(), passes="loop")
    with pytest.raises(RuntimeError, match=r"changed its buffer 'b' \(65537 elements\)"):
        buf.backward(losses)
    after = _buffers(model)
    assert torch.equal(after["block.1.running_mean"], before["block.1.running_mean"])
    assert all(p.grad is None for p in model.parameters())


LayoutCase = Callable[[], tuple[nn.Module, list[nn.Parameter], Callable[[], list[Tensor]]]]


def _channels_last() -> tuple[nn.Module, list[nn.Parameter], Callable[[], list[Tensor]]]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3),
                          nn.Flatten()).to(memory_format=torch.channels_last)
    heads = nn.ModuleList(nn.Linear(32, 1) for _ in range(K))
    x = torch.randn(5, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    model = nn.ModuleDict({"trunk": trunk, "heads": heads})

    def losses() -> list[Tensor]:
        f = trunk(x)
        return [h(f).pow(2).mean() for h in heads]
    return model, list(trunk.parameters()), losses


def _transposed() -> tuple[nn.Module, list[nn.Parameter], Callable[[], list[Tensor]]]:
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(6, 8).T)  # [8, 6], strides (1, 8)
    heads = nn.ModuleList(nn.Linear(6, 1) for _ in range(K))
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    model = nn.ModuleDict({"heads": heads})

    def losses() -> list[Tensor]:
        f = torch.tanh(x @ weight)
        return [h(f).pow(2).mean() for h in heads]
    return model, [weight], losses


@pytest.mark.parametrize("case", [_channels_last, _transposed])
@pytest.mark.parametrize(("mode", "passes"), [("matrix", "loop"), ("matrix", "batched"),
                                              ("auto", "auto")])
def test_a_new_grad_takes_the_parameters_strides(case: LayoutCase, mode: str,
                                                 passes: str) -> None:
    model, trunk, losses = case()
    sum(losses()).backward()
    plain = [p.grad for p in trunk]
    assert any(not p.is_contiguous() for p in trunk)  # the case is what it claims
    model, trunk, losses = case()
    heads = [p for p in model.parameters() if all(p is not q for q in trunk)]
    buf = TaskGradBuffer(trunk, heads, mode=mode, passes=passes, modules=model)
    buf.backward(losses())
    buf.apply_(Sum())
    for p, want in zip(trunk, plain):
        assert p.grad.stride() == want.stride() == p.stride()
        torch.testing.assert_close(p.grad, want)


class SharedAcrossSegments(nn.Module):
    """One module with buffers called in two checkpointed segments; task 0 reads the first
    segment's output, task 1 the second's (``both``: every task reads both)."""

    def __init__(self, shared: nn.Module, both: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.shared = nn.Linear(4, 6), shared
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.heads = nn.ModuleList(nn.Linear(6, 1) for _ in range(2))
        self.both = both
        self.double()

    def losses(self) -> list[Tensor]:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        h = torch.tanh(self.inp(x))
        ya = checkpoint(lambda t: torch.tanh(self.a(self.shared(t))), h, use_reentrant=False)
        yb = checkpoint(lambda t: torch.tanh(self.b(self.shared(2 * t))), h,
                        use_reentrant=False)
        if self.both:
            ya, yb = ya + yb, ya - yb
        return [self.heads[0](ya).pow(2).mean(), self.heads[1](yb).pow(2).mean()]

    def trunk(self) -> list[Tensor]:
        return [p for name, p in self.named_parameters() if not name.startswith("heads")]


class Constant(nn.Module):
    """A buffer its forward only reads (a table, a mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


def _assert_plain_step(make: Callable[[], SharedAcrossSegments | Nested], passes: str) -> None:
    """One step with ``passes`` (``Sum``) leaves the buffers and ``.grad`` of plain
    ``sum(losses).backward()`` on an identical model."""
    plain = make()
    sum(plain.losses()).backward()
    model = make()
    buf = TaskGradBuffer(model.trunk(), model.heads.parameters(), passes=passes)
    buf.backward(model.losses())
    buf.apply_(Sum())
    _assert_same(_buffers(model), _buffers(plain))
    for got, want in zip([p.grad for p in model.trunk()], [p.grad for p in plain.trunk()]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["matrix", "gramian"])
def test_a_module_shared_by_segments_tasks_reach_apart_is_refused(mode: str) -> None:
    """Plain backward recomputes both segments, each moving the running statistics; the
    loop's passes would count the second task's segment out. Refused by name, the
    statistics and every ``.grad`` as the forward left them; ``passes="batched"`` (one pass)
    gives plain PyTorch's statistics and update."""
    model = SharedAcrossSegments(nn.BatchNorm1d(6))
    buf = TaskGradBuffer(model.trunk(), model.heads.parameters(), mode=mode, passes="loop",
                         modules=None if mode == "matrix" else model)
    losses = model.losses()
    before = _buffers(model)
    with pytest.raises(RuntimeError, match=r"BatchNorm1d.*two torch\.utils\.checkpoint "
                                           r"segments.*passes='batched'"):
        buf.backward(losses)
    _assert_same(_buffers(model), before)
    assert all(p.grad is None for p in model.parameters())

    _assert_plain_step(lambda: SharedAcrossSegments(nn.BatchNorm1d(6)), "batched")


@pytest.mark.parametrize(("shared", "both"), [("constant", False), ("batchnorm", True)])
def test_a_module_shared_by_segments_counts_as_plain(shared: str, both: bool) -> None:
    """A shared module whose buffers its recomputation leaves alone, and a BatchNorm in two
    segments every task reaches: the loop's passes give plain PyTorch's buffers and update."""
    def make() -> SharedAcrossSegments:
        return SharedAcrossSegments(Constant() if shared == "constant" else nn.BatchNorm1d(6),
                                    both)

    _assert_plain_step(make, "loop")


class Nested(nn.Module):
    """A BatchNorm in a checkpointed segment inside another, every task reading the outer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.bn = nn.Linear(4, 6), nn.BatchNorm1d(6)
        self.a, self.c = nn.Linear(6, 6), nn.Linear(6, 6)
        self.heads = nn.ModuleList(nn.Linear(6, 1) for _ in range(K))
        self.double()

    def inner(self, t: Tensor) -> Tensor:
        return torch.tanh(self.a(self.bn(t)))

    def outer(self, t: Tensor) -> Tensor:
        return torch.tanh(self.c(checkpoint(self.inner, t, use_reentrant=False)))

    def losses(self) -> list[Tensor]:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        y = checkpoint(self.outer, torch.tanh(self.inp(x)), use_reentrant=False)
        return [h(y).pow(2).mean() * (k + 1) for k, h in enumerate(self.heads)]

    def trunk(self) -> list[Tensor]:
        return [p for name, p in self.named_parameters() if not name.startswith("heads")]


@pytest.mark.parametrize("passes", ["loop", "batched"])
def test_nested_checkpoints_count_as_plain(passes: str) -> None:
    """Every task reaches both segments (the inner one recomputed inside the outer's
    recomputation): nothing refused, the buffers and the update plain PyTorch's."""
    _assert_plain_step(Nested, passes)
