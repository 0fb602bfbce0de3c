"""The balanced step against plain PyTorch on inputs ``sum(losses).backward()`` takes: with
``Sum`` (or ``Constant`` weights, ``Mean``) every mode's update is the plain one; with UPGrad
every mode's update is ``matrix`` mode's (docs/loop.md, "Inputs plain PyTorch takes" and "One
update whatever the route").

The references are plain ``backward`` on an identical model and ``matrix`` mode (autograd's
per-task gradients). The wide layers (40 → 48 → 40 on 4 rows) put the trunk's linear layers on
``gramian`` mode's activations route, the route built from recorded layer calls, so each edge
case reaches it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn import functional
from torch.nn.utils import parametrizations, prune
from torch.utils.checkpoint import checkpoint

from gradbalance import TaskGradBuffer, balanced_backward
from gradbalance.balancers import Balancer, Constant, Mean, Sum, UPGrad

ROUTES = [("matrix", "loop"), ("gramian", "loop"), ("gramian", "batched"), ("auto", "loop")]


class Net(nn.Module):
    """A trunk of two wide linear layers and K linear heads, float64; ``feats`` is the forward
    a case alters."""

    def __init__(self, seed: int, num_tasks: int = 3, widths: tuple[int, ...] = (40, 48, 40),
                 rows: int = 4) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(widths[0], widths[1]), nn.Tanh(),
                                   nn.Linear(widths[1], widths[2])).double()
        self.heads = nn.ModuleList([nn.Linear(widths[2], 1) for _ in range(num_tasks)]).double()
        self.num_tasks, self.width, self.rows, self.seed = num_tasks, widths[0], rows, seed

    def feats(self, x: Tensor) -> Tensor:
        return torch.tanh(self.trunk(x))

    def losses(self, micro: int) -> list[Tensor]:
        g = torch.Generator().manual_seed(1000 * self.seed + micro)
        x = torch.randn(self.rows, self.width, generator=g, dtype=torch.float64)
        y = torch.randn(self.rows, self.num_tasks, generator=g, dtype=torch.float64)
        f = self.feats(x)
        return [((h(f)[:, 0] - y[:, k]) ** 2).mean() for k, h in enumerate(self.heads)]


def grads(params: list[Tensor]) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def assert_same(got: list[Tensor | None], expected: list[Tensor | None],
                rtol: float = 1e-10, scale: float | None = None) -> None:
    """Each ``.grad`` as expected, within ``rtol`` of ``scale`` (default: the largest entry
    expected; an update near zero, as UPGrad's where the dual cone is a point, takes the
    plain gradient's)."""
    if scale is None:
        scale = max(float(e.abs().max()) for e in expected if e is not None)
    for a, e in zip(got, expected, strict=True):
        assert (a is None) == (e is None)
        if a is not None and e is not None:
            torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * scale)


Make = Callable[[int], Net]


def plain(make: Make, seed: int, micro: int = 1, weights: list[float] | None = None,
          prepare: Callable[[Net], Any] | None = None
          ) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """``sum(w * losses).backward()`` per micro-batch: the trunk's and the heads' ``.grad``."""
    net = make(seed)
    if prepare is not None:
        prepare(net)
    for i in range(micro):
        losses = net.losses(i)
        w = weights or [1.0] * len(losses)
        sum(wk * loss for wk, loss in zip(w, losses)).backward()
    return grads(list(net.trunk.parameters())), grads(list(net.heads.parameters()))


def balanced(make: Make, seed: int, mode: str, passes: str, balancer: Balancer,
             micro: int = 1, prepare: Callable[[Net], Any] | None = None
             ) -> tuple[list[Tensor | None], list[Tensor | None], TaskGradBuffer]:
    net = make(seed)
    buf = TaskGradBuffer(net.trunk.parameters(), net.heads.parameters(), mode=mode,
                         passes=passes, modules=None if mode == "matrix" else net.trunk)
    if prepare is not None:
        prepare(net)
    for i in range(micro):
        buf.backward(net.losses(i))
    buf.apply_(balancer)
    return grads(list(net.trunk.parameters())), grads(list(net.heads.parameters())), buf


