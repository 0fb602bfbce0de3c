"""Pieces every ``gradbalance`` command shares: number parsers and the output folder.

An output folder (``--out``) is checked before any work: it must be a folder that exists or
can be created, and that can be written. An existing folder that holds anything is refused
unless ``--overwrite`` is given; then only the files and folders the command family writes
(``outputs``) are deleted from it before the run, and everything else there is left alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "OVERWRITE_HELP",
    "OutputError",
    "check_file",
    "check_out",
    "int_at_least",
    "prepare_out",
]

#: ``--overwrite``'s help, completed by each command with the names it deletes.
OVERWRITE_HELP = ("use an --out folder that already holds files: first delete the outputs "
                  "of an earlier run there ({names}); other files are kept")


class OutputError(Exception):
    """An output path the command cannot use; the message is one line naming it."""


def int_at_least(low: int) -> Callable[[str], int]:
    """Parser of an int ``>= low`` with argparse's one-line error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"invalid value: {value} (expected an int >= {low})")
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
                option: str = "--out") -> None:
    """Check ``path`` again, create it and, with ``overwrite``, delete ``outputs`` in it.

    A file is then created and removed in the folder, so that a folder that only looked
    writable fails here, before any work, with :class:`OutputError`.
    """
    check_out(path, overwrite=overwrite, option=option)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if overwrite:
            for name in outputs:
                _remove(path / name)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise OutputError(f"{option} {path}: cannot write there "
                          f"({error.strerror or error})") from None


def _remove(entry: Path) -> None:
    if entry.is_symlink() or entry.is_file():
        entry.unlink()
    elif entry.is_dir():
        shutil.rmtree(entry)


def check_file(path: Path, option: str) -> None:
    """Raise :class:`OutputError` unless ``path`` can be written as a file (its folder
    exists); an existing file there is replaced."""
    if path.is_dir():
        raise OutputError(f"{option} {path}: is a folder; give a file name")
    parent = path.absolute().parent
    if not parent.is_dir():
        what = "does not exist" if not os.path.lexists(parent) else "is not a folder"
        raise OutputError(f"{option} {path}: its folder {parent} {what}")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{option} {path}: the file is not writable")
    if not path.exists() and not _writable(parent):
        raise OutputError(f"{option} {path}: its folder {parent} is not writable")
