"""Values: jax_tiled.matmul against float64 NumPy and jnp.matmul(HIGHEST), for
every kernel on every platform, over jnp.matmul's shape cases, tile edges,
zero sizes, every dtype, promotion and preferred_element_type."""

from __future__ import annotations

import concurrent.futures
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from conftest import assert_matmul_close, kernels_on, matmul_problem, random_array, x64

# jnp.matmul's own cases: vectors, matrices, broadcast batches.
SHAPE_CASES = [
    ((3,), (3,)),
    ((2, 3), (3,)),
    ((3,), (3, 4)),
    ((3,), (2, 3, 4)),
    ((2, 3, 4), (4,)),
    ((5, 3), (3, 7)),
    ((2, 5, 3), (3, 7)),
    ((5, 3), (2, 3, 7)),
    ((2, 5, 3), (2, 3, 7)),
    ((1, 5, 3), (4, 3, 7)),
    ((3, 1, 3, 4), (5, 4, 1)),
    ((2, 1, 5, 3), (1, 4, 3, 6)),
    ((4, 2, 5, 3), (2, 3, 6)),
    ((2, 5, 3), (4, 2, 3, 6)),
]


@pytest.mark.parametrize("a_shape,b_shape", SHAPE_CASES, ids=str)
def test_shape_cases(platform, rng, a_shape, b_shape):
    a = random_array(rng, a_shape, np.float32)
    b = random_array(rng, b_shape, np.float32)
    ref = jnp.matmul(a, b, precision=lax.Precision.HIGHEST)
    for kernel in kernels_on(platform, precision="highest"):
        out = jax_tiled.matmul(a, b, kernel=kernel, precision="highest")
        assert out.shape == ref.shape
        assert_matmul_close(out, a, b, platform=platform, precision="highest")
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


def _edge_sizes(tile: int) -> list[int]:
    return [1, tile - 1, tile, tile + 1, 2 * tile + 1]


# Tile sizes of the rungs: the CPU kernel's register (12 x 32) and cache (up
# to 384 x 256, 256 deep) blocks; CUDA: smem's 16 and 32, regblock's 64,
# warptile's 64 and 128 blocks and 8-deep slabs.
EDGE_SIZES = sorted(set(_edge_sizes(16) + _edge_sizes(32) + _edge_sizes(64) + _edge_sizes(128)
                        + [255, 256, 257, 383, 384, 385, 509, 510, 511]))


@pytest.mark.parametrize("dim", ["m", "k", "n"])
def test_tile_edges_each_dimension(platform, rng, dim):
    for size in EDGE_SIZES:
        dims = {"m": 37, "k": 61, "n": 45, dim: size}
        a = random_array(rng, (dims["m"], dims["k"]), np.float32)
        b = random_array(rng, (dims["k"], dims["n"]), np.float32)
        for kernel in kernels_on(platform, precision="highest"):
            out = jax_tiled.matmul(a, b, kernel=kernel, precision="highest")
            assert_matmul_close(out, a, b, platform=platform, precision="highest")


def test_tile_edges_cube(platform, rng):
    for m, k, n in itertools.product([1, 33, 97, 511], repeat=3):
        a = random_array(rng, (m, k), np.float32)
        b = random_array(rng, (k, n), np.float32)
        for kernel in kernels_on(platform, precision="highest"):
            out = jax_tiled.matmul(a, b, kernel=kernel, precision="highest")
            assert_matmul_close(out, a, b, platform=platform, precision="highest")


@pytest.mark.parametrize("a_shape,b_shape", [
    ((0, 5), (5, 7)), ((5, 0), (0, 7)), ((5, 7), (7, 0)), ((0, 0), (0, 0)),
    ((0, 3, 4), (4, 5)), ((2, 3, 0), (2, 0, 5)), ((2, 0, 4), (1, 4, 5)), ((0,), (0,)),
    ((3, 0), (0,)),
], ids=str)
def test_zero_sizes(platform, rng, a_shape, b_shape):
    a = random_array(rng, a_shape, np.float32)
    b = random_array(rng, b_shape, np.float32)
    ref = np.matmul(a, b)
    for kernel in kernels_on(platform, problem=matmul_problem(a, b)):
        out = jax_tiled.matmul(a, b, kernel=kernel)
        assert out.shape == ref.shape and out.dtype == np.float32
        np.testing.assert_array_equal(out, ref)  # empty, or exact zeros when K == 0


