"""Silent misuse becomes a clear error, or the behaviour of ``sum(losses).backward()``.

Unreached parameters keep ``.grad = None`` (reference: the plain backward on a copy of the
model); non-leaf tensors, frozen or moved parameters, foreign ``features``, a balancer given by
name and an invalid ``num_tasks`` raise, naming the argument, the value and the fix, before
anything the user owns has moved.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gradbalance import AGC, AutoClip, TaskGradBuffer, balanced_backward, get_balancer
from gradbalance.balancers import MGDA, Sum
from gradbalance.clip import PerSampleClip, adaptive_clip_grad_, per_sample_grad_norms
from gradbalance.weighting import WEIGHTINGS

K = 3


class Net(nn.Module):
    """A trunk with a layer some micro-batches use and one none does; an extra head read by
    task 0 in those micro-batches, and a head no task reads."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(4, 5)
        self.sometimes = nn.Linear(4, 5)
        self.never = nn.Linear(4, 5)
        self.heads = nn.ModuleList(nn.Linear(5, 1) for _ in range(K))
        self.extra_head = nn.Linear(5, 1)
        self.unused_head = nn.Linear(5, 1)

    @property
    def trunk(self) -> list[nn.Module]:
        return [self.main, self.sometimes, self.never]

    def shared(self) -> list[torch.Tensor]:
        return [p for m in self.trunk for p in m.parameters()]

    def head_params(self) -> list[torch.Tensor]:
        return [*self.heads.parameters(), *self.extra_head.parameters(),
                *self.unused_head.parameters()]

    def losses(self, x: torch.Tensor, y: torch.Tensor,
               use: bool) -> tuple[torch.Tensor, torch.Tensor]:
        feats = torch.tanh(self.main(x) + (self.sometimes(x) if use else 0))
        losses = [((h(feats).squeeze(-1) - y[:, k]) ** 2).mean() for k, h in
                  enumerate(self.heads)]
        if use:
            losses[0] = losses[0] + self.extra_head(feats).pow(2).mean()
        return feats, torch.stack(losses)


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and
                                             torch.equal(x, y)) for x, y in zip(a, b))


def check_unreached(mode: str, uses: list[bool], preset_never: bool, reused: bool) -> None:
    torch.manual_seed(0)
    net = Net().double()
    x = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randn(6, K, dtype=torch.float64)
    if preset_never:  # an existing .grad of an unreached parameter is left as it is
        for p in net.never.parameters():
            p.grad = torch.full_like(p, 3.0)
    buf = TaskGradBuffer(net.shared(), net.head_params(), mode=mode,
                         update_every=2 if reused else 1,
                         **({"modules": net.trunk} if mode == "gramian" else {}))
    if reused:  # a refresh step first (Sum: weights 1), then the reused step under test
        feats, losses = net.losses(x, y, True)
        buf.backward(losses, features=feats if mode == "features" else None)
        buf.apply_(Sum())
        net.zero_grad(set_to_none=True)
        if preset_never:
            for p in net.never.parameters():
                p.grad = torch.full_like(p, 3.0)
    reference = copy.deepcopy(net)
    for p, q in zip(net.parameters(), reference.parameters()):
        q.grad = None if p.grad is None else p.grad.clone()
    micro = len(uses)
    for use, xs, ys in zip(uses, x.chunk(micro), y.chunk(micro)):
        feats, losses = net.losses(xs, ys, use)
        buf.backward(losses / micro, features=feats if mode == "features" else None)
        _, ref_losses = reference.losses(xs, ys, use)
        (ref_losses / micro).sum().backward()
    buf.apply_(Sum())
    for name, got, exp in zip([n for n, _ in net.named_parameters()], _grads(
            list(net.parameters())), _grads(list(reference.parameters()))):
        assert (got is None) == (exp is None), f"{name}: .grad {got} but plain backward {exp}"
        if got is not None:
            torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("mode", ["matrix", "gramian", "features"])
@pytest.mark.parametrize("reused", [False, True])
def test_unreached_parameters_keep_no_grad(mode: str, reused: bool) -> None:
    uses = [True] if mode == "features" and not reused else [False, True]
    check_unreached(mode, uses, preset_never=False, reused=reused)


@settings(max_examples=30, deadline=None)
@given(mode=st.sampled_from(["matrix", "gramian", "features"]),
       uses=st.lists(st.booleans(), min_size=1, max_size=3), preset=st.booleans(),
       reused=st.booleans())
