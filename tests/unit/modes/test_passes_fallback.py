"""One implementation of the K task passes: ``matrix`` and ``gramian`` modes fall back alike.

A trunk op without a batching rule makes the batched call fail; under ``passes="auto"`` both
modes then run the loop (with one warning, and the loop sticks), and give the update of
``passes="loop"`` — computed by ``matrix`` mode's loop, an independent path for the gramian
mode's activations route. ``passes="batched"`` raises in both, with nothing moved.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer, taskgrads
from gradbalance._batching import raised_by_model
from gradbalance_lab.models import MultiTaskModel, make_heads, regression_losses
from support.helpers import ItemInBackward, forced_buffer, grads_of
from support.perf import make_balancer

K = 3


class _Unbatchable(nn.Module):
    """Doubles its input through a backward that vmap cannot batch."""

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = ItemInBackward.apply(x)
        return out


def _model() -> tuple[MultiTaskModel, Tensor, Tensor]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(6, 8), _Unbatchable(), nn.Tanh(), nn.Linear(8, 8),
                          nn.Tanh())
    model = MultiTaskModel(trunk, make_heads(8, K)).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    return model, x, torch.randn(5, K, generator=gen, dtype=torch.float64)



def _step(buf: TaskGradBuffer, model: MultiTaskModel, x: Tensor, y: Tensor
          ) -> tuple[list[Tensor], list[Tensor]]:
    buf.backward(regression_losses(model(x), y))
    buf.apply_(make_balancer("upgrad"))
    trunk, heads = grads_of(model.shared_parameters()), grads_of(model.head_parameters())
    model.zero_grad(set_to_none=True)
    return trunk, heads


def _close(actual: list[Tensor], expected: list[Tensor]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("mode", "force"), [
    ("matrix", None), ("gramian", "activations"), ("gramian", "rows"), ("gramian", None),
])
def test_auto_falls_back_to_the_loop_in_every_mode(monkeypatch: pytest.MonkeyPatch, mode: str,
                                                   force: str | None) -> None:
    model, x, y = _model()
    reference = _step(forced_buffer(model, "matrix", "loop", None), model, x, y)
    # "auto" now asks for the batched call on this device, without measuring
    monkeypatch.setitem(taskgrads.AUTO_PREFERENCE, "cpu", "batched")
    buf = forced_buffer(model, mode, "auto", force)
    with pytest.warns(RuntimeWarning, match="falling back to the loop"):
        first = _step(buf, model, x, y)
    _close(first[0], reference[0])
    _close(first[1], reference[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback sticks: no second failed batched call
        second = _step(buf, model, x, y)
    _close(second[0], reference[0])
    _close(second[1], reference[1])


@pytest.mark.parametrize("mode", ["matrix", "gramian"])
def test_forced_batched_raises_in_every_mode(mode: str) -> None:
    model, x, y = _model()
    buf = forced_buffer(model, mode, "batched", "activations" if mode == "gramian" else None)
    with pytest.raises(RuntimeError, match="passes='batched' failed"):
        buf.backward(regression_losses(model(x), y))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", ["matrix", "gramian"])
def test_forced_batched_on_a_sparse_embedding_says_the_fix_in_one_line(mode: str) -> None:
    """``nn.Embedding(sparse=True)`` has no batched backward: the error is one line that names
    the fix, torch's whole dispatcher message (about 60 lines) chained, nothing moved; the
    loop (``passes="auto"``) gives ``sum(losses).backward()``'s gradient for Sum."""
    torch.manual_seed(0)
    emb, lin = nn.Embedding(10, 4, sparse=True).double(), nn.Linear(4, 4).double()
    heads = nn.ModuleList([nn.Linear(4, 1) for _ in range(K)]).double()
    trunk = [*emb.parameters(), *lin.parameters()]
    x = torch.tensor([1, 3, 3, 7, 0, 9])

    def losses() -> Tensor:
        f = lin(emb(x))
        return torch.stack([(h(f) - i).pow(2).mean() for i, h in enumerate(heads)])

    buf = TaskGradBuffer(trunk, list(heads.parameters()), mode=mode, passes="batched",
                         **({"modules": [emb, lin]} if mode == "gramian" else {}))
    with pytest.raises(RuntimeError, match="passes='batched' failed") as caught:
        buf.backward(losses())
    assert len(str(caught.value).splitlines()) == 1
    assert "passes='loop' or 'auto'" in str(caught.value)
    assert "SparseCPU" in str(caught.value.__cause__)
    assert all(p.grad is None for p in [*trunk, *heads.parameters()])

    buf = TaskGradBuffer(trunk, list(heads.parameters()), mode=mode, passes="auto",
                         **({"modules": [emb, lin]} if mode == "gramian" else {}))
    buf.backward(losses())
    buf.apply_(make_balancer("sum"))
    got = [p.grad.to_dense() for p in trunk]
    for p in [*trunk, *heads.parameters()]:
        p.grad = None
    losses().sum().backward()
    _close(got, [p.grad.to_dense() for p in trunk])