def check_parity(make: Make, seed: int, micro: int = 1, routes: list[tuple[str, str]] = ROUTES,
                 prepare: Callable[[Net], Any] | None = None) -> None:
    """Sum equals plain backward, UPGrad equals matrix mode's, on every route."""
    trunk_ref, heads_ref = plain(make, seed, micro, prepare=prepare)
    upgrad_ref = balanced(make, seed, "matrix", "loop", UPGrad(), micro, prepare)
    for mode, passes in routes:
        trunk, heads, _ = balanced(make, seed, mode, passes, Sum(), micro, prepare)
        assert_same(trunk, trunk_ref)
        assert_same(heads, heads_ref)
        trunk, heads, _ = balanced(make, seed, mode, passes, UPGrad(), micro, prepare)
        scale = max(float(e.abs().max()) for e in trunk_ref if e is not None)
        assert_same(trunk, upgrad_ref[0], rtol=1e-8, scale=scale)
        assert_same(heads, upgrad_ref[1])


# -- a layer call that is not the linear form of its parameters ----------------------------


class ScaledCall(Net):
    """The first layer called through ``functional_call`` with twice its weight."""

    def feats(self, x: Tensor) -> Tensor:
        layer = self.trunk[0]
        h = torch.func.functional_call(layer, {"weight": layer.weight * 2}, (x,), strict=False)
        return torch.tanh(self.trunk[2](torch.tanh(h)))


class Pruned(Net):
    """``torch.nn.utils.prune``: the weight a pre-hook computes from ``weight_orig``."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        torch.manual_seed(seed + 7)
        prune.random_unstructured(self.trunk[0], "weight", 0.5)


class OutputHooked(Net):
    """A forward hook, registered before the buffer, that replaces the layer's output."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.trunk[0].register_forward_hook(lambda m, a, y: 2.0 * y)


def hook_first(net: Net) -> None:
    """After the buffer: a forward hook put before every other one, replacing the output."""
    net.trunk[2].register_forward_hook(lambda m, a, y: 0.5 * y + 0.1, prepend=True)


ALTERED: dict[str, tuple[Make, Callable[[Net], Any] | None]] = {
    "functional_call": (ScaledCall, None),
    "prune": (Pruned, None),
    "forward_hook": (OutputHooked, None),
    "forward_hook_prepended_later": (Net, hook_first),
}


def test_the_unaltered_net_takes_the_activations_route() -> None:
    """The cases below reach the route built from recorded calls."""
    *_, buf = balanced(Net, 0, "gramian", "loop", UPGrad())
    assert buf.layer_routes == {"0": "activations", "2": "activations"}


@pytest.mark.parametrize("case", list(ALTERED))
@pytest.mark.parametrize("micro", [1, 2])
def test_a_call_that_is_not_the_layers_own_gets_matrix_modes_update(case: str,
                                                                     micro: int) -> None:
    # Before the fix gramian mode built these layers' gradients from the recorded input and
    # output gradient as if the layer had used its own weight: 50 % off with Sum on the
    # forward hook, 1-30 % off with UPGrad elsewhere (a pruned weight's block was left out
    # of the Gramian).
    make, prepare = ALTERED[case]
    check_parity(make, 0, micro, prepare=prepare)


def test_a_layer_not_called_with_its_own_weight_takes_the_rows() -> None:
    *_, buf = balanced(ScaledCall, 0, "gramian", "batched", UPGrad())
    assert buf.layer_routes == {"0": "rows", "2": "activations"}


class Checkpointed(Net):
    def feats(self, x: Tensor) -> Tensor:
        h = checkpoint(lambda z: torch.tanh(self.trunk[0](z)), x, use_reentrant=False)
        return torch.tanh(checkpoint(self.trunk[2], h, use_reentrant=False))


class NestedCheckpoints(Net):
    def feats(self, x: Tensor) -> Tensor:
        def inner(z: Tensor) -> Tensor:
            return torch.tanh(self.trunk[0](z))

        def outer(z: Tensor) -> Tensor:
            return torch.tanh(self.trunk[2](checkpoint(inner, z, use_reentrant=False)))

        out = checkpoint(outer, x, use_reentrant=False)
        assert isinstance(out, Tensor)
        return out


