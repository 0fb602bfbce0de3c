"""``_amp.all_finite``: the sum-first finiteness test agrees with ``isfinite(t).all()``.

A tensor's sum is non-finite when an entry is (inf and NaN absorb any sum) and also when
finite entries overflow it; the second case must fall through to the entry-wise test. The
reference is torch's own ``isfinite`` per entry, on tensors of every floating dtype with
planted infs, NaNs and entries near the dtype's largest value.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradbalance._amp import all_finite

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
PLANTS = st.sampled_from(["none", "inf", "-inf", "nan", "huge", "huge_and_nan"])


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(1, 300), PLANTS),
                min_size=0, max_size=4),
       st.integers(0, 2**16))
def test_agrees_with_the_entrywise_test(specs: list[tuple[torch.dtype, int, str]],
                                        seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for dtype, n, plant in specs:
        t = torch.randn(n, generator=gen).to(dtype)
        at = int(torch.randint(n, (1,), generator=gen))
        if plant in ("inf", "-inf", "nan"):
            t[at] = float(plant)
        elif plant.startswith("huge"):  # finite entries whose sum overflows the dtype
            t[:] = torch.finfo(dtype).max * 0.75
            if plant == "huge_and_nan":
                t[at] = float("nan")
        tensors.append(t)
    expected = all(bool(torch.isfinite(t).all()) for t in tensors)
    assert all_finite(tensors) is expected


def test_overflowing_sum_of_finite_entries_is_finite() -> None:
    big = torch.full((4,), 3e38)  # float32: the sum is inf, every entry finite
    assert not bool(torch.isfinite(big.sum()))
    assert all_finite([big, torch.ones(2, 2)])
    assert not all_finite([big, torch.tensor([0.0, float("-inf")])])
