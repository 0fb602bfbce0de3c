"""Helpers of the data-parallel tests: a small training run, on one rank or on several.

``run(scenario, rank, world)`` trains the same multitask MLP on the same global batches; on
``world`` ranks each rank takes its shard, on one process the whole batch is used, which is
the reference every data-parallel run must reproduce.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from gradbalance import Balancer, TaskGradBuffer
from gradbalance.balancers import Constant, Mean, Sum
from gradbalance.clip import GhostNorms, PerSampleClip, TaskClip
from gradbalance.distributed import (
    assert_same_across_ranks,
    broadcast_generator_,
    broadcast_parameters_,
    ddp_no_sync,
    sync_weighting_,
)
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses
from support.helpers import optimizer_step

K = 3
GLOBAL_BATCH = 16
SCALES = (1.0, 3.0, 0.3)  # tasks of different scale, so that balancers act


class EmaNormBalancer(Balancer):
    """A stateful, random stand-in balancer: ``w_k = (½ + u_k) · mean(m) / m_k``.

    ``m`` is an EMA of the task-gradient norms and ``u ~ U(0, 1)`` is drawn from the
    balancer's own generator, so both its state and its randomness must agree on every rank.
    """

    from_gramian = True

    def __init__(self, num_tasks: int = K, beta: float = 0.5, seed: int = 0) -> None:
        super().__init__(num_tasks)
        self.beta = beta
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        self.ema = torch.zeros(K, dtype=torch.float64)
        self.steps = torch.zeros((), dtype=torch.int64)
        self.generator = torch.Generator().manual_seed(self.seed)

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        norms = torch.diagonal(gramian).clamp_min(0).sqrt()
        self.ema = norms if int(self.steps) == 0 else self.beta * self.ema + (1 - self.beta) * norms
        self.steps += 1
        noise = torch.rand(K, generator=self.generator, dtype=torch.float64)
        return (0.5 + noise) * self.ema.mean() / self.ema.clamp_min(1e-12)

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.ema.clone(), "steps": self.steps.clone(),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.ema = state_dict["ema"].clone()
        self.steps = state_dict["steps"].clone()
        self.generator.set_state(state_dict["generator"])


def make_balancer(name: str) -> Balancer:
    if name == "sum":
        return Sum()
    if name == "mean":
        return Mean()
    if name == "constant":
        return Constant([0.5, 1.0, 2.0])
    if name == "emanorm":
        return EmaNormBalancer()
    from gradbalance import get_balancer

    if name == "mgda-loss":
        return get_balancer("mgda", num_tasks=K, normalization="loss")
    return get_balancer(name, num_tasks=K)


@dataclass(frozen=True)
class Scenario:
    balancer: str = "sum"
    ddp: bool = False
    micro: int = 1
    steps: int = 4
    amp: bool = False
    inf_step: int = -1  # the last rank's losses get an inf at this step
    naive: bool = False  # K loss.backward(retain_graph=True) under DDP, grads copied
    update_every: int = 1
    mode: str = "matrix"  # "features": gradients of the trunk's output, gathered over ranks;
    # "gramian": linear inputs and output gradients gathered over ranks
    per_sample: bool = False  # PerSampleClip (ghost norms) and DP noise drawn on every rank

    @property
    def key(self) -> str:
        return (f"{self.balancer}-ddp{int(self.ddp)}-micro{self.micro}-amp{int(self.amp)}"
                f"-inf{self.inf_step}-naive{int(self.naive)}-every{self.update_every}"
                f"-{self.mode}-ps{int(self.per_sample)}")


def data(steps: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(steps, GLOBAL_BATCH, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(steps, GLOBAL_BATCH, K, generator=gen, dtype=torch.float64)
    return x, y * torch.tensor(SCALES, dtype=torch.float64)


def flat(params: list[Tensor]) -> Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]


def _naive_step(net: Any, model: MultiTaskModel, balancer: Balancer, x: Tensor,
                y: Tensor) -> None:
    """The pattern DDP breaks: K backward passes, trunk gradients copied between them."""
    shared = model.shared_parameters()
    losses = regression_losses(net(x), y)
    rows = []
    for k in range(K):
        losses[k].backward(retain_graph=True)
        rows.append(flat(shared).clone())
        for p in shared:
            p.grad = None
    g = balancer.combine(torch.stack(rows), losses.detach()).vector
    offset = 0
    for p in shared:
        p.grad = g[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def run(sc: Scenario, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Train ``sc.steps`` steps on this rank's shard; return parameters, state and stats."""
    torch.manual_seed(100 + rank)  # ranks start apart: DDP or broadcast_parameters_ aligns them
    model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, K)).double()
    net: Any = model
    if sc.ddp and world > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
    else:
        broadcast_parameters_(model.parameters())
    weighting = None
    if sc.balancer == "gradnorm":  # a loss weighting: weighted losses, then a plain sum
        from gradbalance.weighting import GradNorm

        weighting, balancer = GradNorm(K, model.trunk, alpha=1.5, lr=0.05), Sum()
    else:
        balancer = make_balancer(sc.balancer)
    generator = getattr(balancer, "generator", None)
    if generator is not None:
        torch.rand(rank + 1, generator=generator)  # ranks drawn apart, then aligned
        broadcast_generator_(generator)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if sc.amp else None
    if scaler is not None:
        assert scaler.is_enabled()
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                         update_every=sc.update_every, mode=sc.mode,  # type: ignore[arg-type]
                         **({"modules": model.trunk} if sc.mode == "gramian" else {}))
    xs, ys = data(sc.steps)
    shard = GLOBAL_BATCH // world
    clip = ghost = None
    if sc.per_sample:  # the same noise seed on every rank: the ranks add the same noise
        clip = PerSampleClip(0.5, noise_multiplier=0.3,
                             generator=torch.Generator().manual_seed(5))
        ghost = GhostNorms(model)
    found_inf, losses_log = [], []
    for step in range(sc.steps):
        x = xs[step, rank * shard : (rank + 1) * shard]
        y = ys[step, rank * shard : (rank + 1) * shard]
        if sc.naive:
            _naive_step(net, model, balancer, x, y)
        else:
            with ddp_no_sync(net):
                for xm, ym in zip(x.chunk(sc.micro), y.chunk(sc.micro)):
                    feats = model.trunk(xm) if sc.mode == "features" else None
                    outputs = net(xm) if feats is None else [h(feats) for h in model.heads]
                    if clip is not None and ghost is not None:
                        per_sample = torch.stack([(o.squeeze(-1) - ym[:, k]) ** 2
                                                  for k, o in enumerate(outputs)], dim=1)
                        losses = clip(per_sample, model.parameters(),
                                      norms=ghost.norms(per_sample))
                    else:
                        losses = regression_losses(outputs, ym)
                    if step == sc.inf_step and rank == world - 1:
                        losses = losses * torch.tensor([1.0, float("inf"), 1.0],
                                                       dtype=torch.float64)
                    losses = losses / sc.micro
                    if weighting is not None:
                        losses = weighting(losses, scaler=scaler)
                    buf.backward(losses, scaler=scaler, features=feats)
            stats = buf.apply_(balancer, scaler=scaler)
            if clip is not None:
                clip.add_noise_(model.parameters(), batch_size=GLOBAL_BATCH)
            found_inf.append(stats.found_inf)
            losses_log.append(stats.losses.clone())
        optimizer_step(opt, scaler)
        if weighting is not None:
            sync_weighting_(weighting)
            weighting.update(found_inf=stats.found_inf)
    out = {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": (balancer if weighting is None else weighting).state_dict(),
        "found_inf": found_inf,
        "losses": losses_log,
        "scale": None if scaler is None else float(scaler.get_scale()),
    }
    if world > 1 and not sc.naive:
        assert_same_across_ranks(out["params"], what="parameters")
    del net
    return out


