"""`jax_tiled.dot_general`, and the one path from a product to the primitive.

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

`matmul` (`_matmul.py`) states its product as dimension numbers and takes the
same path, `product`, as `jnp.matmul` is built on `lax.dot_general`. It adds
one thing, NumPy's broadcasting of batches: paired batch dimensions may differ
where one of them is 1. An operand whose whole batch is 1 is broadcast by the
kernel (a zero batch stride); any other broadcast is materialised.
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

from jax_tiled import _checks
from jax_tiled._checks import DTypeLike, PrecisionLike, ShardingLike
from jax_tiled._compat import inline_jit
from jax_tiled._primitive import tiled_matmul

API = "jax_tiled.dot_general"

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def dot_general(
    lhs: jax.typing.ArrayLike,
    rhs: jax.typing.ArrayLike,
    dimension_numbers: DimensionNumbers,
    precision: PrecisionLike = None,
    preferred_element_type: DTypeLike = None,
    out_sharding: ShardingLike = None,
    *,
    kernel: str = "auto",
) -> jax.Array:
    """`lax.dot_general` run on this package's kernels.

    Args:
      lhs, rhs: arrays. float16, bfloat16, float32 and float64 are computed;
        mixed dtypes give `lax.dot_general`'s result dtype (an integer or bool
        operand takes the other's float dtype). Integers only are computed in
        a floating `preferred_element_type`, as jnp computes them; into an
        integer result they raise TypeError, unless nothing is contracted (an
        elementwise product, left to `lax.dot_general`).
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
    kernel = _checks.kernel(kernel, API)
    return _dot_general_jit(
        _checks.operand("lhs", lhs, API),
        _checks.operand("rhs", rhs, API),
        dimension_numbers=_checks.dimension_numbers(dimension_numbers, API),
        precision=_checks.hashable(precision),
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
        kernel=kernel,
    )


def einsum(subscripts: str, /, *operands: jax.typing.ArrayLike, **kwargs: Any) -> jax.Array:
    """`jnp.einsum` whose contractions run on this package's kernels, for
    example as `flax.nnx.Einsum(..., einsum_op=jax_tiled.einsum)`."""
    return jnp.einsum(subscripts, *operands, _dot_general=dot_general, **kwargs)


# Inside a traced function the plain computation, no call in the jaxpr.
@inline_jit(
    static_argnames=(
        "dimension_numbers",
        "precision",
        "preferred_element_type",
        "out_sharding",
        "kernel",
    )
)
def _dot_general_jit(
    lhs, rhs, *, dimension_numbers, precision, preferred_element_type, out_sharding, kernel
):
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    _checks.dot_general_shapes(lhs.shape, rhs.shape, dimension_numbers, API)
    if not dimension_numbers[0][0] and _checks.integer_result(
        lhs.dtype, rhs.dtype, preferred_element_type
    ):
        # Nothing contracted: an elementwise (or outer) product of integers,
        # which jnp computes exactly in integer arithmetic (jnp.einsum's
        # "ij,ij->ij", say); the kernels would compute it in floating point.
        return lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
        )
    dtype = _checks.dot_general_dtype(lhs.dtype, rhs.dtype, preferred_element_type, API)
    request = Request(
        dtype,
        _checks.out_dtype(dtype, preferred_element_type, API),
        _checks.precision(precision, API),
        kernel,
    )
    return product(lhs, rhs, dimension_numbers, request, out_sharding)


# ---- The path to the primitive, for dot_general and matmul ----


@dataclasses.dataclass(frozen=True)
class Request:
    """What a checked product computes, besides its operands' layout: the dtype
    they are cast to, the result's, the precision and the kernel."""

    dtype: np.dtype
    out_dtype: np.dtype
    precision: lax.Precision | lax.DotAlgorithmPreset
    kernel: str


def product(lhs, rhs, dimension_numbers, request: Request, out_sharding=None):
    """lhs and rhs contracted as `dimension_numbers` say (batch dimensions may
    broadcast, see the module docstring), on `tiled_matmul`."""
    a, b, transpose_a, transpose_b, out_shape = canonical(
        lhs, rhs, dimension_numbers, request.dtype
    )
    out = tiled_matmul(
        a,
        b,
        transpose_a=transpose_a,
        transpose_b=transpose_b,
        out_dtype=request.out_dtype,
        precision=request.precision,
        kernel=request.kernel,
    )
    return reshard_result(out.reshape(out_shape), out_sharding)


def canonical(lhs, rhs, dimension_numbers, dtype) -> tuple:
    """(a, b, transpose_a, transpose_b, out_shape): lhs and rhs cast to `dtype`
    in the primitive's form, with as few copies as their layouts allow
    (`plan_layouts`), and the shape the (B, M, N) result reshapes to."""
    (lc, rc), (lb, rb) = dimension_numbers
    lf = tuple(d for d in range(lhs.ndim) if d not in lc + lb)
    rf = tuple(d for d in range(rhs.ndim) if d not in rc + rb)
    lhs_layout, rhs_layout, _ = plan_layouts(lhs.shape, rhs.shape, dimension_numbers)
    batch_shape = _checks.broadcast_shapes([lhs.shape[d] for d in lb], [rhs.shape[d] for d in rb])
    batch = math.prod(batch_shape)

    def operand(x, layout, batch_dims, rows, cols):
        x = x.astype(dtype)
        x_batch = batch
        own = tuple(x.shape[d] for d in batch_dims)
        if own != batch_shape:  # a broadcast batch (matmul's)
            if math.prod(own) == 1:
                x_batch = 1  # the kernel broadcasts it: a zero batch stride
            else:  # one stride cannot express it
                shape = list(x.shape)
                for d, size in zip(batch_dims, batch_shape):
                    shape[d] = size
                x = jnp.broadcast_to(x, shape)
        if layout.perm is not None:
            x = jnp.transpose(x, layout.perm)
        return x.reshape(x_batch, *((cols, rows) if layout.k_first else (rows, cols)))

    m, n, k = _size(lhs.shape, lf), _size(rhs.shape, rf), _size(lhs.shape, lc)
    return (
        operand(lhs, lhs_layout, lb, m, k),  # (B, M, K), or (B, K, M) when K first
        operand(rhs, rhs_layout, rb, n, k),  # (B, K, N) when K first, else (B, N, K)
        lhs_layout.k_first,
        not rhs_layout.k_first,
        (*batch_shape, *(lhs.shape[d] for d in lf), *(rhs.shape[d] for d in rf)),
    )


def reshard_result(out, out_sharding):
    """The result with the sharding `out_sharding` asks for. Only explicit mesh
    axes make a sharding part of a type, and `jax.sharding.reshard` refuses
    others as `jnp.matmul` does."""
    if out_sharding is None:
        return out
    return jax.sharding.reshard(out, out_sharding)


# ---- Layouts ----


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
    candidates = dict.fromkeys(
        [tuple(sorted(pairs, key=lc.__getitem__)), tuple(sorted(pairs, key=rc.__getitem__))]
    )
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
