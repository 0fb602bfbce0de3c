"""The visiting pass of PCGrad and GradVac on the Gramian, blocked for many tasks.

Not a balancer module (no ``__all__``). Every task ``i`` visits the others in its own order
``π_i``; at step ``t`` it reads ``d = g_i^PC·gⱼ`` (``j = π_i(t)``) and adds ``w gⱼ`` to
``g_i^PC``, ``w = visit(t, d, out)``. With ``g_i^PC = C[i] J`` the dot is ``(C G)[i, j]``, so
the pass is a forward recurrence per task, ``d_t = G[i, π(t)] + Σ_{s<t} w_s G[π(s), π(t)]``,
vectorised over the K tasks.

Blocked: ``C G`` is refreshed after every block of ``b`` steps; inside a block each dot is
corrected by the block's earlier visits, read from the strict upper triangle of the
``[b, b]`` sub-Gramian of the task's visits (one gather of ``K b(b−1)/2`` entries). The
refresh adds ``Δ G``, ``Δ`` the block's weights (``b`` entries per row, about half of them
zero where the visits conflict half the time): as a sparse product, one row of ``G`` per
non-zero weight (``O(nnz·K)``, ``O(K³)`` over the pass whatever ``b``), or as one dense
``[K, K]`` product where that is cheaper (:data:`SPARSE_COST`). So ``b`` stays small
(:func:`pass_block`) and the gathers, ``O(K² b)`` over the pass, stay few. From
:data:`TILE_FROM` tasks on, ``G`` and ``C G`` are stored in tiles of columns
(:func:`column_tiles`) and the refresh runs tile by tile, each tile of ``G`` read from the
cache.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

#: Steps per block: :data:`SPARSE_BLOCK` where the refreshes are sparse products (from
#: :data:`SPARSE_FROM` tasks on), :data:`DENSE_BLOCK` below, where one ``[K, K]`` product
#: costs about as much as the block's gathers.
SPARSE_BLOCK = 16
DENSE_BLOCK = 32
SPARSE_FROM = 512
#: A sparse refresh's work per entry (one row of ``G`` per non-zero weight, gathered)
#: against a dense product's (BLAS): the sparse product is used while
#: ``nnz · SPARSE_COST < K²``.
SPARSE_COST = 12
#: Columns per tile of ``G`` and ``C G`` in the refreshes from :data:`TILE_FROM` tasks on:
#: each non-zero weight of the sparse product reads one row of a tile, and a tile of 128
#: float64 columns (1 MB at K = 1,024) stays in the core's cache across the rows of ``Δ``
#: (one thread, ``K = 1,024``, 16 weights per row: 1.9 against 4.1 ms per refresh
#: untiled; GradVac's combine 472 against 522 ms, 250 against 273 at K = 768). Below, ``G``
#: fits the cache whole (K = 512, 640: the tiles 1.03–1.06× slower).
TILE_COLUMNS = 128
TILE_FROM = 768

#: ``visit(t, d, out)``: the weights ``w`` ``[K]`` of step ``t`` (``orders[:, t]``) from the
#: dots ``d`` ``[K]``, written into ``out`` and returned.
Visit = Callable[[int, Tensor, Tensor], Tensor]


def pass_block(k: int) -> int:
    """Steps per block of a pass over ``k`` tasks."""
    return SPARSE_BLOCK if k >= SPARSE_FROM else DENSE_BLOCK


def tile_width(k: int, device: torch.device) -> int:
    """Columns per tile of the refreshed ``C G`` of a pass over ``k`` tasks (``k``: one tile;
    always on an accelerator, whose sparse products do not read through the CPU's cache)."""
    return TILE_COLUMNS if k >= TILE_FROM and device.type == "cpu" else k


def _triangle(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The strict upper triangle of an ``n × n`` block, row-major (``first``, ``second``
    ``[n(n−1)/2]``): row ``s`` holds the ``n − 1 − s`` pairs ``(s, s' > s)``."""
    first, second = torch.triu_indices(n, n, 1, device=device)
    return first, second


def _block_pairs(gram: Tensor, rows: Tensor, cols: Tensor, tri: tuple[Tensor, Tensor]) -> Tensor:
    """``G[c[s, i], c[s', i]]`` for ``s < s'`` (``[n(n−1)/2, K]``, the pairs row-major) of the
    block's columns ``c`` ``[n, K]``, given as ``rows = c·K`` and ``cols = c`` (int32 flat
    indices while ``K²`` fits, made once for the pass)."""
    index = rows.index_select(0, tri[0]).add_(cols.index_select(0, tri[1]))
    return gram.reshape(-1).index_select(0, index.view(-1)).view(-1, gram.shape[0])


def _refresh(cg: list[Tensor], gram: list[Tensor], cols: Tensor, weights: Tensor) -> None:
    """``cg += Δ G`` with ``Δ[i, cols[s, i]] = weights[s, i]`` (``[n, K]`` each), tile by
    tile (``cg`` and ``gram``: the same column tiles of each, ``[K, w]`` contiguous,
    :func:`column_tiles`): sparse (one row of each tile of ``G`` per non-zero weight; ``Δ``
    in CSR, its columns in visiting order) or dense products, whichever is cheaper."""
    k = cols.shape[1]
    by_task = weights.T.contiguous()  # CSR row i: task i's weights, in visiting order
    live = by_task != 0
    per_row = live.sum(dim=1)
    if int(per_row.sum()) * SPARSE_COST >= k * k:
        delta = torch.zeros(k, k, dtype=by_task.dtype, device=by_task.device)
        delta.scatter_(1, cols.T, by_task)
    else:
        crow = torch.zeros(k + 1, dtype=torch.int64, device=by_task.device)
        torch.cumsum(per_row, 0, out=crow[1:])
        at = torch.nonzero(live.view(-1)).view(-1)  # row-major: grouped by task
        columns = cols.T.reshape(-1).index_select(0, at)
        with warnings.catch_warnings():  # torch calls its sparse CSR support beta
            warnings.filterwarnings("ignore", "Sparse CSR tensor support", UserWarning)
            delta = torch.sparse_csr_tensor(crow, columns, by_task.view(-1).index_select(0, at),
                                            (k, k), check_invariants=False)
    for out, part in zip(cg, gram, strict=True):
        out.addmm_(delta, part)


def column_tiles(m: Tensor, width: int) -> tuple[Tensor, list[Tensor]]:
    """``m`` ``[K, N]`` stored tile by tile: ``(flat, tiles)``, the ``[K, w]`` row-major tiles of
    ``width`` columns (the last one narrower) one after the other in ``flat`` ``[K·N]``, and
    their views. ``m`` itself (no copy) where one tile holds every column."""
    if width >= m.shape[1]:
        return m.reshape(-1), [m]
    flat = torch.cat([part.reshape(-1) for part in torch.split(m, width, dim=1)])
    return flat, tile_views(flat, m.shape[0], m.shape[1], width)


def tile_views(flat: Tensor, k: int, n: int, width: int) -> list[Tensor]:
    """The ``[K, w]`` tiles of :func:`column_tiles`'s ``flat`` (``n`` columns)."""
    return [flat[k * c : k * min(c + width, n)].view(k, -1) for c in range(0, n, width)]


def tiled_index(k: int, n: int, width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(base, stride)`` ``[n]``: entry ``(i, j)`` of ``[K, n]`` stored by
    :func:`column_tiles` is ``flat[base[j] + i·stride[j]]``."""
    col = torch.arange(n, device=device)
    first = col - col % width  # the tile's first column
    stride = torch.clamp(n - first, max=width)
    return first * k + col % width, stride


def pairwise_pass(gram: Tensor, orders: Tensor, visit: Visit, block: int | None = None) -> Tensor:
    """``C`` ``[K, K]`` with ``g_i^PC = Σⱼ C[i, j] gⱼ`` after a pass of visits, from the Gramian
    (:func:`pass_weights`, scattered: ``C = I`` plus each visit's weight at its place).

    At step ``t`` every task ``i`` visits ``j = orders[i, t]`` and adds ``w gⱼ`` to
    ``g_i^PC = C[i] J``, with ``w = visit(t, (C G)[:, j], out)`` (``[K]``, over ``i``; each
    pair visited at most once). ``block`` steps between refreshes of ``C G`` (default
    :func:`pass_block`); the result does not depend on it beyond rounding.

    Example:
        >>> import torch
        >>> g = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
        >>> gram, orders = g @ g.T, torch.tensor([[1], [0]])
        >>> def half(t, dots, out):  # add ½ gⱼ at every visit
        ...     return out.fill_(0.5)
        >>> pairwise_pass(gram, orders, half)
        tensor([[1.0000, 0.5000],
                [0.5000, 1.0000]], dtype=torch.float64)
    """
    return coefficients(orders, pass_weights(gram, orders, visit, block))


def coefficients(orders: Tensor, weights: Tensor) -> Tensor:
    """``C`` ``[K, K]`` from a pass's ``weights`` ``[steps, K]`` (:func:`pass_weights`):
    the identity plus each visit's weight at its place, ``C[i, orders[i, t]] += w[t, i]``."""
    coef = torch.eye(orders.shape[0], dtype=weights.dtype, device=weights.device)
    return coef.scatter_add_(1, orders.to(weights.device), weights.T)


def column_sums(orders: Tensor, weights: Tensor) -> Tensor:
    """``1ᵀC`` ``[K]`` of :func:`pairwise_pass` without forming ``C`` (the update's weights,
    ``Σᵢ g_i^PC = Σⱼ (1ᵀC)ⱼ gⱼ``): one plus every weight given to task ``j``, added by index
    (``weights`` ``[steps, K]`` from :func:`pass_weights`, ``orders`` ``[K, steps]``)."""
    ones = torch.ones(orders.shape[0], dtype=weights.dtype, device=weights.device)
    return ones.index_add_(0, orders.to(weights.device).T.reshape(-1), weights.reshape(-1))


def pass_weights(gram: Tensor, orders: Tensor, visit: Visit, block: int | None = None) -> Tensor:
    """``[steps, K]``: the weight ``w`` each task ``i`` gives at step ``t`` to ``orders[i, t]``
    (row ``t``), the pass of :func:`pairwise_pass`; ``O(K³)``."""
    k, steps = orders.shape
    block = pass_block(k) if block is None else block
    orders = orders.to(gram.device)
    by_step = orders.T.contiguous()  # [steps, K]: every per-step vector contiguous
    # int32 flat indices for the large gathers while K² fits (the step's small K: as is)
    narrow = by_step.to(torch.int32) if k >= SPARSE_FROM and k * k < 2**31 else by_step
    scaled = narrow * k  # row offsets of the pairs' flat indices
    width = tile_width(k, gram.device)
    if width >= k:  # one tile, row-major: (i, π_i(t)) flat
        at_dot = by_step + torch.arange(0, k * k, k, device=gram.device)
    else:  # (i, π_i(t)) in the tiles, flat: base[π] + i·stride[π] (gathers, no int addcmul)
        base, stride = (t.to(narrow.dtype) for t in tiled_index(k, k, width, gram.device))
        rows = torch.arange(k, dtype=narrow.dtype, device=gram.device)
        at_dot = base.index_select(0, narrow.view(-1)).view(narrow.shape)
        if bool((stride == width).all()):  # every tile full: one stride
            at_dot.add_(rows * width)
        else:
            at_dot.add_(stride.index_select(0, narrow.view(-1)).view(narrow.shape).mul_(rows))
    weights = torch.zeros(steps, k, dtype=gram.dtype, device=gram.device)
    weight_rows = weights.unbind(0)  # every step's view made once
    gram_flat, gram_tiles = column_tiles(gram, width)
    cg, cg_tiles = gram_flat, gram_tiles
    triangles: dict[int, tuple[Tensor, Tensor]] = {}
    for start in range(0, steps, block):
        cols = by_step[start : start + block]
        n = cols.shape[0]
        tri = triangles.setdefault(n, _triangle(n, gram.device))
        dots = cg.index_select(0, at_dot[start : start + n].view(-1)).view(n, k)
        pairs = torch.split(_block_pairs(gram, scaled[start : start + n],
                                         narrow[start : start + n], tri),
                            list(range(n - 1, -1, -1)))
        for s, dot in enumerate(dots.unbind(0)):
            w = visit(start + s, dot, weight_rows[start + s])
            if s + 1 < n:
                dots[s + 1 :].addcmul_(w, pairs[s])
        if start + n < steps:
            if cg is gram_flat:
                cg = gram_flat.clone()
                cg_tiles = tile_views(cg, k, k, width)
            _refresh(cg_tiles, gram_tiles, cols, weights[start : start + n])
    return weights
