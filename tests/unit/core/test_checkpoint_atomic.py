"""Checkpoints are never lost: atomic saves, refused values, clear load errors, all-or-nothing
restores. Faults are injected in the writer and by killing a saving process."""

from __future__ import annotations

import io
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gradbalance.balancers import GradVac, PCGrad
from gradbalance.checkpoint import (
    CheckpointError,
    CheckpointNotFoundError,
    capture_state,
    get_rng_state,
    load_checkpoint,
    restore_state,
    save_checkpoint,
)
from support.loop_state import assert_same_state

N = 4096  # elements of the test tensor: a file of some size, so a write can stop inside it
BIG = 1_000_000  # elements saved by a process that is killed (4 MB: saves take a while)


def _save(path: Path | io.BytesIO, step: int, **objects: Any) -> None:
    save_checkpoint(path, step=step, rng=False, extra={"w": torch.full((N,), float(step))},
                    **objects)


def _assert_whole(path: Path, step: int) -> None:
    meta = load_checkpoint(path, strict=False)
    assert meta["step"] == step and torch.equal(meta["extra"]["w"], torch.full((N,), float(step)))


def _only(folder: Path, *names: str) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)


# -- a failing save leaves the previous file ------------------------------------------------


class _Boom(Exception):
    pass


def _half_written(exc: BaseException) -> Any:
    """A ``torch.save`` that writes half a checkpoint into its file, then raises ``exc``."""
    real = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        buffer = io.BytesIO()
        real(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        raise exc

    return save


@pytest.mark.parametrize("exc", [_Boom("disk full"), KeyboardInterrupt()],
                         ids=["error", "interrupt"])
def test_a_write_failing_mid_file_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch,
                                                                exc: BaseException) -> None:
    path = tmp_path / "run.pt"
    _save(path, 1)
    before = path.read_bytes()
    monkeypatch.setattr(torch, "save", _half_written(exc))
    with pytest.raises(type(exc)):
        _save(path, 2)
    monkeypatch.undo()
    assert path.read_bytes() == before
    _only(tmp_path, "run.pt")
    _assert_whole(path, 1)


@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_a_failing_sync_or_rename_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch,
                                                                where: str) -> None:
    path = tmp_path / "run.pt"
    _save(path, 1)
    before = path.read_bytes()

    def fail(*args: Any) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, where, fail)
    with pytest.raises(OSError, match="Input/output"):
        _save(path, 2)
    monkeypatch.undo()
    assert path.read_bytes() == before
    _only(tmp_path, "run.pt")


def test_the_file_and_its_folder_are_synced_before_and_after_the_rename(tmp_path: Path,
                                                                        monkeypatch) -> None:
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        assert Path(src).parent == Path(dst).parent == tmp_path  # same folder: atomic
        calls.append("replace")
        real_replace(src, dst)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to tell a folder's descriptor from a file's")
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _save(tmp_path / "run.pt", 1)
    assert calls == ["file", "replace", "dir"]


def test_permissions_and_symbolic_links_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "run.pt"
    _save(path, 1)
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()
    path.chmod(0o640)
    _save(path, 2)
    assert path.stat().st_mode & 0o777 == 0o640
    link = tmp_path / "latest.pt"
    link.symlink_to(path)
    _save(link, 3)
    assert link.is_symlink() and os.readlink(link) == str(path)
    _assert_whole(path, 3)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_save_into_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        _save(tmp_path / "nope" / "run.pt", 1)
    _only(tmp_path)


def test_an_open_file_still_works() -> None:
    buffer = io.BytesIO()
    model = torch.nn.Linear(2, 2)
    save_checkpoint(buffer, step=4, model=model)
    buffer.seek(0)
    fresh = torch.nn.Linear(2, 2)
    assert load_checkpoint(buffer, model=fresh)["step"] == 4
    assert torch.equal(fresh.weight, model.weight)


# -- a killed save leaves a whole checkpoint -------------------------------------------------

_CHILD = textwrap.dedent("""
    import sys, time, torch
    from gradbalance import save_checkpoint
    path, n = sys.argv[1], int(sys.argv[2])
    step = 0
    while True:
        step += 1
        start = time.monotonic()
        save_checkpoint(path, step=step, rng=False, extra={"w": torch.full((n,), float(step))})
        print(step, time.monotonic() - start, flush=True)
""")
TRIALS = 4