def _probe_checks(rank: int) -> dict[str, Any]:
    """The helpers' own behaviour on two ranks."""
    result: dict[str, Any] = {}
    try:
        assert_same_across_ranks([torch.full((2,), float(rank))])
        result["differing_detected"] = False
    except RuntimeError as error:
        result["differing_detected"] = "ranks [1] differ from rank 0" in str(error)
    gen = torch.Generator().manual_seed(rank)
    broadcast_generator_(gen)
    result["draw"] = torch.rand(4, generator=gen)
    return result


def _forgot_no_sync() -> bool:
    """The buffer under DDP without ``no_sync``: the same parameters after two steps as
    with it. The step writes every gradient itself (the trunk's task passes by
    ``autograd.grad``, the heads' accumulated after them), so DDP's reducer is never
    armed, and the buffer averages over the ranks itself."""
    from torch.nn.parallel import DistributedDataParallel

    finals = []
    for wrap in (True, False):
        torch.manual_seed(0)
        model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, K)).double()
        net = DistributedDataParallel(model)
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = data(2)
        for step in range(2):
            with ddp_no_sync(net) if wrap else contextlib.nullcontext():
                buf.backward(regression_losses(net(x[step, :4]), y[step, :4]))
            buf.apply_(Sum())
            opt.step()
            opt.zero_grad(set_to_none=True)
        finals.append([p.detach().clone() for p in model.parameters()])
        del net
    return all(torch.equal(a, b) for a, b in zip(finals[0], finals[1], strict=True))


