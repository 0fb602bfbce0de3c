"""The Lightning helper trains like the plain loop: same parameters, same logged stats."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Sum
from gradbalance.integrations.lightning import BalancedManualStep
from gradbalance_lab.models import MultiTaskModel, regression_losses

pl = pytest.importorskip("lightning.pytorch")
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

from support.lightning import BalancedModule, K, make_balancer, make_model  # noqa: E402

BATCH, STEPS = 4, 3


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8 * BATCH, 8, generator=gen)
    y = torch.randn(8 * BATCH, K, generator=gen) * torch.tensor([1.0, 3.0, 0.3])
    return TensorDataset(x, y)


Module = BalancedModule
_model, _balancer = make_model, make_balancer


def _lightning(accumulate: int, amp: bool, mode: str = "matrix") -> tuple[Module, Any]:
    module = Module(accumulate, mode)
    plugins = []
    if amp:
        from lightning.pytorch.plugins import MixedPrecision

        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        assert scaler.is_enabled()
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=plugins)
    trainer.fit(module, DataLoader(_data(), batch_size=BATCH, shuffle=False))
    return module, trainer


def _plain(accumulate: int, amp: bool) -> tuple[MultiTaskModel, Any]:
    model = _model()
    balancer = _balancer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if amp else None
    assert scaler is None or scaler.is_enabled()
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    batches = iter(DataLoader(_data(), batch_size=BATCH, shuffle=False))
    stats = None
    for _ in range(STEPS):
        for _ in range(accumulate):
            x, y = next(batches)
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp, cache_enabled=False):
                losses = regression_losses(model(x), y)
                buf.backward(losses / accumulate, scaler=scaler)
        stats = buf.apply_(balancer, scaler=scaler)
        if scaler is not None:
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return model, stats


@pytest.mark.parametrize(("accumulate", "amp", "mode"), [
    (1, False, "matrix"), (2, False, "matrix"), (2, True, "matrix"),
    (2, False, "gramian"),  # the gramian mode's micro-batches against the plain matrix loop
])
def test_lightning_matches_plain_loop(accumulate: int, amp: bool, mode: str) -> None:
    module, trainer = _lightning(accumulate, amp, mode)
    model, stats = _plain(accumulate, amp)
    assert trainer.global_step == STEPS
    start = _model()
    moved = max((p - s).abs().max().item()
                for p, s in zip(model.parameters(), start.parameters()))
    assert moved > 1e-3
    for p, q in zip(module.net.parameters(), model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6)
    logged = trainer.callback_metrics
    for k in range(K):
        torch.testing.assert_close(logged[f"balance/loss/task{k}"].double(),
                                   stats.losses[k].double(), rtol=1e-6, atol=1e-6)
        assert f"balance/size/task{k}" in logged
    assert "balance/cos/task0_task1" in logged
    assert module.balanced.last_stats is not None
    assert module.balanced.last_stats.num_backward == accumulate


def test_needs_manual_optimisation() -> None:
    class Auto(Module):
        def __init__(self) -> None:
            super().__init__(1)
            self.automatic_optimization = True

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return self.balanced(self, regression_losses(self.net(x), y), batch_idx)

    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with pytest.raises(ValueError, match="automatic_optimization = False"):
        trainer.fit(Auto(), DataLoader(_data(), batch_size=BATCH))


def test_invalid_accumulation() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"Invalid accumulate_grad_batches: 0 \(expected"):
        BalancedManualStep(_balancer(), model.shared_parameters(), accumulate_grad_batches=0)


class Scheduled(Module):
    """The helper's module with a StepLR (halving) from ``configure_optimizers``."""

    def __init__(self, interval: str | None, step_schedulers: bool = True,
                 plateau: bool = False) -> None:
        super().__init__(1)
        self.balanced.step_schedulers = step_schedulers
        self.interval, self.plateau = interval, plateau

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.plateau:
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
                "monitor": "val"}}
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        if self.interval is None:  # Lightning's default: once per epoch
            return [opt], [scheduler]
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler,
                                                   "interval": self.interval}}


def _fit_scheduled(module: Scheduled, epochs: int, batches: int) -> float:
    trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_train_batches=batches)
    trainer.fit(module, DataLoader(_data(), batch_size=BATCH, shuffle=False))
    assert trainer.global_step == epochs * batches
    return float(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize(("interval", "step_schedulers", "halvings"), [
    ("step", True, 6),  # after each of the 2 × 3 optimizer steps
    (None, True, 2),  # at the end of each of the 2 epochs
    ("step", False, 0),  # left to the module
])
def test_configured_schedulers_are_stepped(interval: str | None, step_schedulers: bool,
                                           halvings: int) -> None:
    lr = _fit_scheduled(Scheduled(interval, step_schedulers), epochs=2, batches=3)
    assert lr == pytest.approx(0.1 * 0.5**halvings, rel=1e-12)


class _Frequency(Module):
    """The helper's module, accumulating ``accumulate`` batches, with a StepLR (halving)
    stepped on ``"step"`` every ``frequency``."""

    def __init__(self, accumulate: int, frequency: int) -> None:
        super().__init__(accumulate)
        self.frequency = frequency

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step",
                                                   "frequency": self.frequency}}


class _AutomaticFrequency(pl.LightningModule):
    """The same optimizer and scheduler under Lightning's automatic optimisation."""

    def __init__(self, frequency: int) -> None:
        super().__init__()
        self.net = _model()
        self.frequency = frequency

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return regression_losses(self.net(x), y).sum()

    configure_optimizers = _Frequency.configure_optimizers


