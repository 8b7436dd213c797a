"""Special values: every kernel, dtype, precision and layout gives NaN, +inf and
-inf where true arithmetic on the same inputs does, and finite values where it
is finite.

One product carries every case in its own rows and columns, placed in
different tiles: +-inf and NaN in either operand, a finite product that
overflows, operands at the dtype's largest finite value (which a split into
high and low parts must not overflow), rows of tiny normal values, and rows of
subnormal values, which a kernel may flush to zero (docs/precision.md, "Special values").

The kind of each element is checked against `jnp.matmul` at HIGHEST with a
float32 (float64) accumulator on the same backend, cast to the output dtype;
the finite elements against a float64 product.
"""

from __future__ import annotations

import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from helpers import EPS, accumulation_rounding, input_rounding, kernels_on, x64
from jax_tiled._checks import canonical_precision
from jax_tiled._primitive import tiled_matmul

F32, BF16, F16, F64 = (np.dtype(t) for t in (np.float32, jnp.bfloat16, np.float16, np.float64))

# (input dtype, output dtype, precision): float32 at every precision the API
# takes, 16-bit inputs into themselves and into float32 (where float16's
# overflow is finite), float64.
CONFIGS = [(F32, F32, p) for p in (None, "default", "high", "highest")] + [
    (BF16, BF16, None),
    (BF16, F32, None),
    (F16, F16, None),
    (F16, F32, None),
    (F64, F64, None),
]
CONFIG_IDS = [f"{i.name}-{o.name}-{p}" for i, o, p in CONFIGS]

LAYOUTS = list(itertools.product((False, True), repeat=2))  # (transpose_a, transpose_b)

# (M, K, N): odd sizes that span several tiles of every kernel, and sizes
# whose rows the Hopper kernel's copy engine can read (multiples of 8); the
# last, 64 rows, it computes as C^T for 16-bit inputs, K split.
SHAPES = [(197, 263, 131), (200, 264, 136), (64, 264, 1032)]

# Magnitudes per input dtype: tiny is normal, sub is subnormal.
TINY = {F32: 1e-30, BF16: 1e-30, F16: 1e-3, F64: 1e-300}
SUB = {F32: 1e-40, BF16: 1e-40, F16: 1e-6, F64: 1e-310}


# The largest float32 that TF32 rounding leaves finite: (2 - 2^-10) * 2^127.
# At DEFAULT the `wgmma` kernel rounds both operands to TF32 (the copy engine
# one, its consumers' cvt the other), which takes the float32 values above it
# (within half a TF32 step of the limit) to inf (docs/precision.md, "Special values";
# test_default_rounds_the_top_of_float32_to_inf_on_wgmma).
TF32_MAX = float(np.uint32(0x7F7FE000).view(np.float32))


def largest_operand(platform, dtype, precision) -> float:
    """The largest finite operand every kernel keeps finite at `precision`."""
    if platform == "cuda" and np.dtype(dtype) == F32 and precision in (None, "default"):
        return TF32_MAX
    return float(jnp.finfo(dtype).max)


def special_operands(rng, m, k, n, dtype, fmax=None):
    """(a, b, subnormal_rows) with every case in its own rows, columns and k;
    `fmax`: the operands' largest finite value (default the dtype's)."""
    a = rng.standard_normal((m, k))
    b = rng.standard_normal((k, n))
    fmax = float(jnp.finfo(dtype).max) if fmax is None else fmax
    # Distinct contraction indices for the cases, spread over the K slabs.
    k_inf, k_ninf, k_nan, k_bnan, k_big, k_near, k_nearb, k_binf = (
        7,
        k - 2,
        k // 2,
        11,
        k - 5,
        k // 3,
        13,
        k // 4,
    )
    special_k = [k_inf, k_ninf, k_nan, k_bnan, k_big, k_near, k_nearb, k_binf]
    assert len(set(special_k)) == len(special_k)
    r_pinf, r_ninf, r_nan, r_big, r_near, r_tiny, r_sub = 3, m - 2, m // 2, 17, m - 9, 40, 60
    c_nan, c_near, c_binf = 5, n - 3, n // 2

    a[:, k_nearb] = 0.25  # meets b's largest finite value: finite
    b[k_near, :] = 0.25  # meets a's largest finite value: finite
    b[k_big, :] = 2.0  # meets big: the product overflows
    a[r_pinf, k_inf] = np.inf
    a[r_ninf, k_ninf] = -np.inf
    a[r_nan, k_nan] = np.nan
    b[k_bnan, c_nan] = np.nan
    b[k_binf, c_binf] = np.inf
    a[r_big, k_big] = fmax / 1.5  # times 2: past the largest finite value
    a[r_big, k_binf] = 1.0  # so its +inf is not also an inf - inf
    a[r_near, k_near] = fmax
    b[k_nearb, c_near] = fmax
    plain_k = [i for i in range(k) if i not in special_k]
    a[r_tiny, plain_k] = TINY[dtype] * rng.standard_normal(len(plain_k))
    a[r_sub, plain_k] = SUB[dtype] * rng.standard_normal(len(plain_k))
    return np.asarray(a, dtype), np.asarray(b, dtype), [r_sub]


