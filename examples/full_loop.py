"""A complete balanced training loop: every stage of the step in its place.

GradVac on a 3-task model, mixed precision with a GradScaler, two micro-batches per step,
per-task clipping of the task gradients, the usual global clip, TensorBoard (or CSV) logging
of the step statistics, and a checkpoint that resumes bit-identically.

    python examples/full_loop.py --steps 200 --out runs/full_loop
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import gradbalance as gb
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three regression tasks of very different scales on shared inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 16, generator=gen)
    directions = torch.randn(16, 3, generator=gen)
    y = torch.tanh(x @ directions) * torch.tensor([1.0, 10.0, 0.1])
    return x, y


def train(steps: int, out: str, micro_batches: int = 2, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)
    x, y = make_data(seed)
    model = MultiTaskModel(mlp_trunk(16, 64, 2), make_heads(64, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cpu")                       # enabled on CPU too
    balancer = gb.balancers.GradVac(num_tasks=3, generator=torch.Generator().manual_seed(seed))
    buf = gb.TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    task_clip = gb.TaskClip(max_norm=5.0)                      # rows of G, before the combine
    running = gb.RunningStats(window=50)
    os.makedirs(out, exist_ok=True)
    csv = gb.CSVLogger(os.path.join(out, "scalars.csv"))
    batch_gen = torch.Generator().manual_seed(seed + 1)
    first_losses: list[float] = []
    for step in range(steps):
        idx = torch.randint(0, x.shape[0], (128,), generator=batch_gen)
        for xs, ys in zip(x[idx].chunk(micro_batches), y[idx].chunk(micro_batches)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outputs = model(xs)
            losses = torch.stack([
                nn.functional.mse_loss(out.float().squeeze(-1), ys[:, k])
                for k, out in enumerate(outputs)
            ])
            buf.backward(losses / micro_batches, scaler=scaler)    # heads .grad +=, G +=
        stats = buf.apply_(balancer, scaler=scaler, clip=task_clip)
        scaler.unscale_(optimizer)
        pre_clip = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
        scaler.step(optimizer)                                     # skipped on inf/NaN
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scalars = gb.stats_to_dict(stats, pre_clip=pre_clip)   # one host sync
        csv.log(scalars | running.update(scalars), step)
        if step == 0:
            first_losses = stats.losses.tolist()
    csv.close()
    gb.save_checkpoint(os.path.join(out, "last.pt"), step=steps, model=model,
                       optimizer=optimizer, scaler=scaler, balancer=balancer,
                       task_clip=task_clip, running=running)
    final = stats.losses.tolist()
    print("first losses", [f"{v:.4f}" for v in first_losses])
    print("final losses", [f"{v:.4f}" for v in final])
    print(f"outputs in {out}: scalars.csv, last.pt")
    return final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="runs/full_loop")
    args = parser.parse_args()
    torch.set_num_threads(1)
    train(args.steps, args.out)


if __name__ == "__main__":
    main()
