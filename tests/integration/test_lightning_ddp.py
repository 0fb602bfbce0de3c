"""Lightning under ``ddp_spawn`` (2 CPU processes, gloo): ranks agree and match one process."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gradbalance import TaskGradBuffer
from gradbalance_lab.models import regression_losses

pl = pytest.importorskip("lightning.pytorch")
pytestmark = pytest.mark.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

from support.lightning import K, SavingModule, make_balancer, make_model  # noqa: E402

PER_RANK_BATCH, WORLD, STEPS = 4, 2, 3


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    n = 4 * WORLD * PER_RANK_BATCH * STEPS
    x = torch.randn(n, 8, generator=gen)
    y = torch.randn(n, K, generator=gen) * torch.tensor([1.0, 3.0, 0.3])
    return TensorDataset(x, y)


def _one_process(accumulate: int) -> dict[str, torch.Tensor]:
    """The plain loop on the global batch: what every rank must end with.

    The ranks' batches of one step together are the next ``WORLD·PER_RANK_BATCH`` samples
    (``SavingModule.train_dataloader``).
    """
    model = make_model()
    balancer = make_balancer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    batches = iter(DataLoader(_data(), batch_size=WORLD * PER_RANK_BATCH, shuffle=False))
    for _ in range(STEPS):
        for _ in range(accumulate):
            x, y = next(batches)
            buf.backward(regression_losses(model(x), y) / accumulate)
        buf.apply_(balancer)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_ddp_spawn_ranks_agree_and_match_one_process(tmp_path: Path, accumulate: int) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp_spawn",
                         max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    trainer.fit(SavingModule(str(tmp_path), accumulate, _data(), PER_RANK_BATCH))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    expected = _one_process(accumulate)
    start = {name: p.detach() for name, p in make_model().named_parameters()}
    for name, value in expected.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # bit-identical ranks
        torch.testing.assert_close(ranks[0][name], value, rtol=1e-6, atol=1e-6)
        assert not torch.equal(value, start[name])  # the run did train
