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

    def raising():
        raise RuntimeError("no data here")

    def mistyped():
        return dict(build_model=Conv, make_batches=batches, nope=1).items()[0]
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
    ("{m}:raising", "raising() raised RuntimeError: no data here"),
    ("{m}:mistyped", "mistyped() raised TypeError"),
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


def _own(user_folder: str, *options: str) -> list[str]:
    return ["compare", "--model", f"{user_folder}:problem", "--steps", "2", "--seeds", "1",
            "--no-plot", "--no-tensorboard", "--out", "out", *options]


@pytest.mark.parametrize("options", [["--lr", "0.1"], ["--noise", "5"], ["--max-norm", "1"],
                                     ["--per-sample-clip", "1", "--epochs", "3"]])
def test_cli_model_refuses_the_multidigits_options_by_name(
        user_folder: str, tmp_path: Path, options: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    # they were dropped silently: a DP-SGD noise or clip that never ran
    assert main(_own(user_folder, *options)) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradbalance compare: error: --model does not take ")
    assert all(o in err for o in options if o.startswith("--")) and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_cli_model_all_skips_the_balancers_the_model_cannot_take(
        user_folder: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 'all' on two tasks: krum and trimmedmean need more; they stopped the comparison
    with pytest.warns(RuntimeWarning) as record:
        code = main(_own(user_folder, "--balancers", "all", "--weightings", "none",
                         "--timing-rounds", "0", "--quiet"))
    assert code == 0, capsys.readouterr().err
    skipped = sorted(str(w.message).split("'")[1] for w in record)
    assert skipped == ["krum", "trimmedmean"]
    methods = [r["method"] for r in _read(tmp_path / "out" / "summary.csv")]
    assert methods[0] == "plain" and "upgrad" in methods and "krum" not in methods
    assert "sum" in methods  # 'all' is every balancer, sum too
    # named alone, it is an error
    assert main(_own(user_folder, "--balancers", "krum", "--out", "other")) == 2


def test_cli_model_takes_threads_timing_zero_and_quiet(
        user_folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from gradbalance_lab import _own_compare

    seen: list[int] = []
    run = _own_compare.own_run

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(torch.get_num_threads())
        return run(*args, **kwargs)

    monkeypatch.setattr(_own_compare, "own_run", recording)
    threads = torch.get_num_threads()
    assert main(_own(user_folder, "--balancers", "mgda", "--weightings", "none",
                     "--threads", "2", "--timing-rounds", "0", "--quiet")) == 0
    assert seen == [2, 2] and torch.get_num_threads() == threads
    runs = _read(tmp_path / "out" / "runs.csv")
    assert all(float(r["step_ms"]) > 0 for r in runs)  # each run's own median step time
    out = capsys.readouterr().out
    assert "| mgda |" in out and "outputs in" not in out and "tensorboard" not in out


def _stopping(at: int):  # type: ignore[no-untyped-def]
    """An ``own_run`` that sends SIGTERM to this process on its call number ``at``."""
    import os
    import signal

    from gradbalance_lab import _own_compare

    calls: list[int] = []
    run = _own_compare.own_run

    def stopping(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return run(*args, **kwargs)
    return stopping


def test_cli_model_stopped_writes_the_finished_runs(
        user_folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # it exited with "interrupted" alone, the finished runs unwritten and the cut-short run's
    # TensorBoard folder left behind
    monkeypatch.setattr("gradbalance_lab._own_compare.own_run", _stopping(3))
    argv = ["compare", "--model", f"{user_folder}:problem", "--steps", "2", "--seeds", "2",
            "--balancers", "mgda", "--weightings", "none", "--timing-rounds", "0",
            "--no-plot", "--out", "out"]
    assert main(argv) == 143
    err = capsys.readouterr().err
    assert err.endswith("gradbalance compare: interrupted: 2 of 4 runs finished; the summary "
                        "and CSVs in out/ hold those runs only\n"), err
    out = tmp_path / "out"
    assert [(r["method"], r["seed"]) for r in _read(out / "runs.csv")] == [("plain", "0"),
                                                                          ("mgda", "0")]
    assert "(interrupted: 2 of 4 runs finished)" in (out / "summary.md").read_text()
    assert sorted(p.name for p in (out / "tb").iterdir()) == ["mgda", "plain", "summary"]
    assert [p.name for p in (out / "tb" / "plain").iterdir()] == ["seed0"]  # seed 1 removed


def test_cli_model_stopped_overwrite_keeps_the_earlier_outputs(
        user_folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "--model", f"{user_folder}:problem", "--steps", "2", "--seeds", "2",
            "--balancers", "mgda", "--weightings", "none", "--timing-rounds", "0",
            "--no-plot", "--no-tensorboard", "--out", "out", "--overwrite"]
    assert main(argv) == 0
    out = tmp_path / "out"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr("gradbalance_lab._own_compare.own_run", _stopping(2))
    assert main(argv) == 143
    assert "the earlier outputs in out/ are kept" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    [staged] = sorted(tmp_path.glob("out.incomplete-*"))
    assert [r["method"] for r in _read(staged / "runs.csv")] == ["plain"]
