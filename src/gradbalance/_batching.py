"""Telling a batched backward that torch cannot batch from an error the model itself raised.

Where a batched ``autograd.grad`` (``is_grads_batched=True``) fails, the library falls back to
one backward per lane (:func:`~gradbalance.taskgrads.batched_grads`, the per-sample routes,
docs/performance.md "Modes"). A lane-by-lane backward repeats what an op without a batching
rule could not do; it must not hide an error of the user's own code: a tensor or module hook,
or a custom ``autograd.Function``'s backward that raises once (a check, a counter, an
injected failure) raises under plain ``sum(losses).backward()`` and so raises here too.

Not part of the public API.

Example:
    >>> import torch
    >>> def hook(grad):
    ...     raise RuntimeError("the model's own check failed")
    >>> x = torch.ones(2, requires_grad=True)
    >>> y = x * 2
    >>> _ = y.register_hook(hook)
    >>> try:
    ...     torch.autograd.grad(torch.stack([y.sum(), y.prod()]), x, torch.eye(2),
    ...                         is_grads_batched=True)
    ... except RuntimeError as error:
    ...     raised_by_model(error)
    True
"""

from __future__ import annotations

import os
import traceback

import torch

from ._caller import is_internal

#: Words of torch's messages where an op has no batching rule (``Batching rule not
#: implemented``, ``LegacyBatchedFallback``, ``BatchedTensorImpl``, ``vmap: …``), code
#: reads a batched tensor's data (``… doesn't have storage``), or memory ran out (``can't
#: allocate memory``, ``Tried to allocate``, ``out of memory``: a hook's copy of K lanes;
#: the fallback needs one lane's), lower case.
BATCHING_WORDS = ("batch", "vmap", "storage", "allocate", "out of memory")

_AUTOGRAD = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "autograd") + os.sep


def raised_by_model(error: BaseException) -> bool:
    """Whether the model's own backward code raised ``error``: the deepest frame of its
    traceback lies outside torch and this library, below a frame of torch's autograd (a
    tensor or module hook, a custom Function's backward; not a forward that a vectorised
    route runs again), and its message names no batching limit (:data:`BATCHING_WORDS`).
    Such an error is re-raised as it is, not answered by a fallback."""
    text = str(error).lower()
    if any(word in text for word in BATCHING_WORDS):
        return False
    files = [os.path.abspath(f.filename) for f in traceback.extract_tb(error.__traceback__)]
    below_autograd = any(f.startswith(_AUTOGRAD) for f in files[:-1])
    return below_autograd and not is_internal(files[-1])
