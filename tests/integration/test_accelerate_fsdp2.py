"""``BalancedAcceleratorStep`` under Accelerate's FSDP2 plugin.

accelerate 1.15 turns its FSDP plugin on only for accelerator devices (``accelerate/state.py``:
the ``DistributedType.FSDP`` branch is taken for ``MULTI_GPU``, ``MULTI_NPU``, ... never for
``MULTI_CPU``). The workers patch that one check (``support/fsdp_on_cpu.py``: what enables the
accelerator path on CPU), so ``prepare`` runs accelerate's ``fsdp2_prepare_model``
(``fully_shard`` over two gloo processes), its FSDP2 ``no_sync``, clipping and sharded
``save_state``/``load_state``, as on GPUs. The documented loop then equals one process on the
global batch, and resumes bit-identically from ``save_state`` with each rank's balancer state
(DB-MTL's ``[K, P]`` EMA: that rank's columns). FSDP1, DeepSpeed and parameters read before
``prepare`` are refused with the reason and the fix.

Run as a script (``torchrun --nproc_per_node 2 test_accelerate_fsdp2.py OUT``), it is the
worker of the two-process tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate.utils import DistributedType

from gradbalance.balancers import UPGrad
from gradbalance.integrations.accelerate import BalancedAcceleratorStep

pytestmark = pytest.mark.filterwarnings("ignore")


def _loop() -> ModuleType:
    """``test_accelerate`` (the documented loop, its model, data and plain reference)."""
    from support.sibling import load_sibling

    return load_sibling(__file__, "test_accelerate")


# accelerate keeps process-wide singletons; every test starts from none (autouse)
_fresh_accelerate_state = _loop()._fresh_accelerate_state


def _stand_in(kind: DistributedType, version: int | None = None) -> SimpleNamespace:
    plugin = None if version is None else SimpleNamespace(fsdp_version=version)
    return SimpleNamespace(sync_gradients=True, distributed_type=kind,
                           gradient_accumulation_steps=1,
                           state=SimpleNamespace(fsdp_plugin=plugin))


@pytest.mark.parametrize(("kind", "version", "reason"),
                         [(DistributedType.FSDP, 1, "FlatParameter"),
                          (DistributedType.DEEPSPEED, None, "ZeRO")])
def test_fsdp1_and_deepspeed_are_refused_with_the_reason_and_the_fix(
        kind: DistributedType, version: int | None, reason: str) -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=f"distributed_type={kind.value}") as err:
        BalancedAcceleratorStep(_stand_in(kind, version), UPGrad(2), [w])
    assert reason in str(err.value) and "Sharded trunks (FSDP2)" in str(err.value)
    assert "fsdp_version=2" in str(err.value)
    assert w.grad is None


def test_under_fsdp2_parameters_read_before_prepare_are_refused() -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=r"Invalid shared_params: under FSDP2 1 of its 1 "
                                         r"parameters .* after accelerator\.prepare"):
        BalancedAcceleratorStep(_stand_in(DistributedType.FSDP, 2), UPGrad(2), [w])
    assert w.grad is None


def test_a_data_parallel_accelerator_is_accepted() -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    step = BalancedAcceleratorStep(_stand_in(DistributedType.MULTI_CPU), UPGrad(2), [w])
    step.backward([w @ torch.tensor([1.0, 0.0]), w @ torch.tensor([-1.0, 1.0])])
    assert torch.equal(w.grad, torch.tensor([0.25, 0.75]))  # UPGrad's example, by hand


@pytest.mark.usefixtures("one_process_group")
def test_a_sharded_state_resumes_on_as_many_processes_as_saved_it() -> None:
    from torch.distributed.fsdp import fully_shard

    from gradbalance.checkpoint import CheckpointError
    from gradbalance_lab.models import regression_losses
    from support.loop_state import assert_same_state

    loop = _loop()
    run = loop._build("dbmtl")
    model = run["model"]
    fully_shard(model)
    step = BalancedAcceleratorStep(_stand_in(DistributedType.FSDP, 2), run["balancer"],
                                   model.shared_parameters(), model.head_parameters())
    x, y = loop._data().tensors
    step.backward(regression_losses(model(x), y))
    saved = step.state_dict()
    assert len(saved["ranks"]) == 1 and saved["ranks"][0]["objects"]["balancer"]["_ema"] is not None
    for wrong, message in [({"ranks": saved["ranks"] * 2}, "holds 2 ranks' states, this run "
                                                            "has 1 processes"),
                           (saved["ranks"][0], "no per-rank states")]:
        with pytest.raises(CheckpointError, match=message):
            step.load_state_dict(wrong)
        assert_same_state(step.state_dict(), saved)  # nothing moved
    step.backward(regression_losses(model(x), y))
    step.load_state_dict(saved)
    assert_same_state(step.state_dict(), saved)


STAGE = "GRADBALANCE_TEST_STAGE"  # the worker's run: "straight" or "resumed"


def _worker(out: str) -> None:
    """One rank: the documented loop under the FSDP2 plugin. ``straight``: 2 epochs,
    ``save_state`` after the first; ``resumed``: other initial weights, ``load_state`` of
    that, 1 epoch. Saves what it saw, its full parameters and every rank's step state."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.tensor import DTensor

    from support.fsdp_on_cpu import force_fsdp_on_cpu

    force_fsdp_on_cpu()
    loop = _loop()
    stage = os.environ[STAGE]
    state = str(Path(out).parent / "state")
    run = loop._build("dbmtl", seed=0 if stage == "straight" else 99)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator, step, seen = loop._accelerated(
        run, epochs=2 if stage == "straight" else 1, fsdp_plugin=plugin,
        save=state if stage == "straight" else None,
        load=state if stage == "resumed" else None)
    params = dict(run["model"].named_parameters())
    torch.save({"seen": seen, "state": step.state_dict(),  # every rank's (a collective)
                "sharded": all(isinstance(p, DTensor) for p in params.values()),
                "params": {name: p.full_tensor().detach().clone() for name, p in params.items()},
                "distributed": str(accelerator.distributed_type)},
               Path(out) / f"rank{accelerator.process_index}.pt")