def kinds(x) -> np.ndarray:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    x = np.asarray(x, np.float64)
    return np.select([np.isnan(x), np.isposinf(x), np.isneginf(x)], [1, 2, 3], 0)


def reference(a, b, out_dtype):
    """jnp.matmul in true arithmetic on the current backend, cast to out_dtype."""
    acc = F64 if F64 in (a.dtype, out_dtype) else F32
    ref = jnp.matmul(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=acc)
    return np.asarray(ref.astype(out_dtype))


def assert_special_values(out, a, b, *, platform, precision, out_dtype, subnormal_rows=()):
    """Kinds as `reference`; finite elements within the float64 bound of
    conftest.assert_matmul_close; subnormal rows within it or flushed to 0."""
    out = np.asarray(out)
    assert out.dtype == out_dtype and out.shape == (a.shape[0], b.shape[1])
    ref_kinds = kinds(reference(a, b, out_dtype))
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    # The test's own construction: true float32 arithmetic and a float64
    # product agree on every kind, so no case depends on summation order.
    with np.errstate(invalid="ignore", over="ignore"):
        np.testing.assert_array_equal(kinds(np.matmul(a64, b64).astype(out_dtype)), ref_kinds)
    got = kinds(out)
    wrong = got != ref_kinds
    assert not wrong.any(), (
        f"{wrong.sum()} of {wrong.size} elements of the wrong kind (0 finite, 1 NaN, 2 +inf, "
        f"3 -inf); first at {np.argwhere(wrong)[0]}: got {got[wrong][0]}, "
        f"want {ref_kinds[wrong][0]}"
    )

    finite = ref_kinds == 0
    a0, b0 = np.where(np.isfinite(a64), a64, 0), np.where(np.isfinite(b64), b64, 0)
    with np.errstate(over="ignore"):
        ref, mag = a0 @ b0, np.abs(a0) @ np.abs(b0)
    in_dtype = a.dtype
    bound = (a.shape[1] + 2) * accumulation_rounding(
        platform, in_dtype, out_dtype, precision
    ) + 2 * input_rounding(platform, in_dtype, precision)
    # Plus half the output's subnormal spacing, where rounding is absolute.
    tol = (
        bound * mag
        + EPS[np.dtype(out_dtype)] * np.abs(ref)
        + float(jnp.finfo(out_dtype).smallest_subnormal)
    )
    err = np.abs(np.where(finite, out.astype(np.float64), 0) - np.where(finite, ref, 0))
    ok = err <= tol
    ok[list(subnormal_rows)] |= out[list(subnormal_rows)] == 0
    bad = finite & ~ok
    assert not bad.any(), (
        f"{bad.sum()} finite elements off; worst at {np.argwhere(bad)[0]}: got "
        f"{out[tuple(np.argwhere(bad)[0])]}, want {ref[tuple(np.argwhere(bad)[0])]}"
    )


def stored(x, transposed):
    """The canonical (1, rows, cols) operand, stored transposed when asked."""
    return jnp.asarray(x.T if transposed else x)[None]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: f"tA{int(t[0])}tB{int(t[1])}")
@pytest.mark.parametrize("in_dtype,out_dtype,precision", CONFIGS, ids=CONFIG_IDS)
def test_every_kernel_gives_true_arithmetics_special_values(
    platform, rng, in_dtype, out_dtype, precision, layout, shape
):
    m, k, n = shape
    ta, tb = layout
    with x64() if F64 in (in_dtype, out_dtype) else contextlib.nullcontext():
        a, b, sub_rows = special_operands(
            rng, m, k, n, in_dtype, largest_operand(platform, in_dtype, precision)
        )
        problem = (1, 1, m, n, k, ta, tb)
        for kernel in kernels_on(
            platform, in_dtype, out_dtype, problem=problem, precision=precision
        ):
            if layout == (False, False):
                out = jax.jit(
                    lambda a, b: jax_tiled.matmul(
                        a, b, precision=precision, preferred_element_type=out_dtype, kernel=kernel
                    )
                )(a, b)
            else:
                out = jax.jit(
                    lambda a, b: tiled_matmul(
                        a,
                        b,
                        transpose_a=ta,
                        transpose_b=tb,
                        out_dtype=out_dtype,
                        precision=canonical_precision(precision),
                        kernel=kernel,
                    )[0]
                )(stored(a, ta), stored(b, tb))
            try:
                assert_special_values(
                    out,
                    a,
                    b,
                    platform=platform,
                    precision=precision,
                    out_dtype=out_dtype,
                    subnormal_rows=sub_rows,
                )
            except AssertionError as error:
                raise AssertionError(f"kernel {kernel!r}: {error}") from None


