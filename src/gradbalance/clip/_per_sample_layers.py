"""The layers whose per-sample gradients have an outer form ``Dᵢᵀ Xᵢ`` (the ghost-norm
identity): which layers, why another is refused, and a hooked layer's recorded calls as
``[B, S, in]`` / ``[B, S, out]`` rows. Shared by :class:`~gradbalance.clip.GhostNorms` (the
diagonal of the per-sample Gramian) and the per-sample Gramian of ``batch_dim=0``
(docs/per_sample.md).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

__all__ = ["COVERED", "HookedLayer", "batched_rank", "refusal", "refuse_training_batch_norm"]

#: The layers with a ghost form.
COVERED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.LayerNorm, nn.Embedding)


class HookedLayer:
    """One hooked layer: its recorded calls and how they become ``[B, S, in]`` / ``[B, S, out]``."""

    def __init__(self, name: str, module: nn.Module, weight: bool, bias: bool) -> None:
        self.name = name
        self.module = module
        self.weight = weight
        self.bias = bias
        self.inputs: list[Tensor] = []
        self.outputs: list[Tensor] = []

    def bounded(self) -> list[tuple[str, Tensor, bool]]:
        """The layer's bounded parameters: their name in the model, the tensor, and whether
        it is the layer's weight (else its bias)."""
        prefix = f"{self.name}." if self.name else ""
        weight, bias = getattr(self.module, "weight", None), getattr(self.module, "bias", None)
        found: list[tuple[str, Tensor, bool]] = []
        if self.weight and isinstance(weight, Tensor):
            found.append((f"{prefix}weight", weight, True))
        if self.bias and isinstance(bias, Tensor):
            found.append((f"{prefix}bias", bias, False))
        return found

    def rows(self, x: Tensor, batch: int) -> Tensor:
        """The layer's input as ``[B, S, in]``: tokens, or a convolution's unfolded patches."""
        m = self.module
        if isinstance(m, nn.Conv2d):
            assert not isinstance(m.padding, str)  # refusal turns string paddings away
            patches = nn.functional.unfold(x, m.kernel_size, m.dilation, m.padding, m.stride)
            return patches.transpose(1, 2)  # [B, H'·W', C·kh·kw]
        if isinstance(m, nn.LayerNorm):  # the normalised input x̂: y = γ ⊙ x̂ + β
            dims = len(m.normalized_shape)
            flat = nn.functional.layer_norm(x, m.normalized_shape, None, None, m.eps)
            return flat.reshape(batch, -1, *x.shape[x.dim() - dims:]).flatten(2)
        if isinstance(m, nn.Conv1d):  # a 1 × k convolution on a [B, C, 1, L] image
            assert not isinstance(m.padding, str)  # refusal turns string paddings away
            patches = nn.functional.unfold(x.unsqueeze(2), (1, m.kernel_size[0]),
                                           (1, m.dilation[0]), (0, m.padding[0]),
                                           (1, m.stride[0]))
            return patches.transpose(1, 2)  # [B, L', C·k]
        if isinstance(m, nn.Embedding):  # the token ids [B, S]
            return x.reshape(batch, -1)
        return x.reshape(batch, -1, x.shape[-1])

    def output_rows(self, d: Tensor, batch: int) -> Tensor:
        """The gradient of the layer's output as ``[B, S, out]``."""
        if isinstance(self.module, (nn.Conv1d, nn.Conv2d)):
            return d.reshape(batch, d.shape[1], -1).transpose(1, 2)
        if isinstance(self.module, nn.LayerNorm):
            dims = len(self.module.normalized_shape)
            return d.reshape(batch, -1, *d.shape[d.dim() - dims:]).flatten(2)
        return d.reshape(batch, -1, d.shape[-1])


def batched_rank(module: nn.Module) -> int:
    """The fewest dims of a batched input of ``module``: one more than its unbatched input's
    (``[B, in]`` for a Linear, ``[B, C, L]`` for a Conv1d, ``[B, *normalized_shape]`` for a
    LayerNorm, ``[B]`` token ids for an Embedding). An unbatched call whose dim 0 happens to
    be B must not pass for a batch."""
    if isinstance(module, nn.LayerNorm):
        return len(module.normalized_shape) + 1
    if isinstance(module, nn.Conv2d):
        return 4
    if isinstance(module, nn.Conv1d):
        return 3
    return 1 if isinstance(module, nn.Embedding) else 2


def refusal(module: nn.Module) -> str | None:
    """Why ``module``'s per-sample gradient has no ghost form here (None: it has one). A
    subclass of a covered layer that overrides ``forward`` (a readout scaling its input, a
    weight-standardised convolution) has none: the form is the plain layer's, and the hooks
    see only its input and output."""
    own = _own_forward(module)
    if own is not None:
        return own
    if isinstance(module, (nn.Linear, nn.LayerNorm)):
        return None
    if isinstance(module, nn.Embedding):
        return "scale_grad_by_freq couples the samples" if module.scale_grad_by_freq else None
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return _conv_refusal(module)
    return type(module).__name__


def refuse_training_batch_norm(roots: Iterable[tuple[str, nn.Module]], instead: str) -> None:
    """Raise ``ValueError`` naming the first BatchNorm (or SyncBatchNorm) in training mode
    under the ``(prefix, module)`` pairs ``roots``: it mixes the samples (per-sample
    gradients are not defined); ``instead``: the caller's last fix (``", or ..."``)."""
    for prefix, root in roots:
        for name, sub in root.named_modules():
            if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.training:
                where = f"{prefix}.{name}" if prefix and name else prefix or name
                raise ValueError(
                    f"layer {where!r} ({type(sub).__name__} in training mode) mixes the "
                    f"samples of the batch, so per-sample gradients are not defined: use "
                    f"nn.GroupNorm or nn.LayerNorm, or put it in eval mode "
                    f"(module.eval()){instead}"
                )


def _own_forward(module: nn.Module) -> str | None:
    """``"X overrides nn.Y.forward"`` where ``module`` is a covered layer ``nn.Y`` whose class
    overrides its ``forward``, else None."""
    for base in COVERED:
        if isinstance(module, base) and type(module).forward is not base.forward:
            return f"{type(module).__name__} overrides nn.{base.__name__}.forward"
    return None


def _conv_refusal(module: nn.Conv1d | nn.Conv2d) -> str | None:
    """Why a convolution has no ghost form here: groups, or a padding other than zeros given
    as numbers (None: it has one)."""
    if module.groups != 1:
        return "grouped convolution"
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        return f"padding {module.padding!r} with padding_mode {module.padding_mode!r}"
    return None