@pytest.mark.parametrize("make", [Checkpointed, NestedCheckpoints], ids=["flat", "nested"])
@pytest.mark.parametrize("micro", [1, 2])
def test_a_checkpoints_recomputation_is_not_recorded(make: Make, micro: int) -> None:
    # Before the fix the recomputation inside the first task's pass was recorded as new
    # calls, and gramian mode's loop raised a shape mismatch.
    check_parity(make, 1, micro)
    *_, buf = balanced(make, 1, "gramian", "loop", UPGrad(), micro)
    assert set((buf.layer_routes or {}).values()) == {"activations"}


# -- the same in the per-sample route (batch_dim=0) ----------------------------------------


def per_sample_losses(net: Net) -> Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(net.rows, net.width, generator=g, dtype=torch.float64)
    y = torch.randn(net.rows, net.num_tasks, generator=g, dtype=torch.float64)
    f = net.feats(x)
    return torch.stack([(h(f)[:, 0] - y[:, k]) ** 2 for k, h in enumerate(net.heads)], 1)


def test_per_sample_route_takes_a_replaced_output_exactly() -> None:
    """Reference: ``balanced_backward(batch_dim=0)``, autograd's rows (no layer hooks)."""
    net, twin = OutputHooked(2), OutputHooked(2)
    buf = TaskGradBuffer(net.trunk.parameters(), net.heads.parameters(), modules=net.trunk,
                         batch_dim=0)
    buf.backward(per_sample_losses(net))
    buf.apply_(UPGrad())
    balanced_backward(per_sample_losses(twin), UPGrad(), shared_params=twin.trunk.parameters(),
                      head_params=twin.heads.parameters(), modules=twin.trunk, batch_dim=0)
    assert_same(grads(list(net.trunk.parameters())), grads(list(twin.trunk.parameters())),
                rtol=1e-8)


def test_per_sample_route_refuses_a_swapped_weight_before_anything_moves() -> None:
    net = ScaledCall(3)
    buf = TaskGradBuffer(net.trunk.parameters(), net.heads.parameters(), modules=net.trunk,
                         batch_dim=0)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"layer '0' \(Linear\) was called with a weight"):
        buf.backward(per_sample_losses(net))
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in net.parameters()
               if p.grad is not None)


# -- state saved or loaded during a step ---------------------------------------------------


@pytest.mark.parametrize("batch_dim", [None, 0])
def test_load_state_dict_during_a_step_is_refused(batch_dim: int | None) -> None:
    # Before the fix the load was taken mid-step: update_every's reused step applied the old
    # weights to micro-batch 1 and the loaded ones to micro-batch 2.
    net = Net(4)
    buf = TaskGradBuffer(net.trunk.parameters(), net.heads.parameters(), update_every=2,
                         modules=net.trunk, batch_dim=batch_dim)

    def losses(i: int) -> Tensor | list[Tensor]:
        return per_sample_losses(net) if batch_dim == 0 else net.losses(i)

    buf.backward(losses(0))
    buf.apply_(UPGrad())
    saved = buf.state_dict()
    buf.backward(losses(1))
    before = buf.state_dict()
    with pytest.raises(RuntimeError, match="during a step"):
        buf.load_state_dict({**saved, "weights": 3 * saved["weights"]})
    after = buf.state_dict()
    assert after.keys() == before.keys()
    assert torch.equal(after["weights"], before["weights"]) and after["step"] == before["step"]
    buf.reset(keep_weights=True)
    buf.load_state_dict(saved)  # between steps: taken


def test_a_state_saved_during_a_step_is_the_state_before_it() -> None:
    # Before the fix steps_begun counted the step in progress, so a run resumed from it and
    # repeating the step counted it twice.
    net = Net(5)
    buf = TaskGradBuffer(net.trunk.parameters(), net.heads.parameters())
    buf.backward(net.losses(0))
    buf.apply_(Sum())
    between = buf.state_dict()
    buf.backward(net.losses(1))
    assert buf.state_dict()["steps_begun"] == between["steps_begun"] == 1


# -- already right: pinned -----------------------------------------------------------------


class FullBackwardHook(Net):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.trunk[2].register_full_backward_hook(lambda m, gi, go: (0.5 * gi[0],))
        self.trunk[2].register_full_backward_pre_hook(lambda m, go: (3.0 * go[0],))


class TensorHook(Net):
    def feats(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.trunk[0](x))
        mask = (torch.arange(h.shape[-1]) % 3 != 0).to(h.dtype)
        h.register_hook(lambda g: g * mask)
        return torch.tanh(self.trunk[2](h))


