"""Split K on the Hopper kernel: where whole 128 x 128 tiles would leave most
SMs idle, "wgmma" splits each tile's K among a cluster of blocks and adds
their partial sums in rank order through distributed shared memory; where K
is deep and the tiles fewer still, among several such clusters a tile, whose
sums a second kernel adds in cluster order from scratch. Checked
against float64 on every layout, off the tile and slab edges, batched, in
each input type; bitwise the same run to run; special values in one part's
K reach the result; and over a long K, no less accurate than jnp."""

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
    bind_product,
    operands,
)
from jax_tiled import _ffi

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("on_gpu")]

# float32 runs as one TF32 pass at the default precision; at HIGH as split
# TF32 (four products of hi and lo parts), whose split-K kernel is its own.
DTYPES = [jnp.bfloat16, jnp.float16, np.float32]
# (dtype, precision): every input type at DEFAULT, and float32 at HIGH.
PRODUCTS = [(d, "default") for d in DTYPES] + [(np.float32, "high")]
PRODUCT_IDS = [f"{np.dtype(d).name}-{p}" for d, p in PRODUCTS]

# (batch, m, n, k): few tiles and a deep K. Rows, columns and K off the tile
# (128) and slab (64 16-bit, 32 float32 elements) edges; a batch of them.
# Split within one cluster a tile:
IN_ONE_CLUSTER = [(1, 128, 1024, 4096), (1, 120, 1000, 3000), (3, 72, 264, 1544)]
# ... across clusters, in every input type (on an H100, into 32 to 44 parts,
# some not a power of two):
ACROSS_CLUSTERS = [(1, 200, 136, 40000), (2, 72, 264, 40000)]
# 16-bit results on 128 x 256 tiles (on an H100: K in 4, across 2 clusters
# of 2 a tile; on 132 SMs as explain assumes them without a GPU, within one
# cluster of 4); their float32 results on 128 x 128 ones:
WIDE = [(1, 1024, 1024, 8192)]
# A few rows (16-bit inputs: C^T = B^T A^T on 128 x 64 tiles, their K split),
# within one cluster and, batched over a deep K, across clusters:
FEW_ROWS = [(1, 8, 136, 8200), (1, 16, 1000, 4104), (2, 40, 264, 20000)]
SHAPES = IN_ONE_CLUSTER + FEW_ROWS + ACROSS_CLUSTERS + WIDE


@pytest.fixture(autouse=True)
def require_hopper(on_gpu):
    if _ffi.cuda_compute_capability() != _ffi.HOPPER:
        pytest.skip("split K is the Hopper kernel's")


