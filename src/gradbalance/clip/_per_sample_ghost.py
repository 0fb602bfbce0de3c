"""Per-sample gradient norms of linear, conv, LayerNorm and embedding layers without
per-sample gradients (the ghost-norm identity ``‖Dᵢᵀ Xᵢ‖² = Σₛ,ₜ (Xᵢₛ·Xᵢₜ)(Dᵢₛ·Dᵢₜ)``; the
design, covered layers and refusals: docs/loop.md, "Per-sample clipping")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from .._amp import no_autocast
from .._checks import check_bool, check_loss_scale, check_norm_type
from .._per_sample_mixing import mixed_outputs, mixing_error
from ._per_sample_graph import _check_losses
from ._per_sample_layers import COVERED as _COVERED
from ._per_sample_layers import HookedLayer as _Layer
from ._per_sample_layers import refusal as _refusal
from ._per_sample_record import LayerRecorder
from ._per_sample_tied import Site, site_form, tied_powers
from ._per_sample_tokens import token_rows

__all__ = ["GhostNorms"]


def _embedding_norms(ids: Tensor, d: Tensor, module: nn.Embedding, norm_type: float) -> Tensor:
    """Per-sample ``‖∇W‖ᵖ`` (float64) of an embedding from its token rows."""
    rows = token_rows(ids, d, module, torch.float64)
    powers = torch.linalg.vector_norm(rows.rows, norm_type, dim=1) ** norm_type
    total = torch.zeros(ids.shape[0], dtype=torch.float64, device=d.device)
    return total.index_add_(0, rows.samples, powers)


def _powers(sites: list[tuple[_Layer, bool]], rows: dict[int, tuple[Tensor, Tensor]],
            grams: dict[int, Tensor], norm_type: float) -> Tensor:
    """Per-sample ``‖Σ_sites ∇θ‖ᵖ`` (float64 ``[B]``) of one parameter from its sites'
    ``(input rows, output gradient rows)``; an embedding weight alone sums its rows per token,
    a layer's own weight takes its inputs' Gram from ``grams`` (one for every task)."""
    first, first_is_weight = sites[0]
    if len(sites) == 1 and first_is_weight and isinstance(first.module, nn.Embedding):
        return _embedding_norms(*rows[id(first)], first.module, norm_type)

    def input_gram() -> Tensor:
        if id(first) not in grams:
            x = rows[id(first)][0]
            x = x.to(torch.promote_types(x.dtype, torch.float32))
            grams[id(first)] = (x @ x.transpose(1, 2)).double()
        return grams[id(first)]

    return tied_powers([site_form(Site(layer.module, is_weight), *rows[id(layer)])
                        for layer, is_weight in sites], norm_type,
                       input_gram if len(sites) == 1 and first_is_weight else None)


def _finite_norm_type(norm_type: float) -> float:
    """A valid, finite ``norm_type`` (the p-th powers are summed over layers)."""
    p = check_norm_type("norm_type", norm_type)
    if p == float("inf"):
        raise ValueError(
            "Invalid norm_type: inf (GhostNorms sums p-th powers over layers; "
            "use a finite p, or per_sample_grad_norms_of_model for the max-norm)"
        )
    return p


def _wanted_of(module: nn.Module, wanted: set[int]) -> list[Tensor]:
    """The weight and bias of a covered layer that are among the ``wanted`` ids."""
    if not isinstance(module, _COVERED):
        return []
    bias = getattr(module, "bias", None)
    return [p for p in (module.weight, bias) if p is not None and id(p) in wanted]


def _uncovered(named: Mapping[str, Tensor], uncovered: set[int], given: bool,
               refused: list[str]) -> str | None:
    """Which wanted parameters have no ghost form (given tensors that are no parameters of the
    module included) and what to do instead; None when every one has."""
    missing = [name for name, p in named.items() if id(p) in uncovered]
    if given and len(uncovered) > len(missing):
        missing.append("(tensors that are not parameters of module)")
    if not missing:
        return None
    layers = f" (refused layers: {', '.join(refused)})" if refused else ""
    return (
        f"GhostNorms covers the weights and biases of nn.Linear, nn.Conv1d, "
        f"nn.Conv2d (groups=1, zero padding), nn.LayerNorm and nn.Embedding; "
        f"{missing} are not{layers}: bound "
        f"them with per_sample_grad_norms_of_model (torch.func), or pass params= "
        f"without them"
    )


class GhostNorms:
    """Forward hooks on the linear, conv, LayerNorm and embedding layers of ``module``;
    per-sample norms.

    Build it once, before the forward; per step ``clip(per_sample, params,
    norms=ghost.norms(per_sample))`` (docs/loop.md, "Per-sample clipping").

    Args:
        module: the model (or the part whose parameters are bounded).
        params: the parameters bounded (default: every trainable parameter of ``module``);
            each must be the weight or bias of an ``nn.Linear``, ``nn.Conv1d``,
            ``nn.Conv2d``, ``nn.LayerNorm`` or ``nn.Embedding`` in ``module``.
        norm_type: the p of the p-norm (2 uses the Gram form).
        per_task: ``[B, K]`` norms of every (sample, task) gradient, or ``[B]`` norms of
            each sample's gradient of ``Σₖ ℓᵢₖ``.

    Inputs are recorded only while grad is enabled; :meth:`norms` consumes the step's
    records.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from gradbalance.clip import GhostNorms
        >>> _ = torch.manual_seed(0)
        >>> embed, out = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
        >>> out.weight = embed.weight  # tied, as in language models
        >>> model = nn.Sequential(embed, out)
        >>> ghost = GhostNorms(model)
        >>> ids = torch.tensor([[0, 1, 1], [2, 4, 2]])
        >>> per_sample = model(ids).logsumexp(-1).sum(1)          # [B]
        >>> norms = ghost.norms(per_sample)
        >>> alone = torch.autograd.grad(per_sample[1], embed.weight)[0]  # sample 1's gradient
        >>> torch.allclose(norms[1], alone.norm())
        True
    """

    def __init__(self, module: nn.Module, params: Iterable[Tensor] | None = None, *,
                 norm_type: float = 2.0, per_task: bool = True) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"Invalid module: a {type(module).__name__} (expected the nn.Module "
                            f"whose layers are bounded, e.g. GhostNorms(model))")
        self.norm_type = _finite_norm_type(norm_type)
        self.per_task = check_bool("per_task", per_task)
        named = {name: p for name, p in module.named_parameters() if p.requires_grad}
        wanted = set(map(id, named.values() if params is None else params))
        self._record = LayerRecorder("GhostNorms", many_calls=(
            "since the last norms(): every forward under grad is kept until norms() or "
            "clear(); evaluate under torch.no_grad() or call clear()"))
        self._layers = self._record.layers
        self._bounded: list[Tensor] = []  # each bounded parameter (its sites: the record's)
        self._unmixed: set[tuple[tuple[int, ...], int]] = set()  # structures checked unmixed
        covered, refused = self._hook_layers(module, wanted)
        message = _uncovered(named, wanted - covered, params is not None, refused)
        if message is not None:
            self.remove()
            raise ValueError(message)

    def _hook_layers(self, module: nn.Module, wanted: set[int]) -> tuple[set[int], list[str]]:
        """Hook every covered layer holding a wanted parameter; the ids of the parameters
        covered, and the layers refused (``"name (reason)"``)."""
        refused: list[str] = []
        refused_ids: set[int] = set()  # held by a refused layer: not covered, even if tied
        for name, sub in module.named_modules():
            mine = _wanted_of(sub, wanted)
            if not mine:
                continue
            reason = _refusal(sub)
            if reason is not None:
                refused.append(f"{name} ({reason})")
                refused_ids.update(map(id, mine))
                continue
            layer = self._record.add_layer(name, sub, wanted)
            self._bounded += [p for _, p, _ in layer.bounded()
                              if len(self._record.sites[id(p)]) == 1]
        return set(self._record.sites) - refused_ids, refused

    def norms(self, per_sample_losses: Tensor, scale: float | Tensor = 1.0) -> Tensor:
        """Per-sample norms ``[B, K]`` (``[B]`` for one task or ``per_task=False``).

        K backward passes (one for ``per_task=False``) from the losses to the recorded layer
        outputs; the graph is kept and ``.grad`` untouched. Clears the records. ``scale``:
        differentiate ``scale·ℓ`` and divide the norms by it (fp16 autocast).
        """
        losses = _check_losses(per_sample_losses)
        scale = check_loss_scale("scale", scale)
        layers = [layer for layer in self._layers if layer.outputs]
        if len(layers) != len(self._layers):
            idle = [layer.name for layer in self._layers if not layer.outputs]
            self.clear()
            raise RuntimeError(
                f"no forward under grad was recorded for layers {idle}; run the forward after "
                f"building GhostNorms and call norms() once per forward"
            )
        with no_autocast(losses.device):
            return self._norms(losses, layers, scale)

    def _norms(self, losses: Tensor, layers: list[_Layer], scale: float | Tensor) -> Tensor:
        columns = losses.reshape(losses.shape[0], -1)
        batch = columns.shape[0]
        try:  # a refused step drops its records
            self._record.check(
                columns, self._bounded, "the losses must keep it too (no slice or reduction over "
                "the batch)", "bound the parameter with "
                "per_sample_grad_norms_of_model (torch.func) or per_sample_grad_norms, or "
                "pass params= without it")
        except (ValueError, RuntimeError):
            self.clear()
            raise
        layers = [layer for layer in layers if layer.outputs]  # off the losses' graph: 0
        self._check_unmixed(columns, layers, scale)
        inputs = [torch.cat([layer.rows(t, batch) for t in layer.inputs], 1)
                  for layer in layers]  # once for all K tasks
        grams: dict[int, Tensor] = {}  # layer id: its inputs' Gram, once for all K tasks
        roots = [columns.sum(dim=1)] if not self.per_task else list(columns.unbind(1))
        outputs = [y for layer in layers for y in layer.outputs]
        result = torch.zeros(batch, len(roots), dtype=torch.float64, device=losses.device)
        try:
            for k, root in enumerate(roots):
                grads = torch.autograd.grad(root.sum() * scale, outputs, retain_graph=True,
                                            allow_unused=True)
                self._add_powers(result[:, k], layers, inputs, grams, grads, batch)
        finally:  # the records are this forward's, used or failed
            self.clear()
        divisor = scale.detach().double() if isinstance(scale, Tensor) else float(scale)
        norms = result ** (1.0 / self.norm_type) / divisor
        norms = norms.to(torch.promote_types(losses.dtype, torch.float32))
        return norms[:, 0] if norms.shape[1] == 1 else norms

    def _check_unmixed(self, columns: Tensor, layers: list[_Layer],
                       scale: float | Tensor) -> None:
        """Refuse (``ValueError``, records dropped) a model that mixes the samples after a
        recorded layer (:mod:`gradbalance._per_sample_mixing`), once per structure of
        recorded calls, number of task columns and batch size."""
        structure = (tuple(len(layer.outputs) for layer in layers), *columns.shape)
        if structure in self._unmixed:
            return
        factor = scale if isinstance(scale, Tensor) else torch.tensor(float(scale))
        try:
            mixing = mixed_outputs(columns, factor.to(columns.device),
                                   [(layer.name, layer.outputs) for layer in layers])
        except BaseException:
            self.clear()
            raise
        if mixing:
            self.clear()
            raise mixing_error(mixing, "bound the per-sample norms with "
                                       "per_sample_grad_norms_of_model (torch.func)")
        if mixing is not None and len(self._unmixed) < 64:
            self._unmixed.add(structure)

    def _add_powers(self, column: Tensor, layers: list[_Layer], inputs: list[Tensor],
                    grams: dict[int, Tensor], grads: tuple[Tensor | None, ...],
                    batch: int) -> None:
        """Add every bounded parameter's per-sample ``‖∇θ‖ᵖ`` to ``column`` ``[B]`` (in place),
        from one task's gradients of every recorded output (in order; None: unused, zero)."""
        at = 0
        rows: dict[int, tuple[Tensor, Tensor]] = {}  # layer id: (input rows, output gradients)
        for layer, x in zip(layers, inputs):
            ds = [torch.zeros_like(y) if g is None else g
                  for y, g in zip(layer.outputs, grads[at : at + len(layer.outputs)])]
            at += len(layer.outputs)
            rows[id(layer)] = x, torch.cat([layer.output_rows(t, batch) for t in ds], 1)
        for p in self._bounded:  # every site's gradient summed before the norm
            sites = [(layer, w) for layer, w in self._record.sites[id(p)] if id(layer) in rows]
            if sites:  # else every site is off the losses' graph: 0
                column += _powers(sites, rows, grams, self.norm_type)

    def clear(self) -> None:
        """Drop the recorded inputs and outputs (e.g. after an evaluation under grad)."""
        self._record.clear()

    def remove(self) -> None:
        """Remove the forward hooks."""
        self._record.remove()
