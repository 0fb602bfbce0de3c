"""An ``accelerate`` loop with ``BalancedAcceleratorStep`` trains like the plain gradbalance
loop, resumes from ``save_state``/``load_state`` bit for bit, and runs on two processes (DDP
over gloo, started by ``torchrun``) like one process on the global batch.

Run as a script (``torchrun --nproc_per_node 2 test_accelerate.py OUT``), it is the worker of
the two-process test.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("accelerate")

from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from gradbalance import TaskAutoClip, TaskGradBuffer
from gradbalance.balancers import DBMTL, GradVac, PCGrad
from gradbalance.integrations.accelerate import BalancedAcceleratorStep
from gradbalance.weighting import GradNorm
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

pytestmark = pytest.mark.filterwarnings("ignore")

K, N, BATCH, ACCUMULATE, MAX_NORM = 3, 32, 4, 2, 1.0


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """accelerate keeps process-wide singletons; every test starts from none."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, 8, generator=gen)
    y = torch.randn(N, K, generator=gen) * torch.tensor([1.0, 3.0, 0.3])
    return TensorDataset(x, y)


def _build(method: str, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, K))
    gen = torch.Generator().manual_seed(seed)
    if method == "gradvac":
        parts: dict[str, Any] = {"balancer": GradVac(K, beta=0.5, generator=gen),
                                 "clip": TaskAutoClip(percentile=50, history_size=4)}
    elif method == "dbmtl":  # a [K, P] state: each rank's columns on a sharded trunk
        parts = {"balancer": DBMTL(K, beta=0.5),
                 "clip": TaskAutoClip(percentile=50, history_size=4)}
    else:
        parts = {"balancer": PCGrad(K, generator=gen),
                 "weighting": GradNorm(K, model.trunk, alpha=1.5, lr=0.05)}
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return {"model": model, "optimizer": opt, **parts}


