"""What the public functions accept: every check of their arguments, in one place.

`matmul` and `dot_general` (and `explain` and `kernels`) validate here, at
trace time, and raise TypeError or ValueError naming what is wrong; past these
checks a product is well formed, and the rest of the package does not check
again (the primitive's abstract evaluation and the handlers still refuse
malformed calls that bypass the API).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_tiled import _ffi, _presets
from jax_tiled._canonical import SUPPORTED_DTYPES
from jax_tiled._ffi import PRECISION_CODES

# What `precision=` takes: None, a lax.Precision, its string names, a pair of
# those, or a lax.DotAlgorithmPreset or its name.
PrecisionLike = Any
# What `preferred_element_type=` takes: None or anything np.dtype takes.
DTypeLike = Any
# What `out_sharding=` takes, as jnp.matmul and lax.dot_general take it.
ShardingLike = jax.sharding.NamedSharding | jax.sharding.PartitionSpec | None

_SUPPORTED_NAMES = ", ".join(d.name for d in SUPPORTED_DTYPES)


# ---- Arguments as jit takes them ----


def operand(name: str, x, api: str):
    """An operand as jnp.matmul takes it: an array, a scalar, or a list or
    tuple of numbers (made an array here, before jit would take it for a
    pytree); anything else a TypeError naming it."""
    if isinstance(x, (list, tuple)):
        x = np.asarray(x)
    if (
        isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))
        or hasattr(x, "__jax_array__")
    ) and jnp.dtype(getattr(x, "dtype", np.float32)) != np.object_:
        return x
    shown = repr(x)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise TypeError(
        f"{api}: {name} must be an array or a scalar (as jnp.asarray takes it), got "
        f"{type(x).__name__} {shown}"
    )


def hashable(x):
    """Lists as tuples, so that an argument can be a static one of `jit`
    (named tuples, such as a lax.DotAlgorithm, kept as they are)."""
    return tuple(map(hashable, x)) if isinstance(x, list) or type(x) is tuple else x


# ---- Kernel ----


def kernel(name: Any, api: str) -> str:
    """ "auto" or a kernel some platform of this build has (the lowering checks
    the platform it lowers for)."""
    if not isinstance(name, str):
        raise TypeError(f"{api}: kernel must be a string, got {name!r}")
    known = {p: _ffi.kernel_names(p) for p in ("cpu", "cuda")}
    if name == "auto" or any(name in names for names in known.values()):
        return name
    valid = "; ".join(f"on {p}: {['auto', *names]}" for p, names in known.items() if names)
    if not known["cuda"] and name in _ffi.cuda_ladder_names():
        raise ValueError(
            f"{api}: kernel {name!r} is a CUDA kernel, not built in this install (no CUDA "
            f"module: the package was built without nvcc, or with JAX_TILED_CUDA=OFF); "
            f"valid {valid}"
        )
    raise ValueError(f"{api}: unknown kernel {name!r}; valid {valid}")


# ---- Precision ----


def _one_precision(p, allow_preset: bool, api: str) -> lax.Precision | lax.DotAlgorithmPreset:
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
            f"{api}: unsupported precision {p!r}: a custom lax.DotAlgorithm; use a "
            "lax.DotAlgorithmPreset (or its name) or a lax.Precision"
        )
    pair = "" if allow_preset else " in a pair (a lax.DotAlgorithmPreset stands alone)"
    raise ValueError(
        f"{api}: unsupported precision {p!r}{pair}; use None, a lax.Precision, one of "
        "'default', 'high', 'highest', 'bfloat16', 'tensorfloat32', 'float32', a pair of them, "
        "or a lax.DotAlgorithmPreset or its name"
    )


def canonical_precision(
    precision: PrecisionLike, api: str = "jax_tiled.matmul"
) -> lax.Precision | lax.DotAlgorithmPreset:
    """One lax.Precision or lax.DotAlgorithmPreset for a product, honouring
    jax.default_matmul_precision (which may name a preset, as for jnp.matmul).
    A per-operand pair takes the more precise of the two, as XLA does."""
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
        if precision is None:
            return lax.Precision.DEFAULT
    if isinstance(precision, (tuple, list)) and not isinstance(precision, lax.DotAlgorithm):
        if len(precision) != 2:
            raise ValueError(f"{api}: a precision pair needs 2 entries, got {precision!r}")
        return max(
            (_one_precision(p, allow_preset=False, api=api) for p in precision),
            key=PRECISION_CODES.__getitem__,
        )
    return _one_precision(precision, allow_preset=True, api=api)


def precision(precision: PrecisionLike, api: str, platform: str | None = None):
    """canonical_precision, and a preset that `platform` (default: the one this
    is traced for) refuses raises ValueError now, at trace time, naming the
    presets it takes."""
    precision = canonical_precision(precision, api)
    if _presets.is_preset(precision):
        _presets.check(platform or _presets.trace_platform(), precision, api)
    return precision


# ---- Dtypes ----


def float_dtype(name: str, dtype, api: str) -> np.dtype:
    """`dtype` if the kernels compute it, else a TypeError naming it."""
    dtype = np.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{api}: unsupported dtype {dtype.name} for {name}; supported: {_SUPPORTED_NAMES}"
        )
    return dtype


def _is_integer(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer) or np.dtype(dtype) == np.bool_


def computed(lhs_dtype, rhs_dtype, out_dtype) -> bool:
    """Whether the kernels compute a product of these dtypes: a floating
    result of floating or integer (bool) operands (`tiled` routes exactly these)."""
    return np.dtype(out_dtype) in SUPPORTED_DTYPES and all(
        np.dtype(d) in SUPPORTED_DTYPES or _is_integer(d) for d in (lhs_dtype, rhs_dtype)
    )


def integer_result(lhs_dtype, rhs_dtype, preferred_element_type) -> bool:
    """Whether a product is of integers (or bools) into an integer result,
    which jnp computes in integer arithmetic, wrapping around where the
    kernels' floating point would round."""
    return (
        _is_integer(lhs_dtype)
        and _is_integer(rhs_dtype)
        and (preferred_element_type is None or _is_integer(preferred_element_type))
    )


