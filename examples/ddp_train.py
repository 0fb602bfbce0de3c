"""Data-parallel balanced training with torchrun.

    torchrun --nproc_per_node=2 examples/ddp_train.py            # CPU: gloo
    torchrun --nproc_per_node=2 examples/ddp_train.py --balancer mgda --micro 2 --amp
    torchrun --nproc_per_node=2 examples/ddp_train.py --balancer upgrad --mode gramian --micro 2

NCCL on CUDA (one GPU per rank), gloo on CPU. Every rank trains on its own shard of each
global batch; TaskGradBuffer averages the task gradients ``[K, P]``, the heads' gradients and
the losses over the ranks before balancing, so every rank takes the same step, the step one
process would take on the whole batch. The model is wrapped in DistributedDataParallel; the
forward and ``buf.backward`` run inside ``model.no_sync()`` so that DDP's own reducer stays
out of the way. At the end the ranks check they hold bit-identical weights and balancer state.
``--mode gramian`` gathers the linear layers' inputs and output gradients instead of
averaging ``[K, P]``; ``--mode features`` gathers the gradients of the trunk's output (one
micro-batch per step).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gradbalance
from gradbalance.distributed import assert_same_across_ranks, ddp_no_sync
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--balancer", default="pcgrad")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--micro", type=int, default=1, help="micro-batches per rank")
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--amp", action="store_true", help="mixed precision + GradScaler")
    parser.add_argument("--mode", default="matrix", choices=["matrix", "gramian", "features"])
    args = parser.parse_args()
    if args.mode == "features" and args.micro > 1:
        raise SystemExit("--mode features takes one micro-batch per step: use --micro 1")

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % (world * args.micro):
        raise SystemExit(f"--batch {args.batch} must divide into {world} ranks × "
                         f"{args.micro} micro-batches")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else (
        torch.device("cpu"))
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    k = args.tasks
    model = MultiTaskModel(mlp_trunk(32, 64, 3), make_heads(64, k)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    # Same seed on every rank: random task orders (PCGrad, GradVac) drawn identically.
    generator = torch.Generator().manual_seed(1234)
    kwargs = {"generator": generator} if args.balancer in ("pcgrad", "gradvac") else {}
    balancer = gradbalance.get_balancer(args.balancer, num_tasks=k, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp)
    buf = gradbalance.TaskGradBuffer(
        model.shared_parameters(), model.head_parameters(), mode=args.mode,
        **({"modules": model.trunk} if args.mode == "gramian" else {}))

    data = torch.Generator().manual_seed(42)  # the same global batches on every rank
    mix = torch.randn(32, k, generator=data)
    shard = args.batch // world
    for step in range(args.steps):
        x = torch.randn(args.batch, 32, generator=data)
        y = torch.tanh(x @ mix) * torch.tensor([10.0 ** -t for t in range(k)])
        x, y = x[rank * shard:(rank + 1) * shard].to(device), y[rank * shard:(rank + 1) * shard]
        with ddp_no_sync(ddp):
            for xm, ym in zip(x.chunk(args.micro), y.to(device).chunk(args.micro)):
                with torch.autocast(device.type, enabled=args.amp,
                                    dtype=torch.float16 if cuda else torch.bfloat16):
                    feats = model.trunk(xm) if args.mode == "features" else None
                    outputs = ddp(xm) if feats is None else [h(feats) for h in model.heads]
                    losses = regression_losses(outputs, ym)
                buf.backward(losses / args.micro, scaler=scaler, features=feats)
        stats = buf.apply_(balancer, scaler=scaler)
        scaler.unscale_(opt)
        pre_clip = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            losses_txt = " ".join(f"{v:.4f}" for v in stats.losses.tolist())
            print(f"step {step:4d}  losses {losses_txt}  pre-clip {float(pre_clip):.3f}"
                  f"  skipped {stats.found_inf}", flush=True)

    assert_same_across_ranks(list(model.parameters()), what="parameters")
    assert_same_across_ranks(balancer.state_dict(), what="balancer state")
    if rank == 0:
        print(f"{world} ranks hold identical parameters and balancer state", flush=True)
    del ddp  # before the process group goes: DDP's reducer holds on to it
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
