"""Lightning modules of the tests; importable, so that ``ddp_spawn`` can pickle them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from gradbalance import get_balancer
from gradbalance.integrations.lightning import BalancedManualStep
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

K = 3


def make_model() -> MultiTaskModel:
    torch.manual_seed(0)
    return MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, K))


def make_balancer() -> Any:  # PCGrad: its random task order must agree on every rank
    return get_balancer("pcgrad", num_tasks=K, generator=torch.Generator().manual_seed(0))


class BalancedModule(pl.LightningModule):
    """Trains ``make_model()`` with ``BalancedManualStep`` (PCGrad) and SGD with momentum."""

    def __init__(self, accumulate: int, mode: str = "matrix") -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = make_model()
        extra = {"modules": self.net.trunk} if mode == "gramian" else {}
        self.balanced = BalancedManualStep(make_balancer(), self.net.shared_parameters(),
                                           self.net.head_parameters(),
                                           accumulate_grad_batches=accumulate, mode=mode,
                                           **extra)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.balanced(self, regression_losses(self.net(x), y), batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class SavingModule(BalancedModule):
    """Reads its rank's shard and saves its final parameters on every rank.

    Rank r of W reads the r-th block of ``batch_size`` samples out of every ``W·batch_size``,
    in order: the ranks' batches of one step together are the next ``W·batch_size`` samples
    (run with ``use_distributed_sampler=False``).
    """

    def __init__(self, out_dir: str, accumulate: int, data: TensorDataset,
                 batch_size: int) -> None:
        super().__init__(accumulate)
        self.out_dir = out_dir
        self.data = data
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        rank, world, size = self.global_rank, self.trainer.world_size, self.batch_size
        mine = [i for i in range(len(self.data)) if (i // size) % world == rank]
        return DataLoader(Subset(self.data, mine), batch_size=size, shuffle=False)

    def on_train_end(self) -> None:
        params = {name: p.detach().clone() for name, p in self.net.named_parameters()}
        torch.save(params, Path(self.out_dir) / f"rank{self.global_rank}.pt")