def test_auto_splits_k_only_where_tiles_leave_sms_idle():
    S = jax.ShapeDtypeStruct
    explain = lambda m, k, n: jax_tiled.explain(S((m, k), jnp.bfloat16), S((k, n), jnp.bfloat16))
    # 16 tiles: in 4 parts (64 blocks), not 8 (16 clusters of 8 exceed what an
    # H100's GPCs hold at once).
    skinny = explain(128, 4096, 2048)
    assert skinny.kernel == "wgmma" and "K split in 4 across clusters of 4" in skinny.plan, skinny
    assert "K split" not in explain(4096, 4096, 4096).plan  # tiles fill the GPU
    assert "K split" not in explain(128, 128, 4096).plan  # two slabs: nothing to split
    # 16 rows: C^T, whose 16 columns take 128 x 64 tiles, K split.
    few = explain(16, 8192, 8192)
    assert few.plan.startswith("128 x 64 tiles") and "K split" in few.plan, few
    assert "C^T" in few.plan and "a few rows" in few.reason, few
    # Four tiles over K = 65536: clusters of a tile enough to hold at least
    # half the SMs, all at once.
    deep = _ffi.cuda_plan(
        "wgmma", jnp.bfloat16, jnp.bfloat16, (1, 1, 256, 256, 65536, False, False)
    )
    assert deep.split_groups > 1 and "from scratch" in deep.text, deep
    tiles = (256 // deep.block_m) * (256 // deep.block_n)
    blocks = tiles * deep.split_k * deep.split_groups
    assert _ffi.cuda_multiprocessors() / 2 <= blocks <= _ffi.cuda_multiprocessors(), deep


def test_16_bit_results_split_k_on_wide_tiles_where_k_is_deep():
    """128 x 256 tiles read each slab of A for twice the columns; their parts
    are one running sum each (no room for blocked sums), so float32 results
    keep the 128 x 128 split."""

    def plan(m, k, n, dtype, out_dtype):
        return _ffi.cuda_plan("wgmma", dtype, out_dtype, (1, 1, m, n, k, False, False))

    for dtype in (jnp.bfloat16, jnp.float16):
        for m, k, n in [(1024, 32768, 1024), *((m, k, n) for _, m, n, k in WIDE)]:
            wide = plan(m, k, n, dtype, dtype)
            assert wide.block_n == 256 and wide.split_k * wide.split_groups > 1, wide
            assert plan(m, k, n, dtype, np.float32).block_n == 128
        # Where the 128 x 128 split crosses clusters, the wide one would double
        # the partial sums the second kernel adds: the narrow tiles are kept.
        deep = plan(256, 65536, 256, dtype, dtype)
        assert deep.block_n == 128 and deep.split_groups > 1, deep
    assert plan(1024, 32768, 1024, np.float32, np.float32).block_n == 128
    # The wide split would leave each block 16 slabs (on an H100) or run fewer
    # blocks than the narrow one (on 132 SMs as explain assumes them): kept narrow.
    assert plan(512, 8192, 512, jnp.bfloat16, jnp.bfloat16).block_n == 128
    # Columns that one 128-wide tile holds: wide tiles would only add padding.
    assert plan(136, 40000, 72, jnp.bfloat16, jnp.bfloat16).block_n == 128


@pytest.mark.parametrize("dtype,precision", PRODUCTS, ids=PRODUCT_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_layout_against_float64(rng, dtype, precision, shape):
    batch, m, n, k = shape
    for ta, tb in LAYOUTS:
        if np.dtype(dtype) == np.float32 and ta and not tb:
            continue  # TF32 wgmma cannot take it; "auto" runs it on "mma"
        a, b, a_op, b_op = operands(rng, m, n, k, ta, tb, dtype, batch, batch)
        for out_dtype in {np.dtype(dtype), np.dtype(np.float32)}:
            out = bind_product(
                a, b, ta, tb, precision=precision, kernel="wgmma", out_dtype=out_dtype
            )
            assert_matmul_close(
                out, a_op, b_op, platform="cuda", precision=precision, out_dtype=out_dtype
            )


def test_the_shapes_here_split():
    """Every shape above, as "auto" plans it, splits K (else the tests above
    would check whole tiles only), within one cluster or across several."""
    S = jax.ShapeDtypeStruct
    for dtype, precision in PRODUCTS:
        for batch, m, n, k in SHAPES:
            plan = jax_tiled.explain(
                S((batch, m, k), dtype), S((batch, k, n), dtype), precision=precision
            ).plan
            assert "K split" in plan, (dtype, precision, (batch, m, n, k), plan)
            if (batch, m, n, k) in IN_ONE_CLUSTER:
                assert "from scratch" not in plan, (dtype, precision, (batch, m, n, k), plan)
            if (batch, m, n, k) in ACROSS_CLUSTERS:
                assert "from scratch" in plan, (dtype, precision, (batch, m, n, k), plan)


@pytest.mark.parametrize("dtype,precision", PRODUCTS, ids=PRODUCT_IDS)
@pytest.mark.parametrize("mnk", [(128, 2048, 8192), (256, 256, 65536)], ids=str)
def test_bitwise_the_same_run_to_run(rng, dtype, precision, mnk):
    a, b, _, _ = operands(rng, *mnk, False, False, dtype)
    product = jax.jit(
        lambda a, b: jax_tiled.matmul(a, b, precision=precision, preferred_element_type=jnp.float32)
    )
    assert_same_bits_run_to_run(product, a, b)


@pytest.mark.parametrize("dtype,precision", [(jnp.bfloat16, "default"), (np.float32, "high")])
@pytest.mark.parametrize("mnk", [(128, 1024, 4096), (128, 256, 65536)], ids=str)
def test_special_values_in_one_part_reach_the_result(rng, dtype, precision, mnk):
    """inf in the last part's K, NaN in the first's: the sum across the
    parts (and across clusters: the second shape) carries them as true
    arithmetic does; at HIGH through every product of hi and lo parts."""
    m, n, k = mnk
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    a[0, k - 1] = np.inf  # row 0: +-inf where b's last row is nonzero
    a[1, 0] = np.nan  # row 1: NaN everywhere
    a[2, k - 1], a[2, 0] = np.inf, -np.inf  # row 2: inf - inf where both signs meet
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert "K split" in jax_tiled.explain(a, b, precision=precision).plan
    got = np.asarray(
        jax_tiled.matmul(a, b, precision=precision, preferred_element_type=jnp.float32),
        np.float64,
    )
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)])
    assert_matmul_close(
        got[3:].astype(np.float32),
        a[3:],
        b,
        platform="cuda",
        precision=precision,
        out_dtype=np.float32,
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: np.dtype(d).name)
def test_long_k_no_less_accurate_than_jnp(rng, dtype):
    """bf16/f16 -> float32 over K = 65536 with few tiles, positive inputs
    (where truncated sums show as bias): the error against float64 is within
    twice jnp's."""
    m, n, k = 256, 256, 65536
    a = rng.uniform(0, 1, (m, k)).astype(dtype)
    b = rng.uniform(0, 1, (k, n)).astype(dtype)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert "from scratch" in jax_tiled.explain(a, b, preferred_element_type=jnp.float32).plan
    errors = {}
    for name, product in (("ours", jax_tiled.matmul), ("jnp", jnp.matmul)):
        got = np.asarray(product(a, b, preferred_element_type=jnp.float32), np.float64)
        errors[name] = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert errors["ours"] <= 2 * errors["jnp"], errors