def _readable(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    assert proc.stdout is not None
    return bool(select.select([proc.stdout], [], [], timeout)[0])


def _last_save_time(proc: subprocess.Popen[bytes]) -> float:
    """Read the child's reports up to now (at least two saves); the last save's duration."""
    assert proc.stdout is not None
    durations: list[float] = []
    deadline = time.monotonic() + 120
    while len(durations) < 2 or _readable(proc, 0):
        line = proc.stdout.readline() if _readable(proc, deadline - time.monotonic()) else b""
        if not line:
            pytest.fail("the saving process stopped reporting saves")
        durations.append(float(line.split()[1]))
    return durations[-1]


def _kill_trials(tmp_path: Path, script: Path, first: int) -> int:
    """``TRIALS`` processes saving in a loop, each killed at a random (seeded) moment; checks
    every file is one whole checkpoint and returns how many kills landed inside a save."""
    paths = [tmp_path / f"trial{trial}" / "run.pt" for trial in range(first, first + TRIALS)]
    for path in paths:
        path.parent.mkdir()
    procs = [subprocess.Popen([sys.executable, str(script), str(path), str(BIG)],
                              stdout=subprocess.PIPE, bufsize=0) for path in paths]
    try:  # started together: one interpreter start-up for all trials
        for trial, proc in enumerate(procs, start=first):
            period = _last_save_time(proc)
            time.sleep(random.Random(trial).uniform(0, 1.5 * period))
            proc.kill()
            proc.wait(timeout=30)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)
    interrupted = 0
    for path in paths:
        meta = load_checkpoint(path, strict=False)
        assert meta["step"] >= 2
        assert torch.equal(meta["extra"]["w"], torch.full((BIG,), float(meta["step"])))
        leftovers = [p.name for p in path.parent.iterdir() if p.name != "run.pt"]
        assert all(name.startswith(".run.pt.") and name.endswith(".tmp") for name in leftovers)
        interrupted += bool(leftovers)
    return interrupted


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_process_killed_mid_save_leaves_a_whole_checkpoint(tmp_path: Path) -> None:
    """Processes saving a 4 MB checkpoint in a loop are killed (SIGKILL) at random moments
    (seeded): each file is one whole checkpoint, the last or the one before. Before atomic
    saves, every trial left a file that no longer loaded (EOFError). On a loaded machine a
    round of kills may land only between saves; up to three rounds run until one lands
    inside a save, so the test always exercises the interrupted write."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    interrupted = 0
    for round_ in range(3):
        interrupted += _kill_trials(tmp_path, script, round_ * TRIALS)
        if interrupted:
            break
    assert interrupted >= 1, "no kill landed inside a save: the test exercised nothing"


# -- values a checkpoint could not load back are refused before writing --------------------


class _Opaque:
    pass


@pytest.mark.parametrize(("extra", "path", "kind", "fix"), [
    ({"a": np.zeros(3)}, r"extra\['a'\]", "numpy.ndarray", "torch.from_numpy"),
    ({"m": {"lr": [1.0, np.float64(2.0)]}}, r"extra\['m'\]\['lr'\]\[1\]", "numpy.float64",
     r"\.item\(\)"),
    ({"o": _Opaque()}, r"extra\['o'\]", "_Opaque", "add_safe_globals"),
    ({"f": lambda: 0}, r"extra\['f'\]", "function", "pickled"),
    ({"s": {1, frozenset()}}, r"extra\['s'\]\[\d\]", "frozenset", "plain Python values"),
    ({np.int64(3): 1}, r"extra \(the key [^)]*3\)+", "numpy.int64", r"\.item\(\)"),
], ids=["ndarray", "numpy-scalar", "object", "lambda", "frozenset", "numpy-key"])
def test_an_unloadable_extra_is_refused_before_anything_is_written(
        tmp_path: Path, extra: dict, path: str, kind: str, fix: str) -> None:
    target = tmp_path / "run.pt"
    _save(target, 1)
    before = target.read_bytes()
    with pytest.raises(CheckpointError, match=rf"{path} has type .*{kind}.*{fix}.*Nothing was"):
        save_checkpoint(target, step=2, extra=extra)
    assert target.read_bytes() == before
    _only(tmp_path, "run.pt")
    with pytest.raises(CheckpointError):
        save_checkpoint(tmp_path / "new.pt", extra=extra)
    _only(tmp_path, "run.pt")


def test_an_unloadable_state_or_step_is_refused(tmp_path: Path) -> None:
    class Holder:
        def state_dict(self) -> dict[str, Any]:
            return {"ok": torch.ones(1), "bad": np.ones(2)}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    with pytest.raises(CheckpointError, match=r"thing\.state_dict\(\)\['bad'\] has type numpy"):
        save_checkpoint(tmp_path / "a.pt", thing=Holder())
    with pytest.raises(CheckpointError, match=r"step has type numpy\.int64.*\.item\(\)"):
        save_checkpoint(tmp_path / "a.pt", step=np.int64(3))
    _only(tmp_path)


def test_every_loadable_value_is_accepted_and_comes_back(tmp_path: Path) -> None:
    extra = {
        "tensor": torch.arange(3), "param": torch.nn.Parameter(torch.ones(2)),
        "dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3]),
        "ordered": OrderedDict(b=1, a=2), "set": {1, 2}, (1, "tuple key"): (None, True),
        "numbers": [1, 2.5, 3j, 2**70, float("inf")], "bytes": b"\x00\x01", "text": "é",
    }
    cyclic: list[Any] = [1]
    cyclic.append(cyclic)
    save_checkpoint(tmp_path / "a.pt", extra={**extra, "cyclic": cyclic})
    back = load_checkpoint(tmp_path / "a.pt", strict=False)["extra"]
    assert back["cyclic"][1] is back["cyclic"]
    del back["cyclic"]
    assert_same_state(back, extra)


def test_a_class_allowed_by_torch_is_accepted(tmp_path: Path) -> None:
    with torch.serialization.safe_globals([_Opaque]):
        save_checkpoint(tmp_path / "a.pt", extra={"o": _Opaque()})
        assert isinstance(load_checkpoint(tmp_path / "a.pt", strict=False)["extra"]["o"],
                          _Opaque)


# -- an unreadable file raises one clear error -----------------------------------------------


def _checkpoint_bytes() -> bytes:
    buffer = io.BytesIO()
    _save(buffer, 1, balancer=PCGrad(num_tasks=2))
    return buffer.getvalue()


def _foreign(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.pt"
    data = _checkpoint_bytes()
    if kind == "missing":
        pass
    elif kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind.startswith("cut"):
        path.write_bytes(data[: int(len(data) * float(kind[3:]))])
    elif kind == "text":
        path.write_text("step = 3\nloss = 0.25\n")
    elif kind == "other-dict":
        torch.save({"weight": torch.ones(2)}, path)
    elif kind == "list":
        torch.save([torch.ones(2)], path)
    elif kind == "numpy":
        torch.save({"format": 1, "objects": {}, "a": np.ones(2)}, path)
    elif kind == "newer":
        torch.save({"format": 99, "objects": {}}, path)
    return path


KINDS = {
    "missing": "does not exist", "directory": "is a directory", "empty": "is empty",
    "cut0.001": "not a readable checkpoint", "cut0.5": "not a readable checkpoint",
    "cut0.999": "not a readable checkpoint", "text": "not a readable checkpoint",
    "other-dict": r"not a gradbalance checkpoint: it holds a dict with keys \['weight'\]",
    "list": "not a gradbalance checkpoint: it holds a list",
    "numpy": "values other than tensors and plain Python values .*numpy",
    "newer": "format 99",
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_unreadable_file_raises_checkpoint_error(tmp_path: Path, kind: str) -> None:
    path = _foreign(tmp_path, kind)
    balancer = PCGrad(num_tasks=2, generator=torch.Generator().manual_seed(0))
    before = balancer.state_dict()
    with pytest.raises(CheckpointError, match=KINDS[kind]) as info:
        load_checkpoint(path, balancer=balancer)
    message = str(info.value)
    assert str(path) in message
    assert "weights_only=False" not in message and "weights_only` set to `False" not in message
    assert info.value.__cause__ is None or "weights only" not in str(info.value.__cause__).lower()
    assert isinstance(info.value, FileNotFoundError) == (kind == "missing")
    assert isinstance(info.value, CheckpointNotFoundError) == (kind == "missing")
    assert_same_state(balancer.state_dict(), before)


@pytest.mark.parametrize("data", [b"", b"PK\x03\x04", b"not a checkpoint"],
                         ids=["empty", "zip-header", "text"])
def test_an_unreadable_stream_raises_checkpoint_error(data: bytes) -> None:
    with pytest.raises(CheckpointError, match="checkpoint in BytesIO"):
        load_checkpoint(io.BytesIO(data))


def test_restore_state_refuses_what_is_not_a_checkpoint() -> None:
    for bad in ({"weight": torch.ones(1)}, [1], None):
        with pytest.raises(CheckpointError, match="not a gradbalance checkpoint"):
            restore_state(bad)  # type: ignore[arg-type]


# -- restoring is all or nothing -------------------------------------------------------------


def _run_objects(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt,
            "balancer": PCGrad(num_tasks=3, generator=torch.Generator().manual_seed(seed)),
            "generator": torch.Generator().manual_seed(seed)}


def _states(objects: dict[str, Any]) -> dict[str, Any]:
    return capture_state(rng=False, **objects)["objects"]


@pytest.mark.parametrize("damage", ["balancer-type", "generator", "model-shape", "rng"])
def test_a_failing_restore_changes_nothing(tmp_path: Path, damage: str) -> None:
    saved = _run_objects(seed=0)
    checkpoint = capture_state(**saved)
    if damage == "balancer-type":  # the last object refuses: the others were already loaded
        checkpoint["objects"]["balancer"] = GradVac(num_tasks=3).state_dict()
    elif damage == "generator":
        checkpoint["objects"]["generator"] = {"generator_state": torch.zeros(3)}
    elif damage == "model-shape":
        checkpoint["objects"]["model"]["weight"] = torch.zeros(5, 4)
    else:  # objects all load, then the random states fail
        checkpoint["rng"]["python"] = [3, "not a state"]
    save_checkpoint(tmp_path / "a.pt", rng=False, **saved)  # a file path too, below
    fresh = _run_objects(seed=1)
    before, rng_before = _states(fresh), get_rng_state()
    with pytest.raises(CheckpointError, match="nothing was changed"):
        restore_state(checkpoint, **fresh)
    assert_same_state(_states(fresh), before)
    assert_same_state(get_rng_state(), rng_before)
    torch.testing.assert_close(torch.rand(3), (torch.set_rng_state(rng_before["torch"]),
                                               torch.rand(3))[1], rtol=0, atol=0)


def test_a_failing_load_from_a_file_names_the_entry_and_changes_nothing(tmp_path: Path) -> None:
    saved = _run_objects(seed=0)
    saved["balancer"] = GradVac(num_tasks=3)
    save_checkpoint(tmp_path / "a.pt", step=7, **saved)
    fresh = _run_objects(seed=1)
    before = _states(fresh)
    with pytest.raises(CheckpointError,
                       match=r"a\.pt: entry 'balancer' does not load into the PCGrad given "
                             r"\(ValueError: state_dict was saved by a GradVac"):
        load_checkpoint(tmp_path / "a.pt", **fresh)
    assert_same_state(_states(fresh), before)


def test_a_successful_restore_loads_everything(tmp_path: Path) -> None:
    saved = _run_objects(seed=0)
    save_checkpoint(tmp_path / "a.pt", step=7, **saved)
    fresh = _run_objects(seed=1)
    assert load_checkpoint(tmp_path / "a.pt", **fresh)["step"] == 7
    assert_same_state(_states(fresh), _states(saved))


# -- a write-protected checkpoint is refused like torch.save refuses it --------------------


def _outcome(save: Any, path: Path, mode: int) -> tuple[str, bool, int]:
    """Write a previous file with ``mode``, call ``save(path)``: what happened, whether the
    previous bytes are still there, the file's mode after."""
    path.write_bytes(b"previous")
    path.chmod(mode)
    try:
        save(path)
        outcome = "saved"
    except PermissionError:
        outcome = "PermissionError"
    kept = path.read_bytes() == b"previous"
    final = path.stat().st_mode & 0o777
    path.chmod(0o600)
    return outcome, kept, final


