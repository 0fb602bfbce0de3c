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
    """Trains ``make_model()`` with ``BalancedManualStep`` (PCGrad, or ``balancer``) and SGD
    with momentum."""

    def __init__(self, accumulate: int, mode: str = "matrix", balancer: Any = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = make_model()
        extra = {"modules": self.net.trunk} if mode == "gramian" else {}
        balancer = make_balancer() if balancer is None else balancer
        self.balanced = BalancedManualStep(balancer, self.net.shared_parameters(),
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


# -- checkpoint and resume ------------------------------------------------------------------

#: The stateful configurations of the resume tests: (balancer, weighting, row clipper).
METHODS = ("gradvac", "gradnorm")


def make_parts(method: str, net: MultiTaskModel, seed: int) -> dict[str, Any]:
    """A balancer, a weighting and a row clipper with state; ``seed`` seeds the generator."""
    from gradbalance import TaskAutoClip
    from gradbalance.balancers import GradVac, PCGrad
    from gradbalance.weighting import GradNorm

    gen = torch.Generator().manual_seed(seed)
    if method == "gradvac":  # EMA targets, a generator, a row clipper with a history
        return {"balancer": GradVac(K, beta=0.5, generator=gen),
                "clip": TaskAutoClip(percentile=50, history_size=4)}
    if method == "gradnorm":  # learned weights with their own Adam, a generator
        return {"balancer": PCGrad(K, generator=gen),
                "weighting": GradNorm(K, net.trunk, alpha=1.5, lr=0.05)}
    raise ValueError(f"unknown method {method!r}")


def resume_data(world: int = 1, batch_size: int = 4, batches: int = 6) -> TensorDataset:
    """``batches`` global batches of ``world·batch_size`` samples, tasks of different scale."""
    gen = torch.Generator().manual_seed(1)
    n = batches * world * batch_size
    x = torch.randn(n, 8, generator=gen)
    y = torch.randn(n, K, generator=gen) * torch.tensor([1.0, 3.0, 0.3])
    return TensorDataset(x, y)


class ResumableModule(pl.LightningModule):
    """``BalancedManualStep`` with every stateful part, Adam, and a sharded loader.

    ``seed`` changes the initial weights and the generator, which a resume must overwrite.
    Rank r of W reads the r-th block of ``batch_size`` samples out of every ``W·batch_size``
    (run with ``use_distributed_sampler=False``). With ``out_dir`` every rank saves its final
    parameters and the helper's state there.
    """

    def __init__(self, method: str, seed: int = 0, accumulate: int = 2, batch_size: int = 4,
                 out_dir: str | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(seed)
        self.net = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, K))
        self.balanced = BalancedManualStep(
            shared_params=self.net.shared_parameters(), head_params=self.net.head_parameters(),
            accumulate_grad_batches=accumulate, **make_parts(method, self.net, seed))
        self.batch_size = batch_size
        self.out_dir = out_dir

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.balanced(self, regression_losses(self.net(x), y), batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.net.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        rank, world, size = self.global_rank, self.trainer.world_size, self.batch_size
        data = resume_data(world, size)
        mine = [i for i in range(len(data)) if (i // size) % world == rank]
        return DataLoader(Subset(data, mine), batch_size=size, shuffle=False)

    def on_train_end(self) -> None:
        if self.out_dir is not None:
            torch.save(final_state(self), Path(self.out_dir) / f"rank{self.global_rank}.pt")


def final_state(module: ResumableModule) -> dict[str, Any]:
    """The trained parameters and the helper's state (copies)."""
    return {"params": {name: p.detach().clone() for name, p in module.net.named_parameters()},
            "balanced": module.balanced.get_extra_state()}


def fit(module: ResumableModule, epochs: int, root: str, *, precision: str = "32",
        strategy: str = "auto", devices: int = 1, ckpt_path: str | None = None) -> Any:
    """``Trainer.fit`` for ``epochs`` epochs, saving ``e{epoch}.ckpt`` under ``root`` at the
    end of every epoch.

    ``precision="16-mixed-cpu"``: float16 autocast with a CPU ``GradScaler`` (the plugin
    passed explicitly: ``precision="16-mixed"`` on CPU is turned into ``bf16-mixed``).
    """
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins import MixedPrecision

    plugins: list[Any] = []
    if precision == "16-mixed-cpu":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=scaler))
        precision = "32"  # the plugin decides
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=epochs,
        precision=precision if not plugins else None, plugins=plugins, logger=False,
        callbacks=[ModelCheckpoint(dirpath=root, filename="e{epoch}", save_top_k=-1,
                                   auto_insert_metric_name=False)],
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        default_root_dir=root,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def ddp_resume_main(out_dir: str, method: str) -> None:
    """Two epochs straight (saving ``e0.ckpt`` after the first), then a fresh run resumed from
    ``e0.ckpt`` for the second, under ``ddp_spawn`` on 2 CPU processes; each rank's final
    state in ``out_dir/{straight,resumed}``."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    root = Path(out_dir)
    for name in ("straight", "resumed"):
        (root / name).mkdir()
    ddp = {"strategy": "ddp_spawn", "devices": 2}
    fit(ResumableModule(method, out_dir=str(root / "straight")), 2, str(root / "straight"),
        **ddp)
    fit(ResumableModule(method, seed=99, out_dir=str(root / "resumed")), 2,
        str(root / "resumed"), ckpt_path=str(root / "straight" / "e0.ckpt"), **ddp)
