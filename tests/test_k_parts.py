"""K in parts on the SIMT kernels: where even their 64 x 64 blocks would
leave SMs idle and K is long, each tile's K is cut into parts, a block each,
whose sums a second kernel adds in part order from XLA's scratch memory
(cpp/cuda/blocks/k_parts.cuh). The plans (no GPU needed: the CUDA module
plans for an H100 without one); on a GPU, the products against float64 on
every layout, off the tile and slab edges and with a short last part,
batched, in every input and output type the kernel takes that accumulates in
float32; bitwise the same run to run; special values in one part reach the
result; and over a long K on positive inputs, no less accurate than jnp at
HIGHEST, the sum that jnp splits too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from helpers import (
    CUDA_TABLE,
    LAYOUTS,
    assert_matmul_close,
    assert_same_bits_run_to_run,
    assert_special_values_across_k,
    bind_product,
    errors_beside_jnp,
    highest_plan,
    needs_cuda_module,
    operands,
)
from jax_tiled import _ffi

HIGHEST = lax.Precision.HIGHEST

# (batch, m, n, k): a few 64 x 64 tiles over a long K. On an H100 (132 SMs):
# 2 tiles in 16 parts of 264 (the last 140: not whole slabs); 18 tiles (a
# batch of 3, m and n off the tile edge) in 8 parts of 376; 12 tiles in 32
# parts of 1256; 2 tiles in 250 parts of 280, whose sums AddKParts adds as
# a tree of eights three levels deep (3 sums of 64 parts, 7 of 8, 2 parts).
# (warptile's float32 mainloop, whose model of the waves may take 128 x 128
# blocks, runs none of them as laid here: too few tiles of it for the first
# and last, rows off 16-byte lines for the others; test_warptile_float32.py
# tests that.)
SHAPES = [(1, 72, 40, 4100), (3, 65, 130, 3000), (1, 200, 138, 40000), (1, 72, 40, 70000)]
WHOLE_K = (1, 72, 40, 300)  # K too short to cut: two parts would be under 256 deep


def splitting_kernels():
    """The listed kernels whose plan cuts K into parts of a block each: the
    SIMT kernels that plan so, from the kernel table."""
    if not _ffi.cuda_module_built():
        return []
    return [
        k.name
        for k in CUDA_TABLE
        if not k.tensor_cores
        and "float32" in k.inputs
        and (found := highest_plan(k.name, SHAPES[0])) is not None
        and found.split_k == 1
        and found.split_groups > 1
    ]


KERNELS = splitting_kernels()


def kernel_products(kernel):
    """(dtype, out_dtype) pairs the kernel takes whose accumulator is float32:
    each input type into itself and into float32."""
    facts = next(k for k in CUDA_TABLE if k.name == kernel)
    return [
        (dtype, out)
        for dtype in facts.inputs
        if dtype != "float64"
        for out in dict.fromkeys((dtype, "float32"))
        if out in facts.outputs
    ]


@needs_cuda_module
def test_the_simt_kernels_of_auto_cut_k():
    """warptile and pipelined, auto's SIMT kernels for float32 at HIGHEST, both
    cut K: the list the GPU tests below run is not empty by accident."""
    assert {"warptile", "pipelined"} <= set(KERNELS), KERNELS


@needs_cuda_module
@pytest.mark.parametrize("kernel", KERNELS)
def test_parts_only_where_tiles_leave_sms_idle(kernel):
    h100 = dict(multiprocessors=_ffi.H100_MULTIPROCESSORS)
    counts = [highest_plan(kernel, shape, **h100).split_groups for shape in SHAPES]
    assert counts == [16, 8, 32, 250], counts
    two_tiles = highest_plan(kernel, SHAPES[0], **h100)
    assert (two_tiles.block_m, two_tiles.block_n, two_tiles.split_k) == (64, 64, 1)
    assert two_tiles.text.endswith(
        "K split in 16 parts, a block each (partial sums added in part order from scratch "
        "by a second kernel)"
    ), two_tiles.text
    assert highest_plan(kernel, WHOLE_K, **h100).split_groups == 1
    # 128 x 128 blocks that fill the GPU twice over: K whole.
    square = highest_plan(kernel, (1, 4096, 4096, 4096), **h100)
    assert (square.block_m, square.split_groups) == (128, 1), square
    # 64 x 64 blocks that fill the GPU: K whole; fewer SMs hold fewer parts.
    assert highest_plan(kernel, (1, 1024, 2052, 8190), **h100).split_groups == 1
    assert highest_plan(kernel, SHAPES[2], multiprocessors=36).split_groups == 8
    # The parts' blocks fit the GPU at once (4 small blocks an SM), and
    # each part is at least 256 deep.
    for batch, m, n, k in SHAPES:
        parts = highest_plan(kernel, (batch, m, n, k), **h100).split_groups
        tiles = batch * -(-m // 64) * -(-n // 64)
        assert tiles * parts <= 4 * _ffi.H100_MULTIPROCESSORS and k // parts >= 256


@needs_cuda_module
def test_no_parts_for_double_accumulators():
    """float64 products keep K whole: a thread's 64 double accumulators
    leave no registers for the parts (ptxas spilled)."""
    for dtype, out in (("float64", "float64"), ("float32", "float64")):
        assert highest_plan("warptile", SHAPES[0], dtype, out).split_groups == 1


@needs_cuda_module
def test_auto_explains_the_parts():
    S = jax.ShapeDtypeStruct
    found = jax_tiled.explain(
        S((256, 65536), jnp.float32),
        S((65536, 256), jnp.float32),
        precision="highest",
        backend="gpu",
    )
    assert found.kernel in KERNELS and "parts, a block each" in found.plan, found


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_every_layout_against_float64(rng, kernel, shape):
    batch, m, n, k = shape
    assert highest_plan(kernel, shape).split_groups > 1
    for dtype, out_dtype in kernel_products(kernel):
        for ta, tb in LAYOUTS:
            a, b, a_op, b_op = operands(rng, m, n, k, ta, tb, np.dtype(dtype), batch, batch)
            out = bind_product(a, b, ta, tb, precision=HIGHEST, kernel=kernel, out_dtype=out_dtype)
            assert_matmul_close(
                out, a_op, b_op, platform="cuda", precision=HIGHEST, out_dtype=out_dtype
            )


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_bitwise_the_same_run_to_run(rng, kernel):
    a, b, _, _ = operands(rng, 256, 256, 65536, False, False)
    product = jax.jit(lambda a, b: jax_tiled.matmul(a, b, precision=HIGHEST, kernel=kernel))
    assert_same_bits_run_to_run(product, a, b)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_special_values_in_one_part_reach_the_result(rng, kernel):
    """inf in the last part's K, NaN in the first's, inf - inf across parts:
    the sum over the parts carries them as true arithmetic does."""
    m, n, k = 128, 96, 8192
    assert highest_plan(kernel, (1, m, n, k)).split_groups > 1
    assert_special_values_across_k(rng, m, n, k, kernel)


@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_long_k_no_less_accurate_than_jnp(rng):
    """256 x 65536 x 256 at HIGHEST on positive inputs: auto cuts K, and its
    error against float64 is at most jnp's (one running sum a tile had 2.6x
    jnp's error: cpp/cuda/NOTES.md, "Split K for the SIMT kernels")."""
    m, n, k = 256, 256, 65536
    a = rng.uniform(0.5, 1.5, (m, k)).astype(np.float32)
    b = rng.uniform(0.5, 1.5, (k, n)).astype(np.float32)
    assert "parts, a block each" in jax_tiled.explain(a, b, precision=HIGHEST).plan
    errors = errors_beside_jnp(a, b)
    assert errors["ours"] <= errors["jnp"], errors
