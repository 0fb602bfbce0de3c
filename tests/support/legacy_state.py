"""The flat ``state_dict`` format of gradbalance 0.1 and 0.2, written out by hand.

Before balancers and loss weightings were ``nn.Module`` s, ``state_dict()`` returned one flat
dict: ``"_type"`` (0.2 only: the class name), one key per state tensor (None for a state not
yet set) and the non-tensor state (generator states, counters, optimizer states) beside them;
a weighting added ``"num_tasks"``, and CR-MOGM put its inner balancer's flat state under
``"inner.<key>"``. :data:`OLD_KEYS` lists, per class, the old key of each state tensor, read
from the 0.2 sources (``state_dict`` of each class); the non-tensor entries kept their names
in the module format's extra state. :func:`to_legacy` rewrites a module-format state in the
old format, so a test can check that such a state still loads (the library's conversion is a
separate table, in the classes).
"""

from __future__ import annotations

from typing import Any

#: Class name -> {module-format tensor name: 0.2 key}. A class not listed kept no tensors.
OLD_KEYS: dict[str, dict[str, str]] = {
    "CRMOGM": {"_lambda": "weights"},
    "DBMTL": {"_ema": "ema", "_step": "step"},
    "ExcessMTL": {"_root_sq_sum": "root_sq_sum", "_weights": "weights",
                  "_baseline": "baseline", "_warmup_sum": "warmup_sum", "_step": "step"},
    "GradVac": {"targets": "targets"},
    "MoCo": {"_y": "y", "_lambda": "lambda", "_step": "step"},
    "MoDo": {"_lambda": "lambda"},
    "NashMTL": {"alpha": "alpha", "step": "step"},
    "PCD": {"_ema": "ema", "_step": "step"},
    "SDMGrad": {"_w": "w"},
    "DWA": {"_weights": "weights", "_history": "history", "_window": "window"},
    "FAMO": {"logits": "logits", "min_losses": "min_losses"},
    "GradNorm": {"task_weights": "weights", "_initial": "initial_losses"},
    "IMTLL": {"log_scales": "log_scales"},
    "RLW": {"_weights": "weights"},
    "STCH": {"_nadir": "nadir", "_warmup_sum": "warmup_sum"},
    "UncertaintyWeighting": {"log_vars": "log_vars"},
}

#: Submodules whose state 0.2 nested under ``"<name>."``.
NESTED = ("inner",)


def to_legacy(state: dict[str, Any], tagged: bool = True, prefix: str = "") -> dict[str, Any]:
    """``state`` (module format) as 0.2 wrote it; ``tagged=False``: as 0.1 (no ``"_type"``)."""
    extra = dict(state[prefix + "_extra_state"])
    name = extra.pop("_type")
    out: dict[str, Any] = {"_type": name} if tagged else {}
    for new, old in OLD_KEYS.get(name, {}).items():
        out[old] = state.get(prefix + new)
    out.update(extra)
    for child in NESTED:
        if prefix + child + "._extra_state" in state:
            inner = to_legacy(state, tagged, prefix + child + ".")
            out.update({f"{child}.{key}": value for key, value in inner.items()})
    return out
