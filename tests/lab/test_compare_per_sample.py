"""``gradbalance compare --per-sample``: balancers over the per-sample (sample × task) losses
against the plain mean (docs/compare.md, "Per-sample objectives").

The reference is a second implementation of the same training: the matrix route, every
(sample, task) loss ``ℓᵢₖ / B`` passed as a task of its own (``TaskGradBuffer`` without
``batch_dim``, one backward per objective).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, UPGrad
from gradbalance_lab._mtl_methods import Method
from gradbalance_lab._mtl_runner import RunConfig, build_model, train_run
from gradbalance_lab.cli import main
from gradbalance_lab.data import MultiDigits, make_multidigits

pytest.importorskip("sklearn")

TINY = ["--n-train", "96", "--n-test", "40", "--epochs", "1", "--batch-size", "32",
        "--hidden", "8", "--no-progress", "--no-tensorboard", "--quiet"]
# width 32: a full-rank per-sample Gramian (at width 8 it is rank-deficient and UPGrad's
# weights are not unique)
CFG = RunConfig(epochs=1, batch_size=32, optimizer="sgd", lr=0.5, width=32)


def _read(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def data() -> MultiDigits:
    return make_multidigits(96, 40, seed=0)


def _by_rows(data: MultiDigits, balancer: str, seed: int) -> list[float]:
    """The run's epoch-mean task losses, trained through the matrix route over the B·K
    objectives ``ℓᵢₖ / B``; the train loop of ``train_run`` written out."""
    torch.manual_seed(seed)
    model = build_model(data, CFG, [0, 1])
    opt = torch.optim.SGD(model.parameters(), lr=CFG.lr, momentum=0.9)
    order = torch.randperm(96, generator=torch.Generator().manual_seed(seed))
    chosen = UPGrad() if balancer == "upgrad" else MGDA()  # one instance, as in a user's loop
    sums = torch.zeros(2, dtype=torch.float64)
    for b in range(3):
        idx = order[32 * b:32 * (b + 1)]
        losses = data.per_sample_losses(model(data.x_train[idx]), data.y_train[idx]) / 32
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
        buf.backward(losses.reshape(-1))  # objective (i, k) at i·K + k
        buf.apply_(chosen)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sums += losses.detach().sum(0).double()
    return (sums / 3).tolist()


@pytest.mark.parametrize("balancer", ["upgrad", "mgda"])
def test_a_run_equals_the_matrix_route_over_the_same_objectives(data: MultiDigits,
                                                                balancer: str) -> None:
    for seed in (0, 1):
        run = train_run(data, Method("per-sample", balancer), seed, CFG)
        assert run.error is None and run.steps == 3
        expected = _by_rows(data, balancer, seed)
        assert run.train_losses == pytest.approx(expected, rel=1e-4)
        # the comparison can fail: the plain mean's run takes other steps
        mean = train_run(data, Method("balancer", "sum"), seed, CFG)
        assert max(abs(a - b) for a, b in zip(mean.train_losses, expected)) > 1e-3


def test_the_cli_writes_the_rows_config_and_figure(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    with_tb = [a for a in TINY if a != "--no-tensorboard"]
    code = main(["compare", "--per-sample", *with_tb, "--seeds", "2", "--timing-rounds", "1",
                 "--log-every", "1", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    summary = _read(out / "summary.csv")
    assert [(r["method"], r["kind"]) for r in summary] == [
        ("single-task", "single"), ("plain", "plain step"), ("sum", "balancer"),
        ("mgda-per-sample", "per-sample"), ("upgrad-per-sample", "per-sample")]
    assert all(r["runs"] == "2" for r in summary[2:])
    assert all(math.isfinite(float(r["x_plain_step"])) for r in summary[1:])
    assert json.loads((out / "config.json").read_text())["per_sample"] is True
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "# gradbalance compare --per-sample" in (out / "summary.md").read_text()
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb" / "mgda-per-sample" / "seed0"))
    acc.Reload()
    assert {"loss/task0", "loss/task1", "w/task0", "w/task1"} <= set(acc.Tags()["scalars"])
    # MGDA's weights are a convex combination of the B·K objectives, so the per-task means
    # over the batch of 32 add up to 1/32 at every logged step
    for w0, w1 in zip(acc.Scalars("w/task0"), acc.Scalars("w/task1")):
        assert w0.value + w1.value == pytest.approx(1 / 32, rel=1e-4)
    assert len(acc.Scalars("w/task0")) == 3


@pytest.mark.parametrize(("extra", "text"), [
    (["--weightings", "dwa"], "--per-sample does not take --weightings dwa"),
    (["--per-sample-clip", "1"], "--per-sample does not take --per-sample-clip 1.0"),
    (["--model", "pkg.mod:factory"], "--per-sample does not take --model pkg.mod:factory"),
    (["--balancers", "graddrop"], "balancer 'graddrop' needs the per-sample gradient rows"),
    (["--balancers", "nope"], "Unknown balancer 'nope' in --balancers"),
])
def test_what_it_cannot_run_is_one_line_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str],
        text: str) -> None:
    out = tmp_path / "out"
    code = main(["compare", "--per-sample", *TINY, "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert code == 2 and text in err and err.count("\n") == 1, err
    assert not out.exists() or not any(out.iterdir())


def test_all_skips_the_balancers_that_need_rows(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.warns(RuntimeWarning, match="skipped per-sample 'graddrop'"):
        code = main(["compare", "--per-sample", *TINY, "--seeds", "1", "--timing-rounds", "0",
                     "--no-plot", "--no-baselines", "--balancers", "all", "--epochs", "1",
                     "--n-train", "8", "--batch-size", "8", "--out", str(out)])
    assert code == 0
    methods = {r["method"] for r in _read(out / "summary.csv")}
    assert "graddrop-per-sample" not in methods and "upgrad-per-sample" in methods
