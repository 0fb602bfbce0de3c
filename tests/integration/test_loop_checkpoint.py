"""Checkpoints: a run saved after N steps and resumed in fresh objects continues
bit-identically (model, Adam, GradScaler, balancer, weighting, clippers, generator, RNG)."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from gradbalance import (
    BALANCERS,
    AutoClip,
    RunningStats,
    TaskAutoClip,
    TaskGradBuffer,
    capture_state,
    load_checkpoint,
    restore_state,
    save_checkpoint,
    stats_to_dict,
)
from gradbalance.balancers import Sum
from gradbalance.checkpoint import CheckpointError
from support.helpers import build, losses_of
from support.loop_state import assert_same_state

K, TOTAL, SAVE_AT, OVERFLOW_AT = 3, 6, 3, 4


def _objects(spec: str, seed: int) -> dict:
    """Fresh objects for a run; ``seed`` changes every initial value a load must overwrite."""
    model, _, _ = build("mlp", num_tasks=K, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    if spec == "gradnorm":
        from gradbalance.weighting import WEIGHTINGS

        if "gradnorm" not in WEIGHTINGS:
            pytest.skip("GradNorm is not in the weighting registry")
        balancer, weighting = Sum(), WEIGHTINGS["gradnorm"](K, model.trunk)
    else:
        if spec not in BALANCERS:
            pytest.skip(f"balancer {spec!r} is not in the registry")
        kwargs = {"generator": gen} if spec == "pcgrad" else {}
        balancer, weighting = BALANCERS[spec](num_tasks=K, **kwargs), None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    assert scaler.is_enabled()
    return {
        "model": model,
        "optimizer": torch.optim.Adam(model.parameters(), lr=1e-2),
        "scaler": scaler,
        "balancer": balancer,
        "weighting": weighting,
        "row_clip": TaskAutoClip(percentile=50, history_size=4),
        "clipper": AutoClip(percentile=25, history_size=3),
        "running": RunningStats(window=3),
        "generator": gen,
    }


def _train(o: dict, start: int, stop: int) -> list[dict[str, float]]:
    gen = torch.Generator().manual_seed(0)  # fixed data; build() would reseed torch's RNG
    x0, y = torch.randn(8, 16, generator=gen), torch.randn(8, K, generator=gen)
    model, opt, scaler = o["model"], o["optimizer"], o["scaler"]
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    logs = []
    for step in range(start, stop):
        # the global RNGs drive the data: the resumed run must restore them
        x = x0 + 0.1 * torch.randn(x0.shape) + random.random() + float(np.random.rand())
        factor = 1e38 if step == OVERFLOW_AT else 1.0  # one skipped step after the resume
        losses = losses_of(model, x, y) * torch.tensor([1.0, factor, 1.0])
        if o["weighting"] is not None:
            losses = o["weighting"](losses, scaler=scaler)
        buf.backward(losses, scaler=scaler)
        stats = buf.apply_(o["balancer"], scaler=scaler, clip=o["row_clip"])
        s = scaler.get_scale()
        scaler.unscale_(opt)
        pre_clip = o["clipper"](model.parameters())
        scaler.step(opt)
        scaler.update()
        skipped = scaler.get_scale() < s
        assert skipped == (step == OVERFLOW_AT)
        if o["weighting"] is not None:
            o["weighting"].update(found_inf=skipped)
        opt.zero_grad(set_to_none=True)
        scalars = stats_to_dict(stats, pre_clip=pre_clip, amp_skipped=skipped)
        scalars.update(o["running"].update(scalars))
        logs.append(scalars)
    return logs


def _states(o: dict) -> dict:
    return capture_state(rng=False, **o)["objects"]


@pytest.mark.parametrize("spec", ["gradvac", "pcgrad", "gradnorm"])
def test_resume_is_bit_identical(spec: str) -> None:
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    straight = _objects(spec, seed=0)
    logs_straight = _train(straight, 0, TOTAL)

    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    first = _objects(spec, seed=0)
    logs_first = _train(first, 0, SAVE_AT)
    file = io.BytesIO()
    save_checkpoint(file, step=SAVE_AT - 1, **first)
    torch.manual_seed(123), random.seed(123), np.random.seed(123)  # a new process's RNGs

    resumed = _objects(spec, seed=99)
    file.seek(0)
    meta = load_checkpoint(file, **resumed)
    assert meta["step"] == SAVE_AT - 1
    logs_resumed = _train(resumed, meta["step"] + 1, TOTAL)

    for p, q in zip(straight["model"].parameters(), resumed["model"].parameters()):
        assert torch.equal(p, q)
    assert_same_state(_states(resumed), _states(straight))
    np.testing.assert_equal(logs_first + logs_resumed, logs_straight)  # NaN == NaN here


def test_a_refused_save_keeps_the_file_to_resume_from(tmp_path) -> None:
    """A run saved to a file, then a later save refused (a NumPy value in ``extra``): the file
    still holds the first save, and the run resumed from it continues bit-identically."""
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    straight = _objects("pcgrad", seed=0)
    logs_straight = _train(straight, 0, TOTAL)

    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    first = _objects("pcgrad", seed=0)
    logs_first = _train(first, 0, SAVE_AT)
    path = tmp_path / "run.pt"
    save_checkpoint(path, step=SAVE_AT - 1, **first)
    saved = path.read_bytes()
    _train(first, SAVE_AT, SAVE_AT + 1)
    with pytest.raises(CheckpointError, match=r"extra\['loss'\] has type numpy\.float32"):
        save_checkpoint(path, step=SAVE_AT, extra={"loss": np.float32(0.5)}, **first)
    assert path.read_bytes() == saved and sorted(tmp_path.iterdir()) == [path]

    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    resumed = _objects("pcgrad", seed=99)
    meta = load_checkpoint(path, **resumed)
    assert meta["step"] == SAVE_AT - 1
    logs_resumed = _train(resumed, SAVE_AT, TOTAL)
    assert_same_state(_states(resumed), _states(straight))
    np.testing.assert_equal(logs_first + logs_resumed, logs_straight)


def test_resume_without_rng_or_balancer_state_differs() -> None:
    # Sensitivity of the test above: leaving out the RNGs or Adam's moments changes the
    # weights; leaving out GradVac's EMA targets changes its final state.
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    straight = _objects("gradvac", seed=0)
    _train(straight, 0, TOTAL)
    for leave_out in ("rng", "optimizer", "balancer"):
        torch.manual_seed(7), random.seed(7), np.random.seed(7)
        first = _objects("gradvac", seed=0)
        _train(first, 0, SAVE_AT)
        checkpoint = capture_state(**first)
        if leave_out == "rng":
            del checkpoint["rng"]
        else:
            del checkpoint["objects"][leave_out]
        torch.manual_seed(123), random.seed(123), np.random.seed(123)
        resumed = _objects("gradvac", seed=99)
        restore_state(checkpoint, strict=leave_out == "rng", **resumed)
        _train(resumed, SAVE_AT, TOTAL)
        if leave_out == "balancer":
            with pytest.raises(AssertionError):
                assert_same_state(resumed["balancer"].state_dict(),
                                  straight["balancer"].state_dict())
        else:
            same = all(torch.equal(p, q) for p, q in
                       zip(straight["model"].parameters(), resumed["model"].parameters()))
            assert not same, leave_out


def test_strict_names_and_errors(tmp_path) -> None:
    gen = torch.Generator().manual_seed(0)
    save_checkpoint(tmp_path / "c.pt", generator=gen, clipper=AutoClip())
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['scaler'\]"):
        load_checkpoint(tmp_path / "c.pt", generator=gen, clipper=AutoClip(),
                        scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(CheckpointError, match=r"saved but not given: \['clipper'\]"):
        load_checkpoint(tmp_path / "c.pt", generator=gen)
    fresh = torch.Generator().manual_seed(1)  # loads first, then is put back
    state = fresh.get_state()
    with pytest.raises(CheckpointError, match=r"c\.pt: entry 'clipper' does not load into the "
                                              r"Sum given.*nothing was changed"):
        load_checkpoint(tmp_path / "c.pt", generator=fresh, clipper=Sum())
    assert torch.equal(fresh.get_state(), state) and not torch.equal(state, gen.get_state())
    with pytest.raises(CheckpointError, match="without state_dict"):
        save_checkpoint(tmp_path / "d.pt", thing=object())
    assert not (tmp_path / "d.pt").exists()


def test_rng_round_trip() -> None:
    from gradbalance.checkpoint import get_rng_state, set_rng_state

    state = get_rng_state()
    a = (torch.rand(3), random.random(), np.random.rand())
    set_rng_state(state)
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
