"""``BalancedAcceleratorStep`` and Accelerate's FSDP2 plugin.

accelerate 1.15 turns its FSDP plugin on only for accelerator devices (``state.py``: the
``DistributedType.FSDP`` branch is taken for ``MULTI_GPU``, ``MULTI_NPU``, ... never for
``MULTI_CPU``), so on two gloo CPU processes an ``FullyShardedDataParallelPlugin(fsdp_version=2)``
leaves the run data-parallel. What runs is tested: under that plugin on 2 CPU processes the
helper still equals one process on the global batch, and an accelerator that does shard (FSDP,
DeepSpeed) is refused with the reason and the fix.

Run as a script (``torchrun --nproc_per_node 2 test_accelerate_fsdp2.py OUT``), it is the
worker of the two-process test.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("accelerate")

from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from gradbalance.balancers import UPGrad
from gradbalance.integrations.accelerate import BalancedAcceleratorStep

pytestmark = pytest.mark.filterwarnings("ignore")


def _loop() -> ModuleType:
    """``test_accelerate`` (the documented loop, its model, data and plain reference)."""
    from support.sibling import load_sibling

    return load_sibling(__file__, "test_accelerate")


# accelerate keeps process-wide singletons; every test starts from none (autouse)
_fresh_accelerate_state = _loop()._fresh_accelerate_state


@pytest.mark.parametrize(("kind", "reason"), [(DistributedType.FSDP, "fully_shard"),
                                              (DistributedType.DEEPSPEED, "ZeRO")])
def test_a_sharding_accelerator_is_refused_with_the_reason_and_the_fix(
        kind: DistributedType, reason: str) -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    accelerator = SimpleNamespace(sync_gradients=True, distributed_type=kind,
                                  gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match=f"distributed_type={kind.value}") as err:
        BalancedAcceleratorStep(accelerator, UPGrad(2), [w])
    assert reason in str(err.value) and "Sharded trunks (FSDP2)" in str(err.value)
    assert w.grad is None


def test_a_data_parallel_accelerator_is_accepted() -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    accelerator = SimpleNamespace(sync_gradients=True, distributed_type=DistributedType.MULTI_CPU,
                                  gradient_accumulation_steps=1)
    step = BalancedAcceleratorStep(accelerator, UPGrad(2), [w])
    step.backward([w @ torch.tensor([1.0, 0.0]), w @ torch.tensor([-1.0, 1.0])])
    assert torch.equal(w.grad, torch.tensor([0.25, 0.75]))  # UPGrad's example, by hand


def _worker(out: str) -> None:
    """One rank: the documented loop under the FSDP2 plugin; saves what it saw and ended
    with, and the distributed type accelerate chose."""
    from gradbalance_lab.models import regression_losses

    loop = _loop()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin,
                              gradient_accumulation_steps=loop.ACCUMULATE)
    run = loop._build("gradnorm")
    raw = run["model"]
    model, opt, loader = accelerator.prepare(
        raw, run["optimizer"], DataLoader(loop._data(), batch_size=loop.BATCH, shuffle=False))
    step = BalancedAcceleratorStep(accelerator, run["balancer"], raw.shared_parameters(),
                                   raw.head_parameters(), weighting=run["weighting"])
    seen = []
    for x, y in loader:
        seen.append((x, y))
        with step.accumulate(model):
            if step.backward(regression_losses(model(x), y)) is not None:
                accelerator.clip_grad_norm_(model.parameters(), loop.MAX_NORM)
            opt.step()
            opt.zero_grad()
    torch.save({"seen": seen, "params": loop._params(run), "state": step.state_dict(),
                "distributed": str(accelerator.distributed_type)},
               Path(out) / f"rank{accelerator.process_index}.pt")


def test_under_the_fsdp2_plugin_two_cpu_processes_match_one(tmp_path: Path) -> None:
    from support.ddp import torchrun_two
    from support.loop_state import assert_same_state

    loop = _loop()
    ranks = torchrun_two(__file__, tmp_path)
    assert ranks[0]["distributed"] == "DistributedType.MULTI_CPU"  # the plugin is not applied
    assert_same_state(ranks[1]["params"], ranks[0]["params"])
    assert_same_state(ranks[1]["state"], ranks[0]["state"])
    batches = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]))
               for a, b in zip(ranks[0]["seen"], ranks[1]["seen"])]
    assert len(batches) == loop.N // (2 * loop.BATCH)
    plain = loop._build("gradnorm")
    loop._plain(plain, batches)
    start = loop._params(loop._build("gradnorm"))
    for name, p in loop._params(plain).items():
        assert not torch.equal(p, start[name]), name
        torch.testing.assert_close(ranks[0]["params"][name], p, rtol=1e-6, atol=1e-7)


if __name__ == "__main__":
    _worker(sys.argv[1])