def test_under_fsdp2_two_cpu_processes_match_one_and_resume_bit_identically(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from support.ddp import torchrun_two
    from support.loop_state import assert_same_state

    loop = _loop()
    monkeypatch.setenv(STAGE, "straight")
    (tmp_path / "straight").mkdir()
    straight = torchrun_two(__file__, tmp_path / "straight")
    assert straight[0]["distributed"] == "DistributedType.FSDP" and straight[0]["sharded"]
    assert_same_state(straight[1]["params"], straight[0]["params"])
    states = straight[0]["state"]["ranks"]
    ema = [state["objects"]["balancer"]["_ema"] for state in states]
    assert ema[0].shape == ema[1].shape and not torch.equal(ema[0], ema[1])  # per rank
    batches = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]))
               for a, b in zip(straight[0]["seen"], straight[1]["seen"])]
    assert len(batches) == 2 * loop.N // (2 * loop.BATCH)  # two epochs, the ranks split them
    plain = loop._build("dbmtl")
    loop._plain(plain, batches)
    start = loop._params(loop._build("dbmtl"))
    for name, p in loop._params(plain).items():
        assert not torch.equal(p, start[name]), name
        torch.testing.assert_close(straight[0]["params"][name], p, rtol=1e-6, atol=1e-7)

    monkeypatch.setenv(STAGE, "resumed")
    (tmp_path / "resumed").mkdir()
    resumed = torchrun_two(__file__, tmp_path / "resumed")
    for rank in range(2):
        assert_same_state(resumed[rank]["params"], straight[rank]["params"])
        assert_same_state(resumed[rank]["state"], straight[rank]["state"])


if __name__ == "__main__":
    _worker(sys.argv[1])
