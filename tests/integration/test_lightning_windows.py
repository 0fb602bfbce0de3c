"""Lightning's own ``zero_grad`` inside an accumulation window, and a module Lightning converts
after its ``__init__``: the balanced step (``Sum``) equals plain automatic optimisation on
``sum(losses)`` with ``accumulate_grad_batches``.

Manual optimisation makes Lightning zero the gradients before a validation run that ends
inside a window and at the start of every ``fit``; ``precision="64-true"``/``"bf16-true"``
converts the parameters after the step was built. Each raised before (the heads' ``.grad``
wiped outside the buffer; the parameters' dtype changed since the buffer was built)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradbalance.balancers import Sum
from gradbalance.integrations.lightning import BalancedManualStep

pl = pytest.importorskip("lightning.pytorch")
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec", "ignore:.*does not have many workers",
                                        "ignore:.*val_check_interval", "ignore:.*precision",
                                        "ignore:.*no `val_dataloader`")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

K, WINDOW = 3, 2


def _losses(module: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    features = module.trunk(x.to(module.dtype))
    return torch.stack([nn.functional.mse_loss(head(features).squeeze(-1), y[:, k].to(
        module.dtype)) for k, head in enumerate(module.heads)])


class _Base(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.heads = nn.ModuleList(nn.Linear(16, 1) for _ in range(K))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def validation_step(self, batch: Any, index: int) -> None:
        self.log("val", _losses(self, batch).sum())


class _Plain(_Base):
    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        return _losses(self, batch).sum()


class _Balanced(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.balanced = BalancedManualStep(Sum(), self.trunk.parameters(),
                                           self.heads.parameters(), accumulate_grad_batches=WINDOW,
                                           log=False)

    def training_step(self, batch: Any, index: int) -> None:
        self.balanced(self, _losses(self, batch), index)


class _StopAt(pl.Callback):
    """Stops the run after batch ``at`` (as EarlyStopping or ``max_time`` would)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                           index: int) -> None:
        if index == self.at:
            trainer.should_stop = True


def _loader(batch: int = 4) -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 8, generator=gen), torch.randn(32, K, generator=gen))
    return DataLoader(data, batch_size=batch)


def _trainer(plain: bool, **kwargs: Any) -> Any:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, **({"accumulate_grad_batches": WINDOW} if plain
                                                 else {}), **kwargs)


def _flat(module: Any) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten() for p in module.parameters()])


@pytest.mark.parametrize("every", [3, 5])
def test_a_validation_inside_a_window_keeps_accumulating(every: int) -> None:
    runs = {}
    for plain, cls in ((True, _Plain), (False, _Balanced)):
        module = cls()
        trainer = _trainer(plain, max_epochs=1, val_check_interval=every)
        trainer.fit(module, _loader(), _loader(16))
        runs[plain] = (_flat(module), trainer.global_step)
    assert runs[True][1] == runs[False][1] == 4
    assert (runs[True][0] - _flat(_Base())).abs().max() > 1e-3  # it trained
    torch.testing.assert_close(runs[False][0], runs[True][0], rtol=1e-6, atol=1e-6)


def test_a_fit_stopped_inside_a_window_then_fit_again_starts_clean() -> None:
    runs = {}
    for plain, cls in ((True, _Plain), (False, _Balanced)):
        module = cls()
        first = _trainer(plain, max_epochs=1, callbacks=[_StopAt(2)])
        first.fit(module, _loader())
        second = _trainer(plain, max_epochs=1)
        second.fit(module, _loader())
        runs[plain] = (_flat(module), first.global_step, second.global_step)
    assert runs[True][1:] == runs[False][1:] == (1, 4)
    torch.testing.assert_close(runs[False][0], runs[True][0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_a_module_converted_after_init_trains(precision: str) -> None:
    runs = {}
    for plain, cls in ((True, _Plain), (False, _Balanced)):
        module = cls()
        trainer = _trainer(plain, max_steps=3, precision=precision)
        trainer.fit(module, _loader())
        runs[plain] = (_flat(module), trainer.global_step)
    assert runs[True][1] == runs[False][1] == 3
    # float64: the K passes and the one of sum(losses) round alike; bfloat16: within two of
    # its units at the parameters' size (|p| < 0.5: a unit is 2^-9)
    tol = 1e-10 if precision == "64-true" else 2 * 2.0**-9
    assert runs[True][0].abs().max() < 0.5
    torch.testing.assert_close(runs[False][0], runs[True][0], rtol=0.0, atol=tol)


def test_a_checkpoint_loads_into_a_module_stopped_inside_a_window() -> None:
    # the buffer held the unfinished step and refused the load (validate/test with ckpt_path,
    # a new fit from a checkpoint); plain Lightning loads it
    module = _Balanced()
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v
             for k, v in module.state_dict().items()}
    _trainer(False, max_epochs=1, callbacks=[_StopAt(2)]).fit(module, _loader())
    assert module.balanced.buffer.in_step
    module.load_state_dict(saved)
    assert not module.balanced.buffer.in_step
    torch.testing.assert_close(_flat(module), _flat(_Balanced()), rtol=0.0, atol=0.0)


def test_a_fit_stopped_inside_a_window_then_converted() -> None:
    # the buffer, still in the unfinished step, was not rebuilt for the new dtype and raised
    runs = {}
    for plain, cls in ((True, _Plain), (False, _Balanced)):
        module = cls()
        _trainer(plain, max_epochs=1, callbacks=[_StopAt(2)]).fit(module, _loader())
        second = _trainer(plain, max_epochs=1, precision="64-true")
        second.fit(module, _loader())
        runs[plain] = (_flat(module), second.global_step)
    assert runs[True][1] == runs[False][1] == 4
    # the first fit in float32: its rounding (K passes against one) stays, ~1e-8
    torch.testing.assert_close(runs[False][0], runs[True][0], rtol=1e-6, atol=1e-6)
