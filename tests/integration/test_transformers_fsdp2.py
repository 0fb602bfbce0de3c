"""``BalancedTrainer`` and the Trainer's FSDP2 arguments.

The Trainer's ``fsdp``/``fsdp_config`` go through accelerate's FSDP plugin, which accelerate
1.15 applies only on accelerator devices: on two gloo CPU processes the Trainer reports
``is_fsdp_enabled`` False and accelerate ``MULTI_CPU``, so the run stays data-parallel. What
runs is tested: with ``fsdp_config={"fsdp_version": 2}`` two CPU processes equal one on the
global batch (parameters, logs, a checkpoint with the balancer's state), and a Trainer whose
FSDP is on is refused with the reason.

Run as a script (``torchrun --nproc_per_node 2 test_transformers_fsdp2.py OUT``), it is the
worker of the two-process test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers

from gradbalance.balancers import PCGrad
from gradbalance.integrations.transformers import STATE_FILE, BalancedTrainer

pytestmark = pytest.mark.filterwarnings("ignore")


def _loop() -> ModuleType:
    """``test_transformers`` (its model, data, Trainer and plain reference loop)."""
    from support.sibling import load_sibling

    return load_sibling(__file__, "test_transformers")


def test_a_sharding_trainer_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def set_up(self: Any, *args: Any, **kwargs: Any) -> None:
        self.is_fsdp_enabled = True

    monkeypatch.setattr(transformers.Trainer, "__init__", set_up)
    with pytest.raises(ValueError) as caught:
        BalancedTrainer(balancer=PCGrad(2), shared_params=[], head_params=[])
    message = str(caught.value)
    assert "only on accelerator devices" in message and "Trainer's FSDP" in message
    assert "fully_shard" in message and "DDP" in message


RESUME = "GRADBALANCE_TEST_RESUME_FROM"  # the worker resumes from this checkpoint when set


def _worker(out: str) -> None:
    """One rank: the Trainer with FSDP2 arguments (resumed from ``$RESUME``, other initial
    weights, when set); saves what it saw, ended with and logged."""
    loop = _loop()
    resume = os.environ.get(RESUME)
    trainer = loop._trainer(Path(out), "gradnorm", seed=0 if resume is None else 99,
                            save_strategy="steps", save_steps=2, ddp_backend="gloo", fsdp=True,
                            fsdp_config={"fsdp_version": 2, "reshard_after_forward": True})
    trainer.train(resume_from_checkpoint=resume)
    rank = trainer.args.process_index
    torch.save({"seen": trainer.model.seen, "state": loop._state(trainer),
                "logs": trainer.state.log_history, "fsdp": trainer.is_fsdp_enabled,
                "distributed": str(trainer.accelerator.distributed_type)},
               Path(out) / f"rank{rank}.pt")


def test_under_fsdp2_arguments_two_cpu_processes_match_one(tmp_path: Path) -> None:
    from support.ddp import torchrun_two
    from support.loop_state import assert_same_state

    loop = _loop()
    ranks = torchrun_two(__file__, tmp_path)
    assert ranks[0]["distributed"] == "DistributedType.MULTI_CPU" and not ranks[0]["fsdp"]
    assert_same_state(ranks[1]["state"], ranks[0]["state"])
    assert (tmp_path / "checkpoint-4" / STATE_FILE).is_file()
    batches = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]))
               for a, b in zip(ranks[0]["seen"], ranks[1]["seen"])]
    assert len(batches) == loop.N // loop.BATCH
    model, logs = loop._plain("gradnorm", batches, accumulate=2)
    start = loop._params(loop._model())
    for name, p in loop._params(model).items():
        assert not torch.equal(p, start[name]), name
        torch.testing.assert_close(ranks[0]["state"]["params"][name], p, rtol=1e-6, atol=1e-7)
    trained = [log for log in ranks[0]["logs"] if "loss" in log]
    assert len(trained) == len(logs)
    for got, expected in zip(trained, logs):
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=1e-6)


def test_under_fsdp2_arguments_two_cpu_processes_resume_bit_identically(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from support.ddp import torchrun_two
    from support.loop_state import assert_same_state

    (tmp_path / "straight").mkdir()
    straight = torchrun_two(__file__, tmp_path / "straight")
    checkpoint = tmp_path / "straight" / "checkpoint-2"  # mid-run: 4 steps on 2 processes
    assert (checkpoint / STATE_FILE).is_file()
    monkeypatch.setenv(RESUME, str(checkpoint))
    (tmp_path / "resumed").mkdir()
    resumed = torchrun_two(__file__, tmp_path / "resumed")
    for rank in range(2):
        assert_same_state(resumed[rank]["state"], straight[rank]["state"])
        trained = [log for log in straight[rank]["logs"] if "loss" in log]
        assert len(trained) == 4
        # the first two come from the checkpoint's trainer_state.json, the others were logged
        assert [log for log in resumed[rank]["logs"] if "loss" in log] == trained


if __name__ == "__main__":
    _worker(sys.argv[1])
