"""Per-sample clipping with a balancer: DP-SGD's clip and noise in a multitask loop.

Three regression tasks on a shared MLP; each (sample, task) gradient is clipped to
``--max-norm`` with ghost norms of the ``nn.Linear`` layers (no per-sample gradient is ever
built), the clipped task losses go through MGDA, and Gaussian noise ``N(0, (σC/B)²)`` from the
clipper's own generator is added to the update.

    python examples/dp_sgd.py --steps 200 --max-norm 1.0 --noise 0.5
"""

from __future__ import annotations

import argparse

import torch

import gradbalance as gb
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three regression tasks of different scales on shared inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 16, generator=gen)
    y = torch.tanh(x @ torch.randn(16, 3, generator=gen)) * torch.tensor([1.0, 3.0, 0.3])
    return x, y


def squared_errors(outputs: list[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    """Per-sample losses ``[B, K]`` (``reduction='none'``)."""
    return torch.stack([(o.squeeze(-1) - y[:, k]) ** 2 for k, o in enumerate(outputs)], dim=1)


def train(steps: int, max_norm: float, noise: float, seed: int = 0,
          batch: int = 64) -> dict[str, object]:
    torch.manual_seed(seed)
    x, y = make_data(seed)
    model = MultiTaskModel(mlp_trunk(16, 64, 2), make_heads(64, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    balancer = gb.balancers.MGDA(num_tasks=3)
    buf = gb.TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    clip = gb.clip.PerSampleClip(max_norm, noise_multiplier=noise,
                            generator=torch.Generator().manual_seed(seed + 2))
    ghost = gb.clip.GhostNorms(model)          # hooks: before the first forward
    batches = torch.Generator().manual_seed(seed + 1)
    clipped_share: list[float] = []
    losses_log: list[list[float]] = []
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (batch,), generator=batches)
        per_sample = squared_errors(model(x[idx]), y[idx])          # [B, K]
        norms = ghost.norms(per_sample)                             # [B, K], exact
        losses = clip(per_sample, model.parameters(), norms=norms)  # value: batch means
        buf.backward(losses)
        stats = buf.apply_(balancer)
        clip.add_noise_(model.parameters(), batch_size=batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clipped_share.append(float((norms > max_norm).float().mean()))
        losses_log.append(stats.losses.tolist())
    print("first losses", [f"{v:.4f}" for v in losses_log[0]])
    print("final losses", [f"{v:.4f}" for v in losses_log[-1]])
    print(f"share of (sample, task) gradients clipped: first step {clipped_share[0]:.2f}, "
          f"last {clipped_share[-1]:.2f}")
    return {"model": model, "clip": clip, "losses": losses_log, "clipped": clipped_share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--noise", type=float, default=0.5, help="noise multiplier σ")
    args = parser.parse_args()
    train(args.steps, args.max_norm, args.noise)


if __name__ == "__main__":
    main()
