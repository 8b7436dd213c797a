"""The Hopper kernel's tile widths for 16-bit inputs: 128 x 256 tiles in pairs
sharing B, or 128 x 192 ones where their waves over the SMs end sooner (a
persistent grid's last wave takes a whole one's time however few its tiles:
cpp/cuda/kernels/6_wgmma_tma_warp_specialized.cuh, WgmmaEndsSooner). The
rule on an H100's 132 SMs (no GPU needed: the CUDA module plans without one);
on a GPU, the 192-wide tiles against float64 on every layout and output type,
batched, their last column of tiles partly past N, several tiles a block;
bitwise the same run to run; special values; and on positive inputs over a
long K, no less accurate than jnp."""

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
    load_repository_module,
    needs_cuda_module,
    operands,
)
from jax_tiled import _ffi

S = jax.ShapeDtypeStruct
H100 = _ffi.H100_MULTIPROCESSORS
SIXTEEN_BIT = [jnp.bfloat16, jnp.float16]

# (batch, m, n, k) that take 128 x 192 tiles on 132 SMs, off the tile (128
# rows, 192 columns) and slab (64) edges:
# - one wave either way, the last column of 192-wide tiles 8 columns wide;
# - a batch of three, one wave of 66 pairs against 48 of 128 x 256;
# - two waves either way, some blocks two tiles, the last column 64 wide.
SHAPES_192 = [(1, 2000, 1352, 200), (3, 400, 1992, 136), (1, 2304, 2560, 72)]


def block_n(m, n, k, dtype=jnp.bfloat16, out_dtype=None, batch=1, multiprocessors=H100, **kw):
    problem = (batch, batch, m, n, k, False, False)
    out_dtype = dtype if out_dtype is None else out_dtype
    plan = _ffi.cuda_plan("wgmma", dtype, out_dtype, problem, multiprocessors=multiprocessors, **kw)
    return plan.block_n


@needs_cuda_module
def test_192_wide_where_their_waves_end_sooner_on_an_h100():
    for dtype in SIXTEEN_BIT:
        for out_dtype in (dtype, np.float32):
            # 144 pairs of 128 x 256 (3 waves of 66, the last 12) against 192
            # pairs of 128 x 192 (3 waves, the last 60): 3 x 192 < 3 x 256.
            assert block_n(3072, 3072, 3072, dtype, out_dtype) == 192
            # 1024 pairs (16 waves) against 1376 (21): 21 x 192 < 16 x 256.
            assert block_n(8192, 8192, 8192, dtype, out_dtype) == 192
            # 256 pairs (4 waves) against 352 (6): 6 x 192 > 4 x 256.
            assert block_n(4096, 4096, 4096, dtype, out_dtype) == 256
            # 64 pairs (one wave) against 88 (two).
            assert block_n(2048, 2048, 2048, dtype, out_dtype) == 256
            for batch, m, n, k in SHAPES_192:
                assert block_n(m, n, k, dtype, out_dtype, batch) == 192
    # TF32 keeps its 128 x 256 tiles (no 192-wide TF32 configuration).
    assert block_n(3072, 3072, 3072, np.float32) == 256
    # Parts laid along K need blocked sums, which wide tiles have no room for.
    assert block_n(3072, 3072, 3072, jnp.bfloat16, np.float32, laid_terms=3) == 128
    # Fewer SMs, other waves: on 114 (an H100 PCIe), 3072^3 is 3 waves of 57
    # pairs (the last 30) against 4 (the last 21): 4 x 192 = 3 x 256, a tie, 256.
    assert block_n(3072, 3072, 3072, multiprocessors=114) == 256


@needs_cuda_module
def test_explain_says_why_192():
    plan = jax_tiled.explain(
        S((3072, 3072), jnp.bfloat16), S((3072, 3072), jnp.bfloat16), backend="gpu"
    ).plan
    if _ffi.cuda_compute_capability() != _ffi.HOPPER or _ffi.cuda_multiprocessors() != H100:
        pytest.skip("the waves above are an H100's")  # without a GPU: an H100's
    assert plan.startswith("128 x 192 tiles, 192 wide where their waves"), plan
    assert "clusters of 2 blocks sharing B" in plan, plan


