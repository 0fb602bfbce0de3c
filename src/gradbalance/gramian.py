"""The Gramian ``G Gᵀ`` of a task-gradient matrix, accumulated in float64, scale-safe.

Rows (for :func:`linear_gramian`, the layer input and each task's output gradient) are scaled
by powers of two to a largest entry in ``[0.5, 1)`` before the products and the factors
restored in float64 (on the CPU, only where the unscaled product's diagonal shows a risk):
exact to the products' rounding for every finite float32/half input and for float64 row
norms within about ``1e±150`` (docs/balancers.md, "Numerical range").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["compute_gramian", "cosine_matrix", "is_finite_gramian", "linear_gramian",
           "products_rounding"]

_COLUMN_BLOCK = 1 << 20
#: :func:`products_rounding` of float32 products: ``ε·max(FLOOR, √P / SQRT_DIVISOR)``.
_FLOAT32_FLOOR = 3.0
_FLOAT32_SQRT_DIVISOR = 8.0

#: Exponent field layout (bias, mantissa bits, bit-cast type) of the dtypes scaled here.
_FLOAT_BITS = {
    torch.float32: (127, 23, torch.int32),
    torch.float64: (1023, 52, torch.int64),
}


def _pow2(exponent: Tensor, dtype: torch.dtype) -> Tensor:
    """``2**exponent`` in ``dtype`` (float32/float64), exactly, by writing the exponent bits
    (``exponent``: integers in the normal range of ``dtype``)."""
    bias, mantissa_bits, int_type = _FLOAT_BITS[dtype]
    bits = (exponent.to(int_type) + bias) << mantissa_bits
    return bits.view(dtype)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays, every other floating dtype is multiplied in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def unit_rows(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """``(U, s)``: ``matrix = diag(s) U``, each row's largest ``|entry|`` in ``[0.5, 1)``, with
    ``s = 2**e`` ``[K]`` (float64, exact; 1 for a zero row, ``e`` clamped so that ``2**±e`` is
    normal) and ``U`` a new float32 tensor (float64 input: float64)."""
    part = matrix.to(_work_dtype(matrix.dtype))
    if part.shape[1] == 0:
        return part.clone(), torch.ones(part.shape[0], dtype=torch.float64, device=part.device)
    return _scale_rows(part, part is not matrix, _max_abs(part))


def _max_abs(part: Tensor) -> Tensor:
    """Largest ``|entry|`` of each row ``[K]`` (two plain reductions, no ``|G|`` temporary)."""
    return torch.maximum(part.amax(dim=1), -part.amin(dim=1))


def _scale_rows(part: Tensor, owned: bool, size: Tensor) -> tuple[Tensor, Tensor]:
    """``(U, s)`` with each row's ``2**e`` chosen from ``size`` ``[K]`` (:func:`unit_rows` from
    the largest ``|entry|``; the sharded version from the full rows' norms); ``owned``: scale
    ``part`` in place."""
    work = part.dtype
    _, exponent = torch.frexp(size)
    bias = _FLOAT_BITS[work][0]
    exponent = exponent.clamp(2 - bias, bias - 1)  # 2**±e normal in `work`
    factor = _pow2(-exponent, work).unsqueeze(1)
    unit = part.mul_(factor) if owned else part * factor
    return unit, _pow2(exponent, torch.float64)


#: From this many rows on, :func:`symmetric_product` multiplies the blocks on and above the
#: diagonal only (row blocks of ``max(SYMMETRIC_BLOCK_ROWS, K/8)``): about 5/8 of the
#: products' work at ``K ≥ 512``. One thread, ``P = 20,000``: 179 against 268 ms at
#: ``K = 1,024``, 13.5 against 18.5 at 256, 4.2 against 4.6 at 128; below 128 rows the
#: product is memory-bound and blocks only read the rows again.
SYMMETRIC_MIN_ROWS = 128
SYMMETRIC_BLOCK_ROWS = 64
SYMMETRIC_MAX_BLOCKS = 8


def symmetric_product(part: Tensor) -> Tensor:
    """``part @ part.T`` (``[K, n]`` → ``[K, K]``); from ``SYMMETRIC_MIN_ROWS`` rows on, exactly
    symmetric: the row blocks ``Aₐ`` multiply the rows from their own on, ``Aₐ [Aₐ; Aₐ₊₁;
    …]ᵀ``, and every entry below the diagonal is its mirror's (the same product of two
    rows, rounded once).

    Example:
        >>> import torch
        >>> from gradbalance.gramian import symmetric_product
        >>> a = torch.randn(200, 50, dtype=torch.float64)
        >>> g = symmetric_product(a)
        >>> torch.equal(g, g.T), torch.allclose(g, a @ a.T)
        (True, True)
    """
    k = part.shape[0]
    if k < SYMMETRIC_MIN_ROWS:
        return part @ part.T
    blocks = min(SYMMETRIC_MAX_BLOCKS, k // SYMMETRIC_BLOCK_ROWS)
    out = part.new_empty((k, k))
    bounds = [k * b // blocks for b in range(blocks + 1)]
    for lo, hi in itertools.pairwise(bounds):
        block = torch.mm(part[lo:hi], part[lo:].T, out=out[lo:hi, lo:])  # in place
        diagonal = block[:, : hi - lo]
        diagonal.copy_(diagonal.triu() + diagonal.triu(1).T)
        out[hi:, lo:hi] = block[:, hi - lo :].T
    return out


def _plain_is_exact(product: Tensor, part: Tensor) -> bool:
    """Whether the unscaled product ``part @ part.T`` (CPU) is exact, from its diagonal
    ``dₖ = ‖gₖ‖²`` (``n`` columns): every ``dₖ`` finite and at most ``max/4`` (Cauchy-Schwarz
    bounds every partial sum by ``√(dᵢ dⱼ)``: nothing overflowed) and either 0 on a zero row
    or at least ``n²·tiny/eps`` (a row's largest ``m² ≥ dₖ/n``, so what underflowed is below
    the rounding of ``m²``)."""
    diag = torch.diagonal(product)
    info = torch.finfo(diag.dtype)
    n = part.shape[1]
    low, high = n * n * info.tiny / info.eps, info.max / 4
    unsafe = ~torch.isfinite(diag) | (diag > high) | ((diag < low) & (diag > 0))
    if bool(unsafe.any()):
        return False
    zero = diag == 0
    return not bool(zero.any()) or not bool(part[zero].any())  # d = 0: a zero row only


def compute_gramian(matrix: Tensor, block: int = _COLUMN_BLOCK) -> Tensor:
    """Return ``G Gᵀ`` ``[K, K]`` in float64.

    Each column block is scaled row by row by a power of two (:func:`unit_rows`), multiplied
    in float32 (float64 input: float64) and the rescaled block products summed in float64, so
    rounding does not grow with ``P``. On the CPU each block is multiplied first, as it is,
    and scaled and multiplied again only when its diagonal overflowed or fell outside the
    safe range (the same result: a power of two changes no rounding), so the common case
    reads ``[K, P]`` once.

    Example:
        >>> import torch
        >>> from gradbalance.functional import compute_gramian
        >>> compute_gramian(torch.tensor([[3.0, 4.0], [0.0, 2.0]]))  # [[9+16, 8], [8, 4]]
        tensor([[25.,  8.],
                [ 8.,  4.]], dtype=torch.float64)
    """
    k, p = matrix.shape
    gram: Tensor | None = None  # the first block's product is the sum so far: no zeros, no add
    for start in range(0, p, block):
        raw = matrix[:, start : start + block]
        part = raw.to(_work_dtype(raw.dtype))
        summand = None
        if part.device.type == "cpu":  # multiply first, scale only when the diagonal says so
            product = symmetric_product(part)
            if _plain_is_exact(product, part):
                summand = product.to(torch.float64)
        if summand is None:
            unit, scale = _scale_rows(part, part is not raw, _max_abs(part))
            product = symmetric_product(unit) if unit.device.type == "cpu" else unit @ unit.T
            summand = product.to(torch.float64).mul_(scale[:, None] * scale[None, :])
        gram = summand if gram is None else gram.add_(summand)
    if gram is None:  # no columns
        return torch.zeros(k, k, dtype=torch.float64, device=matrix.device)
    return gram


def is_finite_gramian(gram: Tensor) -> Tensor:
    """True (0-d bool tensor) when every task gradient is finite: O(K), from the diagonal (a
    non-finite entry in row ``k`` makes ``gram[k, k]`` inf or NaN; a finite row never does).

    Example:
        >>> import torch
        >>> from gradbalance.functional import compute_gramian, is_finite_gramian
        >>> G = torch.tensor([[3.0, 4.0], [0.0, float("nan")]])
        >>> is_finite_gramian(compute_gramian(G)), is_finite_gramian(compute_gramian(G[:1]))
        (tensor(False), tensor(True))
    """
    return torch.isfinite(torch.diagonal(gram)).all()


def products_rounding(rows: Tensor | Sequence[Tensor]) -> float:
    """The rounding :func:`compute_gramian` leaves in the Gramian of ``rows``, relative to
    ``‖gᵢ‖‖gⱼ‖``: 0 for float64 rows (taken as exact), else that of float32 products,
    ``ε·max(3, √P/8)`` (``ε = 2⁻²³``, ``P`` the columns of one block, at most ``2²⁰``).

    ``rows``: the ``[K, P]`` matrix, or the parameters whose per-task gradients are the rows
    (their dtypes and total size: float32 products unless every one is float64). Measured
    (one pair of rows, ``1 + cos`` of ``g`` and ``−λg``, 18 draws each): at most
    ``2.0e-7, 1.7e-7, 6.1e-7, 1.9e-6, 5.3e-6`` at ``P = 10², 10³, 10⁴, 10⁵, 10⁶``, 1.8 to 2.8
    times below this bound (about 5 times the median). The weights that invert the Gramian
    on its range take the cosine matrix's eigenvalues below it as zero (docs/balancers.md,
    "Numerical range").

    Example:
        >>> import torch
        >>> from gradbalance.functional import products_rounding
        >>> products_rounding(torch.zeros(4, 2304))  # 2⁻²³ · √2304 / 8
        7.152557373046875e-07
        >>> products_rounding(torch.zeros(4, 9, dtype=torch.float64))
        0.0
    """
    tensors = [rows] if isinstance(rows, Tensor) else list(rows)
    if all(t.dtype == torch.float64 for t in tensors):
        return 0.0
    columns = rows.shape[-1] if isinstance(rows, Tensor) else sum(t.numel() for t in tensors)
    root = math.sqrt(min(max(columns, 1), _COLUMN_BLOCK)) / _FLOAT32_SQRT_DIVISOR
    return torch.finfo(torch.float32).eps * max(_FLOAT32_FLOOR, root)


def cosine_matrix(gram: Tensor, eps: float = 0.0) -> Tensor:
    """Pairwise cosine similarities ``[K, K]`` from the Gramian, in ``[-1, 1]``.

    ``cos(gᵢ, gⱼ) = Gᵢⱼ / ‖gᵢ‖ / ‖gⱼ‖`` (one norm at a time: scale-safe); 0 where a norm is at
    most ``eps`` times the largest norm (default: exactly 0).

    Example:
        >>> import torch
        >>> from gradbalance.functional import cosine_matrix
        >>> gram = torch.tensor([[25.0, 8.0], [8.0, 4.0]])  # norms 5 and 2, dot product 8
        >>> cosine_matrix(gram)[0, 1]  # 8 / (5 * 2)
        tensor(0.8000)
    """
    if not isinstance(gram, Tensor) or gram.dim() != 2 or gram.shape[0] != gram.shape[1]:
        found = tuple(gram.shape) if isinstance(gram, Tensor) else type(gram).__name__
        raise ValueError(f"gram must be a [K, K] Gramian, got {found}; pass "
                         f"compute_gramian(matrix)")
    norms = torch.diagonal(gram).clamp_min(0).sqrt()
    zero = norms <= eps * norms.max() if norms.numel() else norms > 0
    safe = torch.where(zero, torch.ones_like(norms), norms)
    cos = (gram / safe[:, None] / safe[None, :]).clamp(-1.0, 1.0)
    return torch.where(zero[:, None] | zero[None, :], torch.zeros_like(cos), cos)


def linear_gramian(x: Tensor, d: Tensor, weight: bool, bias: bool,
                   route: str | None = None) -> Tensor:
    """``G_b G_bᵀ`` ``[K, K]`` (float64) of an ``nn.Linear`` ``y = x Wᵀ + b`` from its input
    ``x`` ``[N, i]`` and the output gradients ``d`` ``[K, N, o]`` (``d[k] = ∂Lₖ/∂y``).

    ``weight``/``bias``: whether each is among the shared parameters. The weight block takes
    the cheaper of two exact routes: the rows ``G_b[k] = d[k]ᵀ x`` (``2K·N·o·i`` flops), or
    the activations, ``⟨dᵢᵀx, dⱼᵀx⟩ = Σ_{n,m} (dᵢ dⱼᵀ)_{nm} (x xᵀ)_{nm}`` (``N²·i + K²N²·o``
    flops, nothing weight-sized; the ghost trick of per-sample clipping across tasks).
    ``route`` (``"rows"`` or ``"activations"``) forces one; None takes the one of fewer flops.
    ``x`` and each ``d[k]`` are scaled as a whole by :func:`unit_rows` (scale-safe).

    Example:
        >>> import torch
        >>> from gradbalance.functional import linear_gramian
        >>> x = torch.tensor([[1.0, 2.0]])  # N = 1 sample, i = 2 inputs
        >>> d = torch.tensor([[[1.0]], [[3.0]]])  # K = 2 tasks, o = 1 output
        >>> linear_gramian(x, d, weight=True, bias=False)  # rows d[k]ᵀx: [1, 2] and [3, 6]
        tensor([[ 5., 15.],
                [15., 45.]], dtype=torch.float64)
    """
    k, n, o = d.shape
    i = x.shape[1]
    gram = torch.zeros(k, k, dtype=torch.float64, device=d.device)
    if k == 0 or n * o == 0:
        return gram
    d_flat, d_scale = unit_rows(d.reshape(k, n * o))
    d_unit = d_flat.view(k, n, o)
    if bias:
        gram += compute_gramian(d_unit.sum(dim=1))
    if weight and i > 0:
        x_flat, x_scale = unit_rows(x.reshape(1, n * i))
        x_unit = x_flat.view(n, i).to(d_unit.dtype)
        gram += _weight_block(x_unit, d_unit, route) * x_scale.square()
    return gram.mul_(d_scale[:, None] * d_scale[None, :])


#: Entries of ``Dᵢ Dⱼᵀ`` the activation route holds at once (a chunk of tasks i).
_GRAM_CHUNK = 1 << 22


def _weight_block(x: Tensor, d: Tensor, route: str | None = None) -> Tensor:
    """The weight part of :func:`linear_gramian` (float64) on unit-scaled ``x`` and ``d``."""
    k, n, o = d.shape
    i = x.shape[1]
    if route not in (None, "rows", "activations"):
        raise ValueError(f"Invalid route: {route!r} (expected 'rows', 'activations' or None)")
    if route is None:
        route = ("activations" if n * n * (i + k * k * o) < 2 * k * n * o * i + k * k * o * i
                 else "rows")
    if route == "activations":
        a = (x @ x.T).reshape(n * n)  # [N²]
        flat = d.reshape(k * n, o)
        gram = torch.empty(k, k, dtype=torch.float64, device=d.device)
        step = max(1, _GRAM_CHUNK // max(k * n * n, 1))
        for start in range(0, k, step):
            stop = min(k, start + step)
            # (Dᵢ Dⱼᵀ)_{nm} for i in the chunk: [c, N, K, N] -> [c, K, N²]
            m = (flat[start * n : stop * n] @ flat.T).view(stop - start, n, k, n)
            m = m.permute(0, 2, 1, 3).reshape((stop - start) * k, n * n)
            gram[start:stop] = (m @ a).view(stop - start, k).to(torch.float64)
        return gram
    gram = torch.zeros(k, k, dtype=torch.float64, device=d.device)
    step = max(1, _GRAM_CHUNK // max(k * i, 1))  # outputs per block of rows
    for start in range(0, o, step):  # the rows [K, o·i] a column block at a time
        rows = torch.matmul(d[:, :, start : start + step].transpose(1, 2), x)
        gram += compute_gramian(rows.reshape(k, -1))
    return gram
