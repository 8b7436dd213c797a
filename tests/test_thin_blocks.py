"""Products of at most 32 rows (a decode step's M) at HIGHEST: warptile runs
them on thin blocks, 32 x 128 (cpp/cuda/kernels/3_simt_warptiled.cuh,
WarpTileThin), K cut into parts where those blocks leave SMs idle (float32
products whose rows lie on 16-byte lines on its float32 mainloop, the parts
by its model of the waves: tests/test_warptile_float32.py), and `auto`
takes warptile there rather than smem16's 16 x 16 tiles. The plans and auto's
choice (no GPU needed: the CUDA module plans for an H100 without one); on a
GPU, the products against float64 on every layout and in every input and
output type warptile takes, batched and off the tile edges, on one K slab and
over a long K; bitwise the same run to run; special values; jit, grad and
vmap through them; and on positive inputs over a long K, no less accurate than
jnp at HIGHEST."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from helpers import (
    assert_every_layout_and_type,
    assert_same_bits_run_to_run,
    assert_special_values_across_k,
    errors_beside_jnp,
    highest_plan,
    needs_cuda_module,
    operands,
    tanh_loss_of,
)
from jax_tiled import _ffi

HIGHEST = lax.Precision.HIGHEST
S = jax.ShapeDtypeStruct
THIN = (32, 128)  # rows x columns of a thin block
H100 = dict(multiprocessors=_ffi.H100_MULTIPROCESSORS)

# (batch, m, n, k): two rows (one runs the row blocks: test_one_row.py); the
# decode-step sizes the user shapes have (K cut into parts: 16 x 8192 x 8192
# is 64 blocks for 132 SMs); a batch off every edge; 32 rows exactly, K one
# short slab; a K long enough to cut deep.
SHAPES = [
    (1, 2, 200, 300),
    (1, 16, 8192, 8192),
    (3, 17, 130, 1000),
    (1, 32, 64, 5),
    (1, 31, 257, 40000),
]


@needs_cuda_module
def test_thin_blocks_for_at_most_32_rows():
    for m in (2, 16, 32):
        found = highest_plan("warptile", (1, m, 4096, 4096), **H100)
        assert (found.block_m, found.block_n) == THIN, (m, found)
        assert found.text.startswith("32 x 128 tiles"), found.text
    assert highest_plan("warptile", (1, 33, 4096, 4096), **H100).block_m == 64
    # pipelined has no thin blocks: its 64-row ones, as before.
    assert highest_plan("pipelined", (1, 16, 4096, 4096), **H100).block_m == 64


@needs_cuda_module
@pytest.mark.parametrize("n,blocks_an_sm,waves", [(8192, 6, 8), (8190, 4, 1)])
def test_thin_blocks_cut_k_to_fill_the_sms(n, blocks_an_sm, waves):
    """16 x 8192 x n: 64 thin blocks for 132 SMs, so K is cut, each part at
    least 256 deep. On the float32 mainloop (n = 8192) its model of the waves
    cuts it, into at most 8 waves of blocks at six an SM; for the kernel for
    every product (n = 8190: b's rows off 16-byte lines), the parts' blocks
    fit the GPU at once (4 an SM)."""
    found = highest_plan("warptile", (1, 16, n, 8192), **H100)
    tiles = -(-n // THIN[1])
    assert found.split_groups > 1, found
    assert tiles * found.split_groups <= waves * blocks_an_sm * _ffi.H100_MULTIPROCESSORS, found
    assert 8192 // found.split_groups >= 256, found
    assert ("model of the waves" in found.text) == (n % 4 == 0), found
    if n % 4 == 0:  # one whole wave, 768 blocks in 792 places: the fastest of 4-32 parts on an H100
        assert found.split_groups == 12, found
    assert highest_plan("warptile", (1, 16, n, 300), **H100).split_groups == 1


@needs_cuda_module
def test_no_thin_blocks_for_double_sums():
    """A thin block's 64 double sums a thread spill beside its staged copies
    (ptxas): float64 products keep the 64-row blocks."""
    for dtype, out in (("float64", "float64"), ("float32", "float64")):
        assert highest_plan("warptile", (1, 16, 4096, 4096), dtype, out, **H100).block_m == 64


@needs_cuda_module
@pytest.mark.parametrize(
    "rows,n,kernel,reason",
    [
        (2, 8192, "warptile", "at most 32 rows: warptile's blocks of 32 rows"),
        (32, 8192, "warptile", "at most 32 rows: warptile's blocks of 32 rows"),
        (32, 8190, "warptile", "at most 32 rows: warptile's blocks of 32 rows"),
        (33, 8192, "smem16", "fewer than 64 rows or columns"),
    ],
)
def test_auto_takes_thin_blocks(rows, n, kernel, reason):
    """Rows on 16-byte lines (n = 8192) run the float32 mainloop's thin
    blocks, off them (n = 8190) the kernel for every product's; beyond 32
    rows smem16's tiles. (One row: test_one_row.py.)"""
    found = jax_tiled.explain(
        S((rows, 8192), jnp.float32),
        S((8192, n), jnp.float32),
        precision="highest",
        backend="gpu",
    )
    assert found.kernel == kernel and found.reason.startswith(reason), found
    on_the_mainloop = kernel == "warptile" and n == 8192
    assert ("float32's own mainloop" in found.reason) == on_the_mainloop, found
    if rows <= 32:
        assert found.plan.startswith("32 x 128 tiles") and "K split in" in found.plan, found


@needs_cuda_module
@pytest.mark.parametrize("rows,n", [(2, 8192), (16, 8192), (32, 8190), (33, 8192), (16, 40)])
def test_auto_runs_high_of_few_rows_on_thin_blocks(rows, n):
    """float32 at HIGH of at most 32 rows runs as at HIGHEST, on the thin
    blocks in exact fp32, where wgmma's 3xTF32 would pad the rows to 64 for
    its four TF32 products; more rows, or fewer than 64 columns, stay on the
    tensor cores."""
    found = jax_tiled.explain(
        S((rows, 8192), jnp.float32), S((8192, n), jnp.float32), precision="high", backend="gpu"
    )
    if rows <= 32 and n >= 64:
        assert found.kernel == "warptile", found
        assert found.reason.startswith("float32 at HIGH of at most 32 rows"), found
        assert found.plan.startswith("32 x 128 tiles"), found
    else:
        assert found.kernel in ("mma", "wgmma"), found


@needs_cuda_module
def test_auto_keeps_narrow_outputs_off_thin_blocks():
    """Fewer than 64 columns: a 128-wide thin block would be mostly padding."""
    found = jax_tiled.explain(
        S((16, 4096), jnp.float32), S((4096, 40), jnp.float32), precision="highest", backend="gpu"
    )
    assert found.kernel == "smem16", found


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_every_layout_and_type_against_float64(rng, shape):
    batch, m, n, k = shape
    assert_every_layout_and_type(rng, "warptile", m, n, k, batch, batch)


@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_bitwise_the_same_run_to_run(rng):
    a, b, _, _ = operands(rng, 16, 8192, 8192, False, False)
    product = jax.jit(lambda a, b: jax_tiled.matmul(a, b, precision=HIGHEST))
    assert_same_bits_run_to_run(product, a, b)


@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_special_values_reach_the_result(rng):
    """inf in the last part's K, NaN in the first's, inf - inf across parts,
    on thin blocks with K cut: carried as true arithmetic does."""
    m, n, k = 16, 1024, 8192
    assert highest_plan("warptile", (1, m, n, k), **H100).split_groups > 1
    assert_special_values_across_k(rng, m, n, k)


@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_jit_grad_vmap_through_thin_blocks(rng):
    """A decode step's shapes: x (16, k) against w (k, n); the gradient for x
    is thin again, w's is not. vmap over a batch of x."""
    x = jnp.asarray(rng.standard_normal((16, 2048)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2048, 512)), jnp.float32)

    got = jax.jit(jax.grad(tanh_loss_of(jax_tiled.matmul), argnums=(0, 1)))(x, w)
    want = jax.grad(tanh_loss_of(jnp.matmul), argnums=(0, 1))(x, w)
    for g, h in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=2e-4, atol=2e-4)
    xs = jnp.stack([x, 2 * x])
    batched = jax.vmap(lambda x: jax_tiled.matmul(x, w, precision=HIGHEST))(xs)
    np.testing.assert_allclose(
        np.asarray(batched), np.asarray(jnp.matmul(xs, w, precision=HIGHEST)), rtol=2e-5, atol=2e-4
    )


