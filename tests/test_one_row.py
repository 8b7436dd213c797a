"""One row (M = 1, a batch of them), or one column as the transposed
product's row, on warptile's row blocks
(cpp/cuda/blocks/row_product.cuh): each output's sum in double, 128 columns a
block, K cut into parts where the blocks alone leave SMs idle, the parts
added in double. The plans and auto's choice (no GPU needed: the CUDA module
plans for an H100 without one); on a GPU, the products against float64 in
every layout and type (B's quads as 16-byte loads and as single ones, odd
K and N, batched and broadcast), special values across the parts, bitwise
the same run to run, error no more than jnp's at HIGHEST over a long K, and
under jit, grad and vmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from helpers import (
    TENSOR_CORE_KERNELS,
    assert_every_layout_and_type,
    assert_matmul_close,
    assert_same_bits_run_to_run,
    errors_beside_jnp,
    highest_plan,
    needs_cuda_module,
    operands,
    tanh_loss_of,
)
from jax_tiled import _ffi

HIGHEST = lax.Precision.HIGHEST
S = jax.ShapeDtypeStruct
H100 = dict(multiprocessors=_ffi.H100_MULTIPROCESSORS)
ROW_BLOCK = (1, 128)
PART_STEP = 128  # K a part of the row blocks is a multiple of

# (batch_a, batch_b, n, k): a few columns and K; N off the 128-column block
# and K odd (B's quads as single loads in one layout or the other); K deep
# enough to cut into parts, the last one short; a batch, and one broadcast.
SHAPES = [
    (1, 1, 5, 7),
    (1, 1, 200, 301),
    (1, 1, 4100, 9001),
    (1, 1, 257, 40000),
    (3, 3, 130, 1000),
    (1, 4, 136, 2000),
]


@needs_cuda_module
def test_one_row_plans_row_blocks():
    found = highest_plan("warptile", (1, 1, 8192, 8192), **H100)
    assert (found.block_m, found.block_n) == ROW_BLOCK, found
    assert found.text.startswith("1 x 128 tiles, one row, each output's sum in double"), found
    # Either of B's layouts read once: a transpose passed as the flag (test_layouts.py).
    assert found.reads_transposes, found
    # 64 blocks for 132 SMs: K in parts, at least 256 deep, whole steps.
    assert found.split_groups > 1 and 8192 // found.split_groups >= 256, found
    assert 8192 // found.split_groups % PART_STEP == 0, found
    # Blocks enough (a batch of 64, or a short K): K whole.
    assert highest_plan("warptile", (64, 1, 4096, 4096), **H100).split_groups == 1
    assert highest_plan("warptile", (1, 1, 8192, 300), **H100).split_groups == 1
    # Two rows: the thin blocks, as before.
    assert highest_plan("warptile", (1, 2, 8192, 8192), **H100).block_m == 32
    # One column (a matrix times a vector): the transposed product's row,
    # its B read along K, K's parts for the 2 blocks an SM holds of those:
    # 64 blocks in 4 parts for 132 SMs, one wave (16 for one row's layout,
    # planned at 8 blocks an SM).
    column = highest_plan("warptile", (1, 8192, 1, 8192), **H100)
    assert (column.block_m, column.block_n) == ROW_BLOCK, column
    assert "one column as the transposed product's row" in column.text, column
    assert (found.split_groups, column.split_groups) == (16, 4), (found, column)
    # Every type: the sums are double whatever the inputs.
    for dtype, out in (("bfloat16", "float32"), ("float64", "float64"), ("float16", "float16")):
        plan = highest_plan("warptile", (1, 1, 4096, 4096), dtype, out, **H100)
        assert (plan.block_m, plan.block_n) == ROW_BLOCK, (dtype, out, plan)


@needs_cuda_module
@pytest.mark.parametrize("n", [8192, 8190, 40])
def test_auto_runs_one_row_on_the_row_blocks(n):
    """Any number of columns, rows on 16-byte lines or not; b as stored or
    read transposed (the CUDA module's own account for `a @ b.T`)."""
    found = jax_tiled.explain(
        S((1, 8192), jnp.float32), S((8192, n), jnp.float32), precision="highest", backend="gpu"
    )
    assert found.kernel == "warptile" and found.reason.startswith("one row:"), found
    assert found.plan.startswith("1 x 128 tiles"), found
    kernel, reason, plan = _ffi.cuda_explain(
        "float32", "float32", (1, 1, 1, n, 8192, False, True), _ffi.H100_MULTIPROCESSORS, HIGHEST
    )
    assert kernel == "warptile" and reason.startswith("one row:") and plan.startswith("1 x 128")
    # A matrix of n rows times a vector.
    column = jax_tiled.explain(
        S((n, 8192), jnp.float32), S((8192, 1), jnp.float32), precision="highest", backend="gpu"
    )
    assert column.kernel == "warptile" and column.reason.startswith("one column"), column


@needs_cuda_module
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_auto_runs_sixteen_bit_columns_on_the_row_blocks(dtype):
    """16-bit operands: one column, its matrix stored (m, k) or (k, m), into
    its own type or float32, on the row blocks (where wgmma's C^T spends 64
    of its rows on one); one row, two rows, and an emulation preset's parts
    laid along K on the tensor cores as before."""

    def explain(problem, out=dtype, laid_terms=1):
        return _ffi.cuda_explain(
            dtype, out, problem, _ffi.H100_MULTIPROCESSORS, laid_terms=laid_terms
        )

    for transpose_a in (False, True):
        for out in (dtype, "float32"):
            kernel, reason, plan = explain((1, 1, 8192, 1, 8192, transpose_a, False), out)
            assert kernel == "warptile" and reason.startswith("one column"), (out, reason)
            assert plan.startswith("1 x 128 tiles"), plan
    for problem in (
        (1, 1, 1, 8192, 8192, False, False),
        (1, 1, 1, 8192, 8192, False, True),
        (1, 1, 2, 8192, 8192, False, False),
    ):
        assert explain(problem)[0] in TENSOR_CORE_KERNELS, problem
    assert explain((1, 1, 1, 8192, 3 * 8192, False, False), laid_terms=3)[0] == "wgmma"
    # float32 at DEFAULT stays TF32 on the tensor cores.
    kernel, _, _ = _ffi.cuda_explain(
        "float32", "float32", (1, 1, 1, 8192, 8192, False, False), _ffi.H100_MULTIPROCESSORS
    )
    assert kernel == "wgmma", kernel


@needs_cuda_module
def test_auto_runs_float32_high_rows_and_columns_on_the_row_blocks():
    """float32 at HIGH of one row or one column, b as stored or read
    transposed: the row blocks' sums in double (3xTF32's float32 sums over K
    were 1.5-3.2x jnp HIGHEST's error there); two rows take the thin blocks
    (test_thin_blocks.py), 33 rows and the large products the tensor cores'
    3xTF32."""
    HIGH = lax.Precision.HIGH

    def explain(problem):
        return _ffi.cuda_explain("float32", "float32", problem, _ffi.H100_MULTIPROCESSORS, HIGH)

    for problem in (
        (1, 1, 1, 8192, 8192, False, False),
        (1, 1, 1, 8192, 8192, False, True),
        (1, 1, 8192, 1, 8192, False, False),
        (1, 1, 8192, 1, 8192, True, False),
        (4, 4, 1, 300, 5000, False, False),
    ):
        kernel, reason, plan = explain(problem)
        assert kernel == "warptile" and "float32 at HIGH" in reason, (problem, reason)
        assert plan.startswith("1 x 128 tiles"), (problem, plan)
    assert explain((1, 1, 2, 8192, 8192, False, False))[2].startswith("32 x 128 tiles")
    for problem in ((1, 1, 33, 8192, 8192, False, False), (1, 1, 4096, 4096, 4096, False, False)):
        assert explain(problem)[0] in TENSOR_CORE_KERNELS, problem
    found = jax_tiled.explain(
        S((1, 8192), jnp.float32), S((8192, 4096), jnp.float32), precision="high", backend="gpu"
    )
    assert found.kernel == "warptile" and found.reason.startswith("one row:"), found


@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_layout_and_type_against_float64(rng, shape):
    """One row of n columns, and one column of n rows (its transposed
    product's row: A read transposed where it is stored plainly)."""
    batch_a, batch_b, n, k = shape
    for m, columns in ((1, n), (n, 1)):
        assert highest_plan("warptile", (max(batch_a, batch_b), m, columns, k)).block_m == 1
        assert_every_layout_and_type(rng, "warptile", m, columns, k, batch_a, batch_b)


@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
@pytest.mark.parametrize("transpose_b", [False, True])
def test_special_values_across_the_parts(rng, transpose_b):
    """Column 0: inf at the end of K (the last part); 1: NaN at its start;
    2: inf - inf across the parts; 3: sums past float32's largest on the way
    to a finite total, which the double sums carry as float64 does."""
    n, k = 136, 9000
    assert highest_plan("warptile", (1, 1, n, k)).split_groups > 1
    a = rng.uniform(0.5, 1.5, (1, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    b[k - 1, 0] = np.inf
    b[0, 1] = np.nan
    b[0, 2], b[k - 1, 2] = np.inf, -np.inf
    a[0, :3] = 1.0
    b[:, 3] = 0.0
    b[:3, 3] = 3e38, 3e38, -3e38
    with np.errstate(invalid="ignore", over="ignore"):
        want = a.astype(np.float64) @ b.astype(np.float64)
    b_in = jnp.asarray(b.T) if transpose_b else jnp.asarray(b)
    product = (
        (lambda a, b: jax_tiled.matmul(a, b.T, precision=HIGHEST))
        if transpose_b
        else (lambda a, b: jax_tiled.matmul(a, b, precision=HIGHEST))
    )
    got = np.asarray(jax.jit(product)(jnp.asarray(a), b_in), np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    assert got[0, 0] == np.inf and got[0, 3] == np.float32(3e38), got[0, :4]
    assert_matmul_close(
        got[:, 4:].astype(np.float32), a, b[:, 4:], platform="cuda", precision=HIGHEST
    )


@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_bitwise_the_same_run_to_run(rng):
    a, b, _, _ = operands(rng, 1, 4096, 16384, False, False)
    product = jax.jit(lambda a, b: jax_tiled.matmul(a, b, precision=HIGHEST))
    assert_same_bits_run_to_run(product, a, b)


@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["highest", "high"])
@pytest.mark.parametrize("inputs", ["positive", "normal"])
@pytest.mark.parametrize("column", [False, True], ids=["row", "column"])
def test_long_k_no_less_accurate_than_jnp(rng, inputs, column, precision):
    """1 x 8192 x 8192 and 8192 x 8192 x 1 at HIGHEST and HIGH against jnp
    at HIGHEST (HIGH's bound): the float32 chains over K were 2.2x jnp's
    error on normal inputs at one row (one column ran smem16, its chains K
    long), and HIGH's 3xTF32 on wgmma 1.5-3.2x, where jnp's matrix-vector
    product sums each output as a tree; sums in double are rounded once."""
    k, n = 8192, 8192
    draw = (lambda s: rng.uniform(0.5, 1.5, s)) if inputs == "positive" else rng.standard_normal
    shapes = ((n, k), (k, 1)) if column else ((1, k), (k, n))
    a, b = (draw(s).astype(np.float32) for s in shapes)
    errors = errors_beside_jnp(a, b, precision=precision, peer_precision=HIGHEST)
    assert errors["ours"] <= errors["jnp"], errors


@pytest.mark.usefixtures("on_gpu")
@pytest.mark.gpu
def test_jit_grad_vmap(rng):
    """A row's product under vmap (a batch of rows) and grad (the gradient of
    b is an outer product, of a a row times b^T: the row blocks, b read
    transposed), the gradients against float64's, no further than jnp's at
    HIGHEST (whose float32 sums of a's gradient, 520 terms of unit size that
    can cancel, were 2e-6 from ours where ours sum in double)."""
    k, n = 3000, 520
    # Products of about unit size, where tanh does not saturate.
    a = jnp.asarray(rng.standard_normal((1, k)) / np.sqrt(k), jnp.float32)
    b = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)

    ours = jax.jit(jax.grad(tanh_loss_of(jax_tiled.matmul), argnums=(0, 1)))(a, b)
    theirs = jax.grad(tanh_loss_of(jnp.matmul), argnums=(0, 1))(a, b)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    slope = 1 - np.tanh(a64 @ b64) ** 2
    exact = (slope @ b64.T, a64.T @ slope)
    for name, x, y, want in zip(("a", "b"), ours, theirs, exact):
        error, jnp_error = (np.max(np.abs(np.asarray(g, np.float64) - want)) for g in (x, y))
        # tanh's float32 rounding is in both; 1.5x leaves room for its chance.
        assert error <= 1.5 * jnp_error, (name, error, jnp_error)
    rows = jnp.asarray(rng.standard_normal((5, 1, k)), jnp.float32)
    batched = jax.jit(jax.vmap(lambda r: jax_tiled.matmul(r, b, precision=HIGHEST)))(rows)
    assert_matmul_close(
        np.asarray(batched)[:, 0], np.asarray(rows)[:, 0], b, platform="cuda", precision=HIGHEST
    )