def _gramian_unequal_shards(rank: int) -> str:
    """``mode="gramian"`` with shards of different sizes: the error every rank raises."""
    model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, K)).double()
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode="gramian",
                         modules=model.trunk)
    x, y = data(1)
    size = 4 + rank
    buf.backward(regression_losses(model(x[0, :size]), y[0, :size]))
    try:
        buf.apply_(Sum())
    except ValueError as error:
        return str(error)
    return ""


def _worker(rank: int, world: int, init_file: str, out_dir: str,
            scenarios: list[Scenario]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        results: dict[str, Any] = {"probe": _probe_checks(rank)}
        for sc in scenarios:
            results[sc.key] = run(sc, rank, world)
        results["forgot_no_sync_same"] = _forgot_no_sync()
        results["gramian_unequal_shards"] = _gramian_unequal_shards(rank)
        dist.barrier()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn_runs(scenarios: list[Scenario], world: int = 2) -> list[dict[str, Any]]:
    """Run ``scenarios`` on ``world`` gloo processes; one result dict per rank."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(world, init_file, tmp, scenarios), nprocs=world, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]


# -- failures: ranks that disagree, skip a step or stall -----------------------------------

#: The timeout of the stall case's process group: the waiting rank raises within it.
STALL_TIMEOUT_S = 4.0


def _failure_model(k: int = K, width: int = 16) -> MultiTaskModel:
    torch.manual_seed(0)
    return MultiTaskModel(mlp_trunk(8, width, 2), make_heads(width, k)).double()


def _backward(model: MultiTaskModel, buf: TaskGradBuffer, step: int, k: int = K) -> None:
    x, y = data(step + 1)
    buf.backward(regression_losses(model(x[step, :4]), y[step, :4, :k]))


def _snapshot(model: MultiTaskModel, buf: TaskGradBuffer) -> list[Any]:
    """Everything an apply_ that raised must have left alone."""
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    matrix = None if buf.matrix is None else buf.matrix.clone()
    return [grads, params, matrix, buf.state_dict()]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    return bool(a == b)


def _raises(call: Any, model: MultiTaskModel, buf: TaskGradBuffer) -> dict[str, Any]:
    """Run ``call``; its error (type and text) and whether anything moved meanwhile."""
    before = _snapshot(model, buf)
    start = time.monotonic()
    try:
        call()
    except Exception as error:  # the test asserts the type
        return {"type": type(error).__name__, "text": str(error),
                "moved": not _same(before, _snapshot(model, buf)),
                "seconds": time.monotonic() - start}
    return {"type": None, "text": "", "moved": not _same(before, _snapshot(model, buf))}


def _train(model: MultiTaskModel, buf: TaskGradBuffer, steps: range,
           skip: int = -1, how: str = "") -> dict[str, Any]:
    """Plain steps (Sum, SGD) until ``apply_`` raises; this rank skips step ``skip`` by
    ``how``: ``"continue"`` (no apply_, its backward adds into the next step) or ``"reset"``."""
    for step in steps:
        _backward(model, buf, step)
        if step == skip:
            if how == "reset":
                buf.reset()
            continue
        result = _raises(lambda: buf.apply_(Sum()), model, buf)
        if result["type"] is not None:
            return {**result, "step": step}
        with torch.no_grad():  # SGD by hand: torch.optim's first use imports dynamo (seconds)
            for p in model.parameters():
                p -= 0.1 * p.grad  # type: ignore[operator]
                p.grad = None
    return {"type": None, "step": steps[-1], "steps_begun": buf.state_dict()["steps_begun"],
            "params": [p.detach().clone() for p in model.parameters()]}


def _case_shapes(rank: int, k: int = K, width: int = 16, mode: str = "matrix") -> dict[str, Any]:
    """One step where ranks built different models (K, P) or buffers (mode)."""
    model = _failure_model(k, width)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                         mode=mode,  # type: ignore[arg-type]
                         **({"modules": model.trunk} if mode == "gramian" else {}))
    _backward(model, buf, 0, k)
    return _raises(lambda: buf.apply_(Sum()), model, buf)


def _case_skip(rank: int, how: str, update_every: int = 1) -> dict[str, Any]:
    """Four steps; rank 1 skips step 1 by ``how`` (see :func:`_train`)."""
    model = _failure_model()
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                         update_every=update_every)
    return _train(model, buf, range(4), skip=1 if rank == 1 else -1, how=how)


def _case_resume(rank: int) -> dict[str, Any]:
    """Save after 2 and 3 steps; every rank resumes the step-3 state (agreement kept), a
    state saved without the counter (agreement kept), then rank 1 alone the step-2 state."""
    model = _failure_model()
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    saved = []
    for stop in (2, 3):
        _train(model, buf, range(stop - 1, stop) if saved else range(stop))
        saved.append((copy.deepcopy(model.state_dict()), buf.state_dict()))
    out: dict[str, Any] = {"saved_steps": [state["steps_begun"] for _, state in saved]}
    for name, (weights, state) in {
        "same": saved[1],
        "legacy": (saved[1][0], {k: v for k, v in saved[1][1].items() if k != "steps_begun"}),
        "other": saved[0] if rank == 1 else saved[1],
    }.items():
        model.load_state_dict(weights)
        fresh = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
        fresh.load_state_dict(state)
        out[name] = _train(model, fresh, range(3, 5))
    return out


def _case_balancer(rank: int) -> dict[str, Any]:
    """One step where the ranks apply different balancer classes."""
    model = _failure_model()
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    _backward(model, buf, 0)
    return _raises(lambda: buf.apply_(Mean() if rank == 0 else Sum()), model, buf)


def _case_clip(rank: int, per_sample: bool = False) -> dict[str, Any]:
    """One step where rank 0 alone clips the task rows (``TaskClip``)."""
    model = _failure_model()
    if per_sample:
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                             modules=model.trunk, batch_dim=0)
        x, y = data(1)
        buf.backward((torch.cat(model(x[0, :4]), dim=1) - y[0, :4, :K]) ** 2)
    else:
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
        _backward(model, buf, 0)
    clip = TaskClip(0.05) if rank == 0 else None
    return _raises(lambda: buf.apply_(Sum(), clip=clip), model, buf)


def _case_scaler(rank: int) -> dict[str, Any]:
    """One step where rank 0 alone scales its losses with an enabled ``GradScaler``."""
    model = _failure_model().float()
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    scaler = torch.amp.GradScaler("cpu") if rank == 0 else None
    assert scaler is None or scaler.is_enabled()
    x, y = data(1)
    buf.backward(regression_losses(model(x[0, :4].float()), y[0, :4, :K].float()), scaler=scaler)
    return _raises(lambda: buf.apply_(Sum(), scaler=scaler), model, buf)


def _case_one_mask(rank: int) -> dict[str, Any]:
    """One step where rank 1 alone passes ``active=``."""
    model = _failure_model()
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    _backward(model, buf, 0)
    mask = torch.tensor([True, False, True]) if rank == 1 else None
    return _raises(lambda: buf.apply_(Sum(), active=mask), model, buf)


def _case_masks(rank: int) -> dict[str, Any]:
    """Each rank's own mask (task 1 labelled on rank 0's shard only, task 2 on none): the
    step is the one of the combined mask on every rank."""
    from gradbalance.balancers import MGDA

    grads = []
    for active in (torch.tensor([True, rank == 0, False]), torch.tensor([True, True, False])):
        model = _failure_model()
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
        _backward(model, buf, 0)
        stats = buf.apply_(MGDA(), active=active)
        grads.append([p.grad.clone() for p in model.shared_parameters()])
    return {"own": grads[0], "combined": grads[1], "weights": stats.weights}


def _case_per_sample_reset(rank: int) -> dict[str, Any]:
    """``batch_dim=0`` steps; rank 1 drops step 1 by ``reset()`` (the out-of-memory recovery
    of docs/loop.md) while rank 0 runs it: the next ``apply_`` raises on both ranks."""
    model = _failure_model()
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                         modules=model.trunk, batch_dim=0)
    for step in range(3):
        x, y = data(step + 1)
        losses = (torch.cat(model(x[step, :4]), dim=1) - y[step, :4, :K]) ** 2
        buf.backward(losses)
        if step == 1 and rank == 1:
            buf.reset(keep_weights=True)
            continue
        result = _raises(lambda: buf.apply_(Sum()), model, buf)
        if result["type"] is not None:
            return {**result, "step": step}
        model.zero_grad(set_to_none=True)
    return {"type": None, "text": "", "moved": False, "step": 3}


def _case_per_sample_mode(rank: int) -> dict[str, Any]:
    """Rank 1 builds its buffer with ``batch_dim=0``, rank 0 without: one step each."""
    model = _failure_model()
    if rank == 0:
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
        _backward(model, buf, 0)
    else:
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                             modules=model.trunk, batch_dim=0)
        x, y = data(1)
        buf.backward((torch.cat(model(x[0, :4]), dim=1) - y[0, :4, :K]) ** 2)
    return _raises(lambda: buf.apply_(Sum()), model, buf)


def _error_of(call: Any, watched: list[Tensor]) -> dict[str, Any]:
    """``call``'s error (type, text) and whether ``watched`` changed meanwhile."""
    before = [t.clone() for t in watched]
    try:
        call()
        found: dict[str, Any] = {"type": None, "text": ""}
    except Exception as error:  # the test asserts the type
        found = {"type": type(error).__name__, "text": str(error)}
    return {**found, "moved": not _same(before, watched)}


