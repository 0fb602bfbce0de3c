"""``BalancedTrainer`` under the Trainer's FSDP2 (``fsdp``/``fsdp_config`` with FSDP version 2).

The Trainer's FSDP goes through accelerate's FSDP plugin, which accelerate 1.15 applies only
on accelerator devices (``accelerate/state.py``: on gloo CPU processes the run would stay
``MULTI_CPU``). The workers patch that one check (``support/fsdp_on_cpu.py``: what enables
the accelerator path on CPU), so ``prepare`` runs accelerate's ``fsdp2_prepare_model``
(``fully_shard`` over the two gloo processes) and the Trainer its FSDP2 clipping and sharded
checkpoints, as on GPUs. Two processes then equal one on the global batch (parameters, logs)
and resume bit-identically from a checkpoint holding each process's balancer state (DB-MTL's
``[K, P]`` EMA: that rank's columns). FSDP1 and parameters read before the sharding are
refused with the reason.

Run as a script (``torchrun --nproc_per_node 2 test_transformers_fsdp2.py OUT``), it is the
worker of the two-process tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers

from gradbalance.balancers import PCGrad
from gradbalance.integrations.transformers import (
    RANK_STATE_FILE,
    STATE_FILE,
    BalancedTrainer,
)

pytestmark = pytest.mark.filterwarnings("ignore")


def _loop() -> ModuleType:
    """``test_transformers`` (its model, data, Trainer and plain reference loop)."""
    from support.sibling import load_sibling

    return load_sibling(__file__, "test_transformers")


def _stand_in(monkeypatch: pytest.MonkeyPatch, version: int) -> None:
    """The Trainer's set-up stood in for by one reporting its FSDP on, at ``version``."""
    def set_up(self: Any, *args: Any, **kwargs: Any) -> None:
        self.is_fsdp_enabled = True
        plugin = SimpleNamespace(fsdp_version=version)
        self.accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
        self.args = SimpleNamespace(n_gpu=0)
        self.model = kwargs.get("model")

    monkeypatch.setattr(transformers.Trainer, "__init__", set_up)


def test_fsdp1_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    _stand_in(monkeypatch, version=1)
    with pytest.raises(ValueError) as caught:
        BalancedTrainer(balancer=PCGrad(2), shared_params=[], head_params=[])
    message = str(caught.value)
    assert "the Trainer's FSDP1" in message and "FlatParameter" in message
    assert "fsdp_version=2" in message and "DDP" in message


def test_parameters_read_before_the_sharding_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _stand_in(monkeypatch, version=2)
    model = _loop()._model()
    trainer = BalancedTrainer(model=model, balancer=PCGrad(3),
                              shared_params=model.trunk.parameters(),  # plain, not DTensor
                              head_params=lambda m: m.heads.parameters())
    with pytest.raises(ValueError, match=r"Invalid shared_params: under FSDP2 4 of its 4 "
                                         r"parameters .* as callables") as caught:
        trainer.balanced.buffer  # noqa: B018 - built on first use
    assert "before fully_shard replaced" in str(caught.value)
    assert all(p.grad is None for p in model.parameters())


def test_per_process_states_resume_on_as_many_processes_as_saved_them(tmp_path: Path) -> None:
    from gradbalance.checkpoint import CheckpointError
    from gradbalance.integrations.transformers import _check_rank_files

    for rank in range(2):
        (tmp_path / RANK_STATE_FILE.format(rank=rank)).write_bytes(b"")
    (tmp_path / STATE_FILE).write_bytes(b"")  # not a per-process file
    _check_rank_files(str(tmp_path), 2)
    for world in (1, 3):
        with pytest.raises(CheckpointError, match=f"holds 2 processes' states .* this run "
                                                  f"has {world} processes"):
            _check_rank_files(str(tmp_path), world)


RESUME = "GRADBALANCE_TEST_RESUME_FROM"  # the worker resumes from this checkpoint when set


