"""`jax_tiled.matmul`: `jnp.matmul` semantics, stated as a `dot_general`.

As `jnp.matmul` is built on `lax.dot_general`, `matmul` checks its operands
(`_checks`), says which dimensions it contracts and which are batch, and runs
that through `_dot_general.product`:

- a 1-D operand contracts its one dimension and adds no free one (a row
  times b, or a times a column);
- where b has no batch (its batch dimensions are all 1), a's batch joins a's
  rows: one taller product, free for row-major a, whose weight gradient then
  contracts over batch and rows at once;
- otherwise both operands take the broadcast batch's rank (leading unit
  dimensions, free) and their batch dimensions pair up, broadcasting as
  NumPy's do (see `_dot_general`).

Outside `jit`, each public call is one cached jitted function, as
`jnp.matmul` is: run op by op, each reshape around the product would be its
own XLA computation with its own output buffer, a copy of an operand or of
the result.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_tiled import _checks, _dot_general, _sharding
from jax_tiled._checks import DTypeLike, PrecisionLike, ShardingLike
from jax_tiled._compat import inline_jit

API = "jax_tiled.matmul"


def matmul(
    a: jax.typing.ArrayLike,
    b: jax.typing.ArrayLike,
    *,
    precision: PrecisionLike = None,
    preferred_element_type: DTypeLike = None,
    out_sharding: ShardingLike = None,
    kernel: str = "auto",
) -> jax.Array:
    """Matrix product with `jnp.matmul` semantics, run on this package's kernels.

    Args:
      a, b: arrays of rank >= 1. float16, bfloat16, float32 and float64 are
        computed; mixed dtypes promote as in `jnp.matmul`, so an integer or
        bool operand takes the other's float dtype (int32 @ float32 is
        float32). Integers only are computed in a floating
        `preferred_element_type`, as jnp computes them (both operands
        converted to it); into an integer result they raise TypeError.
      precision: None (honours `jax.default_matmul_precision`), a
        `lax.Precision`, one of its string names, or a pair. On CUDA, float32
        products run at DEFAULT on TF32 tensor cores, at HIGH in 3xTF32 split
        arithmetic and at HIGHEST in true fp32; on CPU every setting is exact
        fp32. Other dtypes are computed the same at every setting. Or a
        `lax.DotAlgorithmPreset` (or its name) that `jnp.matmul` takes on the
        backend, with its meaning: the operands cast to its input type, its
        accumulation, the result in the output dtype (`explain` says what
        runs); one the backend refuses raises ValueError.
      preferred_element_type: output dtype (default: the promoted input dtype).
        Accumulation is float32, or float64 for float64.
      out_sharding: the result's sharding, as `jnp.matmul` takes it (a
        `NamedSharding`, or a `PartitionSpec` under `jax.set_mesh`, over
        `AxisType.Explicit` mesh axes).
      kernel: "auto", or a name from `jax_tiled.kernels()` to force that kernel.
    """
    kernel = _checks.kernel(kernel, API)
    return _matmul_jit(
        _checks.operand("a", a, API),
        _checks.operand("b", b, API),
        precision=_checks.hashable(precision),
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
        kernel=kernel,
    )


# Inside a traced function the plain computation, no call in the jaxpr.
@inline_jit(static_argnames=("precision", "preferred_element_type", "out_sharding", "kernel"))
def _matmul_jit(a, b, *, precision, preferred_element_type, out_sharding, kernel):
    lhs, rhs, dimension_numbers, request = as_dot_general(
        a, b, precision, preferred_element_type, kernel
    )
    return _dot_general.product(lhs, rhs, dimension_numbers, request, out_sharding)


def as_dot_general(a, b, precision, preferred_element_type, kernel, platform=None, api=API):
    """`matmul(a, b, ...)` checked (a preset for `platform`, default the one
    traced for; messages name `api`, the function called) and stated as
    `_dot_general.product` takes it: (lhs, rhs, dimension numbers whose batch
    dimensions may broadcast, request)."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    dtype = _checks.matmul_dtype(a, b, preferred_element_type, api)
    request = _dot_general.Request(
        dtype,
        _checks.out_dtype(dtype, preferred_element_type, api),
        _checks.precision(precision, api, platform),
        kernel,
    )
    batch_shape = _checks.matmul_shapes(a.shape, b.shape, api)
    a_batch, b_batch = a.shape[:-2], b.shape[:-2]
    # Explicit mesh axes may split only the first batch dimension (else this
    # raises), or jax cannot type the flattening of the batch.
    a_batch_split = _sharding.splits_batch(a, len(a_batch))
    _sharding.splits_batch(b, len(b_batch))
    b_contracted = max(b.ndim - 2, 0)  # a 1-D b is a column
    if math.prod(b_batch) == 1 and a_batch == batch_shape and not a_batch_split:
        # One taller product (not where explicit mesh axes split the batch: jax
        # cannot type that merge).
        b = b.reshape(b.shape[b_contracted:])
        return a, b, (((a.ndim - 1,), (0,)), ((), ())), request
    rank = len(batch_shape)
    a = a.reshape((1,) * (rank - len(a_batch)) + a.shape)
    b = b.reshape((1,) * (rank - len(b_batch)) + b.shape)
    batch = tuple(range(rank))
    b_contracted = max(b.ndim - 2, rank)
    return a, b, (((a.ndim - 1,), (b_contracted,)), (batch, batch)), request
