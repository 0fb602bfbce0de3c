"""``gradbalance figures``: every claim of the two tutorials, regenerated with the library.

Each figure is one module with ``NAME``, ``TITLE``, ``compute(quick) -> dict`` (the measured
numbers and series), ``claims(result) -> list[Claim]`` (each claim of the text beside the
measured value) and ``plot(result, path)``. The command prints every claim with its value,
writes ``<name>.png`` per figure and ``report.md`` into ``--out`` (a new or empty folder, or
one whose earlier figures ``--overwrite`` replaces once the new ones are complete). On Ctrl-C
or SIGTERM the figures that finished are reported and the command exits with 130 (143).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from gradbalance_lab._cli_common import (
    MAX_THREADS,
    OVERWRITE_HELP,
    check_file,
    check_out,
    commit_out,
    int_at_least,
    prepare_out,
    write_atomic,
)
from gradbalance_lab._out_folder import OutFolder
from gradbalance_lab._signals import shielded
from gradbalance_lab.figures._common import Claim, Missing
from gradbalance_lab.figures.register import register_lines, summary, unexpected_unmet

HELP = "regenerate the tutorials' claims with the library: numbers, one PNG per figure, report"

#: figure name -> module (in the order of the text).
FIGURES: dict[str, str] = {
    "task_grads": "task_grads",
    "loss_scale": "loss_scale",
    "optim_rules": "optim_rules",
    "momentum": "momentum",
    "adam_turn": "adam_turn",
    "adam_tilt": "adam_tilt",
    "pcgrad_momentum": "pcgrad_momentum",
    "mgda_noise": "mgda_noise",
    "gradnorm": "gradnorm",
    "weight_decay": "weight_decay",
    "adam_absorb": "adam_absorb",
    "clipping": "clipping",
    "mixed_precision": "mixed_precision",
    "fp16_underflow": "fp16_underflow",
    "amp_cpu": "amp_cpu",
    "microbatch": "microbatch",
    "logging": "log_scalars",
    # the clip tutorial, in its order
    "clip_basics": "clip_basics",
    "clip_explode": "clip_explode",
    "clip_accumulation": "clip_accumulation",
    "clip_threshold": "clip_threshold",
    "clip_nonfinite": "clip_nonfinite",
    "clip_api": "clip_api",
    "clip_amp": "clip_amp",
    "clip_depth": "clip_depth",
    "clip_autoclip": "clip_autoclip",
    "clip_agc": "clip_agc",
    "clip_per_sample": "clip_per_sample",
    "clip_small_tau": "clip_small_tau",
    "clip_ddp": "clip_ddp",
}


_ROLE = re.compile(r":(?:func|class|mod|meth|data):`~?\.?([^`]+)`")


def load(name: str) -> ModuleType:
    """The module of figure ``name``."""
    if name not in FIGURES:
        raise ValueError(f"Unknown figure {name!r}; valid names: {', '.join(FIGURES)}")
    return importlib.import_module(f"{__name__}.{FIGURES[name]}")


def outputs(names: list[str] | None = None) -> list[str]:
    """What a run of the figures ``names`` (default: all) writes into ``--out``:
    ``--overwrite`` replaces these, and leaves the other figures' PNGs there alone."""
    return ["report.md", *(f"{name}.png" for name in (FIGURES if names is None else names))]


def _names(args: argparse.Namespace) -> list[str]:
    """The figures to run, in the order ``--only`` gives them (default: all)."""
    return list(dict.fromkeys(args.only)) if args.only else list(FIGURES)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("Ctrl-C (or SIGTERM) stops the command after it writes report.md and the "
                     "PNGs of the figures that finished (exit code 130, 143 for SIGTERM; --doc "
                     "is then left as it was; with --overwrite they go to the "
                     "<out>.incomplete-* folder and the earlier ones are kept).")
    parser.add_argument("--only", nargs="+", action="extend", choices=list(FIGURES),
                        metavar="NAME",
                        help=f"figures to run (default: all): {', '.join(FIGURES)}")
    parser.add_argument("--quick", action="store_true",
                        help="short runs for smoke tests (seconds per figure)")
    parser.add_argument("--out", type=Path, default=Path("runs/figures"),
                        help="output folder for the PNGs and report.md; a folder that already "
                             "holds files is refused unless --overwrite (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true",
                        help=OVERWRITE_HELP.format(
                            names="report.md and the PNGs of the figures run"))
    parser.add_argument("--no-plot", action="store_true", help="numbers and report only")
    parser.add_argument("--doc", type=Path, default=None, metavar="PATH",
                        help="also write the report there, without image links "
                             "(e.g. docs/figures.md; replaced if it exists)")
    parser.add_argument("--threads", type=int_at_least(1, MAX_THREADS), default=1,
                        help=f"torch CPU threads, at most {MAX_THREADS} (default: %(default)s)")


