"""Helpers of the FSDP2 tests: one small multitask run, on one process or sharded.

:func:`train` runs a :class:`Case` either unsharded on the full global batch (``world=1``, the
reference) or inside a gloo process group with the trunk under ``fully_shard`` (per-layer and
root wrapping, or root only; heads sharded or replicated), each rank on its shard of every
batch. Every sharded run must reproduce the reference's parameters, statistics and balancer
state. :func:`run_cases` runs several cases in one spawned job to save process start-up.
"""

from __future__ import annotations

import copy
import datetime
import functools
import io
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Balancer, Combination
from gradbalance.distributed import gathered_parameters, sync_weighting_

K = 3
IN, WIDTH, OUT = 6, 7, 5  # odd sizes: FSDP2's dim-0 shards are uneven on 2 and 4 ranks
GLOBAL_BATCH = 8
SCALES = (1.0, 3.0, 0.3)  # tasks of different scale, so that the balancers act


@dataclass
class Case:
    """One training run. ``balancer``: a factory (each run builds its own, seeded alike)."""

    name: str
    balancer: Callable[[], Balancer]
    steps: int = 3
    micro: int = 1  # micro-batches per step (each rank splits its shard alike)
    heads_sharded: bool = False
    wrap: str = "layers"  # "layers": each Linear and the root; "root": the root only
    amp: bool = False
    overflow: tuple[int, int] | None = None  # (step, rank): that rank's losses become inf
    clip: Callable[[], Any] | None = None
    global_clip: float | None = None  # clip_grad_norm_ after apply_
    mode: str = "matrix"
    update_every: int = 1
    weighting: Callable[[Model, int], Any] | None = None  # a LossWeighting, from the model
    local_state: bool = False  # the balancer keeps [K, P] state: each rank its columns
    keep: str = ""  # "forward": reshard_after_forward=False; "backward": the parameters stay
    # gathered through the K passes (set_reshard_after_backward(False), then reshard())
    mesh: tuple[int, int] | None = None  # HSDP: (replicas, shards) over the world's ranks
    submesh: bool = False  # with mesh: the trunk on each replica's 1-D "shard" submesh, the
    # buffer on its group (each replica an independent job; train with its rank and size)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(IN, WIDTH), nn.Tanh(), nn.Linear(WIDTH, OUT),
                                   nn.Tanh())
        self.heads = nn.ModuleList([nn.Linear(OUT, 1) for _ in range(K)])

    def forward(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        feats = self.trunk(x)
        return feats, [head(feats) for head in self.heads]


def graddrop() -> Balancer:
    from gradbalance.balancers import GradDrop

    return GradDrop(K, generator=torch.Generator().manual_seed(5))


def dbmtl() -> Balancer:
    from gradbalance.balancers import DBMTL

    return DBMTL(K, beta=0.5)


def gradnorm(model: Model, world: int) -> Any:
    """GradNorm at the trunk's last linear layer (its gathered copies when sharded)."""
    from gradbalance.weighting import GradNorm

    layer = model.trunk[2]
    return GradNorm(K, gathered_parameters(layer) if world > 1 else layer, alpha=1.5, lr=0.05)


def build_model(case: Case, world: int) -> Model:
    torch.manual_seed(0)
    model = Model()
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        after_forward = case.keep != "forward"
        on: dict[str, Any] = {}
        if case.mesh is not None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=("replicate", "shard"))
            on["mesh"] = mesh["shard"] if case.submesh else mesh
        shard = functools.partial(fully_shard, reshard_after_forward=after_forward, **on)
        if case.wrap == "layers":
            for layer in model.trunk:
                if isinstance(layer, nn.Linear):
                    shard(layer)
        shard(model.trunk)
        if case.heads_sharded:
            fully_shard(model, **on)
    return model


def batches(case: Case) -> list[tuple[Tensor, Tensor]]:
    """The global batches, the same on every process."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(case.steps):
        x = torch.randn(GLOBAL_BATCH * case.micro, IN, generator=g)
        y = torch.randn(GLOBAL_BATCH * case.micro, K, generator=g) * torch.tensor(SCALES)
        out.append((x, y))
    return out


def _full(t: Tensor) -> Tensor:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor's whole value
    return full.detach().clone()


def _checkpoint_state(model: nn.Module, opts: list[torch.optim.Optimizer], balancer: Balancer,
                      buf: TaskGradBuffer, scaler: Any) -> dict[str, Any]:
    """What a resume needs, as torch.distributed.checkpoint takes it (sharded tensors), as
    docs/distributed.md ("Checkpoints") writes it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opts)
    # Keyed by rank and saved as bytes: a matrix balancer's [K, P] state holds this rank's
    # columns only, and a freshly built balancer or buffer (no state tensors yet: the buffer's
    # cached update_every weights) can then be the template of the load.
    rank = dist.get_rank() if dist.is_initialized() else 0
    return {"model": model_state, "optim": optim_state,
            "local": {f"rank{rank}": {"balancer": _blob(balancer), "buffer": _blob(buf)}},
            "scaler": {} if scaler is None else scaler.state_dict()}


