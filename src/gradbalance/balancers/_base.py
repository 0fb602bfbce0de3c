"""The balancer interface: checks, the Gramian's scaling and ``wᵀ G`` in one place
(design: docs/balancers.md; rules for a new balancer: docs/ARCHITECTURE.md, "Extension
contract")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NoReturn

import torch
from torch import Tensor

from .._checks import check_matrix, check_num_tasks, check_range, check_square
from .._module import StateModule
from .._shard import Shard, full_gramian
from .._types import NonFiniteGradientError
from ..gramian import is_finite_gramian, products_rounding
from ._denoise import KeptSpectrum, cleaned

__all__ = ["Balancer", "Combination", "combine_rows"]


@dataclass
class Combination:
    """A balancer's output: the combined gradient ``[P]`` and, for weighted methods, ``[K]``.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import Mean
        >>> out = Mean().combine(torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64))
        >>> out.vector, out.weights
        (tensor([0.5000, 1.0000], dtype=torch.float64),
         tensor([0.5000, 0.5000], dtype=torch.float64))
    """

    vector: Tensor
    weights: Tensor | None = None


#: Up to this many weights on the CPU, :func:`combine_rows` reads their range in Python (4 µs
#: at K = 4, against 13 µs for the tensor reductions).
SMALL_WEIGHTS = 64
#: Columns of ``G`` per float64 block of :func:`combine_rows`'s wide path: at most this many
#: entries of ``G`` in float64 at a time (64 MB).
WIDE_BLOCK_ENTRIES = 2**23


#: The integer dtypes ``losses`` may hold (converted as numbers).
_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def combine_rows(weights: Tensor, matrix: Tensor, norms: Tensor | None = None) -> Tensor:
    """``wᵀ G``: the one place a weighted balancer touches the ``[K, P]`` matrix.

    The product runs in the matrix's dtype, unless a non-zero weight lies outside its normal
    range (above its largest finite value, or below its smallest normal one), or, with the
    rows' norms ``norms`` ``[K]`` (``√diag(G Gᵀ)``), ``Σₖ |wₖ| ‖gₖ‖`` (a bound on every
    partial sum of every entry) is above the largest finite value: then in float64, a block
    of columns at a time (:data:`WIDE_BLOCK_ENTRIES`), rounded once to the matrix's dtype
    (an entry past its range is ``±inf``, never NaN). Rows whose norms span ``1e-30 … 1e19``
    need such weights: UPGrad keeps a tiny row ``gⱼ`` that conflicts with a long one by
    adding ``(gⱼ·g)/‖gⱼ‖²`` times it, a weight of ``1e45`` (beyond float32's ``3.4e38``)
    whose term ``wⱼgⱼ`` is ordinary; cast to float32 it was ``inf``, and ``inf · 0`` made the
    update NaN. Terms ``wₖgₖ`` past the range that cancel (MGDA's ``"loss"`` normalisation of
    rows ``1e30`` by losses ``1e-30``: weights ``1e29``) made ``inf − inf`` in float32. One
    host sync (the weights' range) where the weights are wider than the matrix.

    Example:
        >>> import torch
        >>> from gradbalance.functional import combine_rows
        >>> combine_rows(torch.tensor([1.0, 3.0]), torch.eye(2))
        tensor([1., 3.])
        >>> g = torch.tensor([[1e-30, 0.0], [0.0, 1.0]])  # float32
        >>> combine_rows(torch.tensor([1e45, 2.0], dtype=torch.float64), g)  # 1e45 · 1e-30
        tensor([1.0000e+15, 2.0000e+00])
    """
    if _outside_range(weights, matrix.dtype, norms):
        return _wide_product(weights, matrix)
    return weights.to(dtype=matrix.dtype, device=matrix.device) @ matrix


def _outside_range(weights: Tensor, dtype: torch.dtype, norms: Tensor | None = None) -> bool:
    """Whether a non-zero weight cast to ``dtype`` (floating, narrower than the weights') would
    leave its normal range (overflow, or underflow below its smallest normal value), or, with
    the rows' ``norms``, ``Σₖ |wₖ| ‖gₖ‖`` is above its largest value (a term or a partial sum
    of ``wᵀG`` may overflow)."""
    if not (dtype.is_floating_point and weights.dtype.is_floating_point):
        return False  # integer weights (the functional API) or rows: the plain product
    if torch.finfo(dtype).bits >= torch.finfo(weights.dtype).bits:
        return False
    info = torch.finfo(dtype)
    top, bottom, bound = _weight_range(weights, norms)
    return bool(top > info.max or bottom < info.tiny or bound > info.max)


def _weight_range(weights: Tensor, norms: Tensor | None) -> tuple[float, float, float]:
    """``(max |wₖ|, min non-zero |wₖ|, Σₖ |wₖ| ‖gₖ‖)`` (the last 0 without ``norms``): read in
    Python up to :data:`SMALL_WEIGHTS` weights on the CPU, else one host sync."""
    if weights.device.type == "cpu" and weights.numel() <= SMALL_WEIGHTS:
        sizes = [abs(value) for value in weights.flatten().tolist()]
        bound = (0.0 if norms is None else
                 math.fsum(s * n for s, n in zip(sizes, norms.flatten().tolist(), strict=True)))
        return (max(sizes, default=0.0),
                min((size for size in sizes if size > 0.0), default=math.inf), bound)
    size = weights.abs()
    low = torch.where(size > 0.0, size, torch.inf).amin()
    total = (size.new_zeros(()) if norms is None
             else size @ norms.to(dtype=size.dtype, device=size.device))
    top, bottom, bound = torch.stack([size.amax(), low, total]).tolist()  # one host sync
    return top, bottom, bound


def _wide_product(weights: Tensor, matrix: Tensor) -> Tensor:
    """``wᵀ G`` in float64, :data:`WIDE_BLOCK_ENTRIES` entries of ``G`` at a time, in the
    matrix's dtype."""
    w = weights.to(dtype=torch.float64, device=matrix.device)
    out = torch.empty(matrix.shape[1], dtype=matrix.dtype, device=matrix.device)
    step = max(1, WIDE_BLOCK_ENTRIES // max(1, matrix.shape[0]))
    for start in range(0, matrix.shape[1], step):
        block = matrix[:, start:start + step].to(torch.float64)
        out[start:start + step] = (w @ block).to(matrix.dtype)
    return out


def _row_norms(gram: Tensor) -> Tensor:
    """``‖gₖ‖`` ``[K]`` from the Gramian's diagonal (the full one under a shard: at least the
    local columns' norms, so :func:`combine_rows`'s bound holds)."""
    return torch.diagonal(gram).clamp_min(0.0).sqrt()


class Balancer(StateModule):
    """Base class of every gradient balancer.

    ``num_tasks`` (K, optional) is checked on every call. A subclass declares ``name``,
    ``from_gramian`` (``g = wᵀ G`` with ``w`` from ``G Gᵀ``: implement
    :meth:`_compute_weights`; else :meth:`_combine_matrix`), ``homogeneous``,
    ``needs_losses``, ``min_tasks``, ``per_task_settings`` (the attributes holding one
    entry per task) and, weighted, ``weight_degree``
    (``δ`` with ``w(c·G Gᵀ) = c^δ w(G Gᵀ)``: the weights then see the Gramian over its
    largest diagonal ``t`` and are multiplied by ``t^δ``) and ``inverts_gramian`` (the rule
    inverts the Gramian on its range: it then sees it without a float32 product's rounding,
    :func:`~gradbalance.gramian.products_rounding`), and its state with
    :meth:`register_state`: the rules of docs/ARCHITECTURE.md, "Extension contract".

    Example:
        >>> import torch
        >>> from gradbalance.balancers import Balancer
        >>> class Half(Balancer):  # a weighted balancer: w from the Gramian
        ...     from_gramian = True
        ...     def _compute_weights(self, gramian, losses=None):
        ...         return torch.full(gramian.shape[:1], 0.5, dtype=torch.float64)
        >>> Half()(torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64))
        tensor([0.5000, 1.0000], dtype=torch.float64)
    """

    name: ClassVar[str] = ""
    from_gramian: bool = False
    homogeneous: bool = True
    needs_losses: bool = False
    min_tasks: int = 1
    per_task_settings: tuple[str, ...] = ()
    weight_degree: float | None = None
    inverts_gramian: bool = False
    _kind = "balancer"
    _repr_args: ClassVar[tuple[str, ...]] = ("num_tasks",)

    def __init__(self, num_tasks: int | None = None) -> None:
        super().__init__()
        self.num_tasks = None if num_tasks is None else check_num_tasks("num_tasks", num_tasks)
        self._built_num_tasks = self.num_tasks  # K as built: a K learned from calls is state

    def reset(self) -> None:
        """Forget all state (as freshly built), a K learned from earlier calls too."""
        self.num_tasks = self._built_num_tasks
        super().reset()

    def learned_num_tasks(self, state: Tensor | None, dim: int = 0) -> None:
        """``num_tasks`` after a load (:meth:`_load_extra`) for a balancer that fixes K at
        its first call: ``state``'s K along ``dim``, or the K it was built with where the
        loaded state is unset (a load is a reset to the saved state, a rolled-back
        checkpoint's too)."""
        self.num_tasks = self._built_num_tasks if state is None else state.shape[dim]

    # -- to implement -------------------------------------------------------------------
    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        """Weights ``[K]`` (float64) from the Gramian ``[K, K]``; weighted balancers only."""
        raise NotImplementedError(f"{type(self).__name__} is not a weighted balancer")

    def _rounded_weights(self, gramian: Tensor, losses: Tensor | None, rounding: float,
                         spectrum: KeptSpectrum | None = None) -> Tensor:
        """:meth:`_compute_weights` of a Gramian that carries ``rounding`` (relative to
        ``‖gᵢ‖‖gⱼ‖``; 0: exact to float64); a balancer whose own tolerances must exceed it
        overrides this (PCD's feasibility). ``spectrum``: where :attr:`inverts_gramian`
        cut directions, ``gramian`` as ``D V Λ Vᵀ D`` (a rule that decomposes it may start
        there: IMTL-G, Aligned-MTL)."""
        return self._compute_weights(gramian, losses)

    def _combine_matrix(self, matrix: Tensor, losses: Tensor | None) -> Combination:
        """Combined gradient from the full matrix; matrix balancers only."""
        raise NotImplementedError(f"{type(self).__name__} must implement _combine_matrix")

    def _combine_matrix_sharded(self, matrix: Tensor, losses: Tensor | None, gramian: Tensor,
                                shard: Shard) -> Combination:
        """This rank's columns of :meth:`_combine_matrix`'s update from this rank's columns
        ``[K, P_local]`` and the full Gramian; matrix balancers that can run sharded only
        (implementing it makes :attr:`shardable` True)."""
        raise NotImplementedError(f"{type(self).__name__} cannot combine sharded columns")

    # -- public -------------------------------------------------------------------------
    def combine(
        self, matrix: Tensor, losses: Tensor | None = None, gramian: Tensor | None = None,
        shard: Shard | None = None,
    ) -> Combination:
        """Combine the task gradients ``matrix`` ``[K, P]`` into one update.

        ``gramian`` may be passed when already computed (``matrix @ matrix.T`` in float64);
        either way it is taken to carry the rounding of ``matrix``'s dtype
        (:func:`~gradbalance.gramian.products_rounding`: float32 products unless the rows
        are float64).
        Raises :class:`NonFiniteGradientError` on inf/NaN input, before any state change.

        ``shard`` (a trunk sharded over ranks): ``matrix`` ``[K, P_local]`` holds this rank's
        columns of ``G``, ``gramian`` (if given) the full Gramian, and the vector returned is
        this rank's columns of the single-process update (docs/balancers.md, "Sharded
        trunks"). ``TypeError`` for a balancer that cannot run sharded (:attr:`shardable`).

        A ``matrix`` (or ``gramian``) that requires grad is read as its values, as the
        step's buffers are: the update, the weights and the balancer's state never carry
        an autograd graph (one kept in an EMA would grow across steps).
        """
        if shard is not None:
            self.check_shardable()
        check_matrix("matrix", matrix, self.num_tasks)
        matrix = matrix.detach()
        if isinstance(gramian, Tensor):
            gramian = gramian.detach()
        _check_shard(shard, matrix)
        losses = self._check_losses(losses, matrix.shape[0])
        self.check_tracked_tasks(matrix.shape[0], matrix)
        gram = self._checked_gramian(matrix, gramian, shard)
        if self.from_gramian:
            assert gram is not None
            w = self._scaled_weights(gram, losses, products_rounding(matrix))
            return Combination(combine_rows(w, matrix, _row_norms(gram)), w)
        if shard is None:
            return self._combine_matrix(matrix, losses)
        assert gram is not None
        return self._combine_matrix_sharded(matrix, losses, gram, shard)

    def forward(self, matrix: Tensor, losses: Tensor | None = None) -> Tensor:
        """Combined gradient ``[P]`` (see :meth:`combine`); ``balancer(matrix, losses)``."""
        return self.combine(matrix, losses).vector

    @property
    def homogeneous_degree(self) -> float | None:
        """``a`` with ``B(s·G) = s^a B(G)`` for every ``s > 0``, from the declarations: ``1``
        for a homogeneous balancer, ``1 + 2δ`` for a weighted one of weight degree ``δ``
        (:attr:`weight_degree`), None where no such law holds (a step size or an ``ε`` in
        gradient units)."""
        if self.homogeneous:
            return 1.0
        degree = self._degree() if self.from_gramian else None
        return None if degree is None else 1.0 + 2.0 * degree

    @property
    def shardable(self) -> bool:
        """Whether :meth:`combine` runs with a ``shard``: every weighted balancer
        (``from_gramian``) and the matrix balancers that implement
        :meth:`_combine_matrix_sharded`."""
        return self.from_gramian or (
            type(self)._combine_matrix_sharded is not Balancer._combine_matrix_sharded
        )

    def check_shardable(self) -> None:
        """Raise ``TypeError`` (nothing moved) when :meth:`combine` would refuse a ``shard``."""
        if not self.shardable:
            raise TypeError(
                f"{type(self).__name__} needs every column of the task gradients at once, so it "
                f"cannot combine a sharded trunk's columns exactly; use a weighted balancer "
                f"(e.g. UPGrad, MGDA, PCGrad) or mode='features'"
            )

    def combine_sharded(self, matrix: Tensor, shard: Shard, losses: Tensor | None = None,
                        gramian: Tensor | None = None) -> Combination:
        """:meth:`combine` of this rank's columns under a sharded trunk (``shard=shard``)."""
        return self.combine(matrix, losses, gramian, shard=shard)

    def compute_weights(self, gramian: Tensor, losses: Tensor | None = None, *,
                        rounding: float = 0.0) -> Tensor:
        """The task weights ``w`` ``[K]`` (float64) of ``g = wᵀ G``, from the Gramian alone.

        Weighted balancers only (``from_gramian``); the same input checks as :meth:`combine`.
        Stateful balancers advance their state, as one :meth:`combine` would.
        ``rounding``: the Gramian's rounding relative to ``‖gᵢ‖‖gⱼ‖``, which the rules that
        invert it (:attr:`inverts_gramian`) remove first;
        :func:`~gradbalance.gramian.products_rounding` of the rows for
        :func:`~gradbalance.gramian.compute_gramian`'s; default 0, the Gramian taken as exact
        (:meth:`combine` takes the rows' own).
        """
        if not self.from_gramian:
            raise TypeError(
                f"{type(self).__name__} needs the task-gradient rows, not only the Gramian; "
                f"use mode='matrix'"
            )
        check_square("gramian", gramian)
        check_matrix("gramian", gramian, self.num_tasks)
        gramian = gramian.detach()  # its values, as combine() reads them
        check_range("rounding", rounding, 0.0, 1.0, high_open=True)
        losses = self._check_losses(losses, gramian.shape[0])
        self.check_tracked_tasks(gramian.shape[0])
        self._check_finite_gramian(gramian)
        return self._scaled_weights(gramian, losses, rounding)

    # -- helpers ------------------------------------------------------------------------
    def _degree(self) -> float | None:
        """The weight degree in use: declared, ``0`` for a declared homogeneous class, or None."""
        if self.weight_degree is not None:
            return float(self.weight_degree)
        return 0.0 if self.homogeneous and _declares_homogeneous(self) else None

    def _scaled_weights(self, gramian: Tensor, losses: Tensor | None,
                        rounding: float = 0.0) -> Tensor:
        """:meth:`_compute_weights` on ``G/t`` (``t`` the largest diagonal entry, 1 for a zero
        Gramian) times ``t^δ``; without a degree, on the raw Gramian. A balancer that
        :attr:`inverts_gramian` reads it without the products' ``rounding``
        (:func:`~._denoise.cleaned`). No host sync but that one's."""
        spectrum = None
        if self.inverts_gramian:
            gramian, spectrum = cleaned(gramian, rounding)
        degree = self._degree()
        if degree is None:
            return self._rounded_weights(gramian, losses, rounding, spectrum)
        gram = gramian.to(torch.float64)
        top = torch.diagonal(gram).max()
        t = torch.where(top > 0, top, torch.ones_like(top))
        w = self._rounded_weights(gram / t, losses, rounding,
                                  None if spectrum is None else spectrum.scaled(1.0 / t))
        return w if degree == 0.0 else w * t.to(w.device).pow(degree).to(w.dtype)

    def _check_losses(self, losses: Tensor | None, k: int) -> Tensor | None:
        if losses is None:
            if self.needs_losses:
                raise ValueError(
                    f"{type(self).__name__} reads the task losses: pass losses=[K] to combine()"
                )
            return None
        if not isinstance(losses, (Tensor, list, tuple)):
            raise ValueError(f"Invalid losses: a {type(losses).__name__} (expected None or the "
                             f"K task losses, a [K] tensor or a list of numbers)")
        try:
            losses = torch.as_tensor(losses).detach().reshape(-1)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"Invalid losses: {error} (expected the K task losses, a [K] "
                             f"tensor or a list of numbers)") from None
        if not (losses.is_floating_point() or losses.dtype in _INTEGER_DTYPES):
            raise ValueError(f"Invalid losses: dtype {losses.dtype} (expected real numbers)")
        if losses.numel() != k:
            raise ValueError(
                f"losses has {losses.numel()} entries but the matrix has {k} task rows; "
                f"pass one loss per task"
            )
        if self.needs_losses and not bool(torch.isfinite(losses).all()):
            raise NonFiniteGradientError(
                f"losses holds inf or NaN ({losses.tolist()}); {type(self).__name__} "
                f"state is unchanged; skip this step"
            )
        return losses

    def _checked_gramian(self, matrix: Tensor, gramian: Tensor | None,
                         shard: Shard | None) -> Tensor | None:
        """The full Gramian the combine needs (None: a matrix balancer on every column), raising
        before any state change on inf/NaN rows, or on finite rows whose Gramian overflows
        where the weights need it."""
        k = matrix.shape[0]
        if gramian is not None:
            if gramian.shape != (k, k):
                raise ValueError(
                    f"gramian must be the full [K, K] = [{k}, {k}] Gramian (summed over the "
                    f"ranks under a shard), got shape {tuple(gramian.shape)}"
                )
            self._check_finite_gramian(gramian)
            return gramian
        if not self.from_gramian and shard is None:
            if _count_nonfinite(matrix, None) > 0:
                self._raise_nonfinite(False)
            return None
        gram = full_gramian(matrix, shard)
        if not bool(is_finite_gramian(gram)):  # the same on every rank: agree on the rows
            rows_finite = _count_nonfinite(matrix, shard) == 0
            if self.from_gramian or not rows_finite:
                self._raise_nonfinite(rows_finite)
        return gram

    def _check_finite_gramian(self, gram: Tensor) -> None:
        """Raise :class:`NonFiniteGradientError` before any state change when ``gram`` is not
        finite."""
        if not bool(is_finite_gramian(gram)):
            self._raise_nonfinite(False)

    def _raise_nonfinite(self, rows_finite: bool) -> NoReturn:
        """``ValueError`` for finite rows whose Gramian overflows float64, else
        :class:`NonFiniteGradientError`."""
        name = type(self).__name__
        if rows_finite:
            raise ValueError(
                f"task gradients are finite but their squared norms overflow float64 (row "
                f"norms above ~1e154); {name} state is unchanged. Scale the losses down (the "
                f"supported range is row norms of 1e-150 to 1e150)"
            )
        raise NonFiniteGradientError(
            f"task gradients hold inf or NaN; {name} state is unchanged. Skip the optimizer "
            f"step (a GradScaler does this when the gradient is written back through "
            f"TaskGradBuffer) or find the source of the overflow"
        )


def _check_shard(shard: Shard | None, matrix: Tensor) -> None:
    """``shard`` is None or a :class:`Shard` naming as many columns as ``matrix`` holds."""
    if shard is None:
        return
    if not isinstance(shard, Shard):
        raise TypeError(f"shard must be a Shard, got {type(shard).__name__}")
    if matrix.shape[1] != shard.size:
        raise ValueError(
            f"matrix has {matrix.shape[1]} columns but the shard's runs {list(shard.runs)} "
            f"hold {shard.size}; pass this rank's columns, in the order of the runs"
        )


def _count_nonfinite(matrix: Tensor, shard: Shard | None) -> int:
    """The ranks (one process: 0 or 1) whose rows hold an inf/NaN entry, from the extremes
    ``amax``/``amin`` (NaN propagates; two reductions, no ``[K, P]`` temporary)."""
    if matrix.numel() == 0:
        bad = torch.zeros(1, dtype=torch.float64, device=matrix.device)
    else:
        ends = torch.stack([matrix.amax(), matrix.amin()])
        bad = torch.isfinite(ends).all().logical_not().to(torch.float64).reshape(1)
    return int((bad if shard is None else shard.sum(bad)).item())


def _declares_homogeneous(balancer: Balancer) -> bool:
    """Whether ``homogeneous`` is set on the instance or on a class below :class:`Balancer`."""
    mro = type(balancer).__mro__
    return any("homogeneous" in vars(owner) for owner in (balancer, *mro[: mro.index(Balancer)]))
