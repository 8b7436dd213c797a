"""`jax_tiled.dot_general`: `lax.dot_general` semantics on the canonical primitive.

`dot_general` contracts any dimensions of either operand with any of the
other's and carries any number of batch dimensions anywhere. The primitive
takes row-major `(B, M, K)` or `(B, K, M)` against `(B, K, N)` or `(B, N, K)`:
an operand whose dimensions are already ordered [batch][free][contracted] or
[batch][contracted][free] (size-1 dimensions may sit anywhere) is a reshape
away from that, which is free, and the transpose flags say which of the two
it is. Contracted dimension pairs may be taken in any order as long as both
operands agree, so the order is chosen to fit the operands as they are stored.
An operand that fits no order is transposed once into [batch][free][contracted]
(lhs) or [batch][contracted][free] (rhs). The result `(B, M, N)` reshapes to
`lax.dot_general`'s (batch, lhs free, rhs free) order without a copy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_tiled._compat import inline_jit
from jax_tiled._matmul import (DTypeLike, PrecisionLike, _array_like, _check_float, _check_kernel,
                               _hashable, check_operand_dtypes, check_precision,
                               reshard_result)
from jax_tiled._primitive import tiled_matmul

_API = "jax_tiled.dot_general"

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def dot_general(lhs: jax.typing.ArrayLike, rhs: jax.typing.ArrayLike,
                dimension_numbers: DimensionNumbers, precision: PrecisionLike = None,
                preferred_element_type: DTypeLike = None,
                out_sharding: jax.sharding.NamedSharding | jax.sharding.PartitionSpec | None = None,
                *, kernel: str = "auto") -> jax.Array:
    """`lax.dot_general` run on this package's kernels.

    Args:
      lhs, rhs: arrays. float16, bfloat16, float32 and float64 are computed;
        mixed dtypes give `lax.dot_general`'s result dtype (an integer or bool
        operand takes the other's float dtype). A product of integers only
        raises TypeError.
      dimension_numbers: `((lhs_contracting, rhs_contracting), (lhs_batch,
        rhs_batch))`, sequences of dimension indices, as `lax.dot_general`
        takes them. The result is (batch dims, lhs free dims, rhs free dims).
      precision, preferred_element_type, kernel: as `jax_tiled.matmul` takes them.
      out_sharding: the result's sharding, as `lax.dot_general` takes it.

    Layouts that are a reshape away from the kernels' canonical form (see the
    module docstring) run without a copy; any other operand is transposed once.
    It can be passed as `dot_general=` to `flax.linen.Dense`/`DenseGeneral` and
    `flax.nnx.Linear`/`LinearGeneral`, and as `_dot_general=` to `jnp.einsum`.
    """
    kernel = _check_kernel(kernel)
    return _dot_general_jit(_array_like(lhs), _array_like(rhs),
                            dimension_numbers=_dimension_numbers(dimension_numbers),
                            precision=_hashable(precision),
                            preferred_element_type=preferred_element_type,
                            out_sharding=out_sharding, kernel=kernel)


def einsum(subscripts: str, /, *operands: jax.typing.ArrayLike, **kwargs: Any) -> jax.Array:
    """`jnp.einsum` whose contractions run on this package's kernels, for
    example as `flax.nnx.Einsum(..., einsum_op=jax_tiled.einsum)`."""
    return jnp.einsum(subscripts, *operands, _dot_general=dot_general, **kwargs)


def _dimension_numbers(dimension_numbers) -> tuple:
    """((lc, rc), (lb, rb)) as tuples of Python ints, or a TypeError."""
    def index(d):
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
            raise TypeError
        return int(d)
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        return tuple(tuple(tuple(map(index, group)) for group in pair)
                     for pair in ((lc, rc), (lb, rb)))
    except (TypeError, ValueError):
        raise TypeError(f"{_API}: dimension_numbers must be ((lhs_contracting, rhs_contracting), "
                        f"(lhs_batch, rhs_batch)), sequences of ints; got "
                        f"{dimension_numbers!r}") from None


def _check_dimensions(lhs_shape, rhs_shape, dims) -> None:
    """lax.dot_general's checks, as TypeErrors naming the shapes."""
    (lc, rc), (lb, rb) = dims
    for side, shape, contract, batch in (("lhs", lhs_shape, lc, lb), ("rhs", rhs_shape, rc, rb)):
        bad = [d for d in contract + batch if not 0 <= d < len(shape)]
        if bad:
            raise TypeError(f"{_API}: {side} dimensions {bad} out of range for {side} of shape "
                            f"{tuple(shape)} (contracting {contract}, batch {batch})")
        if len(set(contract + batch)) != len(contract + batch):
            raise TypeError(f"{_API}: {side} contracting {contract} and batch {batch} dimensions "
                            "must be distinct")
    for kind, l, r in (("contracting", lc, rc), ("batch", lb, rb)):
        if len(l) != len(r):
            raise TypeError(f"{_API}: lhs and rhs need as many {kind} dimensions, got {l} and {r}")
        for i, j in zip(l, r):
            if lhs_shape[i] != rhs_shape[j]:
                raise TypeError(
                    f"{_API}: {kind} dimensions differ: lhs{tuple(lhs_shape)} has {lhs_shape[i]} "
                    f"at dimension {i}, rhs{tuple(rhs_shape)} has {rhs_shape[j]} at dimension {j}")


