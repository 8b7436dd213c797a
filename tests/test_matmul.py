"""Values: jax_tiled.matmul against float64 NumPy and jnp.matmul(HIGHEST), for
every kernel on every platform, over jnp.matmul's shape cases, tile edges,
zero sizes, batches, every dtype, promotion and preferred_element_type, and
operands past 2**31 elements; results are deterministic and thread-safe.
(What each float32 precision computes is test_precision.py's.)"""

from __future__ import annotations

import concurrent.futures
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from helpers import (
    F32,
    LAYOUTS,
    assert_matmul_close,
    bind_product,
    kernels_on,
    matmul_problem,
    operands,
    random_array,
    tensor_kernels_on,
    x64,
)
from jax_tiled import _ffi

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
    # ... and batches of a few tiles.
    ((4, 65, 33), (33, 17)),
    ((2, 1, 40, 24), (3, 24, 36)),
    ((65, 33), (2, 33, 17)),
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
    for precision in ("default", "high"):  # on CUDA, "auto" runs these on the tensor cores
        out = jax_tiled.matmul(a, b, precision=precision)
        assert_matmul_close(out, a, b, platform=platform, precision=precision)


def _edge_sizes(tile: int) -> list[int]:
    return [1, tile - 1, tile, tile + 1, 2 * tile + 1]


# Tile sizes of the kernels: the CPU kernel's register (12 x 32) and cache (up
# to 384 x 256, 256 deep) blocks; CUDA: smem's 16 and 32, regblock's 64,
# warptile's 64 and 128 blocks and 8-deep slabs.
EDGE_SIZES = sorted(
    set(
        _edge_sizes(16)
        + _edge_sizes(32)
        + _edge_sizes(64)
        + _edge_sizes(128)
        + [255, 256, 257, 383, 384, 385, 509, 510, 511]
    )
)


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


# (m, k, n) off the tensor-core kernels' tiles (mma 128 x 128 x 32 and 64 x 64;
# wgmma 128 x 256 or 128 x 128, 64 deep), K = 1, and single rows and columns.
TENSOR_CORE_EDGE_SHAPES = [
    (1, 1, 1),
    (1, 7, 65),
    (7, 1, 129),
    (65, 129, 1),
    (129, 257, 7),
    (257, 65, 129),
    (65, 1, 65),
    (1, 257, 1),
    (129, 7, 257),
    (257, 257, 257),
    (64, 1, 64),
    (128, 8, 256),
    (68, 132, 260),
]


@pytest.mark.parametrize("precision", ["default", "high"])
def test_tile_edges_at_tensor_core_precisions(platform, rng, precision):
    """float32 at DEFAULT and HIGH, where CUDA runs it on the tensor cores too."""
    for m, k, n in TENSOR_CORE_EDGE_SHAPES:
        a = random_array(rng, (m, k), F32)
        b = random_array(rng, (k, n), F32)
        for kernel in kernels_on(platform, problem=matmul_problem(a, b), precision=precision):
            out = jax_tiled.matmul(a, b, precision=precision, kernel=kernel)
            assert_matmul_close(out, a, b, platform=platform, precision=precision)


@pytest.mark.parametrize(
    "a_shape,b_shape",
    [
        ((0, 5), (5, 7)),
        ((5, 0), (0, 7)),
        ((5, 7), (7, 0)),
        ((0, 0), (0, 0)),
        ((0, 3, 4), (4, 5)),
        ((2, 3, 0), (2, 0, 5)),
        ((2, 0, 4), (1, 4, 5)),
        ((0,), (0,)),
        ((3, 0), (0,)),
    ],
    ids=str,
)
def test_zero_sizes(platform, rng, a_shape, b_shape):
    a = random_array(rng, a_shape, np.float32)
    b = random_array(rng, b_shape, np.float32)
    ref = np.matmul(a, b)
    for precision in ("default", "high"):
        for kernel in kernels_on(platform, problem=matmul_problem(a, b), precision=precision):
            out = jax_tiled.matmul(a, b, precision=precision, kernel=kernel)
            assert out.shape == ref.shape and out.dtype == np.float32
            np.testing.assert_array_equal(out, ref)  # empty, or exact zeros when K == 0


@pytest.mark.parametrize("batch_a,batch_b", [(3, 3), (1, 3), (3, 1)], ids=str)
@pytest.mark.parametrize("shape", [(72, 136, 200), (33, 65, 17)], ids=str)
def test_batches_and_broadcast_batches(platform, rng, batch_a, batch_b, shape):
    """The primitive's batch, full or broadcast (a zero batch stride) on either
    operand, in every layout, on the tensor-core kernels' inputs: bfloat16 and
    float32 at DEFAULT and HIGH (on CPU, the CPU kernel)."""
    m, n, k = shape
    for ta, tb in LAYOUTS:
        for dtype, precision in [
            (F32, lax.Precision.DEFAULT),
            (F32, lax.Precision.HIGH),
            (jnp.bfloat16, lax.Precision.DEFAULT),
        ]:
            a, b, a_op, b_op = operands(rng, m, n, k, ta, tb, dtype, batch_a, batch_b)
            problem = (batch_a, batch_b, m, n, k, ta, tb)
            for kernel in tensor_kernels_on(platform, problem, precision, dtype):
                out = bind_product(a, b, ta, tb, precision=precision, kernel=kernel)
                assert out.shape == (3, m, n)
                assert_matmul_close(
                    out,
                    np.broadcast_to(a_op, (3, m, k)),
                    np.broadcast_to(b_op, (3, k, n)),
                    platform=platform,
                    precision=precision,
                )


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
            out = bind_product(
                a,
                b,
                "a" in transpose,
                "b" in transpose,
                precision=lax.Precision.HIGHEST,
                kernel=kernel,
            )
            assert_matmul_close(out, a_op, b_op, platform=platform, precision="highest")