class InputPreHook(Net):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.trunk[2].register_forward_pre_hook(lambda m, a: (1.5 * a[0] + 0.1,))


class TiedDepths(Net):
    """The first layer also applied a second time, at another depth."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed, widths=(40, 40, 40))

    def feats(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.trunk[0](x))
        return torch.tanh(self.trunk[2](torch.tanh(self.trunk[0](h))))


class TiedModules(Net):
    """Two layers sharing one weight."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed, widths=(40, 40, 40))
        self.trunk[2].weight = self.trunk[0].weight


class ViewUses(Net):
    """The second weight also read through a slice, ``.t()`` and ``expand``."""

    def feats(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.trunk[0](x))
        w = self.trunk[2].weight
        extra = 0.1 * (h @ w.t()[:, :40]) + w[:3, :2].sum() + 0.01 * w.t().expand(2, 48, 40).mean()
        return torch.tanh(self.trunk[2](h) + extra)


class PartlyNoGrad(Net):
    def feats(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            h0 = self.trunk[0](x)
        return torch.tanh(self.trunk[2](torch.tanh(self.trunk[0](x) + h0)))


class HeadReadsTrunk(Net):
    def losses(self, micro: int) -> list[Tensor]:
        out = super().losses(micro)
        out[0] = out[0] + 0.1 * (self.trunk[2].weight ** 2).sum()
        return out


class TaskWithoutTrunk(Net):
    def losses(self, micro: int) -> list[Tensor]:
        out = super().losses(micro)
        out[1] = (self.heads[1].weight ** 2).sum()
        out[2] = 0.0 * out[2]
        return out


class WeightNormed(Net):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        parametrizations.weight_norm(self.trunk[0])


class OneTask(Net):
    def __init__(self, seed: int) -> None:
        super().__init__(seed, num_tasks=1)


PINNED: dict[str, Make] = {
    "plain": Net, "full_backward_hooks": FullBackwardHook, "tensor_hook": TensorHook,
    "input_pre_hook": InputPreHook, "tied_depths": TiedDepths, "tied_modules": TiedModules,
    "view_uses": ViewUses, "partly_no_grad": PartlyNoGrad, "head_reads_trunk": HeadReadsTrunk,
    "task_without_trunk": TaskWithoutTrunk, "weight_norm": WeightNormed, "one_task": OneTask,
}


@pytest.mark.parametrize("case", list(PINNED))
def test_edge_inputs_give_the_plain_and_matrix_updates(case: str) -> None:
    check_parity(PINNED[case], 6, micro=2)


@pytest.mark.parametrize(("mode", "passes"), ROUTES)
def test_constant_and_mean_weights_and_a_prefilled_grad_are_the_plain_step(mode: str,
                                                                           passes: str) -> None:
    """The trunk gets ``Σₖ cₖ ∂Lₖ``; the heads their plain gradient of ``Σₖ Lₖ``; both add
    into a ``.grad`` the user set before the step, as ``backward`` does."""
    def prefill(net: Net) -> None:
        for p in net.parameters():
            p.grad = torch.full_like(p, 0.25)

    c = [0.5, 2.0, -1.0]
    for balancer, weights in ((Constant(c), c), (Mean(), [1 / 3] * 3)):
        trunk, heads, _ = balanced(Net, 7, mode, passes, balancer, micro=2)
        assert_same(trunk, plain(Net, 7, 2, weights)[0])
        assert_same(heads, plain(Net, 7, 2)[1])
    trunk, heads, _ = balanced(Net, 7, mode, passes, Sum(), micro=2, prepare=prefill)
    for got, ref in zip([*trunk, *heads], [*plain(Net, 7, 2)[0], *plain(Net, 7, 2)[1]],
                        strict=True):
        assert got is not None and ref is not None
        torch.testing.assert_close(got, ref + 0.25, rtol=1e-10, atol=1e-12)


def test_many_tasks_on_a_tiny_trunk_sum_to_the_plain_step() -> None:
    def make(seed: int) -> Net:
        return Net(seed, num_tasks=64, widths=(5, 3, 2), rows=3)

    trunk_ref, heads_ref = plain(make, 8)
    for mode, passes in ROUTES:
        trunk, heads, _ = balanced(make, 8, mode, passes, Sum())
        assert_same(trunk, trunk_ref)
        assert_same(heads, heads_ref)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), depth=st.integers(1, 3), width=st.integers(2, 6),
       rows=st.integers(1, 5), tasks=st.integers(1, 4), micro=st.integers(1, 2),
       tie=st.booleans(), route=st.sampled_from(ROUTES[1:]))