def _operand_dtype(lhs_dtype, rhs_dtype, promoted, preferred_element_type, api) -> np.dtype:
    """The dtype the kernels compute a product in. An integer or bool operand
    takes the other's float type (`promoted()`, the API's promotion). Integers
    only: the floating `preferred_element_type`, as jnp computes them (XLA
    converts both operands to it and multiplies there, so small integers give
    exact results); into an integer result they are refused."""
    for name, dtype in (("a", lhs_dtype), ("b", rhs_dtype)):
        if not _is_integer(dtype):
            float_dtype(name, dtype, api)
    if not (_is_integer(lhs_dtype) and _is_integer(rhs_dtype)):
        return float_dtype("the promoted operands", promoted(), api)
    if not integer_result(lhs_dtype, rhs_dtype, preferred_element_type):
        dtype = out_dtype(None, preferred_element_type, api)
        widest = max((np.dtype(lhs_dtype), np.dtype(rhs_dtype)), key=lambda d: d.itemsize)
        if dtype.itemsize < widest.itemsize:  # as lax.dot_general refuses it
            raise TypeError(
                f"{api}: preferred_element_type {dtype.name} is narrower than the operands' "
                f"{widest.name}; jnp refuses it too"
            )
        return dtype
    raise TypeError(
        f"{api}: integer-only products ({np.dtype(lhs_dtype).name} and "
        f"{np.dtype(rhs_dtype).name}) into an integer result are not computed by jax_tiled's "
        f"floating-point kernels; pass a floating preferred_element_type, use jnp.matmul / "
        f"lax.dot_general for them, or cast an operand to one of {_SUPPORTED_NAMES}"
    )


def matmul_dtype(a, b, preferred_element_type, api: str) -> np.dtype:
    """The dtype a `matmul` is computed in: jnp.matmul's promotion (int32 @
    float32 is float32, int8 @ bfloat16 is bfloat16: jnp.result_type, weak
    types included); see `_operand_dtype`."""
    promoted = lambda: jnp.result_type(a, b)
    return _operand_dtype(a.dtype, b.dtype, promoted, preferred_element_type, api)