@pytest.mark.parametrize("in_dtype,out_dtype,precision", CONFIGS, ids=CONFIG_IDS)
def test_zero_size_k_gives_zeros(platform, in_dtype, out_dtype, precision):
    with x64() if F64 in (in_dtype, out_dtype) else contextlib.nullcontext():
        a, b = np.ones((37, 0), in_dtype), np.ones((0, 45), in_dtype)
        problem = (1, 1, 37, 45, 0, False, False)
        for kernel in kernels_on(
            platform, in_dtype, out_dtype, problem=problem, precision=precision
        ):
            out = jax_tiled.matmul(
                a, b, precision=precision, preferred_element_type=out_dtype, kernel=kernel
            )
            np.testing.assert_array_equal(np.asarray(out), np.zeros((37, 45), out_dtype))


@pytest.mark.parametrize("precision", [None, "high", "highest"])
def test_special_values_under_grad_jvp_and_vmap(platform, rng, precision):
    """The products of jvp, grad and vmap (transposed layouts, batches) keep the
    kinds that jnp.matmul's give."""
    m, k, n = SHAPES[1]
    a, b, _ = special_operands(rng, m, k, n, F32, largest_operand(platform, F32, precision))
    # Tangents and weights below 1/2: times the largest finite value they stay
    # clear of overflow, which TF32's rounding of a factor near 1 could decide.
    ta, tb, w = (rng.uniform(-0.5, 0.5, shape).astype(F32) for shape in (a.shape, b.shape, (m, n)))

    def run(mm):
        mm = jax.jit(mm)
        _, tangent = jax.jvp(mm, (a, b), (ta, tb))
        grads = jax.grad(lambda a, b: jnp.sum(mm(a, b) * w), (0, 1))(a, b)
        batched = jax.vmap(mm, in_axes=(0, None))(np.stack([a, a[::-1]]), b)
        return [np.asarray(x) for x in (tangent, *grads, batched)]

    ours = run(lambda a, b: jax_tiled.matmul(a, b, precision=precision))
    theirs = run(lambda a, b: jnp.matmul(a, b, precision=lax.Precision.HIGHEST))
    for name, x, y in zip(("jvp", "grad a", "grad b", "vmap"), ours, theirs):
        np.testing.assert_array_equal(kinds(x), kinds(y), err_msg=name)


@pytest.mark.gpu
def test_default_rounds_the_top_of_float32_to_inf_on_wgmma(rng, on_gpu):
    """The one documented corner (docs/precision.md, "Special values"): at DEFAULT
    `wgmma` rounds both operands to the nearest TF32, so a float32 within half
    a TF32 step of the limit reads as inf there, in a (row 5 of the result)
    and in b (column 9); every other kernel, and `wgmma` at HIGH, keeps it
    finite. `auto` does as the kernel it runs: K = 520 is past the small
    products it runs on `mma`."""
    m, k, n = 128, 520, 136
    fmax = float(jnp.finfo(F32).max)
    a = rng.uniform(0.5, 1.0, (m, k)).astype(F32)
    b = rng.uniform(0.5, 1.0, (k, n)).astype(F32) / k
    a[5, 7] = fmax
    b[7, :] = 0.25
    b[3, 9] = fmax
    a[:, 3] = 0.25
    assert a[5, 7] > TF32_MAX and b[3, 9] > TF32_MAX
    rounded_up = np.zeros((m, n), bool)
    rounded_up[5, :] = rounded_up[:, 9] = True
    for kernel in kernels_on(
        "cuda", F32, F32, problem=(1, 1, m, n, k, False, False), precision="default"
    ):
        out = np.asarray(jax_tiled.matmul(a, b, precision="default", kernel=kernel))
        runs = jax_tiled.explain(a, b, precision="default", kernel=kernel).kernel
        if runs == "wgmma":
            assert np.isposinf(out[rounded_up]).all() and np.isfinite(out[~rounded_up]).all()
        else:
            assert np.isfinite(out).all(), kernel
    out = np.asarray(jax_tiled.matmul(a, b, precision="high", kernel="wgmma"))
    assert np.isfinite(out).all()
