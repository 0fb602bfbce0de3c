"""Accelerate's FSDP plugin on CPU processes, for the tests of the Trainer and Accelerate
under FSDP2.

accelerate 1.15 takes the ``DistributedType.FSDP`` branch of ``AcceleratorState.__init__``
(``accelerate/state.py``) only for accelerator process groups (``MULTI_GPU``, ``MULTI_NPU``,
...): with gloo CPU processes a ``FullyShardedDataParallelPlugin`` leaves the run
``MULTI_CPU`` (data-parallel). :func:`force_fsdp_on_cpu` makes the state take that branch
for CPU processes too, as it would on GPUs; the rest of accelerate is unchanged, so
``prepare`` runs ``fsdp2_prepare_model`` (``fully_shard`` over the gloo world) and its FSDP2
clipping, ``no_sync`` and checkpointing — the path a GPU cluster takes.
"""

from __future__ import annotations

from typing import Any


def force_fsdp_on_cpu() -> None:
    """Patch ``AcceleratorState.__init__`` (this process) so that an FSDP plugin on a
    ``MULTI_CPU`` process group selects ``DistributedType.FSDP``."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "_forces_fsdp_on_cpu", False):
        return

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            if self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    init._forces_fsdp_on_cpu = True  # type: ignore[attr-defined]
    AcceleratorState.__init__ = init  # type: ignore[method-assign]