class _RaisesOnce(nn.Module):
    """The identity, with a hook on its output that raises on its first call only (a check
    of the user's, an injected failure): ``tensor`` a tensor hook, ``module`` a full backward
    hook, ``function`` a custom Function's backward."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.calls = kind, 0
        if kind == "module":
            self.register_full_backward_hook(lambda *_: self._check())

    def _check(self) -> None:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected: the model's own check failed")

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "function":
            return _CheckedIdentity.apply(x, self)  # type: ignore[no-any-return]
        out = x * 1.0
        if self.kind == "tensor":
            out.register_hook(lambda g: self._check())
        return out


class _CheckedIdentity(torch.autograd.Function):
    """The identity whose backward runs the module's check first."""

    @staticmethod
    def forward(ctx, x, owner):  # type: ignore[no-untyped-def]
        ctx.owner = owner
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        ctx.owner._check()
        return grad, None


def _hooked_model(kind: str) -> tuple[MultiTaskModel, Tensor, Tensor]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), _RaisesOnce(kind), nn.Linear(8, 8),
                          nn.Tanh())
    model = MultiTaskModel(trunk, make_heads(8, K)).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    return model, x, torch.randn(5, K, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["tensor", "module", "function"])
@pytest.mark.parametrize(("mode", "passes", "force"), [
    ("matrix", "auto", None), ("matrix", "measure", None), ("matrix", "batched", None),
    ("gramian", "auto", "rows"), ("gramian", "measure", None), ("gramian", "batched", "rows"),
])
def test_a_hooks_own_error_raises_as_under_plain_backward(
        monkeypatch: pytest.MonkeyPatch, kind: str, mode: str, passes: str,
        force: str | None) -> None:
    """A hook of the model that raises once raises under ``sum(losses).backward()``; the
    batched passes raise it too (the same error, no fallback warning, no ``.grad``), not the
    loop in its place, where it would not raise again and the step would pass as if nothing
    had happened. The next step, the hook quiet, is the loop's update."""
    model, x, y = _hooked_model(kind)
    with pytest.raises(RuntimeError, match="injected"):
        regression_losses(model(x), y).sum().backward()
    model, x, y = _hooked_model(kind)
    model.trunk[2].calls = 1  # quiet: the reference
    reference = _step(forced_buffer(model, "matrix", "loop", None), model, x, y)
    model.trunk[2].calls = 0
    monkeypatch.setitem(taskgrads.AUTO_PREFERENCE, "cpu", "batched")
    buf = forced_buffer(model, mode, passes, force)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "falling back to the loop"
        with pytest.raises(RuntimeError, match=r"^injected: the model's own check failed$"):
            buf.backward(regression_losses(model(x), y))
    assert all(p.grad is None for p in model.parameters())
    got = _step(buf, model, x, y)
    _close(got[0], reference[0])
    _close(got[1], reference[1])


@pytest.mark.parametrize(("message", "model_s"), [
    ("injected: the model's own check failed", True),
    ("Batching rule not implemented for aten::item. We could not generate a fallback.", False),
    ("vmap: aten::add_(self, *extra_args) is not possible", False),
    ("Cannot access data pointer of Tensor that doesn't have storage", False),
    ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes", False),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
])
def test_which_errors_are_the_models_own(message: str, model_s: bool) -> None:
    """A hook's error is the model's own unless its message names a batching limit or memory
    (the loop then needs one lane's); raised inside torch (no hook), never."""
    x = torch.ones(2, requires_grad=True)

    def hook(grad: Tensor) -> None:
        raise RuntimeError(message)

    y = x * 2
    y.register_hook(hook)
    with pytest.raises(RuntimeError) as caught:
        torch.autograd.grad(torch.stack([y.sum(), y.prod()]), x, torch.eye(2),
                            is_grads_batched=True)
    assert raised_by_model(caught.value) is model_s
    with pytest.raises(RuntimeError) as inside:  # torch's own: a shape it refuses
        torch.autograd.grad((x * 2).sum(), x, torch.ones(3))
    assert not raised_by_model(inside.value)