class _LearningRates(pl.Callback):
    """The learning rate after every training batch."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.seen.append(float(trainer.optimizers[0].param_groups[0]["lr"]))


def _rates(module: pl.LightningModule, accumulate: int, epochs: int, batches: int
           ) -> list[float]:
    rates = _LearningRates()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_train_batches=batches,
                         accumulate_grad_batches=accumulate, callbacks=[rates])
    trainer.fit(module, DataLoader(_data(), batch_size=BATCH, shuffle=False))
    return rates.seen


@pytest.mark.parametrize(("accumulate", "frequency", "batches"), [
    (1, 2, 3),  # an epoch of 3 batches: the count starts again each epoch
    (2, 2, 5),  # a last window of one batch
    (2, 3, 7),
    (3, 2, 8),
])
def test_step_schedulers_follow_automatic_optimisation(accumulate: int, frequency: int,
                                                       batches: int) -> None:
    """``"interval": "step"`` with ``frequency`` > 1, with and without accumulation: the
    learning rate after every batch is automatic optimisation's (Lightning's own schedule,
    ``accumulate_grad_batches`` on the Trainer there)."""
    helper = _rates(_Frequency(accumulate, frequency), 1, epochs=2, batches=batches)
    automatic = _rates(_AutomaticFrequency(frequency), accumulate, epochs=2, batches=batches)
    assert len(helper) == 2 * batches
    assert helper == automatic
    assert min(helper) < 0.1  # some step was taken


class _SumHelper(Module):
    """The helper with ``Sum`` (the plain update), plain SGD and a step-interval StepLR."""

    def __init__(self, accumulate: int) -> None:
        super().__init__(accumulate, balancer=Sum())
        self.frequency = 1

    configure_optimizers = _Frequency.configure_optimizers


def _fit_resumable(module: pl.LightningModule, accumulate: int, out: Path,
                   ckpt: Path | None = None) -> tuple[Tensor, float]:
    """Two epochs of 5 batches, a checkpoint every 2 optimizer steps (``out``), resumed from
    ``ckpt`` where given: the final parameters and learning rate."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    saving = ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1,
                             filename="{step}")
    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         limit_train_batches=5, accumulate_grad_batches=accumulate,
                         callbacks=[saving])
    trainer.fit(module, DataLoader(_data(), batch_size=BATCH, shuffle=False),
                ckpt_path=None if ckpt is None else str(ckpt))
    params = torch.cat([p.detach().flatten() for p in module.net.parameters()])
    return params, float(trainer.optimizers[0].param_groups[0]["lr"])


def test_mid_epoch_resume_follows_automatic_optimisation(tmp_path: Path) -> None:
    """Accumulating 2 batches of epochs of 5: the helper with ``Sum`` ends where automatic
    optimisation ends, run straight and resumed from the checkpoint after the second
    optimizer step (inside the first epoch: Lightning's own mid-epoch resume)."""
    runs = {}
    for name, make, accumulate in (("helper", lambda: _SumHelper(2), 1),
                                   ("automatic", lambda: _AutomaticFrequency(1), 2)):
        straight = _fit_resumable(make(), accumulate, tmp_path / name)
        resumed = _fit_resumable(make(), accumulate, tmp_path / f"{name}_resumed",
                                 ckpt=tmp_path / name / "step=2.ckpt")
        runs[name] = (straight, resumed)
    for got, want in zip(runs["helper"], runs["automatic"]):
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
        assert got[1] == pytest.approx(want[1], rel=1e-12)


def test_a_plateau_scheduler_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau.*step_schedulers=False"):
        _fit_scheduled(Scheduled("epoch", plateau=True), epochs=1, batches=1)


class _Unsized:
    """The first ``batches`` batches of ``_data()`` from a loader without a length."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        data = _data()
        for i in range(self.batches):
            yield data[BATCH * i:BATCH * (i + 1)]


def _fit_epochs(loader: Any, epochs: int) -> tuple[Module, Any]:
    module = Module(2)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, loader)
    return module, trainer


def test_a_loader_without_a_length_takes_the_end_of_epoch_step() -> None:
    """``num_training_batches`` is infinite there, so the last-batch test never held: the
    fifth batch's gradients went into the next epoch's first step and the last stayed in the
    buffer. The reference is the same batches from a sized loader."""
    unsized, unsized_trainer = _fit_epochs(_Unsized(5), 2)
    sized, sized_trainer = _fit_epochs(
        DataLoader(TensorDataset(*_data()[:5 * BATCH]), batch_size=BATCH, shuffle=False), 2)
    assert unsized_trainer.global_step == sized_trainer.global_step == 6  # 3 per epoch
    assert not unsized.balanced.buffer.in_step
    for a, b in zip(unsized.parameters(), sized.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("kwargs", "text"), [
    ({"balancer": "upgrad"}, "Invalid balancer"),
    ({"prefix": 3}, "Invalid prefix: 3"),
    ({"log": "no"}, "Invalid log: 'no'"),
    ({"step_schedulers": "no"}, "Invalid step_schedulers: 'no'"),
    ({"batch_dim": 0}, "Invalid buffer_kwargs: batch_dim=0: the per-sample route"),
])
def test_bad_settings_are_named_at_construction(kwargs: dict[str, Any], text: str) -> None:
    """``"upgrad"`` raised an AttributeError; a prefix of 3 raised inside ``fit`` after the
    optimizer had stepped; ``"no"`` was read as true."""
    net = _model()
    args: dict[str, Any] = {"balancer": _balancer(), **kwargs}
    with pytest.raises((ValueError, TypeError), match=text):
        BalancedManualStep(args.pop("balancer"), net.shared_parameters(),
                           net.head_parameters(), **args)
