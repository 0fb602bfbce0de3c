"""The methods of ``gradbalance compare --per-sample``: instance-wise balancing.

Each balancer combines the ``B × K`` per-sample (sample × task) losses of the batch through
``TaskGradBuffer(shared, heads, modules=trunk, batch_dim=0)`` (docs/per_sample.md), against
``sum``, the plain mean of the same losses (the comparison of the Jacobian-descent paper,
Quinton & Rey, arXiv:2406.16232). docs/compare.md, "Per-sample objectives".
"""

from __future__ import annotations

from typing import Any

import torch

from gradbalance.balancers import BALANCERS, Balancer
from gradbalance_lab._mtl_methods import PER_SAMPLE, Method, _accepts, resolve_methods

__all__ = ["DEFAULT_PER_SAMPLE", "PER_SAMPLE", "build_per_sample_balancer",
           "resolve_per_sample"]

#: The balancers ``--per-sample`` runs by default (the weighted ones the paper compares).
DEFAULT_PER_SAMPLE = ("mgda", "upgrad")


def resolve_per_sample(balancers: list[str] | None, optional: bool = False) -> list[Method]:
    """``sum`` (the plain mean, task-wise: the same update as the mean of the per-sample
    losses), then every chosen balancer (``None``: the defaults) over per-sample objectives;
    defaults and ``optional`` ones (``all``) are skipped where they cannot run."""
    chosen = resolve_methods(list(DEFAULT_PER_SAMPLE) if balancers is None else balancers, [],
                             optional=optional or balancers is None)
    return [m if m.key == "sum" else Method(PER_SAMPLE, m.key, None, m.optional)
            for m in chosen]


def build_per_sample_balancer(key: str, seed: int) -> Balancer:
    """The registered balancer ``key`` for a number of objectives that changes with the batch
    (no ``num_tasks``), seeded if it draws randoms; one that needs the gradient rows is refused
    (the per-sample route gives their Gramian only)."""
    kwargs: dict[str, Any] = {}
    cls = BALANCERS[key]
    if _accepts(cls, "generator"):
        kwargs["generator"] = torch.Generator().manual_seed(10_000 + seed)
    balancer = cls(**kwargs)
    if not balancer.from_gramian:
        raise ValueError(
            f"balancer {key!r} needs the per-sample gradient rows, not only their Gramian, so "
            "it cannot combine per-sample objectives (batch_dim=0); pick a weighted balancer "
            f"(e.g. --balancers {','.join(DEFAULT_PER_SAMPLE)}) or run without --per-sample")
    return balancer