@pytest.mark.parametrize("mode", [0o444, 0o400, 0o555, 0o644, 0o600])
def test_a_protected_checkpoint_is_treated_as_torch_save_treats_it(tmp_path: Path,
                                                                   mode: int) -> None:
    """Whatever this process may write (root writes any file), save_checkpoint refuses
    exactly the files torch.save refuses, keeping them whole, and keeps a replaced file's
    mode."""
    ours = _outcome(lambda p: save_checkpoint(p, step=2, rng=False), tmp_path / "ours.pt", mode)
    theirs = _outcome(lambda p: torch.save({"step": 2}, p), tmp_path / "torch.pt", mode)
    assert ours == theirs
    _only(tmp_path, "ours.pt", "torch.pt")


@pytest.mark.parametrize("mode", [0o444, 0o400, 0o555])
@pytest.mark.parametrize("size", [0, 3, 1000])
def test_a_write_protected_checkpoint_is_refused_and_kept(tmp_path: Path, monkeypatch,
                                                          mode: int, size: int) -> None:
    """The OS refuses to open the file for writing (as for any user but root on a 0444
    file): PermissionError naming the fix, the previous file whole, no temporary file."""
    target = tmp_path / "run.pt"
    _save(target, 1)
    target.chmod(mode)
    real_open = os.open

    def refusing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if os.fspath(path) == str(target) and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(PermissionError, match=r"write-protected.*chmod u\+w"):
        save_checkpoint(target, step=2, rng=False, extra={"w": torch.zeros(size)})
    monkeypatch.undo()
    target.chmod(0o600)
    _assert_whole(target, 1)
    _only(tmp_path, "run.pt")