def run_one(name: str, quick: bool, out: Path | None, draw: bool = True) -> dict[str, Any]:
    """Compute one figure; returns ``{"name", "title", "claims", "result", "seconds",
    "missing", "png", "settings"}``. A missing library piece is reported, not raised."""
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
    entry["settings"] = _ROLE.sub(r"`\1`", (module.__doc__ or "").strip()).replace("``", "`")
    return entry


def _verdict(claim: Claim) -> str:
    if claim.met is None and claim.reason:
        return f"not measurable: {claim.reason}"
    return {True: "met", False: "NOT met", None: "shown"}[claim.met]


_INTRO = """Every claim of the two tutorials (balancing inside the training loop; gradient
clipping), regenerated by `gradbalance figures` with the library's own balancers, step,
clipping, weightings and logging. Each section gives the claim as the text states it, the
value measured, and whether the number is met. The verdicts: *met* or *not met* (a comparison
fixed before measuring, with an independent expectation: the text's number as it rounds it, a
closed form, a control run); *not measurable* (with the reason, e.g. the text states no
number); *shown* (a number beside the text, not a verdict); *measured by rows N, M* (a
claim whose words state no quantity beyond the rows named, e.g. a section's summary of two
others: it takes no verdict of its own, so a number is never counted twice, and it is counted
apart, never as met nor as not measured); *not measured* (a claim of a text no figure runs,
with the reason). The *claim register* lists every checkable claim of
the two texts once (section, quoted words, quantity, setup) with its verdict, and its totals
are the report's; the *library checks* (rows marked *(check)*, *control*, *(sensitivity)*
or *(beyond the text)*, and the library's own behaviour) are a separate table and are not
counted. The figures' sections below give every measured row with its value. The settings
chosen where the text leaves them open are under *Settings*. Regenerate this page
and the PNGs with `gradbalance figures --out runs/figures --overwrite --doc docs/figures.md`
(about a minute of CPU on one thread; each figure's time is in its heading; the PNGs land in
the output folder) or add `--quick` for a smoke run. An `--out` folder that already holds
files is refused without `--overwrite`, which replaces only the earlier `report.md` and the
PNGs of the figures it runs (`--only` leaves the others' PNGs there), once the new ones are
complete; an unusable `--doc` is refused before any work, and the page is replaced whole; on
Ctrl-C (or SIGTERM) the figures that finished are reported, `--doc` is left as it was, and
the exit code is 130 (143). The exit code is 1 where a measured row is not met (other than
the two below known not to reproduce the text's number, *not met* in the tables) or a figure
did not run, else 0."""


def write_report(entries: list[dict[str, Any]], path: Path, quick: bool,
                 images: bool = True, planned: int | None = None) -> None:
    """``report.md``: per figure, each claim beside the measured value, then the settings.

    ``planned`` (the figures asked for) marks a report of an interrupted run."""
    lines = ["# gradbalance figures: the tutorials' claims, measured", "", _INTRO, ""]
    if planned is not None and planned > len(entries):
        lines += [f"Interrupted: {len(entries)} of {planned} figures finished.", ""]
    size = "--quick (shortened runs)" if quick else "full size"
    threads = torch.get_num_threads()
    lines += [f"Run: {size}, torch {torch.__version__}, CPU, {threads} thread"
              f"{'s' if threads > 1 else ''}.", ""]
    missing = [e["name"] for e in entries if e["missing"]]
    lines += [f"Figures waiting on a library piece: {', '.join(missing) or 'none'}.", ""]
    lines += register_lines(entries)
    for e in entries:
        lines += [f"## {e['title']} (`{e['name']}`, {e['seconds']:.1f} s)", ""]
        if e["missing"]:
            lines += [f"Not run: {e['missing']}.", ""]
            continue
        lines += ["| claim | measured | verdict |", "|---|---|---|"]
        for c in e["claims"]:
            lines.append(f"| {c.text} | {c.measured} | {_verdict(c)} |")
        lines.append("")
        if images and e["png"] is not None:
            lines += [f"![{e['name']}]({e['png'].name})", ""]
        lines += ["<details><summary>Settings</summary>", "", e["settings"], "", "</details>", ""]
    write_atomic(path, "\n".join(lines))


