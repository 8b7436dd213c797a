"""warptile's float32 mainloop (cpp/cuda/kernels/3_simt_warptiled.cuh,
WarpTiledFloat32): float32 products on its 128 x 128 blocks whose rows start on
16-byte lines, HIGHEST's large products, run with the operand layouts
compiled in, no bounds checks in the mainloop, and sums blocked every 256 of
K with the totals in shared memory; K in parts, a block each, 64 x 128
blocks for few rows and 32 x 128 blocks for at most 32, where a model of the
waves (SimtWaves) has them finish first. Past the matrix's edge its
quads read the last rows or columns inside again, and a K that is not whole
slabs starts with zeros (in the first part). The plans (no GPU needed); on a
GPU, every layout against float64 at tile edges, short and ragged K, K in
parts and batched (and the operands off 16-byte lines, which the kernel
before it runs), special values in the first slab, across parts and in the
last row and column (read again past the edge), bitwise the same run to run;
jit, grad and vmap; no less accurate than jnp at HIGHEST over K of 4096 and
8192 on positive inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from helpers import (
    LAYOUTS,
    assert_matmul_close,
    assert_same_bits_run_to_run,
    assert_special_values_across_k,
    bind_product,
    errors_beside_jnp,
    highest_plan,
    load_repository_module,
    needs_cuda_module,
    operands,
    tanh_loss_of,
    x64,
)
from jax_tiled import _ffi

HIGHEST = lax.Precision.HIGHEST
H100 = dict(multiprocessors=_ffi.H100_MULTIPROCESSORS)
LARGE = (128, 128)  # warptile's blocks for the float32 mainloop

# (batch, m, n, k), each on 128 x 128 blocks and on the float32 mainloop, K
# whole (on an H100): whole tiles (256 of them, one wave: 64 x 64 blocks
# before the model of the waves) and a K of whole slabs; tiles off both
# edges (m and n multiples of 4, not of 128) with a K that ends half a slab
# in (its first slab starts with 4 zeros); a batch; K of one half slab, of
# one slab and of one partial sum (256: no slabs after it). Sums are blocked
# every 256 of K (kSharedTotalsSumDepth): 1024 is four partials, 1004 three
# and 30 slabs more, 260 one and one slab more.
PARTIAL_DEPTH = 256
WHOLE_K = [
    (1, 4096, 1024, 1024),
    (1, 3332, 2052, 1004),
    (2, 1540, 1284, 260),
    (1, 2304, 2048, 4),
    (1, 2304, 2048, 8),
    (1, 2304, 2048, PARTIAL_DEPTH),
]
# K in parts (on an H100): 2 of 504 and 500 (the first from 4 zeros) on 17 x
# 17 tiles off both edges; 13 on 5 x 4 tiles, and 6 on a batch of 2 of them.
IN_PARTS = {(1, 2308, 2052, 1004): 2, (1, 516, 388, 8196): 13, (2, 516, 388, 4100): 6}
SHAPES = WHOLE_K + list(IN_PARTS)
# Products of 64 rows (on an H100): the mainloop's 64 x 128 blocks, off the
# edge along N, K ragged and in 2 parts; a batch of 2. 16 and 32 rows: its
# 32 x 128 blocks, K ragged, in parts (a batch of 2 of them).
NARROW = {
    (1, 64, 16388, 1004): (64, 128),
    (2, 64, 8196, 1004): (64, 128),
    (1, 16, 8196, 1004): (32, 128),
    (2, 32, 4100, 516): (32, 128),
}
# Rows off 16-byte lines (n and K odd): the kernel before it runs these.
OFF_LINES = (1, 2304, 2051, 1001)


@needs_cuda_module
@pytest.mark.parametrize("shape", SHAPES + [OFF_LINES], ids=str)
def test_the_shapes_run_on_large_blocks(shape):
    found = highest_plan("warptile", shape, **H100)
    assert (found.block_m, found.block_n) == LARGE, found
    assert found.split_groups == IN_PARTS.get(shape, 1), found


@needs_cuda_module
@pytest.mark.parametrize("shape", NARROW, ids=str)
def test_few_rows_run_on_narrow_blocks(shape):
    found = highest_plan("warptile", shape, **H100)
    assert (found.block_m, found.block_n) == NARROW[shape], found
    assert found.split_groups > 1 and "model of the waves" in found.text, found


@needs_cuda_module
def test_the_model_of_the_waves_takes_large_blocks_with_parts():
    """The user shapes (M x K x N) that 64 x 64 blocks ran at 0.6-0.67x jnp at
    HIGHEST on an H100 take the 128 x 128 blocks, K in parts where their
    tiles make less than a wave (or a wave and a little); the parts are at
    least 256 deep and their blocks at most 8 waves. 64 rows take its 64 x 128
    blocks; N of 64 keeps the 64 x 64 blocks (a 128-wide block would be half
    padding, and the mainloop's 128 x 64 ones are not built), and so do
    products the mainloop does not run: rows off 16-byte lines, 16-bit
    inputs."""
    sms = _ffi.H100_MULTIPROCESSORS
    for m, k, n in [(2048, 2048, 2048), (1024, 1024, 1024), (1000, 800, 1200)]:
        found = highest_plan("warptile", (1, m, n, k), **H100)
        assert (found.block_m, found.block_n) == LARGE, (m, k, n, found)
    for m, k, n in [
        (2304, 8192, 2048),
        (1536, 4096, 1536),
        (4096, 4096, 128),
        (128, 4096, 4096),
        (512, 8192, 512),
        (256, 65536, 256),
        (1024, 32768, 1024),
    ]:
        found = highest_plan("warptile", (1, m, n, k), **H100)
        assert (found.block_m, found.block_n) == LARGE, (m, k, n, found)
        tiles = -(-m // 128) * -(-n // 128)
        parts = found.split_groups
        assert parts > 1 and k // parts >= PARTIAL_DEPTH, (m, k, n, found)
        assert tiles * parts <= 8 * 2 * sms + tiles, (m, k, n, found)
        assert "model of the waves" in found.text, found
    narrow = {(16384, 4096, 64): (64, 64), (64, 4096, 14336): (64, 128)}
    for (m, k, n), blocks in narrow.items():
        found = highest_plan("warptile", (1, m, n, k), **H100)
        assert (found.block_m, found.block_n) == blocks, (m, k, n, found)
    assert highest_plan("warptile", (1, 2048, 2046, 2048), **H100).block_m == 64
    bf16 = highest_plan("warptile", (1, 2048, 2048, 2048), "bfloat16", "float32", **H100)
    assert bf16.block_m == 64, bf16


@needs_cuda_module
def test_auto_runs_the_model_s_choice():
    """auto runs warptile where its plan takes the 128 x 128 blocks, and says
    why; pipelined's own plan keeps the 64 x 64 blocks there."""
    S = jax.ShapeDtypeStruct
    found = jax_tiled.explain(
        S((512, 8192), jnp.float32), S((8192, 512), jnp.float32), precision="highest", backend="gpu"
    )
    assert found.kernel == "warptile" and "model of the waves" in found.reason, found
    assert "K split in" in found.plan, found
    assert highest_plan("pipelined", (1, 512, 512, 8192), **H100).block_m == 64
    few_rows = jax_tiled.explain(
        S((64, 4096), jnp.float32),
        S((4096, 14336), jnp.float32),
        precision="highest",
        backend="gpu",
    )
    assert few_rows.kernel == "warptile", few_rows
    assert few_rows.reason.startswith("64 x 128 blocks on float32's own mainloop"), few_rows


@needs_cuda_module
def test_the_sanitizers_run_the_float32_mainloop():
    """tests/scripts/sanitizer_cases.py's aligned large cases take the large
    blocks, off both edges: one over more than two partial sums of K, one
    with K in parts."""
    cases = load_repository_module("tests/scripts/sanitizer_cases.py")
    m, k, n = cases.LARGE_ALIGNED_SHAPE
    found = highest_plan("warptile", (1, m, n, k), **H100)
    assert (found.block_m, found.block_n) == LARGE and found.split_groups == 1, found
    assert m % LARGE[0] and n % LARGE[1] and m % 4 == n % 4 == k % 4 == 0
    assert k > 2 * PARTIAL_DEPTH
    m, k, n = cases.LARGE_PARTS_SHAPE
    found = highest_plan("warptile", (1, m, n, k), **H100)
    assert (found.block_m, found.block_n) == LARGE and found.split_groups > 1, found
    assert m % LARGE[0] and n % LARGE[1] and k % 8
    m, k, n = cases.NARROW_SHAPE
    found = highest_plan("warptile", (1, m, n, k), **H100)
    assert (found.block_m, found.block_n) == (64, 128) and found.split_groups > 1, found
    m, k, n = cases.THIN_DEEP_SHAPE
    found = highest_plan("warptile", (1, m, n, k), **H100)
    assert (found.block_m, found.block_n) == (32, 128) and found.split_groups > 1, found
    assert "model of the waves" in found.text, found


@pytest.mark.parametrize("shape", SHAPES + list(NARROW) + [OFF_LINES], ids=str)
@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_every_layout_against_float64(rng, shape):
    batch, m, n, k = shape
    with x64():
        for ta, tb in LAYOUTS:
            a, b, a_op, b_op = operands(rng, m, n, k, ta, tb, np.float32, batch, batch)
            out = bind_product(a, b, ta, tb, precision=HIGHEST, kernel="warptile")
            assert_matmul_close(out, a_op, b_op, platform="cuda", precision=HIGHEST)


@pytest.mark.parametrize("shape", SHAPES[:3] + list(IN_PARTS)[:1] + list(NARROW), ids=str)
@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_bitwise_the_same_run_to_run(rng, shape):
    batch, m, n, k = shape
    for ta, tb in LAYOUTS:
        a, b, _, _ = operands(rng, m, n, k, ta, tb, np.float32, batch, batch)
        assert_same_bits_run_to_run(
            lambda a, b: bind_product(a, b, ta, tb, precision=HIGHEST, kernel="warptile"),
            a,
            b,
            runs=2,
        )


@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [WHOLE_K[1], next(iter(IN_PARTS)), *list(NARROW)], ids=str)
def test_special_values_in_the_first_slab(rng, shape):
    """K = 1004: the first slab is 4 zeros and K's first 4 elements, so row 1's
    NaN at K's start is in it; inf at K's end, inf - inf across K (so across
    the parts, where K is in parts)."""
    _, m, n, k = shape
    found = highest_plan("warptile", shape, **H100)
    assert (found.block_m, found.block_n) in {LARGE, *NARROW.values()}, found
    assert_special_values_across_k(rng, m, n, k, kernel="warptile")