def test_random_small_trunks_agree_with_the_plain_and_matrix_steps(
        seed: int, depth: int, width: int, rows: int, tasks: int, micro: int, tie: bool,
        route: tuple[str, str]) -> None:
    """A trunk of ``depth`` square layers, the first one applied again at the end if ``tie``."""
    class Random(Net):
        def __init__(self, s: int) -> None:
            super().__init__(s, num_tasks=tasks, widths=(width,) * 3, rows=rows)
            self.trunk = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).double()

        def feats(self, x: Tensor) -> Tensor:
            for layer in self.trunk:
                x = torch.tanh(layer(x))
            return torch.tanh(functional.linear(x, self.trunk[0].weight)) if tie else x

    check_parity(Random, seed, micro, routes=[ROUTES[0], route])


class ClampedGradient(Net):
    """A tensor hook not linear in the gradient, on an activation of the trunk."""

    def feats(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.trunk[0](x))
        h.register_hook(lambda g: g.clamp(-0.01, 0.01))
        return torch.tanh(self.trunk[2](h))


@pytest.mark.parametrize("passes", ["loop", "batched"])
def test_a_nonlinear_backward_hook_acts_on_each_tasks_gradient(passes: str) -> None:
    """docs/loop.md, "Inputs plain PyTorch takes": ``Sum`` gives ``Σₖ h(gₖ)``, each task's
    gradient through the hook (reference: one ``autograd.grad`` per task), not the plain
    step's ``h(Σₖ gₖ)``."""
    net = ClampedGradient(9)
    params = list(net.trunk.parameters())
    losses = net.losses(0)
    per_task = [torch.autograd.grad(loss, params, retain_graph=True) for loss in losses]
    expected: list[Tensor | None] = [sum(gs, torch.zeros_like(gs[0])) for gs in zip(*per_task)]
    trunk, _, _ = balanced(ClampedGradient, 9, "matrix", passes, Sum())
    assert_same(trunk, expected)
    plain_trunk, _ = plain(ClampedGradient, 9)
    assert any(not torch.allclose(a, b) for a, b in zip(trunk, plain_trunk)
               if a is not None and b is not None)


class InPlaceHooked(Net):
    """A forward hook, registered before the buffer, that scales the layer's output in place."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.trunk[0].register_forward_hook(lambda m, a, y: y.mul_(2.0))


@pytest.mark.parametrize("passes", ["loop", "batched"])
def test_an_output_scaled_in_place_by_a_forward_hook_is_refused_before_anything_moves(
        passes: str) -> None:
    # Before the fix the recorder's hook ran after it and kept the scaled output as the
    # layer's: 50 % off with Sum, no error.
    net = InPlaceHooked(0)
    buf = TaskGradBuffer(net.trunk.parameters(), net.heads.parameters(), mode="gramian",
                         passes=passes, modules=net.trunk)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="module 0 was modified in place"):
        buf.backward(net.losses(0))
    assert all(p.grad is not None and torch.equal(p.grad, torch.ones_like(p))
               for p in net.parameters())
    check_parity(InPlaceHooked, 0, routes=[("auto", "loop")])  # auto takes matrix's route


def test_per_sample_route_refuses_an_output_scaled_in_place_by_a_forward_hook() -> None:
    # Before the fix the record ran after the hook: a wrong per-sample update, no error.
    net = InPlaceHooked(2)
    buf = TaskGradBuffer(net.trunk.parameters(), net.heads.parameters(), modules=net.trunk,
                         batch_dim=0)
    with pytest.raises(ValueError, match="layer '0' \\(Linear\\) was modified in place"):
        buf.backward(per_sample_losses(net))
    assert all(p.grad is None for p in net.parameters())


class SparseTrunk(nn.Module):
    """A sparse embedding listed after the layer it feeds (its ``.grad`` is written last)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.emb = nn.Embedding(9, 4, sparse=True)


