"""A failed step changes nothing: faults injected at every stage of ``backward()`` and
``apply_()``, in every mode, over micro-batches, with and without a ``GradScaler``.

A failure past the checks drops the step; reference: what was there before the step (every
``.grad``, the state of the balancer, the row clipper, an ``AutoClip`` and a loss weighting),
and a buffer rebuilt from copies taken then, which runs the same clean step that the failed
buffer runs next. A failed check (a frozen parameter, a balancer given by name) leaves even the
step as it was: the call, repeated correctly, finishes the step as if nothing had happened.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gradbalance import (
    BALANCERS,
    AutoClip,
    NonFiniteGradientError,
    StepStats,
    TaskAutoClip,
    TaskGradBuffer,
)
from gradbalance.balancers import Constant, GradVac, SolverError
from gradbalance.modes import _features, _gramian, _local
from gradbalance.modes._engine import WriteBack
from gradbalance.modes._rollback import StateSnapshot
from gradbalance.weighting import WEIGHTINGS
from support.loop_state import assert_same_state

K = 3


class Injected(Exception):
    """The injected fault (not a RuntimeError, which the batched passes' fallback catches)."""


class Fuse:
    """Counts the backward calls of its tripwires that carry a gradient; raises at ``at``."""

    def __init__(self) -> None:
        self.at: int | None = None
        self.calls = 0

    def arm(self, at: int | None) -> None:
        self.at, self.calls = at, 0

    def tick(self, grad: torch.Tensor) -> None:
        if not bool(grad.ne(0).any()):  # zeros sent through another task's head
            return
        n, self.calls = self.calls, self.calls + 1
        if n == self.at:
            raise Injected(f"backward call {n}")


class _Tripwire(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fuse: Fuse) -> torch.Tensor:
        ctx.fuse = fuse
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.fuse.tick(grad)
        return grad, None


class Tripwire(nn.Module):
    def __init__(self, fuse: Fuse) -> None:
        super().__init__()
        self.fuse = fuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Tripwire.apply(x, self.fuse)


class Net(nn.Module):
    """A trunk with a tripwire between its layers; every head's output through another."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk_fuse, self.head_fuse = Fuse(), Fuse()
        self.trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), Tripwire(self.trunk_fuse),
                                   nn.Linear(6, 5), nn.Tanh())
        self.heads = nn.ModuleList(nn.Linear(5, 1) for _ in range(K))
        self.wire = Tripwire(self.head_fuse)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        feats = self.trunk(x)
        return feats, [self.wire(head(feats)).squeeze(-1) for head in self.heads]


class FailingGradVac(GradVac):
    """GradVac that raises a SolverError once its state has moved, when ``fail`` is set."""

    fail = False

    def _compute_weights(self, gramian: torch.Tensor,
                         losses: torch.Tensor | None = None) -> torch.Tensor:
        weights = super()._compute_weights(gramian, losses)
        if self.fail:
            raise SolverError("injected: the solver did not converge")
        return weights


class FailingAutoClip(TaskAutoClip):
    """TaskAutoClip that raises once the norms entered its history, when ``fail`` is set."""

    fail = False

    def coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        coef = super().coefficients(norms)
        if self.fail:
            raise Injected("clipper")
        return coef


#: stage -> the exception it raises: failures past the checks ...
RAISES: dict[str, type[BaseException]] = {
    "heads_pass": Injected, "task_pass": Injected, "trunk": Injected, "clip": Injected,
    "combine": SolverError, "write_back": Injected, "stats": Injected,
    "nonfinite": NonFiniteGradientError,
}
#: ... and failed checks
CHECKS: dict[str, type[BaseException]] = {
    "frozen_backward": ValueError, "frozen_apply": ValueError, "bad_balancer": TypeError,
}
#: stages that a step reusing cached weights reaches (no task passes, no balancer)
REUSED_STAGES = ("heads_pass", "task_pass", "trunk", "write_back", "nonfinite")


def stages(mode: str, reused: bool, scaler: bool) -> list[str]:
    names = list(REUSED_STAGES if reused else RAISES)
    if mode == "features" and "clip" in names:
        names.remove("clip")  # features mode has no rows to clip
    if scaler:
        names.remove("nonfinite")  # with a scaler inf/NaN is a skipped step, not an error
    return names


@dataclass
class Case:
    mode: str
    stage: str
    micro: int
    fail_mb: int
    scaler: bool
    preset: bool
    reused: bool
    index: int  # the task / head index the fault picks


class Run:
    """A model, its step objects and a buffer; one clean step already taken."""

    def __init__(self, case: Case, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.case = case
        self.net = Net().double()
        self.weighting = WEIGHTINGS["uncertainty"](K)
        self.balancer = FailingGradVac(num_tasks=K, beta=0.5)
        self.clip = None if case.mode == "features" else FailingAutoClip(50, history_size=4)
        self.auto = AutoClip(50, history_size=4)
        gen = torch.Generator().manual_seed(seed + 1)
        self.x = torch.randn(6, 4, generator=gen, dtype=torch.float64)
        self.y = torch.randn(6, K, generator=gen, dtype=torch.float64)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if case.scaler else None
        assert self.scaler is None or self.scaler.is_enabled()
        self.buf = self.build_buffer()

    @property
    def shared(self) -> list[torch.Tensor]:
        return list(self.net.trunk.parameters())

    @property
    def heads(self) -> list[torch.Tensor]:
        return [*self.net.heads.parameters(), *self.weighting.parameters()]

    def build_buffer(self) -> TaskGradBuffer:
        kwargs = {"modules": self.net.trunk} if self.case.mode == "gramian" else {}
        return TaskGradBuffer(self.shared, self.heads, mode=self.case.mode,
                              update_every=2 if self.case.reused else 1, **kwargs)

    def step(self, bump: torch.Tensor | None = None, check: str | None = None) -> StepStats:
        """One step; ``check``: make the call it names fail its check once, assert that
        nothing moved, and repeat the call correctly."""
        case = self.case
        micro = 1 if case.mode == "features" and not self.buf._cache.reuse_now() else case.micro
        for m, (xs, ys) in enumerate(zip(self.x.chunk(micro), self.y.chunk(micro))):
            feats, outs = self.net(xs)
            raw = torch.stack([((o - ys[:, k]) ** 2).mean() for k, o in enumerate(outs)])
            raw = raw / micro
            if bump is not None and m == min(case.fail_mb, micro - 1):
                raw = raw * bump
            backward = partial(self.buf.backward, self.weighting(raw), scaler=self.scaler,
                               features=feats if case.mode == "features" else None)
            if check == "frozen_backward" and m == min(case.fail_mb, micro - 1):
                self.fail_check(backward, check)
            backward()
        apply = lambda balancer=self.balancer: self.buf.apply_(  # noqa: E731
            balancer, scaler=self.scaler, clip=self.clip)
        if check == "frozen_apply":
            self.fail_check(apply, check)
        elif check == "bad_balancer":
            self.fail_check(lambda: apply("gradvac"), check)
        return apply()

    def fail_check(self, call: Any, check: str) -> None:
        grads, states = self.grads(), self.states()
        if check.startswith("frozen"):
            self.shared[0].requires_grad_(False)
        with pytest.raises(CHECKS[check]):
            call()
        self.shared[0].requires_grad_(True)
        assert_same_grads(self.grads(), grads)
        assert_same_state(self.states(), states)

    def params(self) -> list[torch.Tensor]:
        return [*self.shared, *self.heads]

    def grads(self) -> list[torch.Tensor | None]:
        return [None if p.grad is None else p.grad.detach().clone() for p in self.params()]

    def states(self) -> dict[str, Any]:
        return copy.deepcopy({
            "balancer": self.balancer.state_dict(),
            "clip": None if self.clip is None else self.clip.state_dict(),
            "auto": self.auto.state_dict(),
            "weighting": self.weighting.state_dict(),
            # ``steps_begun`` counts a failed step too (the ranks compare it): left out
            "buffer": {k: v for k, v in self.buf.state_dict().items() if k != "steps_begun"},
            "rng": torch.get_rng_state(),
            "scale": None if self.scaler is None else self.scaler.get_scale(),
        })

    def copy(self) -> Run:
        """Copies of everything, with a buffer rebuilt from this one's state."""
        other = copy.copy(self)
        other.net, other.weighting = copy.deepcopy((self.net, self.weighting))
        for a, b in zip(self.params(), other.params()):
            b.grad = None if a.grad is None else a.grad.detach().clone()
        other.balancer, other.clip, other.auto, other.scaler = copy.deepcopy(
            (self.balancer, self.clip, self.auto, self.scaler))
        other.buf = other.build_buffer()
        other.buf.load_state_dict(copy.deepcopy(self.buf.state_dict()))
        return other


def assert_same_grads(actual: list[torch.Tensor | None],
                      expected: list[torch.Tensor | None]) -> None:
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert (a is None) == (e is None), f"parameter {i}: .grad {a} != {e}"
        if a is not None:
            assert e is not None and torch.equal(a, e), f"parameter {i}: .grad moved"


@contextmanager
def inject(run: Run, stage: str) -> Iterator[dict[str, Any]]:
    """Arm the fault of ``stage``; yields the keyword arguments of the failing step."""
    case, net = run.case, run.net
    per_micro = 2 * K  # the heads' pass crosses every head, then each task's pass its own
    kwargs: dict[str, Any] = {}
    patches = []
    if stage == "heads_pass":
        net.head_fuse.arm(case.fail_mb * per_micro + case.index)
    elif stage == "task_pass":  # task k > 0 (a reused step: its one weighted pass)
        net.head_fuse.arm(case.fail_mb * per_micro + K + max(case.index, 1))
    elif stage == "trunk":  # the trunk's passes (features mode: its backward in apply_)
        if case.mode == "features" and not case.reused:
            net.trunk_fuse.arm(0)
        elif case.reused:
            net.trunk_fuse.arm(case.fail_mb)
        else:
            net.trunk_fuse.arm(case.fail_mb * K + max(case.index, 1))
    elif stage == "clip":
        assert run.clip is not None
        run.clip.fail = True
    elif stage == "combine":
        run.balancer.fail = True
    elif stage == "write_back":
        patches.append(mock.patch.object(WriteBack, "bound", side_effect=Injected("bound")))
    elif stage == "stats":
        # matrix mode's statistics come from its columns (modes/_layout.py)
        module = {"matrix": _local, "gramian": _gramian, "features": _features}[case.mode]
        patches.append(mock.patch.object(module, "build_stats", side_effect=Injected("stats")))
    elif stage == "nonfinite":
        kwargs["bump"] = torch.tensor([1.0, float("inf"), 1.0], dtype=torch.float64)
    for patch in patches:
        patch.start()
    try:
        yield kwargs
    finally:
        for patch in patches:
            patch.stop()
        net.head_fuse.arm(None)
        net.trunk_fuse.arm(None)
        run.balancer.fail = False
        if run.clip is not None:
            run.clip.fail = False


def prepared(case: Case) -> tuple[Run, Run]:
    """A run after one clean step, with preset (or no) ``.grad``, and its copy."""
    run = Run(case)
    run.step()  # a clean step first: GradVac's targets, the histories, the cached weights
    run.auto(run.net.parameters())
    for p in run.params():
        p.grad = torch.randn_like(p) if case.preset else None
    return run, run.copy()


def check_failed_step_changes_nothing(case: Case) -> None:
    if case.stage in CHECKS:
        check_failed_check_keeps_the_step(case)
        return
    run, reference = prepared(case)
    grads, states = run.grads(), run.states()
    with inject(run, case.stage) as kwargs, pytest.raises(RAISES[case.stage]):
        run.step(**kwargs)

    assert_same_grads(run.grads(), grads)
    assert_same_state(run.states(), states)
    # the buffer runs the next step as a buffer that never saw the failure
    stats = run.step()
    expected = reference.step()
    assert stats.found_inf == expected.found_inf and stats.weights_reused == case.reused
    assert_same_grads(run.grads(), reference.grads())
    assert_same_state(run.states(), reference.states())


def check_failed_check_keeps_the_step(case: Case) -> None:
    run, reference = prepared(case)
    stats = run.step(check=case.stage)  # asserts that the failed call moved nothing
    expected = reference.step()
    assert stats.found_inf == expected.found_inf and stats.weights_reused == case.reused
    assert_same_grads(run.grads(), reference.grads())
    assert_same_state(run.states(), reference.states())


GRID = [
    Case(mode, stage, micro=1 if mode == "features" and not reused else 2, fail_mb=1 if (
        mode != "features" or reused) else 0, scaler=scaler, preset=True, reused=reused,
        index=1)
    for mode in ("matrix", "gramian", "features")
    for reused in (False, True)
    for scaler in (False, True)
    for stage in [*stages(mode, reused, scaler), *CHECKS]
]


@pytest.mark.parametrize(
    "case", GRID,
    ids=[f"{c.mode}-{'reused-' if c.reused else ''}{c.stage}-{'amp' if c.scaler else 'fp'}"
         for c in GRID])
def test_failure_at_every_stage_changes_nothing(case: Case) -> None:
    check_failed_step_changes_nothing(case)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    mode = draw(st.sampled_from(["matrix", "gramian", "features"]))
    reused = draw(st.booleans())
    scaler = draw(st.booleans())
    stage = draw(st.sampled_from([*stages(mode, reused, scaler), *CHECKS]))
    micro = 1 if mode == "features" and not reused else draw(st.integers(1, 3))
    return Case(mode, stage, micro, fail_mb=draw(st.integers(0, micro - 1)), scaler=scaler,
                preset=draw(st.booleans()), reused=reused, index=draw(st.integers(0, K - 1)))


@settings(max_examples=30, deadline=None)
@given(case=cases())
def test_failure_anywhere_changes_nothing(case: Case) -> None:
    check_failed_step_changes_nothing(case)


def test_injected_faults_would_move_state() -> None:
    # Sensitivity: each fault fires after the state it threatens has moved.
    run = Run(Case("matrix", "combine", 1, 0, False, False, False, 0))
    run.step()
    before = run.states()
    run.balancer.combine(torch.randn(K, 7, dtype=torch.float64))
    assert not torch.equal(run.balancer.state_dict()["targets"], before["balancer"]["targets"])
    assert run.clip is not None
    run.clip.coefficients(torch.ones(K))
    assert run.clip.state_dict()["count"] == before["clip"]["count"] + 1


@pytest.mark.parametrize("name", sorted(BALANCERS))
def test_state_snapshot_restores_every_balancer(name: str) -> None:
    # The step saves a balancer's attributes by reference: it holds only if no balancer
    # writes into its state tensors in place.
    torch.manual_seed(0)
    balancer = Constant([1.0, 2.0, 0.5]) if name == "constant" else BALANCERS[name](num_tasks=K)
    losses = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    for _ in range(2):
        balancer.combine(torch.randn(K, 6, dtype=torch.float64), losses)
    before = copy.deepcopy(balancer.state_dict())
    rng = torch.get_rng_state()
    saved = StateSnapshot(balancer)
    for _ in range(2):
        balancer.combine(torch.randn(K, 6, dtype=torch.float64), losses)
    saved.restore()
    assert_same_state(balancer.state_dict(), before)
    assert torch.equal(torch.get_rng_state(), rng)