@pytest.mark.parametrize("m,n,k", [(2308, 2052, 1000), (20, 2052, 1000)])
@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_the_edge_read_again_stays_outside(rng, m, n, k):
    """Past the edge the loaders read a's last row and b's last column again,
    into sums that are never stored: NaN there reaches only that row and that
    column of the result (on the large blocks, and on the 32 x 128 ones, of
    which 20 rows fill less than a block)."""
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    a[-1, 5] = np.nan
    b[7, -1] = np.nan
    for ta, tb in LAYOUTS:
        stored_a = np.ascontiguousarray(a.T) if ta else a
        stored_b = np.ascontiguousarray(b.T) if tb else b
        got = bind_product(
            stored_a[None], stored_b[None], ta, tb, precision=HIGHEST, kernel="warptile"
        )
        got = np.asarray(got)[0]
        assert np.isnan(got[-1]).all() and np.isnan(got[:, -1]).all(), (ta, tb)
        assert np.isfinite(got[:-1, :-1]).all(), (ta, tb)
        assert_matmul_close(got[:-1, :-1], a[:-1], b[:, :-1], platform="cuda", precision=HIGHEST)


@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_jit_grad_vmap(rng):
    """x (2304, 1024) @ w (1024, 2048) runs on the float32 mainloop forward and
    under vmap (w broadcast over the batch); the gradients take smaller blocks
    (their outputs are smaller). Against float64: the products elementwise;
    the gradients, whose error is mostly the forward product's carried
    through tanh', no further from float64 than jnp's at HIGHEST. (Against
    jnp's own float32 gradients at a fixed tolerance this failed on an H100
    once the sums were blocked: the two roundings differ by more than it.)"""
    x = rng.standard_normal((2304, 1024)).astype(np.float32)
    w = rng.standard_normal((1024, 2048)).astype(np.float32)
    assert highest_plan("warptile", (1, 2304, 2048, 1024), **H100).block_m == LARGE[0]

    ours = jax.jit(jax.grad(tanh_loss_of(jax_tiled.matmul), argnums=(0, 1)))(x, w)
    theirs = jax.grad(tanh_loss_of(jnp.matmul), argnums=(0, 1))(x, w)
    x64_, w64 = x.astype(np.float64), w.astype(np.float64)
    g = 1 - np.tanh(x64_ @ w64) ** 2
    for name, got, jnp_got, want in zip(("x", "w"), ours, theirs, (g @ w64.T, x64_.T @ g)):
        error = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
        jnp_error = np.linalg.norm(np.asarray(jnp_got, np.float64) - want) / np.linalg.norm(want)
        assert error <= 1.5 * jnp_error, (name, error, jnp_error)
    xs = np.stack([x, 2 * x])
    batched = jax.vmap(lambda x: jax_tiled.matmul(x, w, precision=HIGHEST))(xs)
    assert_matmul_close(
        batched, xs, np.broadcast_to(w, (2, *w.shape)), platform="cuda", precision=HIGHEST
    )


@pytest.mark.parametrize("k", [4096, 8192])
@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_long_k_no_less_accurate_than_jnp(rng, k):
    """2304 x k x 2048 (m x k x n) on positive inputs (they expose a bias):
    auto runs the float32 mainloop, and its error against float64 is at most
    jnp's (one FMA chain over K was 4.4 times jnp's at K = 8192)."""
    m, n = 2304, 2048
    a = rng.uniform(0.5, 1.5, (m, k)).astype(np.float32)
    b = rng.uniform(0.5, 1.5, (k, n)).astype(np.float32)
    found = jax_tiled.explain(a, b, precision=HIGHEST)
    assert found.kernel == "warptile" and found.plan.startswith("128 x 128 tiles"), found
    errors = errors_beside_jnp(a, b)
    assert errors["ours"] <= errors["jnp"], errors