def _dtype_rank(dtype) -> tuple:
    """lax.dot_general's (and XLA's) order of operand types: the result takes the higher."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        info = jnp.finfo(dtype)
        return (info.maxexp, info.nmant, info.bits)
    return (-1, -1, 0)


def result_dtype(lhs_dtype, rhs_dtype) -> np.dtype:
    check_operand_dtypes(lhs_dtype, rhs_dtype, _API)
    dtype = max((lhs_dtype, rhs_dtype), key=_dtype_rank)
    return _check_float("the operands", dtype, _API)


def _is_one(d) -> bool:
    """Whether a dimension is 1 for certain (a symbolic one never is)."""
    return isinstance(d, (int, np.integer)) and d == 1


def _fits(shape, order) -> bool:
    """Whether the row-major array is stored in `order`, up to size-1 dimensions."""
    keep = lambda dims: [d for d in dims if not _is_one(shape[d])]
    return keep(order) == keep(range(len(shape)))


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one operand reaches canonical form: a transpose first (or None) and
    whether it is then stored K before its free dimensions (the transpose flag)."""
    perm: tuple[int, ...] | None
    k_first: bool


def _operand_layout(shape, batch, free, contract, prefer_k_first) -> Layout | None:
    orders = {False: (*batch, *free, *contract), True: (*batch, *contract, *free)}
    for k_first in (prefer_k_first, not prefer_k_first):
        if _fits(shape, orders[k_first]):
            return Layout(None, k_first)
    return None


def plan_layouts(lhs_shape, rhs_shape, dims) -> tuple[Layout, Layout, tuple[int, ...]]:
    """The layouts of lhs and rhs and the order of the contracted pairs that
    take the fewest transposes (0, 1 or 2)."""
    (lc, rc), (lb, rb) = dims
    lf = tuple(d for d in range(len(lhs_shape)) if d not in lc + lb)
    rf = tuple(d for d in range(len(rhs_shape)) if d not in rc + rb)
    pairs = range(len(lc))
    # Contract the pairs in the order one operand stores them in.
    candidates = dict.fromkeys([tuple(sorted(pairs, key=lc.__getitem__)),
                                tuple(sorted(pairs, key=rc.__getitem__))])
    best = None
    for order in candidates:
        l_contract = tuple(lc[p] for p in order)
        r_contract = tuple(rc[p] for p in order)
        lhs = _operand_layout(lhs_shape, lb, lf, l_contract, prefer_k_first=False)
        rhs = _operand_layout(rhs_shape, rb, rf, r_contract, prefer_k_first=True)
        lhs = lhs or Layout((*lb, *lf, *l_contract), False)
        rhs = rhs or Layout((*rb, *r_contract, *rf), True)
        copies = (lhs.perm is not None) + (rhs.perm is not None)
        if best is None or copies < best[0]:
            best = (copies, lhs, rhs, order)
    _, lhs, rhs, order = best
    return lhs, rhs, order


def _size(shape, dims):
    return math.prod(shape[d] for d in dims)


# Inside a traced function the plain computation, no call in the jaxpr.
@inline_jit(static_argnames=(
    "dimension_numbers", "precision", "preferred_element_type", "out_sharding", "kernel"))
def _dot_general_jit(lhs, rhs, *, dimension_numbers, precision, preferred_element_type,
                     out_sharding, kernel):
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    _check_dimensions(lhs.shape, rhs.shape, dimension_numbers)
    dtype = result_dtype(lhs.dtype, rhs.dtype)
    out_dtype = dtype if preferred_element_type is None else _check_float(
        "preferred_element_type", jax.dtypes.canonicalize_dtype(preferred_element_type), _API)
    precision = check_precision(precision, _API)

    (lc, rc), (lb, rb) = dimension_numbers
    lf = tuple(d for d in range(lhs.ndim) if d not in lc + lb)
    rf = tuple(d for d in range(rhs.ndim) if d not in rc + rb)
    lhs_layout, rhs_layout, _ = plan_layouts(lhs.shape, rhs.shape, dimension_numbers)
    batch, m, n, k = (_size(lhs.shape, lb), _size(lhs.shape, lf), _size(rhs.shape, rf),
                      _size(lhs.shape, lc))

    def canonical(x, layout, rows, cols):
        x = x.astype(dtype)
        if layout.perm is not None:
            x = jnp.transpose(x, layout.perm)
        return x.reshape(batch, *((cols, rows) if layout.k_first else (rows, cols)))

    a = canonical(lhs, lhs_layout, m, k)  # (B, M, K), or (B, K, M) when K first
    b = canonical(rhs, rhs_layout, n, k)  # (B, K, N) when K first, else (B, N, K)
    out = tiled_matmul(a, b, transpose_a=lhs_layout.k_first, transpose_b=not rhs_layout.k_first,
                       out_dtype=out_dtype, precision=precision, kernel=kernel)
    shape = (*(lhs.shape[d] for d in lb), *(lhs.shape[d] for d in lf),
             *(rhs.shape[d] for d in rf))
    return reshard_result(out.reshape(shape), out_sharding)
