"""Where a command writes its outputs, and the swap that publishes them.

A run into a folder that holds an earlier run's outputs (``--overwrite``) writes into a
sibling staging folder (``<out>.incomplete-XXXX``, or ``<out>/.incomplete-XXXX`` when the
parent folder is not writable or on another file system) and moves its outputs into ``--out``
only once they are complete (:meth:`OutFolder.commit`): until then the earlier outputs stay
as they were, so an interrupted or killed rerun never leaves ``--out`` empty. Each file is
replaced by one atomic ``os.replace``; a folder (``tb/``) is moved aside, then the new one in.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OutFolder", "plan", "staging_folder"]


@dataclass(frozen=True)
class OutFolder:
    """``final`` is ``--out``; the command writes into ``work`` (``final`` itself unless
    :attr:`staged`); ``outputs`` are the names it owns there."""

    final: Path
    work: Path
    outputs: tuple[str, ...]

    @property
    def staged(self) -> bool:
        """Whether the outputs are written aside and moved into ``final`` by :meth:`commit`."""
        return self.work != self.final

    def commit(self) -> None:
        """Publish a staged run: each output of ``work`` replaces the one in ``final``; an
        earlier output this run did not write is removed; ``work`` is deleted. Raises
        :class:`OSError` if a move fails (the outputs not yet moved stay in ``work``)."""
        if not self.staged:
            return
        aside = Path(tempfile.mkdtemp(prefix=".replaced-", dir=self.work))
        for name in self.outputs:
            _swap(self.final / name, self.work / name, aside / name)
        shutil.rmtree(self.work, ignore_errors=True)

    def discard(self) -> None:
        """Delete a staged run's folder (``final`` is left as it was)."""
        if self.staged:
            shutil.rmtree(self.work, ignore_errors=True)


def _is_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _swap(target: Path, new: Path, aside: Path) -> None:
    """Put ``new`` (if it exists) at ``target``; an earlier ``target`` goes to ``aside``."""
    if os.path.lexists(new) and not _is_folder(new) and not _is_folder(target):
        os.replace(new, target)  # one atomic step: target is never missing
        return
    if os.path.lexists(target):
        os.rename(target, aside)
    if os.path.lexists(new):
        os.rename(new, target)


def _same_device(a: Path, b: Path) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev


def staging_folder(final: Path) -> Path:
    """Create and return a new folder where a run replacing ``final``'s outputs writes them:
    a sibling when the parent is writable and on the same file system, else inside."""
    parent = final.absolute().parent
    if os.access(parent, os.W_OK | os.X_OK) and _same_device(parent, final):
        return Path(tempfile.mkdtemp(prefix=f"{final.name}.incomplete-", dir=parent))
    return Path(tempfile.mkdtemp(prefix=".incomplete-", dir=final))


def plan(final: Path, *, overwrite: bool, outputs: Sequence[str]) -> OutFolder:
    """The :class:`OutFolder` of a run into the existing folder ``final``: staged when
    ``overwrite`` and an earlier output is there, else written in place."""
    earlier = overwrite and any(os.path.lexists(final / name) for name in outputs)
    work = staging_folder(final) if earlier else final
    return OutFolder(final, work, tuple(outputs))
