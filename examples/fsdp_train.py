"""Balanced training of a trunk sharded with FSDP2 (``fully_shard``), under torchrun.

    torchrun --nproc_per_node=2 examples/fsdp_train.py           # CPU: gloo, 2 shards
    torchrun --nproc_per_node=2 examples/fsdp_train.py --balancer mgda --micro 2 --amp
    python examples/fsdp_train.py                                # one process, whole batch
    # 2 "nodes" × 2 ranks (docs/distributed.md, "Several nodes"): the same with --node_rank 1
    torchrun --nnodes 2 --nproc_per_node 2 --node_rank 0 --master_addr 127.0.0.1 \\
        --master_port 29500 examples/fsdp_train.py

Each linear layer of the trunk and the whole model are wrapped with ``fully_shard``: every
parameter is a ``DTensor`` split on dim 0, and each rank keeps only its shard of the K task
gradients (``[K, P/W]``). The step is the same as on one process: ``buf.backward(losses)``
and ``buf.apply_(balancer, scaler=...)``; the ranks sum their partial Gramians, so every rank
computes the same weights and writes its shard of the update the single process would write.
The printed lines are the same with one process on the whole batch and with 2 or 4 ranks (to
the last printed digit). A checkpoint of the sharded state is saved half-way with
``torch.distributed.checkpoint``; ``--resume`` starts from it.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os

import torch
import torch.distributed as dist
from torch import nn

import gradbalance
from gradbalance.distributed import assert_same_across_ranks
from gradbalance_lab.models import make_heads, mlp_trunk, regression_losses


class Model(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.trunk = mlp_trunk(32, 64, 3)
        self.heads = nn.ModuleList(make_heads(64, k))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        feats = self.trunk(x)
        return [head(feats) for head in self.heads]


def checksum(params: list[torch.Tensor]) -> str:
    """A digest of the full parameters (gathered from the shards)."""
    h = hashlib.sha256()
    for p in params:
        full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
        h.update(f"{float(full.double().sum()):.4e}".encode())
    return h.hexdigest()[:12]


def state_of(model: nn.Module, opt: torch.optim.Optimizer, balancer: gradbalance.Balancer,
             buf: gradbalance.TaskGradBuffer, scaler: torch.amp.GradScaler) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    # Each rank's balancer and buffer states under its own key, as bytes: a matrix balancer's
    # [K, P] state holds the rank's columns, and a fresh balancer or buffer has no state
    # tensors to be the load's template (docs/distributed.md, "Sharded trunks (FSDP2)").
    rank = dist.get_rank() if dist.is_initialized() else 0
    return {"model": model_state, "optim": optim_state, "scaler": scaler.state_dict(),
            "local": {f"rank{rank}": {"balancer": blob(balancer), "buffer": blob(buf)}}}


def blob(obj: gradbalance.Balancer | gradbalance.TaskGradBuffer) -> bytes:
    out = io.BytesIO()
    torch.save(obj.state_dict(), out)
    return out.getvalue()


def unblob(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--balancer", default="upgrad")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--micro", type=int, default=1, help="micro-batches per rank")
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--amp", action="store_true", help="bfloat16 autocast + GradScaler")
    parser.add_argument("--checkpoint", default="", help="directory for the sharded checkpoint")
    parser.add_argument("--resume", action="store_true", help="start from --checkpoint")
    args = parser.parse_args()

    sharded = "WORLD_SIZE" in os.environ
    if sharded:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    if args.batch % (world * args.micro):
        raise SystemExit(f"--batch {args.batch} must divide into {world} ranks × "
                         f"{args.micro} micro-batches")
    torch.manual_seed(0)
    k = args.tasks
    model = Model(k)
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for layer in model.trunk:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)  # the root: the heads are sharded too
    generator = torch.Generator().manual_seed(1234)  # the same random streams on every rank
    kwargs = {"generator": generator} if args.balancer in ("pcgrad", "gradvac") else {}
    balancer = gradbalance.get_balancer(args.balancer, num_tasks=k, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # GradScaler on CPU (enabled only with --amp); one optimizer over DTensor parameters only
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp)
    buf = gradbalance.TaskGradBuffer(model.trunk.parameters(), model.heads.parameters())

    start = 0
    if args.resume:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = state_of(model, opt, balancer, buf, scaler)
        dcp.load(state, checkpoint_id=args.checkpoint)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        local = state["local"][f"rank{dist.get_rank() if sharded else 0}"]
        balancer.load_state_dict(unblob(local["balancer"]))
        buf.load_state_dict(unblob(local["buffer"]))
        scaler.load_state_dict(state["scaler"])
        start = args.steps // 2

    data = torch.Generator().manual_seed(42)  # the same global batches on every rank
    mix = torch.randn(32, k, generator=data)
    shard = args.batch // world
    for step in range(args.steps):
        x = torch.randn(args.batch, 32, generator=data)
        if step < start:
            continue
        if args.checkpoint and not args.resume and step == args.steps // 2:
            import torch.distributed.checkpoint as dcp

            dcp.save(state_of(model, opt, balancer, buf, scaler), checkpoint_id=args.checkpoint)
        y = torch.tanh(x @ mix) * torch.tensor([10.0 ** -t for t in range(k)])
        x, y = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
        for xm, ym in zip(x.chunk(args.micro), y.chunk(args.micro)):
            with torch.autocast("cpu", enabled=args.amp, dtype=torch.bfloat16):
                losses = regression_losses(model(xm), ym)
            buf.backward(losses.float() / args.micro, scaler=scaler)
        stats = buf.apply_(balancer, scaler=scaler)
        scaler.unscale_(opt)
        pre_clip = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        if hasattr(pre_clip, "full_tensor"):  # DTensor gradients give a DTensor norm
            pre_clip = pre_clip.full_tensor()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            losses_txt = " ".join(f"{v:.5f}" for v in stats.losses.tolist())
            weights = "" if stats.weights is None else " ".join(
                f"{v:.4f}" for v in stats.weights.tolist())
            print(f"step {step:4d}  losses {losses_txt}  weights {weights}  "
                  f"pre-clip {float(pre_clip):.4f}"
                  f"  skipped {stats.found_inf}", flush=True)

    digest = checksum(list(model.parameters()))
    if sharded:  # the last step's statistics (a matrix balancer's state is per rank)
        assert_same_across_ranks([stats.losses, stats.task_norms, stats.cosine],
                                 what="step statistics")
    if rank == 0:
        print(f"parameters {digest}", flush=True)
        print(f"{world} rank(s) finished", flush=True)
    if sharded:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