@pytest.mark.parametrize(
    "a_dtype,b_dtype",
    [
        (jnp.float16, jnp.bfloat16),
        (jnp.bfloat16, np.float32),
        (jnp.float16, np.float32),
        (np.float32, np.float64),
        (jnp.bfloat16, np.float64),
    ],
    ids=str,
)
def test_mixed_dtype_promotion(platform, rng, a_dtype, b_dtype):
    with x64():
        a = random_array(rng, (9, 33), a_dtype)
        b = random_array(rng, (33, 17), b_dtype)
        expected = jnp.matmul(a, b).dtype
        out = jax_tiled.matmul(a, b, precision="highest")
        assert out.dtype == expected
        assert_matmul_close(out, a, b, platform=platform, precision="highest")


@pytest.mark.parametrize(
    "in_dtype,out_dtype",
    [
        (jnp.bfloat16, np.float32),
        (jnp.float16, np.float32),
        (np.float32, jnp.bfloat16),
        (np.float32, np.float64),
        (np.float64, np.float32),
        (jnp.bfloat16, jnp.float16),
    ],
    ids=str,
)
def test_preferred_element_type(platform, rng, in_dtype, out_dtype):
    with x64():
        a = random_array(rng, (3, 21, 130), in_dtype)
        b = random_array(rng, (130, 19), in_dtype)
        for kernel in kernels_on(
            platform,
            in_dtype,
            out_dtype,
            precision="highest",
            problem=(1, 1, 3 * 21, 19, 130, False, False),
        ):
            out = jax_tiled.matmul(
                a, b, preferred_element_type=out_dtype, kernel=kernel, precision="highest"
            )
            assert_matmul_close(
                out, a, b, platform=platform, precision="highest", out_dtype=out_dtype
            )


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
            for kernel in kernels_on(
                platform,
                dtype,
                out_dtype,
                precision=precision,
                problem=(2, 2, 45, 77, k, False, False),
            ):
                out = jax_tiled.matmul(
                    a, b, preferred_element_type=out_dtype, kernel=kernel, precision=precision
                )
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
    inputs = [
        (random_array(rng, (130 + i, 257), np.float32), random_array(rng, (257, 190), np.float32))
        for i in range(8)
    ]
    f = jax.jit(lambda a, b: jax_tiled.matmul(a, b, precision="highest"))
    device = jax.devices(platform)[0]

    def run(ab):
        with jax.default_device(device):
            return np.asarray(f(*ab))

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        outs = list(pool.map(run, inputs * 3))
    for (a, b), out in zip(inputs * 3, outs):
        assert_matmul_close(out, a, b, platform=platform, precision="highest")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: np.dtype(d).name)
def test_operand_over_2_31_elements(dtype):
    """(2**21 + 1) x 1024 @ 1024 x 64: a has 2**31 + 1024 elements, so any
    32-bit index arithmetic would wrap. Spot-check first and last rows."""
    m, k, n = 2**21 + 1, 1024, 64
    key_a, key_b = jax.random.split(jax.random.key(0))
    with jax.default_device(jax.devices("cuda")[0]):
        a = jax.random.normal(key_a, (m, k), dtype)
        b = jax.random.normal(key_b, (k, n), dtype)
        true_fp32 = jax_tiled.kernels("gpu", dtype, jnp.float32, precision="highest")
        for kernel in jax_tiled.kernels("gpu", dtype, jnp.float32):
            # Each kernel at the precision it computes: float32 on the tensor-core
            # kernels is TF32 (DEFAULT), on the others true fp32 (HIGHEST).
            precision = "highest" if kernel in true_fp32 else "default"
            out = jax.jit(
                lambda a, b: jax_tiled.matmul(
                    a, b, preferred_element_type=jnp.float32, precision=precision, kernel=kernel
                )
            )(a, b)
            rows = np.r_[0:4, m // 2, m - 4 : m]
            assert_matmul_close(
                out[rows], a[rows], b, platform="cuda", precision=precision, out_dtype=np.float32
            )
            del out


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype", [jnp.bfloat16, np.float32, np.float64], ids=lambda d: np.dtype(d).name
)
def test_the_first_rungs_sum_in_one_order(on_gpu, rng, dtype):
    """naive, smem at each width it chooses at run time, and smem16 add each
    output's products in one order (K ascending, a fresh partial sum every 128),
    so their results are bitwise equal: smem's run-time width computes what the
    compile-time one does."""
    shapes = [(4096, 300, 64), (256, 300, 256), (64, 129, 64), (33, 517, 65)]
    widths = set()
    with x64():
        for m, k, n in shapes:
            problem = (1, 1, m, n, k, False, False)
            widths.add(_ffi.cuda_plan("smem", dtype, dtype, problem, "highest").block_m)
            a = random_array(rng, (m, k), dtype)
            b = random_array(rng, (k, n), dtype)
            naive, smem, smem16 = (
                np.asarray(jax_tiled.matmul(a, b, precision="highest", kernel=kernel))
                for kernel in ("naive", "smem", "smem16")
            )
            np.testing.assert_array_equal(smem, naive)
            np.testing.assert_array_equal(smem16, naive)
    assert widths == {32, 16, 8}, widths