def _three_task_losses(trunk: torch.nn.Module, heads: torch.nn.ModuleList, k: int = 3,
                       seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    features = trunk(torch.randn(5, 4, generator=gen))
    return torch.stack([heads[i](features).pow(2).mean() for i in range(k)])


def test_a_failed_load_leaves_a_buffers_learned_tasks_and_weights_owner() -> None:
    # The buffer loads first and is put back when a later entry refuses: the number of
    # tasks it learned from its losses and the balancer its cached weights belong to are
    # what they were, so it refuses what it refused before the failed load.
    from gradbalance import TaskGradBuffer
    from gradbalance.balancers import MGDA
    torch.manual_seed(0)
    trunk = torch.nn.Linear(4, 8)
    heads = torch.nn.ModuleList(torch.nn.Linear(8, 1) for _ in range(3))
    buf = TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()), update_every=2)
    balancer = MGDA()
    buf.backward(_three_task_losses(trunk, heads))
    buf.apply_(balancer)  # learns K = 3, caches MGDA's weights
    saved = io.BytesIO()
    save_checkpoint(saved, buffer=buf, other=GradVac(num_tasks=3))
    saved.seek(0)
    before = buf.state_dict()
    with pytest.raises(CheckpointError, match="nothing was changed"):
        load_checkpoint(saved, buffer=buf, other=GradVac(num_tasks=2))
    assert_same_state(buf.state_dict(), before)
    assert buf.num_tasks == 3
    with pytest.raises(ValueError, match="losses has 2 tasks but 3 were expected"):
        buf.backward(_three_task_losses(trunk, heads, k=2))
    buf.backward(_three_task_losses(trunk, heads, seed=1))
    with pytest.raises(ValueError, match="another object than the MGDA"):
        buf.apply_(MGDA())
    buf.apply_(balancer)


def test_a_buffer_state_keeps_the_tasks_learned_and_refuses_another_count() -> None:
    from gradbalance import TaskGradBuffer
    torch.manual_seed(0)
    trunk = torch.nn.Linear(4, 8)
    heads = torch.nn.ModuleList(torch.nn.Linear(8, 1) for _ in range(3))
    buf = TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()))
    buf.backward(_three_task_losses(trunk, heads))
    buf.apply_(PCGrad())
    fresh = TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()))
    fresh.load_state_dict(buf.state_dict())
    assert fresh.num_tasks == 3  # as the saved buffer, learned from its losses
    with pytest.raises(ValueError, match="losses has 2 tasks but 3 were expected"):
        fresh.backward(_three_task_losses(trunk, heads, k=2))
    fixed = TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()), num_tasks=2)
    with pytest.raises(ValueError, match=r"state_dict\['num_tasks'\] = 3 but this buffer was "
                                         r"built with num_tasks=2"):
        fixed.load_state_dict(buf.state_dict())
    assert fixed.num_tasks == 2