def _case_layout(rank: int) -> dict[str, Any]:
    """all_reduce_grads_ and sync_weighting_ with other shapes on rank 1."""
    from gradbalance.distributed import all_reduce_grads_
    from gradbalance.weighting import DWA

    w = torch.ones(2 + rank, requires_grad=True)
    w.grad = torch.full_like(w, float(rank))
    weighting = DWA(2 + rank)
    weighting(torch.ones(2 + rank, dtype=torch.float64))
    return {"grads": _error_of(lambda: all_reduce_grads_([w]), [w.grad]),
            "weighting": _error_of(lambda: sync_weighting_(weighting),
                                   weighting.pending_tensors())}


def _case_stall(rank: int, flag: str) -> dict[str, Any]:
    """Rank 1 stalls before apply_ until rank 0 has given up (or 3 timeouts at most), in a
    group of its own with a short timeout (a timed-out group cannot be used again)."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=STALL_TIMEOUT_S))
    model = _failure_model()
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                         process_group=group)
    _backward(model, buf, 0)
    if rank == 1:
        deadline = time.monotonic() + 3 * STALL_TIMEOUT_S
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
    result = _raises(lambda: buf.apply_(Sum()), model, buf)
    if rank == 0:
        open(flag, "w").close()
    return result


def failure_cases(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Every failure case on this rank; the stall comes last."""
    results: dict[str, Any] = {
        "tasks": _case_shapes(rank, k=2 + rank),
        "trunk": _case_shapes(rank, width=16 + rank),
        "mode": _case_shapes(rank, mode=("matrix", "gramian")[rank]),
        "skip": _case_skip(rank, "continue"),
        "reset": _case_skip(rank, "reset"),
        "reused": _case_skip(rank, "reset", update_every=2),
        "resume": _case_resume(rank),
        "layout": _case_layout(rank),
        "balancer": _case_balancer(rank),
        "one_mask": _case_one_mask(rank),
        "clip": _case_clip(rank),
        "per_sample_clip": _case_clip(rank, per_sample=True),
        "scaler": _case_scaler(rank),
        "masks": _case_masks(rank),
        "per_sample_reset": _case_per_sample_reset(rank),
        "per_sample_mode": _case_per_sample_mode(rank),
    }
    results["stall"] = _case_stall(rank, os.path.join(out_dir, "rank0-gave-up"))
    return results