def _accelerated(o: dict[str, Any], epochs: int, load: str | None = None,
                 save: str | None = None, fsdp_plugin: Any = None
                 ) -> tuple[Accelerator, BalancedAcceleratorStep, list[Any]]:
    """The documented loop; ``load``: ``load_state`` before the first epoch; ``save``:
    ``save_state`` after the first epoch."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE,
                              fsdp_plugin=fsdp_plugin)
    raw = o["model"]
    model, opt, loader = accelerator.prepare(
        raw, o["optimizer"], DataLoader(_data(), batch_size=BATCH, shuffle=False))
    step = BalancedAcceleratorStep(accelerator, o["balancer"], raw.shared_parameters(),
                                   raw.head_parameters(), weighting=o.get("weighting"),
                                   clip=o.get("clip"))
    accelerator.register_for_checkpointing(step)
    if load is not None:
        accelerator.load_state(load)
    seen = []
    for epoch in range(epochs):
        for x, y in loader:
            seen.append((x, y))
            with step.accumulate(model):
                stats = step.backward(regression_losses(model(x), y))
                if stats is not None:
                    accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                opt.step()
                opt.zero_grad()
        if save is not None and epoch == 0:
            accelerator.save_state(save)
    return accelerator, step, seen


def _plain(o: dict[str, Any], batches: list[Any]) -> None:
    """The plain gradbalance loop on the given micro-batches."""
    model, opt, weighting = o["model"], o["optimizer"], o.get("weighting")
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    for start in range(0, len(batches), ACCUMULATE):
        for x, y in batches[start:start + ACCUMULATE]:
            losses = regression_losses(model(x), y)
            if weighting is not None:  # one of the step's micro-batches: its share
                buf.backward(weighting(losses, micro_batches=ACCUMULATE))
            else:
                buf.backward(losses / ACCUMULATE)
        stats = buf.apply_(o["balancer"], clip=o.get("clip"))
        if weighting is not None:
            weighting.update(found_inf=stats.found_inf)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _params(o: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in o["model"].named_parameters()}


@pytest.mark.parametrize("method", ["gradvac", "gradnorm"])
def test_helper_matches_the_plain_loop(method: str) -> None:
    run = _build(method)
    _, step, seen = _accelerated(run, epochs=1)
    assert step.last_stats is not None and step.last_stats.num_backward == ACCUMULATE
    plain = _build(method)
    _plain(plain, seen)
    start = _params(_build(method))
    for name, p in _params(plain).items():
        assert not torch.equal(p, start[name]), name
        assert torch.equal(_params(run)[name], p), name  # bit for bit


def test_save_state_and_load_state_resume_bit_identically(tmp_path: Path) -> None:
    from support.loop_state import assert_same_state

    straight = _build("gradnorm")
    _, straight_step, _ = _accelerated(straight, epochs=2, save=str(tmp_path / "state"))

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    resumed = _build("gradnorm", seed=99)  # other weights, other generator
    _, resumed_step, _ = _accelerated(resumed, epochs=1, load=str(tmp_path / "state"))
    assert_same_state(resumed_step.state_dict(), straight_step.state_dict())
    for name, p in _params(straight).items():
        assert torch.equal(_params(resumed)[name], p), name


def _worker(out: str) -> None:
    """One rank: the documented loop on its shard; saves what it saw and ended with."""
    run = _build("gradnorm")
    accelerator, step, seen = _accelerated(run, epochs=1)
    torch.save({"seen": seen, "params": _params(run), "state": step.state_dict(),
                "distributed": str(accelerator.distributed_type)},
               Path(out) / f"rank{accelerator.process_index}.pt")


def test_two_processes_match_one_on_the_global_batch(tmp_path: Path) -> None:
    from support.ddp import torchrun_two
    from support.loop_state import assert_same_state

    ranks = torchrun_two(__file__, tmp_path)
    assert ranks[0]["distributed"] == "DistributedType.MULTI_CPU"
    assert_same_state(ranks[1]["params"], ranks[0]["params"])  # the ranks agree bit for bit
    assert_same_state(ranks[1]["state"], ranks[0]["state"])
    batches = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]))
               for a, b in zip(ranks[0]["seen"], ranks[1]["seen"])]
    assert len(batches) == N // (2 * BATCH)  # the ranks split the data
    plain = _build("gradnorm")
    _plain(plain, batches)
    for name, p in _params(plain).items():
        torch.testing.assert_close(ranks[0]["params"][name], p, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    _worker(sys.argv[1])


def test_drop_step_after_a_failed_micro_batch_lets_the_run_go_on(tmp_path: Path) -> None:
    """A micro-batch that failed (an out-of-memory forward) left the buffer in its step, and
    ``accelerator.load_state`` then raised: ``drop_step()`` drops it, the checkpoint loads,
    and the retried run equals one that never failed."""
    from gradbalance.weighting import DWA

    def run(fail: bool) -> dict[str, torch.Tensor]:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        torch.manual_seed(0)
        model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, K))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE, cpu=True)
        net, opt, loader = accelerator.prepare(
            model, opt, DataLoader(_data(), batch_size=BATCH, shuffle=False))
        step = BalancedAcceleratorStep(accelerator, PCGrad(K, generator=torch.Generator()
                                                           .manual_seed(0)),
                                       model.shared_parameters(), model.head_parameters(),
                                       weighting=DWA(K))
        accelerator.register_for_checkpointing(step)
        accelerator.save_state(str(tmp_path / ("fail" if fail else "clean")))
        if fail:
            try:
                for b, (x, y) in enumerate(loader):
                    with step.accumulate(net):
                        if b == 3:
                            raise RuntimeError("injected")
                        step.backward(regression_losses(net(x), y))
                        opt.step()
                        opt.zero_grad()
            except RuntimeError:
                step.drop_step()
            accelerator.load_state(str(tmp_path / "fail"))
        for x, y in loader:
            with step.accumulate(net):
                step.backward(regression_losses(net(x), y))
                opt.step()
                opt.zero_grad()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    clean, retried = run(False), run(True)
    for name, p in clean.items():
        assert torch.equal(retried[name], p), name


def test_buffer_kwargs_are_checked_when_the_step_is_built() -> None:
    # the buffer is built at the first backward: a wrong keyword named now, not mid-training
    model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, K))
    accelerator = Accelerator(cpu=True)
    for kwargs, error, match in (
            ({"task_names": ["a", "b"]}, TypeError, r"Invalid buffer_kwargs: 'task_names'"),
            ({"num_tasks": K}, TypeError, r"'num_tasks'.*the balancer's"),
            ({"mode": "gramain"}, ValueError, r"mode='gramain'"),
            ({"mode": "gramian"}, ValueError, r"mode='gramian' needs modules"),
            ({"batch_dim": 0, "modules": model.trunk}, ValueError,
             r"batch_dim=0: the per-sample route")):
        with pytest.raises(error, match=match):
            BalancedAcceleratorStep(accelerator, PCGrad(), model.shared_parameters(),
                                    model.head_parameters(), **kwargs)
    built = BalancedAcceleratorStep(accelerator, PCGrad(), model.shared_parameters(),
                                    model.head_parameters(), mode="gramian",
                                    modules=model.trunk)
    assert built.buffer.mode == "gramian"
