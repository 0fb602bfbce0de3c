"""``StepStats.per_task`` of a ``batch_dim=0`` step, against an independent computation (the
gradients of the summed tasks ``Lₖ = Σᵢ ℓᵢₖ`` by ``autograd.grad``), and its logging
(docs/per_sample.md, "Statistics and logging")."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from gradbalance import CSVLogger, StepStats, TaskGradBuffer, log_stats, stats_to_dict
from gradbalance.balancers import MGDA, UPGrad

from .per_sample_models import TRUNKS

pytestmark = pytest.mark.usefixtures("float64")


def _flat(grads: tuple[Tensor | None, ...], params: list[Tensor]) -> Tensor:
    return torch.cat([torch.zeros_like(p).flatten() if g is None else g.flatten()
                      for g, p in zip(grads, params)])


@pytest.mark.parametrize("name", ["mlp", "mixed", "tokens"])
@pytest.mark.parametrize("tasks", [1, 3])
def test_per_task_summaries_equal_the_summed_tasks_gradients(name: str, tasks: int) -> None:
    torch.manual_seed(9)
    trunk, inputs = TRUNKS[name]()
    heads = nn.Linear(8, tasks)
    shared = list(trunk.parameters())
    buf = TaskGradBuffer(shared, heads.parameters(), modules=trunk, batch_dim=0)
    all_losses, task_grads = [], torch.zeros(tasks, sum(p.numel() for p in shared))
    for batch in (3, 5):  # two micro-batches
        losses = (heads(trunk(inputs(batch))) - torch.randn(batch, tasks)) ** 2
        losses = losses[:, 0] if tasks == 1 else losses
        columns = losses.reshape(batch, tasks)
        for k in range(tasks):
            task_grads[k] += _flat(torch.autograd.grad(columns[:, k].sum(), shared,
                                                       retain_graph=True, allow_unused=True),
                                   shared)
        all_losses.append(columns.detach())
        buf.backward(losses)
    stats = buf.apply_(UPGrad())
    assert buf._per_sample is not None
    buf._per_sample.gramian.remove()
    update = torch.cat([p.grad.flatten() for p in shared if p.grad is not None])
    summary = stats.per_task
    assert summary is not None and stats.weights is not None and summary.weights is not None
    assert summary.mode == "per_sample" and summary.num_tasks == tasks
    assert torch.allclose(summary.losses, torch.cat(all_losses).sum(0), rtol=1e-12)
    assert torch.allclose(summary.weights, stats.weights.reshape(-1, tasks).sum(0),
                          rtol=1e-12)
    norms = task_grads.norm(dim=1)
    assert summary.task_norms is not None and summary.cosine is not None
    assert torch.allclose(summary.task_norms, norms, rtol=1e-9)
    unit = task_grads / norms[:, None]
    assert torch.allclose(summary.cosine, unit @ unit.T, rtol=1e-9, atol=1e-12)
    assert summary.cosine_to_update is not None and summary.update_norm is not None
    assert torch.allclose(summary.cosine_to_update, unit @ update / update.norm(), rtol=1e-9,
                          atol=1e-12)
    assert float(summary.update_norm) == pytest.approx(float(update.norm()), rel=1e-9)


def test_micro_batches_with_another_number_of_tasks_are_refused() -> None:
    model = nn.Linear(3, 2)
    buf = TaskGradBuffer(model.parameters(), modules=model, batch_dim=0)
    buf.backward(model(torch.randn(4, 3)) ** 2)
    out = model(torch.randn(3, 3))
    with pytest.raises(ValueError, match=r"1 task column\(s\) but the earlier backward\(\) "
                                         r"of this step had 2"):
        buf.backward(out[:, 0] ** 2)
    buf.backward(out ** 2)  # the call fixed, with the same forward
    stats = buf.apply_(MGDA())
    assert stats.weights is not None and stats.weights.shape == (14,)


def _step() -> tuple[StepStats, list[str]]:
    torch.manual_seed(10)
    trunk, heads = nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Linear(6, 2)
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    buf.backward((heads(trunk(torch.randn(5, 4))) - torch.randn(5, 2)) ** 2)
    return buf.apply_(UPGrad()), ["depth", "seg"]


def test_logging_writes_the_per_task_summaries_with_task_names(tmp_path: Path) -> None:
    stats, names = _step()
    assert stats.per_task is not None
    summary = stats.per_task
    assert summary.task_norms is not None and summary.weights is not None
    assert summary.cosine is not None
    scalars = stats_to_dict(stats, task_names=names)
    assert list(scalars) == ["loss/depth", "size/depth", "loss/seg", "size/seg", "w/depth",
                             "w/seg", "cos/depth_seg", "amp_skipped"]
    want = [*summary.losses.tolist(), *summary.task_norms.tolist(), *summary.weights.tolist(),
            float(summary.cosine[0, 1])]
    got = [scalars[t] for t in ("loss/depth", "loss/seg", "size/depth", "size/seg",
                                "w/depth", "w/seg", "cos/depth_seg")]
    assert got == pytest.approx(want, rel=1e-12)

    class Writer:
        def __init__(self) -> None:
            self.tags: list[str] = []

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.tags.append(tag)

    writer = Writer()
    log_stats(writer, stats, 0, task_names=names)
    assert writer.tags == list(scalars)
    with CSVLogger(tmp_path / "run.csv", task_names=names) as logger:
        logger.log_stats(stats, 0)
        logger.log_stats(stats, 1)
    rows = list(csv.reader((tmp_path / "run.csv").open()))
    assert rows[0] == ["step", *scalars] and len(rows) == 3
    with pytest.raises(ValueError, match="expected 2 distinct"):
        stats_to_dict(stats, task_names=["a", "b", "c", "d", "e"])  # objectives, not tasks
