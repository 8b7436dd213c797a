"""The primitive's canonical form, and the rules every layer reads from it.

All arrays row-major:

    a: (Ba, M, K), or (Ba, K, M) when transpose_a
    b: (Bb, K, N), or (Bb, N, K) when transpose_b
    result: (B, M, N), with Ba, Bb in {1, B}

A batch of 1 is broadcast by the kernel through a zero batch stride. The front
end (`_dot_general`), the primitive's rules (`_primitive`), its lowering and
partitioning (`_lowering`, `_sharding`, `_rings`) all read the batch, the
dimensions and the accumulation type from here.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# The dtypes the kernels compute.
SUPPORTED_DTYPES = tuple(map(np.dtype, (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)))


def batch(a_batch, b_batch):
    """The result's batch B: a's, unless a's is 1 (broadcast against b's). Not
    max/min: a symbolic batch (jax.export) cannot be ordered against 1."""
    return b_batch if a_batch == 1 else a_batch


def positions(transpose_a: bool, transpose_b: bool):
    """Positions of (batch, M, K) in stored a and of (batch, K, N) in stored b."""
    return (0, 2, 1) if transpose_a else (0, 1, 2), (0, 2, 1) if transpose_b else (0, 1, 2)


def problem_dims(a_shape, b_shape, transpose_a, transpose_b):
    """(B, M, N, K) of a canonical problem, or a TypeError naming the shapes."""
    if len(a_shape) != 3 or len(b_shape) != 3:
        raise TypeError(
            f"tiled_matmul: operands must have rank 3, got shapes {a_shape} and {b_shape}"
        )
    (_, am, ak), (_, bk, bn) = positions(transpose_a, transpose_b)
    m, k, kb, n = a_shape[am], a_shape[ak], b_shape[bk], b_shape[bn]
    if k != kb:
        raise TypeError(
            f"tiled_matmul: contracting dimensions differ: a{tuple(a_shape)} has K={k} and "
            f"b{tuple(b_shape)} has K={kb} (transpose_a={transpose_a}, transpose_b={transpose_b})"
        )
    ba, bb = a_shape[0], b_shape[0]
    out_batch = batch(ba, bb)
    if ba not in (1, out_batch) or bb not in (1, out_batch):
        raise TypeError(
            f"tiled_matmul: operand batches {ba} and {bb} must each be 1 or the same size"
        )
    return out_batch, m, n, k


def accumulation_dtype(dtype) -> np.dtype:
    """What the kernels sum products in, for operands or a result of `dtype`:
    float64 for float64, float32 for the others."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)
