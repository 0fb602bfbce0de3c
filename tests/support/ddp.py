"""Helpers of the data-parallel tests: a small training run, on one rank or on several.

``run(scenario, rank, world)`` trains the same multitask MLP on the same global batches; on
``world`` ranks each rank takes its shard, on one process the whole batch is used, which is
the reference every data-parallel run must reproduce.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from gradbalance import Balancer, TaskGradBuffer
from gradbalance.balancers import Constant, Mean, Sum
from gradbalance.clip import GhostNorms, PerSampleClip
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
    """The buffer under DDP without ``no_sync``: DDP raises at the next forward."""
    torch.manual_seed(0)
    model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, K)).double()
    from torch.nn.parallel import DistributedDataParallel

    net = DistributedDataParallel(model)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    x, y = data(2)
    try:
        for step in range(2):
            buf.backward(regression_losses(net(x[step, :4]), y[step, :4]))
            buf.apply_(Sum())
    except RuntimeError as error:
        return "Expected to have finished reduction" in str(error)
    finally:
        del net
    return False


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
        results["forgot_no_sync_raises"] = _forgot_no_sync()
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