DTYPES = [jnp.float16, jnp.bfloat16, np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("transpose", ["", "a", "b", "ab"])
def test_dtypes_and_transposes(platform, rng, dtype, transpose):
    """Every dtype; transposed operands as the VJP produces them (via the primitive)."""
    m, k, n = 67, 129, 35
    with x64():
        a = random_array(rng, (2, k, m) if "a" in transpose else (2, m, k), dtype)
        b = random_array(rng, (2, n, k) if "b" in transpose else (2, k, n), dtype)
        a_op = np.swapaxes(a, 1, 2) if "a" in transpose else a
        b_op = np.swapaxes(b, 1, 2) if "b" in transpose else b
        problem = (2, 2, m, n, k, "a" in transpose, "b" in transpose)
        for kernel in kernels_on(platform, dtype, problem=problem, precision="highest"):
            out = jax_tiled.tiled_matmul_p.bind(
                jnp.asarray(a), jnp.asarray(b), transpose_a="a" in transpose,
                transpose_b="b" in transpose, out_dtype=np.dtype(dtype),
                precision=lax.Precision.HIGHEST, kernel=kernel)
            assert_matmul_close(out, a_op, b_op, platform=platform, precision="highest")


@pytest.mark.parametrize("a_dtype,b_dtype", [
    (jnp.float16, jnp.bfloat16), (jnp.bfloat16, np.float32), (jnp.float16, np.float32),
    (np.float32, np.float64), (jnp.bfloat16, np.float64)], ids=str)
def test_mixed_dtype_promotion(platform, rng, a_dtype, b_dtype):
    with x64():
        a = random_array(rng, (9, 33), a_dtype)
        b = random_array(rng, (33, 17), b_dtype)
        expected = jnp.matmul(a, b).dtype
        out = jax_tiled.matmul(a, b, precision="highest")
        assert out.dtype == expected
        assert_matmul_close(out, a, b, platform=platform, precision="highest")


@pytest.mark.parametrize("in_dtype,out_dtype", [
    (jnp.bfloat16, np.float32), (jnp.float16, np.float32), (np.float32, jnp.bfloat16),
    (np.float32, np.float64), (np.float64, np.float32), (jnp.bfloat16, jnp.float16)], ids=str)
def test_preferred_element_type(platform, rng, in_dtype, out_dtype):
    with x64():
        a = random_array(rng, (3, 21, 130), in_dtype)
        b = random_array(rng, (130, 19), in_dtype)
        for kernel in kernels_on(platform, in_dtype, out_dtype, precision="highest",
                                 problem=(1, 1, 3 * 21, 19, 130, False, False)):
            out = jax_tiled.matmul(a, b, preferred_element_type=out_dtype, kernel=kernel,
                                   precision="highest")
            assert_matmul_close(out, a, b, platform=platform, precision="highest",
                                out_dtype=out_dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("k", [1, 7, 64, 255, 512])
def test_bit_exact_on_small_integers(platform, rng, dtype, k):
    """Integer values in [-8, 8] with K <= 512: every partial sum is exact in float32."""
    with x64():
        a = random_array(rng, (2, 45, k), dtype, integers=True)
        b = random_array(rng, (2, k, 77), dtype, integers=True)
        ref = np.matmul(a.astype(np.float64), b.astype(np.float64))
        assert np.abs(ref).max() > 0
        out_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        for precision in ("default", "high", "highest"):
            for kernel in kernels_on(platform, dtype, out_dtype, precision=precision,
                                     problem=(2, 2, 45, 77, k, False, False)):
                out = jax_tiled.matmul(a, b, preferred_element_type=out_dtype, kernel=kernel,
                                       precision=precision)
                np.testing.assert_array_equal(np.asarray(out, np.float64), ref)


def test_repeated_runs_bitwise_identical(platform, rng):
    a = random_array(rng, (300, 700), np.float32)
    b = random_array(rng, (700, 500), np.float32)
    for kernel in kernels_on(platform, problem=matmul_problem(a, b)):
        f = jax.jit(lambda a, b: jax_tiled.matmul(a, b, kernel=kernel))
        first = np.asarray(f(a, b))
        for _ in range(9):
            np.testing.assert_array_equal(np.asarray(f(a, b)), first)


def test_concurrent_calls_from_threads(platform, rng):
    inputs = [(random_array(rng, (130 + i, 257), np.float32), random_array(rng, (257, 190), np.float32))
              for i in range(8)]
    f = jax.jit(lambda a, b: jax_tiled.matmul(a, b, precision="highest"))
    device = jax.devices(platform)[0]

    def run(ab):
        with jax.default_device(device):
            return np.asarray(f(*ab))

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        outs = list(pool.map(run, inputs * 3))
    for (a, b), out in zip(inputs * 3, outs):
        assert_matmul_close(out, a, b, platform=platform, precision="highest")


def test_kernels_lists_cpu_rungs():
    assert jax_tiled.kernels("cpu") == ["blocked"]


def _precision_of(fn, *args):
    (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive is jax_tiled.tiled_matmul_p]
    return eqn.params["precision"]


def test_precision_setting_is_honoured(rng):
    a = random_array(rng, (4, 8), np.float32)
    b = random_array(rng, (8, 3), np.float32)
    assert _precision_of(jax_tiled.matmul, a, b) == lax.Precision.DEFAULT
    with jax.default_matmul_precision("float32"):
        assert _precision_of(jax_tiled.matmul, a, b) == lax.Precision.HIGHEST
    with jax.default_matmul_precision("tensorfloat32"):
        assert _precision_of(jax_tiled.matmul, a, b) == lax.Precision.HIGH
    pair = lambda a, b: jax_tiled.matmul(a, b, precision=("default", "high"))
    assert _precision_of(pair, a, b) == lax.Precision.HIGH
    explicit = lambda a, b: jax_tiled.matmul(a, b, precision=lax.Precision.HIGHEST)
    assert _precision_of(explicit, a, b) == lax.Precision.HIGHEST
