"""The `tiled_matmul` primitive: abstract eval, autodiff and batching.

Its lowering, the FFI call behind the partitioning rule, is `_lowering.py`'s.
Its operands are in the canonical form of `_canonical.py`: a (Ba, M, K) or
(Ba, K, M), b (Bb, K, N) or (Bb, N, K), the result (B, M, N). Params (all
static): transpose_a, transpose_b (bool), out_dtype (np.dtype), precision
(lax.Precision, or a lax.DotAlgorithmPreset that the lowering resolves for its
platform through `_presets`), kernel (str: "auto" or a kernel name).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from jax_tiled import _canonical, _ffi, _presets, _sharding
from jax_tiled._canonical import SUPPORTED_DTYPES
from jax_tiled._ffi import PRECISION_CODES

tiled_matmul_p = Primitive("tiled_matmul")
_PARAMS = ("transpose_a", "transpose_b", "out_dtype", "precision", "kernel")


def tiled_matmul(
    a,
    b,
    *,
    transpose_a=False,
    transpose_b=False,
    out_dtype=None,
    precision=lax.Precision.DEFAULT,
    kernel="auto",
):
    """Binds the primitive on canonical operands (see the module docstring)."""
    out_dtype = np.dtype(a.dtype if out_dtype is None else out_dtype)
    a, b = _sharding.match_varying(a, b)
    return tiled_matmul_p.bind(
        a,
        b,
        transpose_a=bool(transpose_a),
        transpose_b=bool(transpose_b),
        out_dtype=out_dtype,
        precision=precision,
        kernel=kernel,
    )


def _abstract_eval(a, b, *, transpose_a, transpose_b, out_dtype, precision, kernel):
    for dtype in (a.dtype, b.dtype, out_dtype):
        if np.dtype(dtype) not in SUPPORTED_DTYPES:
            raise TypeError(
                f"tiled_matmul: unsupported dtype {dtype}; supported: "
                f"{', '.join(d.name for d in SUPPORTED_DTYPES)}"
            )
    if a.dtype != b.dtype:
        raise TypeError(f"tiled_matmul: operand dtypes differ: {a.dtype} and {b.dtype}")
    if (
        precision not in PRECISION_CODES
        and not _presets.is_preset(precision)
        and not isinstance(precision, _presets.PartsLaid)
    ):
        raise TypeError(
            "tiled_matmul: precision must be a lax.Precision or a "
            f"lax.DotAlgorithmPreset, got {precision!r}"
        )
    batch, m, n, _ = _canonical.problem_dims(a.shape, b.shape, transpose_a, transpose_b)
    return _sharding.result_aval(a, b, (batch, m, n), out_dtype, transpose_a, transpose_b)


def check_kernel_runs(platform, kernel, dtype, out_dtype, problem, precision) -> None:
    """A forced kernel that cannot compute the dtypes raises TypeError; one that
    cannot run the problem's shape or layout at this precision (the tensor-core
    kernels cannot give float32 HIGHEST) raises ValueError. Both name why."""
    dtypes = _ffi.refusal(platform, kernel, dtype, out_dtype)
    if dtypes:
        raise TypeError(f"jax_tiled: {dtypes}")
    layout = _ffi.refusal(platform, kernel, dtype, out_dtype, problem, precision)
    if layout:
        batch_a, batch_b, m, n, k, transpose_a, transpose_b = problem
        raise ValueError(
            f"jax_tiled: {layout} (m={m}, n={n}, k={k}, batches {batch_a} and "
            f"{batch_b}, transpose_a={transpose_a}, transpose_b={transpose_b}, "
            f"precision {lax.Precision(precision).name})"
        )


# ---- Autodiff: the product is bilinear, and each cotangent is another product ----


def _cotangent_product(ct_aval, x, y, *, out_dtype, **params):
    """x @ y through the kernel, reduced over the batch when the operand whose
    cotangent this is was broadcast (batch 1) against a larger batch."""
    reduce = ct_aval.shape[0] == 1 and not (x.shape[0] == 1 and y.shape[0] == 1)
    if (
        reduce
        and params["transpose_a"]
        and not params["transpose_b"]
        and x.shape[0] == y.shape[0]
        and not (_sharding.splits_batch(x) or _sharding.splits_batch(y))
    ):
        # Both operands are stored with the contracted axis as rows, so the batch
        # joins the contraction for free: one product, no batched partial sums.
        # (Not where explicit mesh axes split the batch: jax cannot type that merge.)
        rows = lambda z: z.reshape(1, z.shape[0] * z.shape[1], z.shape[2])
        x, y, reduce = rows(x), rows(y), False
    product_dtype = _canonical.accumulation_dtype(ct_aval.dtype) if reduce else ct_aval.dtype
    g = tiled_matmul_p.bind(x, y, out_dtype=product_dtype, **params)
    if reduce:
        g = jnp.sum(g, axis=0, keepdims=True)
    return _sharding.reshard_like(g.astype(ct_aval.dtype), ct_aval)


def _transpose_a(ct, a, b, *, transpose_a, transpose_b, out_dtype, precision, kernel):
    # op(a) = ct @ op(b)^T.  Stored a^T (transpose_a) = op(b) @ ct^T.
    ct = ct.astype(b.dtype)
    common = dict(out_dtype=a.aval.dtype, precision=precision, kernel=kernel)
    if transpose_a:
        return _cotangent_product(
            a.aval, b, ct, transpose_a=transpose_b, transpose_b=True, **common
        )
    return _cotangent_product(
        a.aval, ct, b, transpose_a=False, transpose_b=not transpose_b, **common
    )


def _transpose_b(ct, a, b, *, transpose_a, transpose_b, out_dtype, precision, kernel):
    # op(b) = op(a)^T @ ct.  Stored b^T (transpose_b) = ct^T @ op(a).
    ct = ct.astype(a.dtype)
    common = dict(out_dtype=b.aval.dtype, precision=precision, kernel=kernel)
    if transpose_b:
        return _cotangent_product(
            b.aval, ct, a, transpose_a=True, transpose_b=transpose_a, **common
        )
    return _cotangent_product(
        b.aval, a, ct, transpose_a=not transpose_a, transpose_b=False, **common
    )


# ---- Batching: the vmapped axis joins the primitive's batch dimension ----


def _batch(args, dims, **params):
    a, b = args
    a_dim, b_dim = dims
    if a_dim is not None:
        a = jnp.moveaxis(a, a_dim, 0)
    if b_dim is not None:
        b = jnp.moveaxis(b, b_dim, 0)
    a_mapped = a_dim is not None
    b_mapped = b_dim is not None
    vmapped = (a if a_mapped else b).shape[0]
    a_batch = a.shape[1] if a_mapped else a.shape[0]
    b_batch = b.shape[1] if b_mapped else b.shape[0]
    batch = _canonical.batch(a_batch, b_batch)

    # vmap of a plain (batch 1) product over a only: one product with taller a.
    if a_mapped and not b_mapped and not params["transpose_a"] and a_batch == 1 and b_batch == 1:
        _, _, m, k = a.shape
        out = tiled_matmul_p.bind(a.reshape(1, vmapped * m, k), b, **params)
        return out.reshape(vmapped, 1, m, out.shape[-1]), 0

    def merge(x, mapped, x_batch):
        """(V, Bx, r, c) or unmapped (Bx, r, c) -> (V * B, r, c), or (1, r, c) when
        x broadcasts over everything. Broadcasts one stride cannot express are
        materialised."""
        if not mapped and x_batch == 1:
            return x
        if not mapped:
            x = x[None]
        x = jnp.broadcast_to(x, (vmapped, batch, *x.shape[2:]))
        return x.reshape(vmapped * batch, *x.shape[2:])

    a = merge(a, a_mapped, a_batch)
    b = merge(b, b_mapped, b_batch)
    out = tiled_matmul_p.bind(a, b, **params)
    return out.reshape(vmapped, batch, *out.shape[1:]), 0


@functools.partial(jax.jit, static_argnames=tuple(_PARAMS))
def _impl(a, b, **params):
    return tiled_matmul_p.bind(a, b, **params)


tiled_matmul_p.def_impl(_impl)
tiled_matmul_p.def_abstract_eval(_abstract_eval)
ad.defbilinear(tiled_matmul_p, _transpose_a, _transpose_b)
batching.primitive_batchers[tiled_matmul_p] = _batch