def _failure_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    results = failure_cases(rank, world, out_dir)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    # the result is saved; the stall case's group timed out, and tearing the groups down
    # (or the interpreter) waits seconds for nothing
    os._exit(0)


#: Seconds a spawned rank may take to exit once every rank saved its result: past them it
#: is stuck in torch's gloo teardown (torch 2.6 under CPU contention hangs in the last
#: barrier or ``destroy_process_group``, docs/distributed.md), killed, and the run accepted.
TEARDOWN_GRACE_S = 15.0


def spawn_bounded(target: Any, world: int = 2, limit_s: float = 60.0) -> list[dict[str, Any]]:
    """Run ``target(rank, world, init_file, out_dir)`` on ``world`` processes, each of which
    saves ``out_dir/rank{r}.pt``; a process still running after ``limit_s`` is killed and the
    call fails, so a hang fails a test instead of stalling it, unless every rank saved its
    result by then: a rank still alive ``TEARDOWN_GRACE_S`` after that is in the gloo
    teardown, killed, and the results are returned."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        paths = [os.path.join(tmp, f"rank{r}.pt") for r in range(world)]
        procs = [ctx.Process(target=target, args=(r, world, init_file, tmp))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + limit_s
        saved_at = None
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if saved_at is None and all(os.path.exists(path) for path in paths):
                saved_at = time.monotonic()
            if saved_at is not None and time.monotonic() > saved_at + TEARDOWN_GRACE_S:
                break
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        assert not hung or saved_at is not None, f"ranks {hung} still ran after {limit_s} s: a hang"
        missing = [(r, procs[r].exitcode) for r, path in enumerate(paths)
                   if not os.path.exists(path)]
        assert not missing, f"(rank, exit code) without a result: {missing}"
        return [torch.load(path, weights_only=False) for path in paths]


TORCHRUN_TIMEOUT = 180  # seconds for a two-process torchrun of a test file


def torchrun_two(script: str, out: Path) -> list[dict[str, Any]]:
    """Run ``script out`` as 2 CPU ranks under ``torchrun --standalone`` (bounded by
    :data:`TORCHRUN_TIMEOUT`); each rank saves ``out/rank{r}.pt``, returned in rank order."""
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(  # `accelerate launch --cpu` starts one process without MPI
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", script, str(out)],
        env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT, check=False)
    results = [out / f"rank{r}.pt" for r in range(2)]
    # Under CPU contention torch's gloo teardown sometimes aborts a rank after its result is
    # saved ("terminate called without an active exception", docs/distributed.md): the run is
    # judged by both results; any other failure fails.
    teardown = "terminate called without an active exception" in done.stderr
    finished = all(path.is_file() for path in results)
    assert done.returncode == 0 or (finished and teardown), done.stderr[-3000:]
    return [torch.load(path, weights_only=False) for path in results]
