"""``gradbalance figures``: every claim of the two tutorials, regenerated with the library.

Each figure is one module with ``NAME``, ``TITLE``, ``compute(quick) -> dict`` (the measured
numbers and series), ``claims(result) -> list[Claim]`` (each claim of the text beside the
measured value) and ``plot(result, path)``. The command prints every claim with its value,
writes ``<name>.png`` per figure and ``report.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ._common import Claim, Missing

HELP = "regenerate the tutorials' claims with the library: numbers, one PNG per figure, report"

#: figure name -> module (in the order of the text).
FIGURES: dict[str, str] = {
    "loss_scale": "loss_scale",
    "momentum": "momentum",
    "adam_turn": "adam_turn",
    "adam_tilt": "adam_tilt",
    "pcgrad_momentum": "pcgrad_momentum",
    "mgda_noise": "mgda_noise",
    "gradnorm": "gradnorm",
    "weight_decay": "weight_decay",
    "clipping": "clipping",
    "mixed_precision": "mixed_precision",
    "microbatch": "microbatch",
    "logging": "log_scalars",
}


def load(name: str) -> ModuleType:
    """The module of figure ``name``."""
    if name not in FIGURES:
        raise ValueError(f"Unknown figure {name!r}; valid names: {', '.join(FIGURES)}")
    return importlib.import_module(f"{__name__}.{FIGURES[name]}")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", nargs="+", action="extend", choices=list(FIGURES),
                        metavar="NAME",
                        help=f"figures to run (default: all): {', '.join(FIGURES)}")
    parser.add_argument("--quick", action="store_true",
                        help="short runs for smoke tests (seconds per figure)")
    parser.add_argument("--out", type=Path, default=Path("runs/figures"),
                        help="output folder for the PNGs and report.md (default: %(default)s)")
    parser.add_argument("--no-plot", action="store_true", help="numbers and report only")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default: %(default)s)")


def run_one(name: str, quick: bool, out: Path | None, draw: bool = True) -> dict[str, Any]:
    """Compute one figure; returns ``{"name", "title", "claims", "result", "seconds",
    "missing", "png"}``. A missing library piece is reported, not raised."""
    module = load(name)
    start = time.perf_counter()
    entry: dict[str, Any] = {"name": name, "title": module.TITLE, "claims": [],
                             "result": None, "missing": None, "png": None}
    try:
        result = module.compute(quick=quick)
    except Missing as missing:
        entry["missing"] = str(missing)
    else:
        entry["result"] = result
        entry["claims"] = module.claims(result)
        if draw and out is not None:
            png = out / f"{name}.png"
            module.plot(result, png)
            entry["png"] = png
    entry["seconds"] = time.perf_counter() - start
    entry["settings"] = (module.__doc__ or "").strip()
    return entry


def _verdict(claim: Claim) -> str:
    return {True: "met", False: "NOT met", None: "shown"}[claim.met]


def write_report(entries: list[dict[str, Any]], path: Path, quick: bool) -> None:
    """``report.md``: per figure, the settings, then each claim beside the measured value."""
    lines = ["# gradbalance figures: the tutorials' claims, measured", ""]
    size = "--quick (shortened runs)" if quick else "full size"
    lines += [f"Run: {size}, torch {torch.__version__}, CPU.", ""]
    met = sum(c.met is True for e in entries for c in e["claims"])
    unmet = sum(c.met is False for e in entries for c in e["claims"])
    missing = [e["name"] for e in entries if e["missing"]]
    lines += [f"Claims met: {met}; not met: {unmet}; figures waiting on a library piece: "
              f"{', '.join(missing) or 'none'}.", ""]
    for e in entries:
        lines += [f"## {e['title']} (`{e['name']}`, {e['seconds']:.1f} s)", ""]
        if e["missing"]:
            lines += [f"Not run: {e['missing']}.", ""]
            continue
        lines += ["| claim | measured | verdict |", "|---|---|---|"]
        for c in e["claims"]:
            lines.append(f"| {c.text} | {c.measured} | {_verdict(c)} |")
        lines.append("")
        if e["png"] is not None:
            lines += [f"![{e['name']}]({e['png'].name})", ""]
        lines += ["<details><summary>Settings</summary>", "", e["settings"], "", "</details>", ""]
    path.write_text("\n".join(lines), encoding="utf-8")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(max(1, args.threads))
    names = list(dict.fromkeys(args.only)) if args.only else list(FIGURES)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if not args.no_plot:
        from ._common import pyplot

        pyplot()  # fail before any work when matplotlib is missing
    entries = []
    for name in names:
        entry = run_one(name, args.quick, out, draw=not args.no_plot)
        entries.append(entry)
        print(f"== {entry['title']} [{name}, {entry['seconds']:.1f} s]")
        if entry["missing"]:
            print(f"   not run: {entry['missing']}")
        for c in entry["claims"]:
            print(f"   [{_verdict(c):7s}] {c.text}\n             measured: {c.measured}")
    report = out / "report.md"
    write_report(entries, report, args.quick)
    print(f"wrote {report}")
    return 0


__all__ = ["FIGURES", "HELP", "Claim", "configure", "load", "run", "run_one", "write_report"]
