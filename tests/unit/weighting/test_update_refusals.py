"""A refused argument of ``update()`` (FAMO's ``losses_after`` missing, of the wrong length or
below ``min_losses``) raises before anything moves: the step's pending observation stays, so
the call repeated with the right argument learns what an update never refused learns."""

from __future__ import annotations

import pytest
import torch

from gradbalance.weighting import FAMO


@pytest.mark.parametrize("bad", [None, torch.tensor([0.5, 0.4]), torch.tensor([0.5, -1.0, 0.2])])
def test_famo_refused_losses_after_keep_the_observation(bad: torch.Tensor | None) -> None:
    runs = []
    for refused_first in (True, False):
        famo = FAMO(3)
        famo(torch.tensor([1.0, 2.0, 0.5], requires_grad=True))
        if refused_first:
            with pytest.raises(ValueError, match="losses_after"):
                famo.update(bad)
        assert famo.update(torch.tensor([0.9, 1.5, 0.45]))
        runs.append(famo.logits.detach().clone())
    assert torch.equal(runs[0], runs[1])
