"""`mma`'s 32 x 32 blocks: where even its 32 x 32 tiles take at most half the
SMs, a product runs on them rather than on 64 x 64 ones, which would leave
all but a few SMs idle while each runs its whole K (cpp/cuda/kernels/
5_mma_sync_pipelined.cuh, MmaUsesTinyBlocks). The planner's rule is checked
without a GPU; on one: every layout against float64 off the tile and slab
edges, batched, in each input type and at HIGH (3xTF32); operands read in
place from a stack; special values; bitwise the same run to run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tiled
from helpers import (
    LAYOUTS,
    assert_matmul_close,
    assert_same_bits_run_to_run,
    assert_special_values_across_k,
    bind_product,
    needs_cuda_module,
    operands,
)
from jax_tiled import _ffi

# float32 runs as one TF32 pass at DEFAULT and as 3xTF32 at HIGH.
PRODUCTS = [(jnp.bfloat16, "default"), (jnp.float16, "default")]
PRODUCTS += [(np.float32, "default"), (np.float32, "high")]
PRODUCT_IDS = [f"{np.dtype(d).name}-{p}" for d, p in PRODUCTS]
SMS = 132  # an H100's, as explain assumes them without a GPU
# (batch, m, n, k) on tiny blocks on 132 SMs: rows, columns and K off the
# tile (32) and slab (32 16-bit, 16 float32 elements) edges, one row, a batch.
SHAPES = [
    (1, 128, 128, 128),
    (1, 33, 200, 72),
    (1, 1, 64, 1000),
    (3, 40, 72, 33),
    (1, 256, 256, 256),
]


def plan(dtype, shape, precision="default", multiprocessors=SMS):
    batch, m, n, k = shape
    problem = (batch, batch, m, n, k, False, False)
    return _ffi.cuda_plan("mma", dtype, dtype, problem, precision, multiprocessors=multiprocessors)


def tiles(shape, edge):
    batch, m, n, _ = shape
    return batch * -(-m // edge) * -(-n // edge)


@needs_cuda_module
@pytest.mark.parametrize("dtype,precision", PRODUCTS, ids=PRODUCT_IDS)
def test_tiny_blocks_where_their_tiles_take_at_most_half_the_sms(dtype, precision):
    for shape in SHAPES + [(1, 288, 288, 64), (1, 512, 512, 512), (8, 64, 64, 64)]:
        found = plan(dtype, shape, precision)
        tiny = 2 * tiles(shape, 32) <= SMS
        assert (found.block_m, found.block_n) == ((32, 32) if tiny else (64, 64)), (shape, found)
        assert found.text.startswith(f"{found.block_m} x {found.block_n} tiles"), found
    for shape in SHAPES:
        assert plan(dtype, shape, precision).block_m == 32, shape
    # On a GPU of fewer SMs the same product takes the 64 x 64 blocks.
    assert plan(dtype, SHAPES[-1], precision, multiprocessors=100).block_m == 64


@needs_cuda_module
def test_auto_runs_the_same_products_on_mma_as_before():
    """auto's test for a small product reads the plan's tiles; on tiny blocks
    it says what it said of the 64 x 64 ones (the same kernel for every
    product), and explain names the tiny tiles."""
    if _ffi.cuda_compute_capability() != _ffi.HOPPER:
        pytest.skip("auto's small-product path is the Hopper GPU's")
    S = jax.ShapeDtypeStruct
    for m, k, n in [(128, 128, 128), (256, 256, 256), (288, 64, 288), (512, 512, 512)]:
        found = jax_tiled.explain(S((m, k), jnp.bfloat16), S((k, n), jnp.bfloat16), backend="gpu")
        assert found.kernel == "mma", found
        edge = 32 if 2 * tiles((1, m, n, k), 32) <= SMS else 64
        assert found.plan.startswith(f"{edge} x {edge} tiles"), found


@pytest.mark.gpu
@pytest.mark.usefixtures("on_gpu")
@pytest.mark.parametrize("dtype,precision", PRODUCTS, ids=PRODUCT_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_layout_against_float64(rng, dtype, precision, shape):
    assert plan(dtype, shape, precision, _ffi.cuda_multiprocessors()).block_m == 32
    batch, m, n, k = shape
    for ta, tb in LAYOUTS:
        a, b, a_op, b_op = operands(rng, m, n, k, ta, tb, dtype, batch, batch)
        for out_dtype in {np.dtype(dtype), np.dtype(np.float32)}:
            out = bind_product(a, b, ta, tb, precision=precision, kernel="mma", out_dtype=out_dtype)
            assert_matmul_close(
                out, a_op, b_op, platform="cuda", precision=precision, out_dtype=out_dtype
            )


@pytest.mark.gpu
@pytest.mark.usefixtures("on_gpu")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
def test_slices_of_a_stack_read_in_place(rng, dtype):
    """x @ ws[j], the stack read in place: bitwise the product of the slice."""
    m, k, n, stack = 96, 200, 80, 3
    assert plan(dtype, (1, m, n, k), multiprocessors=_ffi.cuda_multiprocessors()).block_m == 32
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    ws = jnp.asarray(rng.standard_normal((stack, k, n)), dtype)
    f = jax.jit(lambda x, ws: [jax_tiled.matmul(x, ws[j], kernel="mma") for j in range(stack)])
    for j, got in enumerate(f(x, ws)):
        want = jax_tiled.matmul(x, jnp.array(np.asarray(ws)[j]), kernel="mma")
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert_matmul_close(got, np.asarray(x), np.asarray(ws)[j], platform="cuda")


@pytest.mark.gpu
@pytest.mark.usefixtures("on_gpu")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
def test_special_values_reach_the_result(rng, dtype):
    """inf at the end of row 0's K, NaN at the start of row 1's, inf - inf
    across row 2's: carried as true arithmetic does; the other rows close."""
    assert_special_values_across_k(
        rng, 128, 128, 256, kernel="mma", dtype=dtype, precision=None, out_dtype=np.float32
    )


@pytest.mark.gpu
@pytest.mark.usefixtures("on_gpu")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
def test_bitwise_the_same_run_to_run(rng, dtype):
    assert (
        plan(dtype, (1, 200, 136, 328), multiprocessors=_ffi.cuda_multiprocessors()).block_m == 32
    )
    a, b, _, _ = operands(rng, 200, 136, 328, False, False, dtype)
    product = jax.jit(lambda a, b: jax_tiled.matmul(a, b, kernel="mma"))
    assert_same_bits_run_to_run(product, a, b)