def _check_paths(args: argparse.Namespace) -> OutFolder:
    """Fail before any work on an unusable ``--out`` or ``--doc`` or a missing matplotlib;
    returns where the figures are written."""
    check_out(args.out, overwrite=args.overwrite)
    if args.doc is not None:
        check_file(args.doc, "--doc", not_in=args.out)
    if not args.no_plot:
        from gradbalance_lab.figures._common import pyplot

        pyplot()  # fail before any work when matplotlib is missing
    return prepare_out(args.out, overwrite=args.overwrite, outputs=outputs(_names(args)))


def _print_entry(entry: dict[str, Any]) -> None:
    print(f"== {entry['title']} [{entry['name']}, {entry['seconds']:.1f} s]")
    if entry["missing"]:
        print(f"   not run: {entry['missing']}")
    for c in entry["claims"]:
        print(f"   [{_verdict(c):7s}] {c.text}\n             measured: {c.measured}")


def _run_all(names: list[str], args: argparse.Namespace,
             work: Path) -> tuple[list[dict[str, Any]], bool]:
    """Run the figures in order, their PNGs into ``work``; returns the finished ones and
    whether Ctrl-C stopped the loop (the PNG of the figure it cut short is removed)."""
    entries: list[dict[str, Any]] = []
    try:
        for name in names:
            entries.append(run_one(name, args.quick, work, draw=not args.no_plot))
            _print_entry(entries[-1])
    except KeyboardInterrupt:
        if len(entries) < len(names):
            (work / f"{names[len(entries)]}.png").unlink(missing_ok=True)
        return entries, True
    return entries, False


def run(args: argparse.Namespace) -> int:
    folder = _check_paths(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # the report names the threads: set while it is written
    try:
        return _run(args, folder)
    except BaseException:
        folder.discard()  # a failure (or a second Ctrl-C) while writing: --out as it was
        raise
    finally:
        torch.set_num_threads(threads)


def _publish(entries: list[dict[str, Any]], planned: int, args: argparse.Namespace,
             folder: OutFolder, interrupted: bool) -> None:
    """``report.md`` into ``folder``, then (all finished) the swap into ``--out`` and ``--doc``;
    interrupted, the message saying what finished and where it is."""
    report = folder.work / "report.md"
    write_report(entries, report, args.quick, planned=planned)
    if interrupted:
        print(f"wrote {report}")
        kept = f"; {args.doc} left as it was" if args.doc is not None else ""
        where = (f"; the earlier outputs in {folder.final}/ are kept" if folder.staged else "")
        print(f"gradbalance figures: interrupted: {len(entries)} of {planned} figures "
              f"finished; {report} and the PNGs hold those only{where}{kept}", file=sys.stderr)
        return
    commit_out(folder)
    print(f"wrote {folder.final / 'report.md'}")
    if args.doc is not None:
        write_report(entries, args.doc, args.quick, images=False)
        print(f"wrote {args.doc}")


def _run(args: argparse.Namespace, folder: OutFolder) -> int:
    names = _names(args)
    entries, interrupted = _run_all(names, args, folder.work)
    with shielded():
        _publish(entries, len(names), args, folder, interrupted)
    if interrupted:
        return 130
    unmet, known = unexpected_unmet(entries)
    missing = [f"{e['name']}: {e['missing']}" for e in entries if e["missing"]]
    print(summary(entries))
    print(f"{len(unmet) + len(known)} measured rows not met ({len(known)} known and documented, "
          f"which do not fail the run), {len(missing)} figures not run")
    for label in unmet:
        print(f"not met: {label}")
    return 1 if unmet or missing else 0


__all__ = ["FIGURES", "HELP", "Claim", "configure", "load", "outputs", "run", "run_one",
           "write_report"]
