"""The cost of the balanced step on a trunk sharded with FSDP2, against the plain FSDP2 step.

Two gloo ranks on CPU (``mp.spawn``, bounded), an MLP trunk with each ``nn.Linear`` and the
root under ``fully_shard``, K linear heads (replicated). Per K and per FSDP2 setting, each
rank times ``--steps`` steps after a warm-up, in alternation with the plain step
(``sum(losses).backward()`` + ``optimizer.step()``), and counts what the collectives carry:

* all-gather: the gathered (output) bytes, reduce-scatter: the input bytes, all-reduce: the
  tensor's bytes, summed per step and rank (the payload; a ring moves (W-1)/W of it);
* time: the median step of rank 0, and its ratio to the plain step's median.

Settings: ``default`` (``fully_shard`` as it comes: reshard after forward and after each
backward), ``keep-forward`` (``reshard_after_forward=False``), ``keep-backward``
(``set_reshard_after_backward(False)`` during the K passes and ``reshard()`` after them: the
parameters are gathered once more for the first pass, held unsharded through the others),
``keep-both`` (both: gathered once per step, by the forward).

With ``--mesh RxS`` the trunk is under HSDP instead: ``R·S`` ranks, ``fully_shard`` over a 2-D
``(replicate, shard)`` mesh of ``R`` replicas of ``S`` shards; the all-reduce column then
holds FSDP2's all-reduce of the gradient shards over the replicate dimension.

    python benchmarks/fsdp_cost.py --quick        # smoke run, ~20 s
    python benchmarks/fsdp_cost.py                # K = 2, 4, 8; writes results/fsdp_cost_cpu.md
    python benchmarks/fsdp_cost.py --mesh 2x2     # HSDP on 4 ranks; results/fsdp_cost_cpu-hsdp.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

SETTINGS = ("default", "keep-forward", "keep-backward", "keep-both")


class Counter:
    """Payload bytes of the collectives ``torch.distributed`` runs, by kind."""

    KINDS: ClassVar[dict[str, str]] = {
        "all_gather_single": "gather", "all_gather_into_tensor": "gather",
        "reduce_scatter_single": "scatter", "reduce_scatter_tensor": "scatter",
        "all_reduce": "reduce", "all_gather": "gather"}

    def __init__(self) -> None:
        self.bytes = {"gather": 0, "scatter": 0, "reduce": 0}
        self.calls = {"gather": 0, "scatter": 0, "reduce": 0}
        for name, kind in self.KINDS.items():
            original = getattr(dist, name)
            setattr(dist, name, self._wrap(original, kind, name))

    def _wrap(self, original: Any, kind: str, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if name in ("all_gather_single", "all_gather_into_tensor"):
                tensor = args[0] if args else kwargs["output_tensor"]
            elif name in ("reduce_scatter_single", "reduce_scatter_tensor"):
                tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
            elif name == "all_gather":
                tensor = args[1] if len(args) > 1 else kwargs["tensor"]
                tensor = tensor.new_empty(tensor.numel() * len(args[0]))
            else:
                tensor = args[0] if args else kwargs["tensor"]
            self.bytes[kind] += tensor.numel() * tensor.element_size()
            self.calls[kind] += 1
            return original(*args, **kwargs)

        return call

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        out = dict(self.bytes), dict(self.calls)
        for key in self.bytes:
            self.bytes[key] = 0
            self.calls[key] = 0
        return out


def _model(args: argparse.Namespace, k: int, setting: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    size = args.inputs
    for _ in range(args.depth):
        layers += [nn.Linear(size, args.width), nn.ReLU()]
        size = args.width
    model = nn.Module()
    model.trunk = nn.Sequential(*layers)
    model.heads = nn.ModuleList([nn.Linear(size, 1) for _ in range(k)])
    keep = setting in ("keep-forward", "keep-both")
    on: dict[str, Any] = {}
    if args.mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh

        on["mesh"] = init_device_mesh("cpu", args.mesh, mesh_dim_names=("replicate", "shard"))
    for layer in model.trunk:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, reshard_after_forward=not keep, **on)
    fully_shard(model.trunk, reshard_after_forward=not keep, **on)
    return model


def _measure(args: argparse.Namespace, k: int, setting: str, rank: int, world: int,
             counter: Counter) -> dict[str, Any]:
    """The plain and the balanced step of one K and one FSDP2 setting, alternated."""
    from torch.distributed.fsdp import FSDPModule

    from gradbalance import TaskGradBuffer
    from gradbalance.balancers import UPGrad

    model = _model(args, k, setting)
    trunk, heads = model.trunk, model.heads
    opt = torch.optim.SGD([*trunk.parameters(), *heads.parameters()], lr=1e-3)
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters())
    balancer = UPGrad()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch // world, args.inputs, generator=g)
    y = torch.randn(args.batch // world, k, generator=g)
    held = setting in ("keep-backward", "keep-both")

    def losses() -> torch.Tensor:
        feats = trunk(x)
        return torch.stack([nn.functional.mse_loss(h(feats).squeeze(-1), y[:, i])
                            for i, h in enumerate(heads)])

    def plain() -> None:
        losses().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def balanced() -> None:
        if held:
            trunk.set_reshard_after_backward(False)  # type: ignore[operator]
        buf.backward(losses())
        if held:  # reshard() acts on one module: every FSDP module of the trunk
            for module in trunk.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
            trunk.set_reshard_after_backward(True)  # type: ignore[operator]
        buf.apply_(balancer)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"plain": [], "balanced": []}
    traffic: dict[str, Any] = {}
    for step in range(args.warmup + args.steps):
        for name, fn in (("plain", plain), ("balanced", balanced)):
            dist.barrier()
            counter.take()
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            traffic[name] = counter.take()
            if step >= args.warmup:
                times[name].append(elapsed)
    return {"k": k, "setting": setting,
            "plain_s": statistics.median(times["plain"]),
            "balanced_s": statistics.median(times["balanced"]),
            "plain_bytes": traffic["plain"][0], "plain_calls": traffic["plain"][1],
            "balanced_bytes": traffic["balanced"][0], "balanced_calls": traffic["balanced"][1],
            "params": sum(p.numel() for p in trunk.parameters())}


def _worker(rank: int, world: int, init_file: str, out_dir: str,
            args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    counter = Counter()
    rows = [_measure(args, k, setting, rank, world, counter)
            for k in args.ks for setting in SETTINGS]
    torch.save(rows, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    mb = 1 / 2**20
    how = "fully_shard" if args.mesh is None else \
        f"fully_shard over a {args.mesh[0]}x{args.mesh[1]} (replicate, shard) mesh: HSDP"
    lines = [
        f"# FSDP2 balanced step: cost on CPU/gloo, {args.world} ranks (torch {torch.__version__})",
        "",
        f"Trunk: MLP {args.depth}x{args.width} on input {args.inputs} "
        f"({rows[0]['params']:,} parameters, each Linear and the root under {how}), "
        f"global batch {args.batch}, K linear heads (replicated), UPGrad; median of "
        f"{args.steps} steps on rank 0 after {args.warmup} warm-up, one torch thread per rank. "
        f"Bytes: the payload per rank and step (all-gather output, reduce-scatter input, "
        f"all-reduce tensor), in MiB.",
        "",
        "| K | setting | plain step (ms) | balanced (ms) | ratio | plain gather / scatter"
        f"{'' if args.mesh is None else ' / all-reduce'} MiB "
        "| balanced gather / scatter / all-reduce MiB | balanced collectives |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pb, bb, bc = r["plain_bytes"], r["balanced_bytes"], r["balanced_calls"]
        reduced = "" if args.mesh is None else f" / {pb['reduce'] * mb:.4f}"
        lines.append(
            f"| {r['k']} | {r['setting']} | {r['plain_s'] * 1e3:.1f} | "
            f"{r['balanced_s'] * 1e3:.1f} | {r['balanced_s'] / r['plain_s']:.2f} | "
            f"{pb['gather'] * mb:.2f} / {pb['scatter'] * mb:.2f}{reduced} | "
            f"{bb['gather'] * mb:.2f} / {bb['scatter'] * mb:.2f} / {bb['reduce'] * mb:.4f} | "
            f"{bc['gather']} AG, {bc['scatter']} RS, {bc['reduce']} AR |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ks", default="2,4,8")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny trunk, K = 2, 2 steps")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--limit", type=float, default=600.0, help="seconds before giving up")
    parser.add_argument("--mesh", default="", help="RxS: HSDP over R replicas of S shards")
    args = parser.parse_args()
    args.ks = [int(v) for v in args.ks.split(",") if v]
    args.mesh = tuple(int(v) for v in args.mesh.split("x")) if args.mesh else None
    if args.mesh is not None and (len(args.mesh) != 2 or min(args.mesh) < 1):
        parser.error(f"--mesh takes RxS (e.g. 2x2), got {'x'.join(map(str, args.mesh))}")
    args.world = 2 if args.mesh is None else args.mesh[0] * args.mesh[1]
    if args.quick:
        args.ks, args.width, args.inputs, args.steps, args.warmup = [2], 32, 16, 2, 1
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker,
                             args=(r, args.world, os.path.join(tmp, "init"), tmp, args))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.limit
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in procs):
            for p in procs:
                p.kill()
            sys.exit(f"fsdp_cost: the ranks ran past --limit {args.limit} s")
        rows = torch.load(os.path.join(tmp, "rank0.pt"), weights_only=False)
    text = _table(rows, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = ("" if args.mesh is None else "-hsdp") + ("-quick" if args.quick else "")
    (out / f"fsdp_cost_cpu{suffix}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
