"""Promotion as jnp.matmul promotes: an integer or bool operand mixed with a
float takes the float's dtype; integers only are computed in a floating
preferred_element_type as jnp computes them, left to jnp where nothing is
contracted, and refused into an integer result (TypeError,
tests/test_errors.py); kernels() lists nothing for a dtype no kernel computes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from helpers import CPU_KERNELS, count_equations, random_array, x64

PAIRS = [
    (np.int32, np.float32),
    (np.float32, np.int32),
    (np.int8, jnp.bfloat16),
    (np.uint8, jnp.float16),
    (np.bool_, np.float32),
    (jnp.bfloat16, np.int16),
    (np.int32, jnp.float16),
]


def small_integers(rng, shape, dtype):
    x = random_array(rng, shape, np.float64, integers=True)
    if np.dtype(dtype) == np.bool_:
        return x > 0
    if np.issubdtype(dtype, np.unsignedinteger):
        x = np.abs(x)
    return x.astype(dtype)


@pytest.mark.parametrize("a_dtype,b_dtype", PAIRS, ids=str)
@pytest.mark.parametrize(
    "a_shape,b_shape", [((5, 7), (7, 3)), ((2, 5, 7), (7,)), ((7,), (7, 3))], ids=str
)
def test_matmul_promotes_as_jnp(platform, rng, a_dtype, b_dtype, a_shape, b_shape):
    a = small_integers(rng, a_shape, a_dtype)
    b = small_integers(rng, b_shape, b_dtype)
    want = jnp.matmul(a, b)
    for f in (jax_tiled.matmul, jax.jit(jax_tiled.matmul)):
        out = f(a, b)
        assert out.dtype == want.dtype and out.shape == want.shape
        # Small integers: every product and sum is exact in every float type here.
        np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(want, np.float64))


def test_promotion_reaches_the_kernel_and_gradient(rng):
    a = small_integers(rng, (4, 6), np.int8)
    w = random_array(rng, (6, 3), jnp.bfloat16)
    text = str(jax.make_jaxpr(jax_tiled.matmul)(a, w))
    assert "tiled_matmul[" in text and "dot_general[" not in text
    g = jax.grad(lambda w: jax_tiled.matmul(a, w).astype(np.float32).sum())(w)
    want = jax.grad(lambda w: jnp.matmul(a, w).astype(np.float32).sum())(w)
    assert g.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g, np.float64), np.asarray(want, np.float64))


def test_int64_with_float32_under_x64(rng):
    with x64():
        a = small_integers(rng, (3, 4), np.int64)
        b = random_array(rng, (4, 2), np.float32)
        with jax.default_matmul_precision("highest"):  # true fp32 on GPUs too
            out, want = jax_tiled.matmul(a, b), jnp.matmul(a, b)
        assert out.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6)


def test_preferred_element_type_with_integer_operand(rng):
    a = small_integers(rng, (4, 6), np.int32)
    b = random_array(rng, (6, 3), jnp.bfloat16)
    out = jax_tiled.matmul(a, b, preferred_element_type=jnp.float32)
    want = jnp.matmul(a, b, preferred_element_type=jnp.float32)
    assert out.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(out, want, rtol=1e-6)


INTEGERS = [np.int8, np.uint8, np.int16, np.int32, np.bool_]


# (operands, result): integer operands into a float result no narrower, as jnp takes them.
INTEGERS_INTO_FLOATS = [
    (dtype, out)
    for dtype in INTEGERS
    for out in (np.float32, jnp.bfloat16, jnp.float16)
    if np.dtype(out).itemsize >= np.dtype(dtype).itemsize
]


@pytest.mark.parametrize(
    "dtype,out",
    INTEGERS_INTO_FLOATS,
    ids=[f"{np.dtype(d).name}-{np.dtype(o).name}" for d, o in INTEGERS_INTO_FLOATS],
)
def test_integer_operands_into_a_float_result_as_jnp(platform, rng, dtype, out):
    """jnp converts both operands to the float result's type and multiplies
    there: small integers give exact results, ours as jnp's.

    The reference runs on the CPU: on a GPU, XLA hands integer operands with a
    16-bit float result to cuBLASLt, which refuses them."""
    a = small_integers(rng, (2, 5, 7), dtype)
    b = small_integers(rng, (7, 3), dtype)
    dims = (((2,), (0,)), ((), ()))
    with jax.default_device(jax.devices("cpu")[0]):
        cases = [
            (
                lambda a, b: jax_tiled.matmul(a, b, preferred_element_type=out),
                np.asarray(jnp.matmul(a, b, preferred_element_type=out)),
            ),
            (
                lambda a, b: jax_tiled.dot_general(a, b, dims, preferred_element_type=out),
                np.asarray(lax.dot_general(a, b, dims, preferred_element_type=out)),
            ),
        ]
    for ours, want in cases:
        jaxpr = jax.make_jaxpr(ours)(a, b)
        assert count_equations(jaxpr, "tiled_matmul") == 1, jaxpr
        assert count_equations(jaxpr, "dot_general") == 0, jaxpr
        got = jax.jit(ours)(a, b)
        assert got.dtype == want.dtype == np.dtype(out)
        np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))


@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float16], ids=lambda d: np.dtype(d).name)
def test_a_float_result_narrower_than_integer_operands_is_refused_as_jnp(out):
    a = jnp.ones((3, 4), jnp.int32)
    with pytest.raises(TypeError, match="narrower"):
        jnp.matmul(a, a.T, preferred_element_type=out)
    with pytest.raises(TypeError, match=rf"{np.dtype(out).name} is narrower.*int32"):
        jax_tiled.matmul(a, a.T, preferred_element_type=out)


def test_int8_over_their_whole_range_into_float32_exactly(rng):
    """Every int8 product, and every sum of 64 of them, is exact in float32."""
    a = rng.integers(-128, 128, (16, 64)).astype(np.int8)
    b = rng.integers(-128, 128, (64, 8)).astype(np.int8)
    got = jax_tiled.matmul(a, b, preferred_element_type=jnp.float32)
    want = jnp.matmul(a, b, preferred_element_type=jnp.float32)
    exact = a.astype(np.int64) @ b.astype(np.int64)
    np.testing.assert_array_equal(np.asarray(got), exact)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
    "spec", ["ij,ij->ij", "i,j->ij", "bij,bj->bij"], ids=lambda s: s.replace(",", " ")
)
def test_integer_products_without_a_contraction_are_left_to_jnp(rng, spec):
    """Nothing contracted: an elementwise (or outer) product, which jnp
    computes in integer arithmetic: exact, wrapping around where a float
    would round."""
    shapes = {"ij": (3, 4), "i": (3,), "j": (4,), "bij": (2, 3, 4), "bj": (2, 4)}
    lhs, rest = spec.split(",")
    rhs = rest.split("->")[0]
    # Large enough that products need more than a float32's 24 bits.
    a = rng.integers(2**12, 2**15, shapes[lhs]).astype(np.int32)
    b = rng.integers(2**12, 2**15, shapes[rhs]).astype(np.int32)
    want = jnp.einsum(spec, a, b)
    got = jax_tiled.einsum(spec, a, b)
    assert got.dtype == want.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    jaxpr = jax.make_jaxpr(lambda a, b: jax_tiled.einsum(spec, a, b))(a, b)
    assert count_equations(jaxpr, "tiled_matmul") == 0, jaxpr


@pytest.mark.parametrize(
    "dtype",
    [jnp.int8, jnp.int32, jnp.uint8, jnp.bool_, jnp.complex64, jnp.float8_e4m3fn],
    ids=lambda d: np.dtype(d).name,
)
def test_kernels_lists_nothing_for_a_dtype_no_kernel_computes(dtype):
    assert jax_tiled.kernels("cpu", dtype) == []
    assert jax_tiled.kernels("cpu", jnp.float32, out_dtype=dtype) == []
    assert jax_tiled.kernels("gpu", dtype) == []


def test_kernels_lists_the_computed_dtypes():
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64):
        assert jax_tiled.kernels("cpu", dtype) == list(CPU_KERNELS)