def test_parameters_reached_by_some_micro_batches_behave_as_plain_backward(
        mode: str, uses: list[bool], preset: bool, reused: bool) -> None:
    if mode == "features" and not reused:
        uses = uses[:1]  # one backward per step
    check_unreached(mode, uses, preset, reused)


# -- non-leaf tensors ------------------------------------------------------------------------

def _w() -> torch.Tensor:
    return torch.ones(2, requires_grad=True)


def test_non_leaf_parameters_are_refused_at_construction() -> None:
    w, h = _w(), _w()
    with pytest.raises(ValueError, match=r"shared_params\[1\] \(shape \(2,\)\) is not a leaf"):
        TaskGradBuffer([w, w * 2])
    with pytest.raises(ValueError, match=r"head_params\[0\].*not a leaf.*parameters themselves"):
        TaskGradBuffer([w], [h.double()])
    with pytest.raises(ValueError, match=r"shared_params\[0\].*not a leaf"):
        balanced_backward([(w * 2).sum()], Sum(), shared_params=[w[:1]])


def test_non_leaf_parameters_are_refused_by_clippers() -> None:
    w = _w()
    (w * 3).sum().backward()
    for clip in (AutoClip(), AGC(), adaptive_clip_grad_):
        with pytest.raises(ValueError, match=r"parameters\[1\].*not a leaf.*no \.grad to clip"):
            clip([w, w * 2])
    with pytest.raises(ValueError, match=r"exclude\[0\].*not a leaf"):
        AGC(exclude=[w * 2])
    per_sample = (w * torch.ones(3, 2)).sum(dim=1, keepdim=True)  # [B, K]
    with pytest.raises(ValueError, match=r"params\[0\].*not a leaf"):
        per_sample_grad_norms(per_sample, [w * 2])
    with pytest.raises(ValueError, match=r"params\[0\].*not a leaf"):
        PerSampleClip(max_norm=1.0)(per_sample, [w * 2])


# -- features= that the trunk does not produce -------------------------------------------------