def _worker(out: str) -> None:
    """One rank: the Trainer under FSDP2 (resumed from ``$RESUME``, other initial weights,
    when set); saves what it saw, its full parameters, every rank's balanced state and logs."""
    from torch.distributed.tensor import DTensor

    from support.fsdp_on_cpu import force_fsdp_on_cpu

    force_fsdp_on_cpu()
    loop = _loop()
    resume = os.environ.get(RESUME)
    trainer = loop._trainer(Path(out), "dbmtl", seed=0 if resume is None else 99,
                            own_optimizer=True, save_strategy="steps", save_steps=2,
                            ddp_backend="gloo", fsdp=True,
                            fsdp_config={"fsdp_version": 2, "reshard_after_forward": True})
    trainer.train(resume_from_checkpoint=resume)
    params = dict(trainer.model.named_parameters())
    rank = trainer.args.process_index
    torch.save({"seen": trainer.model.seen, "logs": trainer.state.log_history,
                "sharded": all(isinstance(p, DTensor) for p in params.values()),
                "params": {name: p.full_tensor().detach().clone() for name, p in params.items()},
                "balanced": trainer.balanced.state_dict(),  # every rank's (a collective)
                "distributed": str(trainer.accelerator.distributed_type)},
               Path(out) / f"rank{rank}.pt")


def test_under_fsdp2_two_cpu_processes_match_one(tmp_path: Path) -> None:
    from support.ddp import torchrun_two
    from support.loop_state import assert_same_state

    loop = _loop()
    ranks = torchrun_two(__file__, tmp_path)
    assert ranks[0]["distributed"] == "DistributedType.FSDP" and ranks[0]["sharded"]
    assert_same_state(ranks[1]["params"], ranks[0]["params"])
    for rank in range(2):
        assert (tmp_path / "checkpoint-4" / RANK_STATE_FILE.format(rank=rank)).is_file()
    assert not (tmp_path / "checkpoint-4" / STATE_FILE).exists()
    batches = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]))
               for a, b in zip(ranks[0]["seen"], ranks[1]["seen"])]
    assert len(batches) == loop.N // loop.BATCH
    model, logs = loop._plain("dbmtl", batches, accumulate=2)
    start = loop._params(loop._model())
    for name, p in loop._params(model).items():
        assert not torch.equal(p, start[name]), name
        torch.testing.assert_close(ranks[0]["params"][name], p, rtol=1e-6, atol=1e-7)
    trained = [log for log in ranks[0]["logs"] if "loss" in log]
    assert len(trained) == len(logs)
    for got, expected in zip(trained, logs):
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=1e-6)


def test_under_fsdp2_two_cpu_processes_resume_bit_identically(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from support.ddp import torchrun_two
    from support.loop_state import assert_same_state

    (tmp_path / "straight").mkdir()
    straight = torchrun_two(__file__, tmp_path / "straight")
    checkpoint = tmp_path / "straight" / "checkpoint-2"  # mid-run: 4 steps on 2 processes
    monkeypatch.setenv(RESUME, str(checkpoint))
    (tmp_path / "resumed").mkdir()
    resumed = torchrun_two(__file__, tmp_path / "resumed")
    states = straight[0]["balanced"]["ranks"]
    ema = [state["objects"]["balancer"]["_ema"] for state in states]
    assert ema[0].shape == ema[1].shape and not torch.equal(ema[0], ema[1])  # per rank
    for rank in range(2):
        assert_same_state(resumed[rank]["params"], straight[rank]["params"])
        assert_same_state(resumed[rank]["balanced"], straight[rank]["balanced"])
        trained = [log for log in straight[rank]["logs"] if "loss" in log]
        assert len(trained) == 4
        # the first two come from the checkpoint's trainer_state.json, the others were logged
        assert [log for log in resumed[rank]["logs"] if "loss" in log] == trained


if __name__ == "__main__":
    _worker(sys.argv[1])
