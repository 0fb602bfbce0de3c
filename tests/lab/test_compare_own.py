"""``gradbalance_lab.compare`` on a model and data the project never used (a GRU over short
sequences, three regression tasks), and ``gradbalance compare --model pkg.module:factory``."""

from __future__ import annotations

import csv
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import gradbalance as gb
import gradbalance_lab
from gradbalance_lab._cli_common import OutputError
from gradbalance_lab.cli import main
from gradbalance_lab.compare import compare

STEPS = 6


class Seq(nn.Module):
    """A GRU trunk over ``[B, 5, 3]`` sequences and three linear heads; forward: the K losses."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.GRU(3, 6, batch_first=True)
        self.heads = nn.ModuleList(nn.Linear(6, 1) for _ in range(3))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)[0][:, -1]

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        feats = self.features(x)
        return torch.stack([nn.functional.mse_loss(h(feats).squeeze(-1), y[:, k])
                            for k, h in enumerate(self.heads)])


def batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 5, 3, generator=gen)
    y = torch.stack([x.sum((1, 2)), x[:, -1, 0], 1e-3 * x[:, 0, 1]], 1)
    return [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]


def _by_hand(seed: int, method: str) -> list[float]:
    """The same training written out with the core's public API: the mean loss of each task
    over the last tenth of the steps (at least one step)."""
    torch.manual_seed(seed)
    model = Seq()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = batches(seed)
    buf = gb.TaskGradBuffer(list(model.encoder.parameters()), list(model.heads.parameters()))
    recent = []
    for step in range(STEPS):
        losses = model(data[step % len(data)])
        if method == "plain":
            losses.sum().backward()
        else:
            buf.backward(losses)
            buf.apply_(gb.get_balancer(method))
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent.append(losses.detach().double())
    return torch.stack(recent[-max(1, STEPS // 10):]).mean(0).tolist()


def _read(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> gradbalance_lab.compare.Comparison:
    out = tmp_path_factory.mktemp("own")
    return compare(Seq, batches, methods=["mgda", "imtlg", "uncertainty"], steps=STEPS,
                   seeds=2, shared="encoder", task_names=["sum", "last", "tiny"],
                   timing_rounds=2, out=out, tensorboard=True)


def test_rows_outputs_and_the_plain_reference(result: gradbalance_lab.compare.Comparison) -> None:
    assert [row.label for row in result.rows] == ["plain", "mgda", "imtlg", "uncertainty"]
    assert result.row("plain").time_ratio == 1.0
    assert all(row.time_ratio > 0 and row.runs == 2 for row in result.rows)
    assert "| plain | plain |" in result.table and "× plain step" in str(result)
    assert result.out is not None
    for name in ("summary.md", "summary.csv", "runs.csv", "history.csv", "config.json",
                 "compare.png"):
        assert (result.out / name).stat().st_size > 0, name
    assert list((result.out / "tb" / "mgda" / "seed1").glob("events.out.tfevents.*"))
    runs = _read(result.out / "runs.csv")
    assert sorted((r["method"], r["seed"]) for r in runs) == sorted(
        (m, s) for m in ("plain", "mgda", "imtlg", "uncertainty") for s in ("0", "1"))
    assert list(runs[0])[3:6] == ["sum_loss", "last_loss", "tiny_loss"]


@pytest.mark.parametrize("method", ["plain", "mgda"])
def test_metrics_match_the_loop_written_by_hand(result: gradbalance_lab.compare.Comparison,
                                                method: str) -> None:
    for seed in (0, 1):
        run = next(r for r in result.runs if r.method.label == method and r.seed == seed)
        assert run.metrics == pytest.approx(_by_hand(seed, method), rel=1e-5)


def test_the_module_is_the_function(tmp_path: Path) -> None:
    evaluate_calls = []

    def evaluate(model: nn.Module) -> list[float]:
        evaluate_calls.append(model.training)
        return [1.0, 2.0, 3.0]

    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    got = gradbalance_lab.compare(Seq, batches, methods=["plain"], steps=2, seeds=[7],
                                  shared=lambda m: m.encoder.parameters(), evaluate=evaluate,
                                  higher_is_better=[True, False, True], timing_rounds=0)
    assert [row.label for row in got.rows] == ["plain"] and got.out is None
    assert got.rows[0].means == [1.0, 2.0, 3.0]
    assert "task0 ↑" in got.table and "task1 ↓" in got.table
    assert evaluate_calls and not any(evaluate_calls)  # evaluated in eval mode
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is kept


@pytest.mark.parametrize(("kwargs", "error", "text"), [
    ({"build_model": "Seq"}, TypeError, "Invalid build_model: a str"),
    ({"shared": "trunk"}, ValueError, "Invalid shared: Seq has no submodule 'trunk'"),
    ({"methods": ["nope"]}, ValueError, "Unknown method 'nope' in methods; valid names: plain"),
    ({"methods": "mgda"}, TypeError, "Invalid methods: the string 'mgda'"),
    ({"steps": 0}, ValueError, "Invalid steps: 0"),
    ({"seeds": []}, ValueError, "Invalid seeds: []"),
    ({"task_names": ["a", "b"]}, ValueError, "Invalid task_names: ['a', 'b'] (expected 3"),
    ({"evaluate": lambda m: [1.0]}, ValueError, "Invalid evaluate: it returned 1 metrics"),
    ({"make_batches": lambda seed: []}, ValueError, "make_batches(0) gave no batch"),
    ({"build_model": lambda: nn.Linear(2, 2)}, ValueError, "Invalid shared: Linear"),
])
def test_bad_arguments_are_named(kwargs: dict[str, object], error: type[Exception],
                                 text: str) -> None:
    args = {"build_model": Seq, "make_batches": batches, "shared": "encoder", "steps": 2,
            "seeds": 1, "timing_rounds": 0, **kwargs}
    with pytest.raises(error) as info:
        compare(args.pop("build_model"), args.pop("make_batches"), **args)  # type: ignore[arg-type]
    assert text in str(info.value)


def test_a_model_returning_a_matrix_is_refused() -> None:
    class Wide(Seq):
        def forward(self, batch):  # type: ignore[no-untyped-def]
            return super().forward(batch)[None].expand(2, 3)

    with pytest.raises(ValueError, match=r"forward\(batch\) returned \(2, 3\)"):
        compare(Wide, batches, shared="encoder", steps=2, seeds=1, timing_rounds=0)


def test_a_full_out_folder_is_refused_before_training(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match="the folder is not empty"):
        compare(Seq, batches, shared="encoder", steps=2, seeds=1, out=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


PROBLEM = """
    import torch
    from torch import nn

    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv1d(2, 3, 3), nn.ReLU(), nn.Flatten())
            self.heads = nn.ModuleList(nn.Linear(3 * 6, 1) for _ in range(2))

        def forward(self, batch):
            x, y = batch
            f = self.body(x)
            return [nn.functional.mse_loss(h(f).squeeze(-1), y[:, k])
                    for k, h in enumerate(self.heads)]

    def batches(seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(16, 2, 8, generator=g)
        return [(x, torch.stack([x.mean((1, 2)), x[:, 1].amax(1)], 1))]

    def problem():
        return dict(build_model=Conv, make_batches=batches, shared="body",
                    task_names=["mean", "max"])

    def not_a_dict():
        return Conv
"""


@pytest.fixture
def user_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"gb_user_problem_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PROBLEM))
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


def test_cli_model_factory(user_folder: str, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["compare", "--model", f"{user_folder}:problem", "--steps", "3", "--seeds", "1",
                 "--balancers", "pcgrad", "--weightings", "dwa", "--timing-rounds", "2",
                 "--no-plot", "--no-tensorboard", "--quiet", "--out", "out"])
    assert code == 0, capsys.readouterr().err
    summary = _read(tmp_path / "out" / "summary.csv")
    assert [r["method"] for r in summary] == ["plain", "pcgrad", "dwa"]
    assert float(summary[0]["x_plain_step"]) == 1.0
    assert "mean_loss_mean" in summary[0]
    assert "| plain | plain |" in capsys.readouterr().out


@pytest.mark.parametrize(("spec", "text"), [
    ("nocolon", "expected pkg.module:factory"),
    ("{m}:missing", "has no 'missing'"),
    ("gb_no_such_module_here:problem", "cannot import 'gb_no_such_module_here'"),
    ("{m}:not_a_dict", "not_a_dict() returned a type"),
    ("{m}:Conv", "Conv() returned a Conv"),
])
def test_cli_bad_model_spec_is_one_line(user_folder: str, spec: str, text: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["compare", "--model", spec.format(m=user_folder), "--out", "out",
                 "--no-plot", "--no-tensorboard"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("gradbalance compare: error: --model ") and text in err, err
    assert err.count("\n") == 1


def test_cli_model_refuses_a_full_out_naming_the_option(user_folder: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert main(["compare", "--model", f"{user_folder}:problem", "--out", "out"]) == 2
    assert "error: --out out: the folder is not empty" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["keep.txt"]


def test_the_docstring_example_runs() -> None:
    import doctest

    from gradbalance_lab import _own_compare

    outcome = doctest.testmod(_own_compare, optionflags=doctest.ELLIPSIS)
    assert outcome.attempted >= 6 and outcome.failed == 0