def _blob(obj: Any) -> bytes:
    out = io.BytesIO()
    torch.save(obj.state_dict(), out)
    return out.getvalue()


def _unblob(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _save(path: str, model: nn.Module, opts: list[torch.optim.Optimizer], balancer: Balancer,
          buf: TaskGradBuffer, scaler: Any) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_checkpoint_state(model, opts, balancer, buf, scaler), checkpoint_id=path)


def _load(path: str, model: nn.Module, opts: list[torch.optim.Optimizer], balancer: Balancer,
          buf: TaskGradBuffer, scaler: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _checkpoint_state(model, opts, balancer, buf, scaler)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opts, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    local = state["local"][f"rank{dist.get_rank()}"]
    balancer.load_state_dict(_unblob(local["balancer"]))
    buf.load_state_dict(_unblob(local["buffer"]))
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])


def train(case: Case, rank: int = 0, world: int = 1, *, save: tuple[int, str] | None = None,
          resume: tuple[int, str] | None = None) -> dict[str, Any]:
    """Run ``case``; return the full parameters, the per-step statistics and the states.

    ``save=(step, dir)``: a torch.distributed.checkpoint of everything before ``step``;
    ``resume=(step, dir)``: start at ``step`` from that checkpoint."""
    model = build_model(case, world)
    trunk_params = list(model.trunk.parameters())
    head_params = list(model.heads.parameters())
    balancer = case.balancer()
    weighting = case.weighting(model, world) if case.weighting is not None else None
    # Two optimizers: torch's GradScaler unscales one optimizer's gradients in one call, which
    # refuses a mix of DTensor (a sharded trunk) and plain (replicated heads) gradients.
    opts = [torch.optim.SGD(trunk_params, lr=0.05, momentum=0.9),
            torch.optim.SGD(head_params, lr=0.05, momentum=0.9)]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if case.amp else None
    sub = case.submesh and world > 1
    group = trunk_params[0].device_mesh.get_group() if sub else None  # type: ignore[attr-defined]
    buf = TaskGradBuffer(trunk_params, head_params, mode=case.mode,
                         update_every=case.update_every, process_group=group)
    clip = case.clip() if case.clip is not None else None
    stats_log: list[dict[str, Any]] = []
    share = GLOBAL_BATCH // world
    for step, (x, y) in enumerate(batches(case)):
        if save is not None and save[0] == step:
            _save(save[1], model, opts, balancer, buf, scaler)
        if resume is not None and step < resume[0]:
            continue
        if resume is not None and step == resume[0]:
            _load(resume[1], model, opts, balancer, buf, scaler)
        hold = world > 1 and case.keep == "backward"
        if hold:
            model.trunk.set_reshard_after_backward(False)  # type: ignore[operator]
        for m in range(case.micro):
            rows = slice(m * GLOBAL_BATCH + rank * share, m * GLOBAL_BATCH + (rank + 1) * share)
            feats, outs = model(x[rows])
            losses = torch.stack([nn.functional.mse_loss(o.squeeze(-1), y[rows, k])
                                  for k, o in enumerate(outs)]) / case.micro
            if weighting is not None:
                losses = weighting(losses, scaler=scaler)
            if case.overflow is not None and case.overflow[0] == step and (
                    world == 1 or case.overflow[1] == rank):
                losses = losses * math.inf
            kwargs = {"features": feats} if case.mode == "features" else {}
            buf.backward(losses, scaler=scaler, **kwargs)
        if hold:  # reshard() acts on one module: each FSDP module of the trunk
            from torch.distributed.fsdp import FSDPModule

            for module in model.trunk.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
            model.trunk.set_reshard_after_backward(True)  # type: ignore[operator]
        stats = buf.apply_(balancer, scaler=scaler, clip=clip)
        if weighting is not None:
            sync_weighting_(weighting)  # the ranks' layer gradients and losses: their mean
            weighting.update(found_inf=stats.found_inf)
        if case.global_clip is not None:
            if scaler is not None:
                for opt in opts:
                    scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_([*trunk_params, *head_params], case.global_clip)
        for opt in opts:
            if scaler is not None:
                scaler.step(opt)
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.update()
        stats_log.append({
            "losses": stats.losses.clone(), "found_inf": stats.found_inf,
            "weights": None if stats.weights is None else stats.weights.clone(),
            "task_norms": None if stats.task_norms is None else stats.task_norms.clone(),
            "cosine_to_update": None if stats.cosine_to_update is None
            else stats.cosine_to_update.clone(),
            "update_norm": None if stats.update_norm is None else stats.update_norm.clone(),
        })
    return {
        "params": [_full(p) for p in model.parameters()],
        "stats": stats_log,
        "balancer": copy.deepcopy((balancer if weighting is None else weighting).state_dict()),
        "clip": copy.deepcopy(clip.state_dict()) if clip is not None and hasattr(
            clip, "state_dict") else None,
        "scale": None if scaler is None else float(scaler.get_scale()),
    }