@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_high_of_few_rows_gives_highests_bits(rng):
    """auto runs HIGH of at most 32 rows as HIGHEST, the same plan on the
    same blocks (test_auto_runs_high_of_few_rows_on_thin_blocks), so the
    same bits, on the float32 mainloop and off it, batched and not."""
    for batch, m, n, k in [(1, 16, 512, 4100), (1, 5, 301, 999), (4, 32, 136, 520)]:
        a, b, _, _ = operands(rng, m, n, k, False, False, np.float32, batch, batch)
        high, highest = (
            np.asarray(jax_tiled.matmul(a, b, precision=precision))
            for precision in (lax.Precision.HIGH, HIGHEST)
        )
        np.testing.assert_array_equal(high, highest)


@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_long_k_no_less_accurate_than_jnp(rng):
    """16 x 65536 x 512 (m x k x n) on positive inputs (they expose a bias): auto runs
    thin blocks with K cut, and its error against float64 is at most jnp's."""
    m, n, k = 16, 512, 65536
    a = rng.uniform(0.5, 1.5, (m, k)).astype(np.float32)
    b = rng.uniform(0.5, 1.5, (k, n)).astype(np.float32)
    found = jax_tiled.explain(a, b, precision=HIGHEST)
    assert found.kernel == "warptile" and found.plan.startswith("32 x 128 tiles"), found
    errors = errors_beside_jnp(a, b)
    assert errors["ours"] <= errors["jnp"], errors
