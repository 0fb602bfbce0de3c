"""Lightning checkpoints hold the balanced step's state: two epochs straight equal a fresh
``Trainer`` resumed with ``ckpt_path=`` from the checkpoint written after the first epoch,
bit for bit."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from support.loop_state import assert_same_state

pl = pytest.importorskip("lightning.pytorch")
pytestmark = pytest.mark.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

from support.lightning import (  # noqa: E402
    ResumableModule,
    ddp_resume_main,
    final_state,
    fit,
)

DDP_TIMEOUT = 240  # seconds for the whole ddp_spawn scenario (two fits of two processes)


def _assert_moved(state: dict[str, Any], method: str) -> None:
    """The run trained and the saved parts left their initial state, so a resume that lost
    them would differ."""
    start = ResumableModule(method)
    for name, p in start.net.named_parameters():
        assert not torch.equal(p, state["params"][name]), name
    objects = state["balanced"]["objects"]
    assert objects["buffer"]["steps_begun"] > 0
    if method == "gradvac":
        assert objects["balancer"]["targets"].abs().sum() > 0
        assert objects["clip"]["count"] > 0  # the row clipper's norm history
    else:
        assert not torch.equal(objects["weighting"]["task_weights"],
                               torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "16-mixed-cpu"])
@pytest.mark.parametrize("method", ["gradvac", "gradnorm"])
def test_resume_equals_the_straight_run(tmp_path: Path, method: str, precision: str) -> None:
    straight_module = ResumableModule(method)
    straight = fit(straight_module, 2, str(tmp_path / "straight"), precision=precision)
    ckpt = tmp_path / "straight" / "e0.ckpt"  # written after the first epoch
    saved = torch.load(ckpt, weights_only=True)
    assert "balanced._extra_state" in saved["state_dict"]  # in Lightning's own file

    resumed_module = ResumableModule(method, seed=99)  # other weights, other generator
    resumed = fit(resumed_module, 2, str(tmp_path / "resumed"), precision=precision,
                  ckpt_path=str(ckpt))

    assert resumed.global_step == straight.global_step == 6
    expected = final_state(straight_module)
    _assert_moved(expected, method)
    assert_same_state(final_state(resumed_module), expected)
    for name, value in straight.callback_metrics.items():  # the last step's logged scalars
        assert torch.equal(resumed.callback_metrics[name], value), name
    if precision == "16-mixed-cpu":
        assert_same_state(resumed.precision_plugin.scaler.state_dict(),
                          straight.precision_plugin.scaler.state_dict())


def test_a_checkpoint_of_another_method_is_refused(tmp_path: Path) -> None:
    fit(ResumableModule("gradvac"), 1, str(tmp_path))
    with pytest.raises(Exception, match="weighting"):
        fit(ResumableModule("gradnorm"), 2, str(tmp_path / "other"),
            ckpt_path=str(tmp_path / "e0.ckpt"))


@pytest.mark.parametrize("method", ["gradnorm"])
def test_ddp_spawn_resume_equals_the_straight_run(tmp_path: Path, method: str) -> None:
    """Under ``ddp_spawn`` (2 CPU processes, in a subprocess with a timeout): every rank of
    the resumed run ends where the straight run's ranks end, bit for bit."""
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    code = ("from support.lightning import ddp_resume_main; "
            f"ddp_resume_main({str(tmp_path)!r}, {method!r})")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=DDP_TIMEOUT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    straight = [torch.load(tmp_path / "straight" / f"rank{r}.pt", weights_only=True)
                for r in range(2)]
    resumed = [torch.load(tmp_path / "resumed" / f"rank{r}.pt", weights_only=True)
               for r in range(2)]
    _assert_moved(straight[0], method)
    assert_same_state(straight[1], straight[0])  # the ranks agree
    for rank in range(2):
        assert_same_state(resumed[rank], straight[0])


assert ddp_resume_main  # imported for the subprocess's benefit: it must import cleanly