def _dtype_rank(dtype) -> tuple:
    """lax.dot_general's (and XLA's) order of operand types: the result takes the higher."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        info = jnp.finfo(dtype)
        return (info.maxexp, info.nmant, info.bits)
    return (-1, -1, 0)


def dot_general_dtype(lhs_dtype, rhs_dtype, preferred_element_type, api: str) -> np.dtype:
    """The dtype a `dot_general` is computed in: lax.dot_general's, the
    operand type of higher rank; see `_operand_dtype`."""
    promoted = lambda: max((lhs_dtype, rhs_dtype), key=_dtype_rank)
    return _operand_dtype(lhs_dtype, rhs_dtype, promoted, preferred_element_type, api)


def out_dtype(dtype: np.dtype | None, preferred_element_type: DTypeLike, api: str) -> np.dtype:
    """The result's dtype: `preferred_element_type`, or the operands' dtype."""
    if preferred_element_type is None:
        return dtype
    return float_dtype(
        "preferred_element_type", jax.dtypes.canonicalize_dtype(preferred_element_type), api
    )


# ---- Shapes ----


def dimension_numbers(numbers, api: str) -> tuple:
    """((lc, rc), (lb, rb)) as tuples of Python ints, or a TypeError."""

    def index(d):
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
            raise TypeError
        return int(d)

    try:
        (lc, rc), (lb, rb) = numbers
        return tuple(
            tuple(tuple(map(index, group)) for group in pair) for pair in ((lc, rc), (lb, rb))
        )
    except (TypeError, ValueError):
        raise TypeError(
            f"{api}: dimension_numbers must be ((lhs_contracting, rhs_contracting), "
            f"(lhs_batch, rhs_batch)), sequences of ints; got {numbers!r}"
        ) from None


def dot_general_shapes(lhs_shape, rhs_shape, dims, api: str) -> None:
    """lax.dot_general's checks of shapes against dimension numbers, as
    TypeErrors naming the shapes."""
    (lc, rc), (lb, rb) = dims
    for side, shape, contract, batch in (("lhs", lhs_shape, lc, lb), ("rhs", rhs_shape, rc, rb)):
        bad = [d for d in contract + batch if not 0 <= d < len(shape)]
        if bad:
            raise TypeError(
                f"{api}: {side} dimensions {bad} out of range for {side} of shape "
                f"{tuple(shape)} (contracting {contract}, batch {batch})"
            )
        if len(set(contract + batch)) != len(contract + batch):
            raise TypeError(
                f"{api}: {side} contracting {contract} and batch {batch} dimensions "
                "must be distinct"
            )
    for kind, left, right in (("contracting", lc, rc), ("batch", lb, rb)):
        if len(left) != len(right):
            raise TypeError(
                f"{api}: lhs and rhs need as many {kind} dimensions, got {left} and {right}"
            )
        for i, j in zip(left, right):
            if lhs_shape[i] != rhs_shape[j]:
                raise TypeError(
                    f"{api}: {kind} dimensions differ: lhs{tuple(lhs_shape)} has {lhs_shape[i]} "
                    f"at dimension {i}, rhs{tuple(rhs_shape)} has {rhs_shape[j]} at dimension {j}"
                )


def matmul_shapes(a_shape, b_shape, api: str) -> tuple:
    """jnp.matmul's checks, as ValueErrors naming the shapes; the broadcast batch
    shape (1-D operands have none: a is a row, b a column)."""
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if not a_shape or not b_shape:
        raise ValueError(
            f"{api}: operands must have at least 1 dimension, got shapes {a_shape} and {b_shape}"
        )
    k, k_b = a_shape[-1], b_shape[-2 if len(b_shape) > 1 else 0]
    if k != k_b:
        raise ValueError(
            f"{api}: contracting dimensions differ: a{a_shape} has {k}, b{b_shape} has {k_b}"
        )
    try:
        return broadcast_shapes(a_shape[:-2], b_shape[:-2])
    except ValueError:
        raise ValueError(
            f"{api}: batch dimensions of a{a_shape} and b{b_shape} do not broadcast"
        ) from None


def broadcast_shapes(a_batch, b_batch) -> tuple:
    """NumPy broadcasting of two batch shapes, symbolic dimensions included."""
    return tuple(lax.broadcast_shapes(tuple(a_batch), tuple(b_batch)))