def init_group(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))


def run_cases_worker(rank: int, world: int, init_file: str, out_dir: str,
                     cases: list[Case]) -> None:
    """Each case's sharded result (or the exception text) into ``out_dir/rank{r}.pt``."""
    init_group(rank, world, init_file)
    results: dict[str, Any] = {}
    for case in cases:
        try:
            results[case.name] = train(case, rank, world)
        except Exception as error:  # reported to the test, which fails with the message
            import traceback

            results[case.name] = {"error": f"{type(error).__name__}: {error}\n"
                                           f"{traceback.format_exc()}"}
        dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def assert_close_runs(got: dict[str, Any], ref: dict[str, Any], rtol: float = 1e-6,
                      atol: float = 1e-7, local_state: bool = False) -> None:
    """Parameters, statistics and states of a sharded run equal the reference's."""
    assert "error" not in got, got.get("error")
    for a, b in zip(got["params"], ref["params"]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    for sa, sb in zip(got["stats"], ref["stats"]):
        assert sa["found_inf"] == sb["found_inf"]
        for key in ("losses", "weights", "task_norms", "cosine_to_update", "update_norm"):
            if sb[key] is None or sa["found_inf"]:
                continue
            torch.testing.assert_close(sa[key], sb[key], rtol=rtol * 10, atol=atol * 10,
                                       check_dtype=False)
    assert got["scale"] == ref["scale"]
    if not local_state:
        _close_state(got["balancer"], ref["balancer"], rtol, atol)


def _close_state(a: Any, b: Any, rtol: float, atol: float) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b)
        for key in a:
            _close_state(a[key], b[key], rtol, atol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _close_state(x, y, rtol, atol)
    elif isinstance(a, Tensor) and a.dtype.is_floating_point:
        torch.testing.assert_close(a, b, rtol=rtol * 10, atol=atol * 10)
    elif isinstance(a, Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def naive_run(case: Case, rank: int, world: int) -> dict[str, Any]:
    """The pattern that looks right: K ``backward`` passes with the trunk's shard of ``.grad``
    copied between them, then each rank balances its own columns (its own Gramian)."""
    from torch.distributed.tensor import DTensor

    model = build_model(case, world)
    trunk, heads = list(model.trunk.parameters()), list(model.heads.parameters())
    balancer = case.balancer()
    opt = torch.optim.SGD([*trunk, *heads], lr=0.05, momentum=0.9)
    weights = []
    share = GLOBAL_BATCH // world
    for x, y in batches(case):
        rows = slice(rank * share, (rank + 1) * share)
        _, outs = model(x[rows])
        losses = [nn.functional.mse_loss(o.squeeze(-1), y[rows, k]) for k, o in enumerate(outs)]
        matrix = []
        for k, loss in enumerate(losses):
            loss.backward(retain_graph=k < K - 1)
            matrix.append(torch.cat([p.grad.to_local().reshape(-1) for p in trunk]))
            for p in trunk:
                p.grad = None
        result = balancer.combine(torch.stack(matrix))
        weights.append(result.weights)
        start = 0
        for p in trunk:
            local = p.to_local()
            part = result.vector[start:start + local.numel()].reshape(local.shape)
            p.grad = DTensor.from_local(part.clone(), p.device_mesh, p.placements,
                                        shape=p.shape, stride=p.stride())
            start += local.numel()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": [_full(p) for p in model.parameters()], "weights": weights}


def resume_run(case: Case, rank: int, world: int, directory: str) -> dict[str, Any]:
    """``case`` uninterrupted (saving a checkpoint before step 2) and resumed from it."""
    path = os.path.join(directory, f"ckpt_{case.name}")
    whole = train(case, rank, world, save=(2, path))
    dist.barrier()
    resumed = train(case, rank, world, resume=(2, path))
    return {"whole": whole, "resumed": resumed}


class NotShardable(Balancer):
    """A matrix balancer without a sharded combine (it needs whole rows)."""

    def _combine_matrix(self, matrix: Tensor, losses: Tensor | None) -> Combination:
        return Combination(matrix.sum(dim=0))


def _error(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as error:  # the test reads the type and the text
        return f"{type(error).__name__}: {error}"
    return "no error"


def failures(rank: int, world: int) -> dict[str, Any]:
    """What a sharded trunk refuses, and that nothing moved when it did."""
    from gradbalance.balancers import UPGrad

    case = Case("failures", UPGrad)
    model = build_model(case, world)
    trunk, heads = list(model.trunk.parameters()), list(model.heads.parameters())
    x, y = batches(case)[0]
    out: dict[str, Any] = {
        "gramian": _error(lambda: TaskGradBuffer(trunk, heads, mode="gramian",
                                                 modules=model.trunk)),
        "auto": _error(lambda: TaskGradBuffer(trunk, heads, mode="auto", modules=model.trunk)),
        "batched": _error(lambda: TaskGradBuffer(trunk, heads, passes="batched")),
        "mixed": _error(lambda: TaskGradBuffer([*trunk, *heads[:1]], heads[1:])
                        if world > 1 else None),
    }

    def losses_of() -> Tensor:
        _, outs = model(x[: GLOBAL_BATCH // world])
        return torch.stack([nn.functional.mse_loss(o.squeeze(-1), y[: GLOBAL_BATCH // world, k])
                            for k, o in enumerate(outs)])

    buf = TaskGradBuffer(trunk, heads)
    buf.backward(losses_of())
    assert buf.matrix is not None
    out["matrix_shape"] = tuple(buf.matrix.shape)
    out["trunk_numel"] = sum(p.numel() for p in trunk)
    heads_before = [None if h.grad is None else h.grad.clone() for h in heads]
    balancer = NotShardable(K)
    out["not_shardable"] = _error(lambda: buf.apply_(balancer))
    out["trunk_grad_after_refusal"] = [p.grad is None for p in trunk]
    out["heads_unchanged"] = all(
        torch.equal(h.grad, b) for h, b in zip(heads, heads_before) if b is not None)
    buf.reset()
    for h in heads:
        h.grad = None
    if world > 1:  # gradient sync off: the sharded .grad is never written
        model.trunk.set_requires_gradient_sync(False)  # type: ignore[operator]
        out["sync_off"] = _error(lambda: buf.backward(losses_of()))
        model.trunk.set_requires_gradient_sync(True)  # type: ignore[operator]
    return out


def run_jobs(rank: int, world: int, init_file: str, out_dir: str,
             jobs: list[tuple[str, Callable[[], Any]]]) -> None:
    """Each ``(name, call)`` in turn inside the process group, its result (or the exception
    text, reported to the test) under ``name``: ``out_dir/rank{r}.pt``."""
    init_group(rank, world, init_file)
    results: dict[str, Any] = {}
    for name, call in jobs:
        try:
            results[name] = call()
        except Exception as error:  # reported to the test, which fails with the message
            import traceback

            results[name] = {"error": f"{type(error).__name__}: {error}\n"
                                      f"{traceback.format_exc()}"}
        dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def run_all_worker(rank: int, world: int, init_file: str, out_dir: str, cases: list[Case],
                   resume: list[Case], with_failures: bool, naive: Case | None = None) -> None:
    """Every case (sharded), every resume, the failures: ``out_dir/rank{r}.pt``."""
    jobs: list[tuple[str, Callable[[], Any]]] = [
        (case.name, functools.partial(train, case, rank, world)) for case in cases]
    jobs += [("resume_" + case.name, functools.partial(resume_run, case, rank, world, out_dir))
             for case in resume]
    if naive is not None:
        jobs.append(("naive", functools.partial(naive_run, naive, rank, world)))
    if with_failures:
        jobs.append(("failures", lambda: failures(rank, world)))
    run_jobs(rank, world, init_file, out_dir, jobs)


def assert_resumed_bit_identical(run: dict[str, Any]) -> None:
    """A :func:`resume_run` result: the resumed run ends as the uninterrupted one, bit for bit."""
    assert "error" not in run, run.get("error")
    whole, resumed = run["whole"], run["resumed"]
    for a, b in zip(whole["params"], resumed["params"]):
        assert torch.equal(a, b)
    assert repr(whole["balancer"]) == repr(resumed["balancer"])
    assert whole["scale"] == resumed["scale"]
    for a, b in zip(whole["stats"][2:], resumed["stats"]):
        assert torch.equal(a["losses"], b["losses"])