@pytest.fixture
def hopper(on_gpu):
    if _ffi.cuda_compute_capability() != _ffi.HOPPER:
        pytest.skip("wgmma is the Hopper kernel")


def require_192(a, b, **kw):
    """Skips unless `auto` runs a @ b on 192-wide tiles on this GPU (the
    shapes here were chosen for 132 SMs)."""
    plan = jax_tiled.explain(a, b, **kw).plan
    if _ffi.cuda_multiprocessors() != H100:
        pytest.skip(f"the shapes here take 192-wide tiles on {H100} SMs, not this GPU's")
    assert plan.startswith("128 x 192 tiles"), plan


@pytest.mark.gpu
@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES_192, ids=str)
def test_192_wide_tiles_against_float64(rng, dtype, shape):
    batch, m, n, k = shape
    require_192(S((batch, m, k), dtype), S((batch, k, n), dtype))
    for ta, tb in LAYOUTS:
        a, b, a_op, b_op = operands(rng, m, n, k, ta, tb, dtype, batch, batch)
        for out_dtype in (np.dtype(dtype), np.dtype(np.float32)):
            out = bind_product(a, b, ta, tb, kernel="wgmma", out_dtype=out_dtype)
            assert_matmul_close(out, a_op, b_op, platform="cuda", out_dtype=out_dtype)


@pytest.mark.gpu
@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
def test_bitwise_the_same_run_to_run(rng, out_dtype):
    batch, m, n, k = SHAPES_192[2]
    a, b, _, _ = operands(rng, m, n, 2048, False, False, jnp.bfloat16)
    require_192(a, b, preferred_element_type=out_dtype)
    product = jax.jit(lambda a, b: jax_tiled.matmul(a, b, preferred_element_type=out_dtype))
    assert_same_bits_run_to_run(product, a, b)


@pytest.mark.gpu
@pytest.mark.usefixtures("hopper")
def test_special_values_reach_the_result(rng):
    """inf at the end of row 0's K, NaN at the start of row 1's, inf - inf
    across row 2's, in the last column of tiles too."""
    batch, m, n, k = SHAPES_192[0]
    operand = lambda *shape: S(shape, jnp.bfloat16)
    require_192(operand(m, k), operand(k, n), preferred_element_type=jnp.float32)
    assert_special_values_across_k(
        rng, m, n, k, dtype=jnp.bfloat16, precision="default", out_dtype=np.float32
    )


@pytest.mark.gpu
@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=lambda d: np.dtype(d).name)
def test_long_k_no_less_accurate_than_jnp(rng, dtype):
    """16-bit into float32 over K = 8192 on positive inputs (where truncated
    sums show as bias): one running sum, as the 256-wide tiles', within twice
    jnp's error against float64."""
    m, n, k = 2000, 1352, 8192
    a = rng.uniform(0, 1, (m, k)).astype(dtype)
    b = rng.uniform(0, 1, (k, n)).astype(dtype)
    require_192(a, b, preferred_element_type=jnp.float32)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    errors = {}
    for name, product in (("ours", jax_tiled.matmul), ("jnp", jnp.matmul)):
        got = np.asarray(product(a, b, preferred_element_type=jnp.float32), np.float64)
        errors[name] = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert errors["ours"] <= 2 * errors["jnp"], errors


@needs_cuda_module
def test_the_sanitizers_run_both_widths():
    """tests/scripts/sanitizer_cases.py's large 16-bit products take 128 x 192
    and 128 x 256 tiles on an H100, several tiles a block."""
    cases = load_repository_module("tests/scripts/sanitizer_cases.py")
    widths = {}
    for m, k, n in (cases.LARGE_SIXTEEN_BIT_SHAPE, cases.LARGE_SIXTEEN_BIT_256_SHAPE):
        plan = _ffi.cuda_plan("wgmma", jnp.bfloat16, jnp.bfloat16, (1, 1, m, n, k, False, False))
        widths[plan.block_n] = (m, k, n)
        pairs = -(-m // 256) * -(-n // plan.block_n)
        assert pairs > plan.persistent_blocks // 2, (m, k, n, plan)
    assert set(widths) == {192, 256}, widths