def _features_buffer() -> tuple[Net, TaskGradBuffer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = Net()
    buf = TaskGradBuffer(list(net.main.parameters()), list(net.heads.parameters()),
                         mode="features")
    return net, buf, torch.randn(6, 4), torch.randn(6, K)


def _head_losses(net: Net, feats: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.stack([((h(feats).squeeze(-1) - y[:, k]) ** 2).mean()
                        for k, h in enumerate(net.heads)])


@pytest.mark.parametrize("kind", ["input", "other_module", "detached"])
def test_features_not_made_by_the_trunk_are_refused(kind: str) -> None:
    net, buf, x, y = _features_buffer()
    if kind == "input":  # an input that requires grad, as the features
        feats = torch.randn(6, 5, requires_grad=True)
        match = r"features \(shape \(6, 5\)\) is not computed from shared_params"
    elif kind == "other_module":
        feats = torch.tanh(net.sometimes(x))
        match = "not computed from shared_params"
    else:
        feats = torch.tanh(net.main(x)).detach().requires_grad_(False)
        match = "does not require grad"
    losses = _head_losses(net, feats, y)
    if not losses.requires_grad:  # detached features and heads: the heads still give grad
        losses = losses + 0 * sum(p.sum() for p in net.heads.parameters())
    with pytest.raises(ValueError, match=match):
        buf.backward(losses, features=feats)
    assert all(p.grad is None for p in net.parameters())


def test_features_the_losses_do_not_read_are_refused_and_nothing_moves() -> None:
    net, buf, x, y = _features_buffer()
    feats = torch.tanh(net.main(x))
    other = torch.tanh(net.main(x))  # a second forward: the heads read this one
    with pytest.raises(ValueError, match="no task loss depends on features"):
        buf.backward(_head_losses(net, other, y), features=feats)
    assert all(p.grad is None for p in net.parameters())  # the heads' pass was undone


# -- the balancer and the clipper of apply_ ------------------------------------------------------

@pytest.mark.parametrize(("value", "match"), [
    ("mgda", r"Invalid balancer: 'mgda', a str.*get_balancer\('mgda', num_tasks=K\)"),
    (MGDA, r"Invalid balancer: the class MGDA.*balancer = MGDA\(\)"),
    (None, r"Invalid balancer: NoneType None \(expected a Balancer object"),
    (lambda g: g.sum(0), r"Invalid balancer: function .*expected a Balancer object"),
])
def test_apply_refuses_anything_but_a_balancer(value: object, match: str) -> None:
    net, x, y = Net(), torch.randn(6, 4), torch.randn(6, K)
    buf = TaskGradBuffer(net.shared(), net.head_params())
    _, losses = net.losses(x, y, True)
    buf.backward(losses)
    grads = _grads(list(net.parameters()))
    with pytest.raises(TypeError, match=match):
        buf.apply_(value)  # type: ignore[arg-type]
    # a failed check moves nothing and keeps the step: the corrected call finishes it
    assert _same(_grads(list(net.parameters())), grads)
    assert not buf.apply_(get_balancer("mgda", num_tasks=K)).found_inf
    assert all(p.grad is not None for p in net.main.parameters())


def test_balanced_backward_refuses_a_balancer_name() -> None:
    w = _w()
    with pytest.raises(TypeError, match=r"Invalid balancer: 'sum', a str"):
        balanced_backward([w.sum()], "sum", shared_params=[w])  # type: ignore[arg-type]
    assert w.grad is None


@pytest.mark.parametrize(("clip", "match"), [
    (AutoClip(), r"Invalid clip: AutoClip, a clipper of the parameters.*TaskAutoClip\(\)"),
    (AGC(), r"Invalid clip: AGC, a clipper of the parameters.*TaskClip\(max_norm=...\)"),
    (1.0, r"Invalid clip: float 1.0 \(expected None or a row clipper"),
])
def test_apply_refuses_a_clip_that_is_not_a_row_clipper(clip: object, match: str) -> None:
    w = _w()
    buf = TaskGradBuffer([w])
    buf.backward([w.sum(), (2 * w).sum()])
    with pytest.raises(TypeError, match=match):
        buf.apply_(Sum(), clip=clip)  # type: ignore[arg-type]
    assert w.grad is None


# -- num_tasks ---------------------------------------------------------------------------------

BAD_NUM_TASKS = [0, -1, 2.0, True]


@pytest.mark.parametrize("value", BAD_NUM_TASKS)
def test_buffer_refuses_invalid_num_tasks(value: object) -> None:
    with pytest.raises(ValueError, match=rf"Invalid num_tasks: {value!r} \(expected a positive"):
        TaskGradBuffer([_w()], num_tasks=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", BAD_NUM_TASKS)
@pytest.mark.parametrize("name", sorted(WEIGHTINGS))
def test_weightings_refuse_invalid_num_tasks(name: str, value: object) -> None:
    args = (nn.Linear(2, 2),) if name == "gradnorm" else ()
    with pytest.raises(ValueError, match=rf"Invalid num_tasks: {value!r}"):
        WEIGHTINGS[name](value, *args)  # type: ignore[arg-type]


# -- parameters changed after the buffer was built -------------------------------------------

def _step_objects() -> tuple[Net, TaskGradBuffer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = Net()
    buf = TaskGradBuffer(list(net.main.parameters()), list(net.heads.parameters()))
    return net, buf, torch.randn(6, 4), torch.randn(6, K)


def test_frozen_parameter_raises_before_the_heads_move() -> None:
    net, buf, x, y = _step_objects()
    net.main.bias.requires_grad_(False)
    _, losses = net.losses(x, y, False)
    with pytest.raises(ValueError, match=r"shared_params\[1\] \(shape \(5,\)\) no longer "
                                         r"requires grad.*build a new buffer"):
        buf.backward(losses)
    assert all(p.grad is None for p in net.parameters())


def test_frozen_between_backward_and_apply_raises_before_anything_moves() -> None:
    net, buf, x, y = _step_objects()
    _, losses = net.losses(x, y, False)
    buf.backward(losses)
    grads = _grads(list(net.parameters()))
    assert net.heads[0].weight.grad is not None
    net.heads[1].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"head_params\[2\].*no longer requires grad"):
        buf.apply_(Sum())
    assert _same(_grads(list(net.parameters())), grads)  # no .grad for the frozen trunk
    net.heads[1].weight.requires_grad_(True)  # undone: the step is still there
    buf.apply_(Sum())
    assert all(p.grad is not None for p in net.main.parameters())


def test_resized_or_cast_parameter_raises() -> None:
    net, buf, x, y = _step_objects()
    net.double()
    _, losses = net.losses(x.double(), y.double(), False)
    with pytest.raises(ValueError, match=r"shared_params\[0\] changed from shape \(5, 4\), "
                                         r"torch.float32 on cpu to shape \(5, 4\), torch.float64"):
        buf.backward(losses)
    net, buf, x, y = _step_objects()
    with torch.no_grad():
        net.main.bias.data = torch.zeros(6)
    with pytest.raises(ValueError, match=r"shared_params\[1\] changed from shape \(5,\)"):
        buf.backward(torch.stack([net.main.bias.sum(), net.main.weight.sum()]))
