"""``BalancedTrainer`` under DeepSpeed is refused with the reason and the alternative
(docs/integrations.md, "Hugging Face"): the Trainer's set-up is stood in for by one that
reports DeepSpeed on, since DeepSpeed itself needs GPUs."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers

from gradbalance.balancers import PCGrad
from gradbalance.integrations.transformers import BalancedTrainer


def test_deepspeed_refusal_gives_the_reason_and_fsdp2(monkeypatch: pytest.MonkeyPatch) -> None:
    def set_up(self: Any, *args: Any, **kwargs: Any) -> None:
        self.is_deepspeed_enabled = True

    monkeypatch.setattr(transformers.Trainer, "__init__", set_up)
    with pytest.raises(ValueError) as caught:
        BalancedTrainer(balancer=PCGrad(2), shared_params=[], head_params=[])
    message = str(caught.value)
    assert "ZeRO owns the gradient partitions" in message
    assert "FSDP2" in message and "fully_shard" in message and "DDP" in message
