"""Pieces every ``gradbalance`` command shares: number parsers and the output folder.

An output folder (``--out``) is checked before any work: it must be a folder that exists or
can be created, and that can be written. An existing folder that holds anything is refused
unless ``--overwrite`` is given; then the run writes aside and its outputs replace the files
and folders the command family writes (``outputs``) only once complete
(:mod:`gradbalance_lab._out_folder`); everything else there is left alone.

Every integer option has a range (:func:`int_at_least`, at most :data:`INT64_MAX` unless a
smaller bound is given): a value outside it is argparse's one-line error, exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from gradbalance_lab._out_folder import OutFolder, plan

__all__ = [
    "INT64_MAX",
    "MAX_THREADS",
    "OVERWRITE_HELP",
    "OutputError",
    "check_file",
    "check_out",
    "commit_out",
    "int_at_least",
    "prepare_out",
    "remove_run_logs",
    "write_atomic",
]

#: The largest value torch's integer arguments (sizes, seeds) take.
INT64_MAX = 2**63 - 1

#: The most torch CPU threads ``--threads`` sets.
MAX_THREADS = 1_024

#: ``--overwrite``'s help, completed by each command with the names it replaces.
OVERWRITE_HELP = ("use an --out folder that already holds files: the outputs of an earlier "
                  "run there ({names}) are replaced once the new ones are complete (until then "
                  "the new ones are written in a sibling <out>.incomplete-* folder); other "
                  "files are kept")


class OutputError(Exception):
    """An output path the command cannot use; the message is one line naming it."""


def int_at_least(low: int, high: int = INT64_MAX) -> Callable[[str], int]:
    """Parser of an int in ``[low, high]`` with argparse's one-line error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int: {text!r}") from None
        if not low <= value <= high:
            bound = f">= {low}" if value < low else f"<= {high}"
            raise argparse.ArgumentTypeError(f"invalid value: {value} (expected an int {bound})")
        return value
    return parse


def _existing_ancestor(path: Path) -> Path:
    """The nearest ancestor of ``path`` (itself excluded) that exists."""
    for parent in path.absolute().parents:
        if os.path.lexists(parent):
            return parent
    return Path(path.absolute().anchor)


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK)


def _listing(path: Path, option: str) -> list[str]:
    try:
        return sorted(entry.name for entry in path.iterdir())
    except OSError as error:
        raise OutputError(f"{option} {path}: cannot list the folder ({error.strerror})") from None


def check_out(path: Path, *, overwrite: bool, option: str = "--out") -> None:
    """Raise :class:`OutputError` unless ``path`` can receive a fresh run's outputs.

    Touches nothing: a missing folder must be creatable (its nearest existing ancestor a
    writable folder); an existing one must be a writable folder, empty unless ``overwrite``.
    """
    if os.path.lexists(path) and not path.exists():
        raise OutputError(f"{option} {path}: is a broken symbolic link")
    if not path.exists():
        parent = _existing_ancestor(path)
        if not parent.is_dir():
            raise OutputError(f"{option} {path}: cannot create the folder: {parent} is a file")
        if not _writable(parent):
            raise OutputError(
                f"{option} {path}: cannot create the folder: {parent} is not writable")
        return
    if not path.is_dir():
        kind = "a file" if path.is_file() else "not a folder"
        raise OutputError(f"{option} {path}: is {kind}; give a folder")
    if not _writable(path):
        raise OutputError(f"{option} {path}: the folder is not writable")
    names = _listing(path, option)
    if names and not overwrite:
        shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
        raise OutputError(
            f"{option} {path}: the folder is not empty ({shown}); pass --overwrite to replace "
            f"an earlier run's outputs there, or give a new or empty folder")


def prepare_out(path: Path, *, overwrite: bool, outputs: Sequence[str],
                option: str = "--out") -> OutFolder:
    """Check ``path`` again, create it and return where the run writes.

    With ``overwrite`` and an earlier run's ``outputs`` in ``path``, the run writes into a
    new staging folder and :meth:`OutFolder.commit` swaps its outputs in at the end; nothing
    in ``path`` is deleted here. A file is then created and removed in the folder written,
    so that a folder that only looked writable fails here, before any work, with
    :class:`OutputError`.
    """
    check_out(path, overwrite=overwrite, option=option)
    folder = None
    try:
        path.mkdir(parents=True, exist_ok=True)
        folder = plan(path, overwrite=overwrite, outputs=outputs)
        with tempfile.TemporaryFile(dir=folder.work):
            pass
    except OSError as error:
        if folder is not None:
            folder.discard()
        raise OutputError(f"{option} {path}: cannot write there "
                          f"({error.strerror or error})") from None
    return folder


def commit_out(folder: OutFolder, option: str = "--out") -> None:
    """:meth:`OutFolder.commit`, a failed move raised as :class:`OutputError`."""
    try:
        folder.commit()
    except OSError as error:
        raise OutputError(f"{option} {folder.final}: cannot move the new outputs in "
                          f"({error.strerror or error}); those not moved are in "
                          f"{folder.work}") from None


def check_file(path: Path, option: str, *, not_in: Path | None = None) -> None:
    """Raise :class:`OutputError` unless ``path`` can be written as a file (its folder
    exists); an existing file there is replaced. ``not_in``: the command's output folder,
    which ``path`` must not be (it becomes a folder). The folder is probed by creating and
    removing a file in it: permission bits do not say what a read-only file system or
    ``/sys`` refuses."""
    if not_in is not None and path.absolute() == not_in.absolute():
        raise OutputError(f"{option} {path}: is the output folder; give a file name")
    if path.is_dir():
        raise OutputError(f"{option} {path}: is a folder; give a file name")
    parent = path.absolute().parent
    if not parent.is_dir():
        what = "does not exist" if not os.path.lexists(parent) else "is not a folder"
        raise OutputError(f"{option} {path}: its folder {parent} {what}")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{option} {path}: the file is not writable")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{path.name}."):
            pass
    except OSError as error:
        raise OutputError(f"{option} {path}: its folder {parent} cannot be written "
                          f"({error.strerror or error})") from None


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` (UTF-8), or, if writing fails, what it held before: the text
    goes to a new file in the folder of the file ``path`` names (through a symbolic link),
    renamed over it, with its permissions (a new file: those the umask gives)."""
    target = Path(os.path.realpath(path))
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(temp, stat.S_IMODE(os.stat(target).st_mode) if target.exists()
                 else 0o666 & ~_umask())
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask (read by setting it and back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def remove_run_logs(folder: Path) -> None:
    """Delete the TensorBoard folder of a run Ctrl-C cut short (``tb/<method>/seed<N>``),
    and its method's folder when that is left empty."""
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()  # only when empty
