"""``gradbalance demo``: a short balanced training run on synthetic multitask regression."""

from __future__ import annotations

import argparse

import torch

from ..balancers import BALANCERS, get_balancer
from ..models import MultiTaskModel, make_heads, mlp_trunk, regression_losses
from ..step import TaskGradBuffer

HELP = "train a small 3-task model for a few steps and print per-task losses"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--balancer", default="mean", choices=sorted(BALANCERS),
                        help="balancer name (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0, help="random seed")


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    k, scales = 3, torch.tensor([1.0, 10.0, 0.1])
    x = torch.randn(512, 8)
    targets = torch.stack([(x @ torch.randn(8)) * s for s in scales], dim=1)
    model = MultiTaskModel(mlp_trunk(8, 32, 2), make_heads(32, k))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    balancer = get_balancer(args.balancer)
    for step in range(args.steps + 1):
        idx = torch.randint(0, x.shape[0], (64,))
        buf.backward(regression_losses(model(x[idx]), targets[idx]))
        stats = buf.apply_(balancer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % max(1, args.steps // 4) == 0:
            losses = " ".join(f"{v:9.4f}" for v in stats.losses.tolist())
            cos = stats.cosine[0, 1].item()
            print(f"step {step:4d}  losses {losses}  cos(task0,task1) {cos:+.2f}")
    return 0
