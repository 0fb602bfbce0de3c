"""Every integer option of the command line has a range: a value outside it (a seed of 2**64,
a negative one, a size torch cannot hold) is one line on stderr and exit code 2, never a
traceback, and nothing is created."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gradbalance_lab.cli import build_parser, main
from lab.test_cli_outputs import COMMANDS, _one_error_line

pytest.importorskip("sklearn")


def _integer_options() -> list[tuple[str, str, int]]:
    """(command, option, default) of every option whose default is an int."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for command, parser in sub.choices.items():
        for action in parser._actions:
            default = action.default
            if isinstance(default, int) and not isinstance(default, bool):
                found.append((command, action.option_strings[-1], default))
    return found


INTEGER_OPTIONS = _integer_options()


def test_the_integer_options_are_found() -> None:
    names = {(c, o) for c, o, _ in INTEGER_OPTIONS}
    assert {("compare", "--data-seed"), ("train", "--seeds"), ("figures", "--threads"),
            ("compare", "--n-train"), ("train", "--log-every")} <= names


@pytest.mark.parametrize("value", [str(2**64), str(2**63), "-1", str(-(2**64)), "10" * 30])
@pytest.mark.parametrize(("command", "option", "default"), INTEGER_OPTIONS)
def test_out_of_range_is_one_line(command: str, option: str, default: int, value: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    if option == "--data-seed" and value == str(2**63):
        pytest.skip("2**63 is a valid data seed (up to 2**64 - 1)")
    with pytest.raises(SystemExit) as info:
        main([command, f"{option}={value}"])
    assert info.value.code == 2
    line = _one_error_line(capsys.readouterr().err, command)
    bound = ">= " if int(value) < 0 else "<= "
    assert f"argument {option}: invalid value: {int(value)} (expected an int {bound}" in line


@pytest.mark.parametrize("seed", [0, 2**32, 2**63, 2**64 - 1])
def test_every_seed_torch_takes_is_accepted(seed: int) -> None:
    args = build_parser().parse_args(["compare", "--data-seed", str(seed)])
    assert args.data_seed == seed


@pytest.mark.parametrize(("option", "value", "words"), [
    ("--n-train", 2**63 - 1, "--n-train 9223372036854775807 and --n-test 40: the data"),
    ("--n-test", 10**12, "--n-train 96 and --n-test 1000000000000: the data"),
    ("--hidden", 2**63 - 1, "--hidden 9223372036854775807 and --depth 2: the model"),
    ("--hidden", 10**10, "--hidden 10000000000 and --depth 2: the model"),
])
def test_sizes_beyond_memory_are_one_line(option: str, value: int, words: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "unused"
    assert main([*COMMANDS["compare"], option, str(value), "--out", str(out)]) == 2
    line = _one_error_line(capsys.readouterr().err, "compare")
    assert words in line and "does not fit in this machine's memory" in line
    assert not out.exists()


def test_the_largest_seed_trains(tmp_path: Path) -> None:
    argv = [*COMMANDS["train"], "--data-seed", str(2**64 - 1), "--out", str(tmp_path)]
    assert main(argv) == 0
    assert (tmp_path / "runs.csv").exists()


@pytest.mark.parametrize(("argv", "words"), [
    (["train", "--balancer", ""], "argument --balancer: invalid name: ''"),
    (["train", "--weighting", "  "], "argument --weighting: invalid name: '  '"),
    (["compare", "--balancers", ""], "Invalid --balancers: ''"),
    (["compare", "--balancers", ",,,"], "Invalid --balancers: ',,,'"),
    (["compare", "--weightings", " "], "Invalid --weightings: ' '"),
    (["compare", "--per-sample", "--balancers", ""], "Invalid --balancers: ''"),
])
def test_an_empty_method_name_is_one_line(argv: list[str], words: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    # `train --balancer ""` trained nothing and exited 0; `compare --balancers ""` ran none
    out = tmp_path / "out"
    try:
        code = main([*argv, "--out", str(out)])
    except SystemExit as stop:  # argparse's refusal
        code = stop.code
    assert code == 2
    assert words in _one_error_line(capsys.readouterr().err, argv[0])
    assert not out.exists()
