"""`jax_tiled.matmul`: `jnp.matmul` semantics on top of the canonical primitive.

This module validates a product once, at trace time, and reduces it to the
primitive's (B, M, K) x (B, K, N) form: 1-D operands get a unit axis, batch
dimensions broadcast by NumPy rules and flatten into one (free for row-major
arrays), and a batch that one zero stride cannot express is materialised.

Outside `jit`, each public call is one cached jitted function, as
`jnp.matmul` is: run op by op, each reshape around the product would be its
own XLA computation with its own output buffer, a copy of an operand or of the
result (a 4096 x 4096 float32 product then peaked at four times the output's
memory over jnp's one).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_tiled import _ffi, _presets, _sharding
from jax_tiled._compat import inline_jit
from jax_tiled._primitive import (PRECISION_CODES, SUPPORTED_DTYPES, check_kernel_runs,
                                  tiled_matmul)

_SUPPORTED_NAMES = ", ".join(d.name for d in SUPPORTED_DTYPES)

# What `precision=` takes: None, a lax.Precision, its string names, a pair of
# those, or a lax.DotAlgorithmPreset or its name.
PrecisionLike = Any
# What `preferred_element_type=` takes: None or anything np.dtype takes.
DTypeLike = Any


def _backend_platform(backend: str | None) -> str:
    backend = jax.default_backend() if backend is None else backend
    return {"gpu": "cuda"}.get(backend, backend)


def kernels(backend: str | None = None, dtype: DTypeLike = None, out_dtype: DTypeLike = None,
            precision: PrecisionLike = None) -> list[str]:
    """Kernels built and usable on `backend` ('cpu', 'gpu'/'cuda'; default:
    jax's default backend). Any of them can be forced with `matmul(..., kernel=)`.

    With `dtype` (the operands', after promotion), only the kernels that compute
    that dtype into `out_dtype` (default: the same) at `precision`, which takes
    what `matmul` takes (default None: the product's default, which honours
    `jax.default_matmul_precision`). On CUDA, the tensor-core kernels take float32
    at DEFAULT (TF32) and HIGH (3xTF32) but not at HIGHEST (true fp32). A
    `lax.DotAlgorithmPreset` lists the kernels of the product it runs as (see
    `explain`); one the backend refuses raises ValueError naming those it takes."""
    platform = _backend_platform(backend)
    precision = canonical_precision(precision)
    if _presets.is_preset(precision):
        _presets.check(platform, precision, "jax_tiled.kernels")
    if platform == "cuda":
        try:
            jax.devices("cuda")
        except RuntimeError:
            return []
    elif platform != "cpu":
        return []
    names = _ffi.kernel_names(platform)
    if dtype is None:
        return list(names)
    dtype = np.dtype(dtype)
    out_dtype = dtype if out_dtype is None else np.dtype(out_dtype)
    if dtype not in SUPPORTED_DTYPES or out_dtype not in SUPPORTED_DTYPES:
        return []  # no kernel computes it: integer operands are promoted to a float first
    run = _presets.resolve(platform, precision, dtype, out_dtype, "jax_tiled.kernels")
    return [name for name in names
            if not _ffi.refusal(platform, name, run.operand_dtype, run.product_dtype,
                                precision=run.precision)]


def _check_kernel(kernel: Any) -> str:
    if not isinstance(kernel, str):
        raise TypeError(f"jax_tiled.matmul: kernel must be a string, got {kernel!r}")
    known = {p: _ffi.kernel_names(p) for p in ("cpu", "cuda")}
    if kernel != "auto" and not any(kernel in names for names in known.values()):
        valid = "; ".join(f"on {p}: {['auto', *names]}" for p, names in known.items() if names)
        raise ValueError(f"jax_tiled.matmul: unknown kernel {kernel!r}; valid {valid}")
    return kernel


def _one_precision(p, allow_preset: bool) -> lax.Precision | lax.DotAlgorithmPreset:
    if isinstance(p, lax.Precision):
        return p
    if isinstance(p, lax.DotAlgorithmPreset) and allow_preset:
        return p
    if isinstance(p, str):
        try:
            return lax.Precision(p)
        except ValueError:
            pass
        if allow_preset and p in lax.DotAlgorithmPreset.__members__:
            return lax.DotAlgorithmPreset[p]
    if isinstance(p, lax.DotAlgorithm):
        raise ValueError(
            f"jax_tiled.matmul: unsupported precision {p!r}: a custom lax.DotAlgorithm; use a "
            "lax.DotAlgorithmPreset (or its name) or a lax.Precision")
    pair = "" if allow_preset else " in a pair (a lax.DotAlgorithmPreset stands alone)"
    raise ValueError(
        f"jax_tiled.matmul: unsupported precision {p!r}{pair}; use None, a lax.Precision, one of "
        "'default', 'high', 'highest', 'bfloat16', 'tensorfloat32', 'float32', a pair of them, "
        "or a lax.DotAlgorithmPreset or its name")


def canonical_precision(precision: PrecisionLike) -> lax.Precision | lax.DotAlgorithmPreset:
    """One lax.Precision or lax.DotAlgorithmPreset for a product, honouring
    jax.default_matmul_precision (which may name a preset, as for jnp.matmul).
    A per-operand pair takes the more precise of the two, as XLA does."""
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
        if precision is None:
            return lax.Precision.DEFAULT
    if isinstance(precision, (tuple, list)) and not isinstance(precision, lax.DotAlgorithm):
        if len(precision) != 2:
            raise ValueError(f"jax_tiled.matmul: a precision pair needs 2 entries, got {precision!r}")
        return max((_one_precision(p, allow_preset=False) for p in precision),
                   key=PRECISION_CODES.__getitem__)
    return _one_precision(precision, allow_preset=True)


def check_precision(precision, api: str, platform: str | None = None):
    """canonical_precision, and a preset that `platform` (default: the one this
    is traced for) refuses raises ValueError now, at trace time, naming the
    presets it takes."""
    precision = canonical_precision(precision)
    if _presets.is_preset(precision):
        _presets.check(platform or _presets.trace_platform(), precision, api)
    return precision


def _check_float(name: str, dtype, api: str = "jax_tiled.matmul") -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{api}: unsupported dtype {dtype.name} for {name}; "
                        f"supported: {_SUPPORTED_NAMES}")
    return dtype


def _is_integer(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer) or np.dtype(dtype) == np.bool_


def check_operand_dtypes(lhs_dtype, rhs_dtype, api: str) -> None:
    """Integer and bool operands are computed as the float they promote to;
    a product of integers only is refused (the kernels compute in floating
    point, and jnp's integer product wraps around where a float one rounds)."""
    for name, dtype in (("a", lhs_dtype), ("b", rhs_dtype)):
        if not _is_integer(dtype):
            _check_float(name, dtype, api)
    if _is_integer(lhs_dtype) and _is_integer(rhs_dtype):
        raise TypeError(
            f"{api}: integer-only products ({np.dtype(lhs_dtype).name} and "
            f"{np.dtype(rhs_dtype).name}) are not computed by jax_tiled's floating-point "
            f"kernels; use jnp.matmul / lax.dot_general for them, or cast an operand to one "
            f"of {_SUPPORTED_NAMES}")


def broadcast_batch(a_batch, b_batch) -> tuple:
    """NumPy broadcasting of two batch shapes, symbolic dimensions included."""
    return tuple(lax.broadcast_shapes(tuple(a_batch), tuple(b_batch)))


def _to_batch(x, x_batch, batch_shape, rows, cols):
    """x of shape x_batch + (rows, cols) as (1 or B, rows, cols)."""
    if math.prod(x_batch) == 1:
        return x.reshape(1, rows, cols)
    padded = (1,) * (len(batch_shape) - len(x_batch)) + tuple(x_batch)
    if padded != tuple(batch_shape):
        x = jnp.broadcast_to(x, (*batch_shape, rows, cols))
    return x.reshape(math.prod(batch_shape), rows, cols)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a product becomes besides its canonical operands."""
    out_dtype: np.dtype
    precision: lax.Precision | lax.DotAlgorithmPreset
    kernel: str
    batch_shape: tuple[int, ...]
    m: int
    n: int
    a_vector: bool
    b_vector: bool


def _canonicalize(a, b, precision, preferred_element_type, kernel, platform=None):
    """Validates a product once (a preset for `platform`, default the one traced
    for) and returns its canonical operands (a3, b3) and plan."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    check_operand_dtypes(a.dtype, b.dtype, "jax_tiled.matmul")
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError("jax_tiled.matmul: operands must have at least 1 dimension, got shapes "
                         f"{a.shape} and {b.shape}")
    # As jnp.matmul: int32 @ float32 is float32, int8 @ bfloat16 is bfloat16.
    dtype = _check_float("the promoted operands", jnp.result_type(a, b))
    out_dtype = dtype if preferred_element_type is None else _check_float(
        "preferred_element_type", jax.dtypes.canonicalize_dtype(preferred_element_type))
    precision = check_precision(precision, "jax_tiled.matmul", platform)
    kernel = _check_kernel(kernel)

    a_vector, b_vector = a.ndim == 1, b.ndim == 1
    a2 = a.reshape(1, a.shape[0]) if a_vector else a
    b2 = b.reshape(b.shape[0], 1) if b_vector else b
    *a_batch, m, k = a2.shape
    *b_batch, k_b, n = b2.shape
    if k != k_b:
        raise ValueError(f"jax_tiled.matmul: contracting dimensions differ: a{a.shape} has {k}, "
                         f"b{b.shape} has {k_b}")
    try:
        batch_shape = broadcast_batch(a_batch, b_batch)
    except ValueError:
        raise ValueError(f"jax_tiled.matmul: batch dimensions of a{a.shape} and b{b.shape} "
                         "do not broadcast") from None

    a2, b2 = a2.astype(dtype), b2.astype(dtype)
    # Explicit mesh axes may split only the first batch dimension (else this
    # raises), or jax cannot type the flattening of the batch.
    a_batch_split = _sharding.splits_batch(a2, len(a_batch))
    _sharding.splits_batch(b2, len(b_batch))
    if math.prod(b_batch) == 1 and tuple(a_batch) == tuple(batch_shape) and not a_batch_split:
        # A batch of rows against one shared b is one taller product, free for
        # row-major a; its weight gradient then contracts over batch and rows at once.
        # (Not where explicit mesh axes split the batch: jax cannot type that merge.)
        a3, b3 = a2.reshape(1, math.prod(batch_shape) * m, k), b2.reshape(1, k, n)
    else:
        a3 = _to_batch(a2, a_batch, batch_shape, m, k)
        b3 = _to_batch(b2, b_batch, batch_shape, k, n)
    return a3, b3, _Plan(out_dtype, precision, kernel, tuple(batch_shape), m, n, a_vector, b_vector)


def matmul(a: jax.typing.ArrayLike, b: jax.typing.ArrayLike, *,
           precision: PrecisionLike = None, preferred_element_type: DTypeLike = None,
           out_sharding: jax.sharding.NamedSharding | jax.sharding.PartitionSpec | None = None,
           kernel: str = "auto") -> jax.Array:
    """Matrix product with `jnp.matmul` semantics, run on this package's kernels.

    Args:
      a, b: arrays of rank >= 1. float16, bfloat16, float32 and float64 are
        computed; mixed dtypes promote as in `jnp.matmul`, so an integer or
        bool operand takes the other's float dtype (int32 @ float32 is
        float32). A product of integers only raises TypeError.
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
    kernel = _check_kernel(kernel)
    return _matmul_jit(_array_like(a), _array_like(b), precision=_hashable(precision),
                       preferred_element_type=preferred_element_type,
                       out_sharding=out_sharding, kernel=kernel)


def _array_like(x):
    """Lists and tuples as arrays, before jit would take them for pytrees."""
    return np.asarray(x) if isinstance(x, (list, tuple)) else x


def _hashable(x):
    """Lists as tuples, so that an argument can be a static one of `jit`
    (named tuples, such as a lax.DotAlgorithm, kept as they are)."""
    return tuple(map(_hashable, x)) if isinstance(x, list) or type(x) is tuple else x


def reshard_result(out, out_sharding):
    """The result with the sharding `out_sharding` asks for. Only explicit mesh
    axes make a sharding part of a type, and `jax.sharding.reshard` refuses
    others as `jnp.matmul` does."""
    if out_sharding is None:
        return out
    return jax.sharding.reshard(out, out_sharding)


# Inside a traced function the plain computation, no call in the jaxpr.
@inline_jit(static_argnames=("precision", "preferred_element_type", "out_sharding", "kernel"))
def _matmul_jit(a, b, *, precision, preferred_element_type, out_sharding, kernel):
    a3, b3, plan = _canonicalize(a, b, precision, preferred_element_type, kernel)
    out = tiled_matmul(a3, b3, out_dtype=plan.out_dtype, precision=plan.precision,
                       kernel=plan.kernel)
    out = out.reshape(*plan.batch_shape, plan.m, plan.n)
    if plan.a_vector:
        out = out.reshape(*out.shape[:-2], plan.n)
    if plan.b_vector:
        out = out.reshape(out.shape[:-1])
    return reshard_result(out, out_sharding)


def explain(a: Any, b: Any, *, precision: PrecisionLike = None,
            preferred_element_type: DTypeLike = None, kernel: str = "auto",
            backend: str | None = None) -> str:
    """Which kernel `matmul(a, b, ...)` runs on `backend` (default: jax's
    default backend), and why. a and b may be arrays or jax.ShapeDtypeStructs.
    For a `lax.DotAlgorithmPreset` it also says what the preset runs as there:
    the casts and the kernel precision."""
    captured = {}
    platform = _backend_platform(backend)

    def canonical(a, b):
        a3, b3, captured["plan"] = _canonicalize(a, b, precision, preferred_element_type, kernel,
                                                 platform)
        return a3, b3

    a3, b3 = jax.eval_shape(canonical, a, b)
    plan = captured["plan"]
    batch = max(a3.shape[0], b3.shape[0]) if min(a3.shape[0], b3.shape[0]) else 0
    _, m, k = a3.shape
    n = b3.shape[2]
    problem = (a3.shape[0], b3.shape[0], m, n, k, False, False)
    run = _presets.resolve(platform, plan.precision, a3.dtype, plan.out_dtype, "jax_tiled.explain")
    head = (f"{platform}: {batch} x ({m} x {k}) @ ({k} x {n}), {a3.dtype.name} -> "
            f"{plan.out_dtype.name}, precision {plan.precision.name}")
    if _presets.is_preset(plan.precision):
        head += f" (runs as {run.describe(a3.dtype, plan.out_dtype)})"
    if plan.kernel != "auto":
        check_kernel_runs(platform, plan.kernel, run.operand_dtype, run.product_dtype, problem,
                          run.precision)
        return f"{head}: {plan.kernel}: forced by kernel={plan.kernel!r}"
    if platform == "cpu":
        return f"{head}: blocked: the cache-blocked CPU kernel, the only CPU kernel"
    if platform == "cuda" and _ffi.cuda_module_built():
        try:
            multiprocessors = getattr(jax.devices("cuda")[0], "core_count", None) or 132
        except RuntimeError:  # no GPU here: explain for an H100/H200-sized one
            multiprocessors = 132
        choice = _ffi.cuda_explain(run.operand_dtype.name, run.product_dtype.name, problem,
                                   multiprocessors, run.precision)
        return f"{head}: {choice}"
    raise ValueError(f"jax_tiled.explain: no kernels for backend {platform!r} in this build")