def sparse_losses(trunk: SparseTrunk, heads: nn.ModuleList, seed: int,
                  per_sample: bool) -> Tensor:
    tokens = torch.randint(0, 9, (5,), generator=torch.Generator().manual_seed(seed))
    f = torch.tanh(trunk.lin(trunk.emb(tokens)))
    per = torch.stack([h(f)[:, 0] ** 2 for h in heads], 1)
    return per if per_sample else per.mean(0)


@pytest.mark.parametrize("mode", ["matrix", "gramian", "auto", "per_sample"])
@pytest.mark.parametrize("update_every", [1, 2])
@pytest.mark.parametrize("scaled", [False, True])
def test_a_sparse_grad_left_by_a_plain_backward_is_added_to(mode: str, update_every: int,
                                                            scaled: bool) -> None:
    # Before the fix the write-back raised "add(sparse, dense) is not supported" after the
    # trunk's other .grad were written (a half-written step); plain backward adds the two.
    def build() -> tuple[SparseTrunk, nn.ModuleList]:
        torch.manual_seed(0)
        return SparseTrunk().double(), nn.ModuleList([nn.Linear(3, 1) for _ in range(2)]).double()

    per_sample = mode == "per_sample"
    trunk, heads = build()
    twin, twin_heads = build()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if scaled else None
    assert scaler is None or scaler.is_enabled()
    factor = 4.0 if scaled else 1.0
    options: dict[str, Any] = {"batch_dim": 0} if per_sample else {"mode": mode}
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk,
                         update_every=update_every, **options)
    for step in range(3):
        for t, h in ((trunk, heads), (twin, twin_heads)):  # an auxiliary plain backward
            (factor * sparse_losses(t, h, 10 + step, False).sum()).backward()
        assert trunk.emb.weight.grad is not None and trunk.emb.weight.grad.is_sparse
        buf.backward(sparse_losses(trunk, heads, step, per_sample), scaler=scaler)
        buf.apply_(Sum(), scaler=scaler)
        (factor * sparse_losses(twin, twin_heads, step, per_sample).sum()).backward()
        for p, q in zip([*trunk.parameters(), *heads.parameters()],
                        [*twin.parameters(), *twin_heads.parameters()], strict=True):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad.to_dense(), q.grad.to_dense(), rtol=1e-12,
                                       atol=1e-14)
        for m in (trunk, heads, twin, twin_heads):
            m.zero_grad()


class WeightGradientPenalty(Net):
    """A task whose loss holds the squared gradient of another task's loss with respect to
    the first layer's weight (a double backward: it reads the layers' weights again)."""

    def losses(self, micro: int) -> list[Tensor]:
        out = super().losses(micro)
        (g,) = torch.autograd.grad(out[0], [self.trunk[0].weight], create_graph=True)
        out[2] = out[2] + 0.5 * (g ** 2).sum()
        return out


@pytest.mark.parametrize("micro", [1, 2])
def test_a_gradient_penalty_through_a_double_backward_gets_matrix_modes_update(
        micro: int) -> None:
    # Before the fix the second layer's weight, read again by the double backward through
    # the same transpose node as its forward, counted one use: gramian mode kept it on the
    # activations route, 50-60 % off with Sum.
    check_parity(WeightGradientPenalty, 0, micro)
    *_, buf = balanced(WeightGradientPenalty, 0, "gramian", "loop", UPGrad(), micro)
    assert buf.layer_routes == {"0": "activations", "2": "rows"}


def test_a_backward_that_frees_the_kept_graph_before_apply_is_named() -> None:
    # Before the fix apply_ raised torch's "backward through the graph a second time".
    net = Net(1)
    buf = TaskGradBuffer(net.trunk.parameters(), net.heads.parameters(), mode="gramian",
                         passes="batched", modules=net.trunk)
    x = torch.randn(net.rows, net.width, generator=torch.Generator().manual_seed(3),
                    dtype=torch.float64)
    f = net.feats(x)
    buf.backward([h(f).pow(2).mean() for h in net.heads])
    f.pow(2).mean().backward()  # a trunk-only loss: frees the graph the write-back keeps
    with pytest.raises(RuntimeError, match="freed it; run that backward before"):
        buf.apply_(UPGrad())
    assert all(p.grad is None for p in net.heads.parameters())  # as before the step
    buf.backward(net.losses(1))  # the step was dropped: the next one starts clean
    buf.apply_(UPGrad())
