"""The tensor-core kernels, "mma" (mma.sync, sm_80+) and "wgmma" (Hopper TMA +
wgmma), on 16-bit inputs (float32 on them, as TF32, is test_precision.py's;
their batches, test_matmul.py's), on shapes both can run: every contiguous
axis a multiple of 8 elements (16 bytes), as the copy engine needs, with M, N
and K off the tile sizes (mma 128 x 128 x 32 and 64 x 64; wgmma 128 x 256,
128 x 128 or 128 x 64, 64 deep). Shapes the copy engine cannot read run on "mma" under
"auto", and forcing "wgmma" on them is refused at trace time. What the
tensor-core kernels refuse (true fp32, float64 results) is checked here too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tiled
from helpers import (
    F32,
    LAYOUTS,
    TENSOR_CORE_KERNELS,
    assert_matmul_close,
    bind_product,
    handler_call,
    operands,
    random_array,
    relative_norm_error,
    tensor_core_kernels,
    tensor_cores_of_this_gpu,
)
from jax_tiled import _ffi

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("on_gpu")]

SIXTEEN_BIT = [jnp.bfloat16, jnp.float16]
# The error class of 16-bit products: relative Frobenius norm against float64.
NORM_ERROR = {np.dtype(jnp.bfloat16): 1e-2, np.dtype(jnp.float16): 2e-3}

# (m, n, k): one element short of, at, and past the tile edges; K past one
# 64-deep slab; a single partial tile; a batch of tiles per SM.
ALIGNED_SHAPES = [
    (8, 8, 8),
    (136, 264, 72),
    (128, 256, 64),
    (120, 248, 56),
    (200, 24, 520),
    (1000, 800, 1208),
    (11400, 40, 136),  # wgmma's 128 x 64 tiles: 40 columns, rows enough to fill the SMs
    (40, 11400, 136),  # 40 rows: C^T on those tiles (16-bit inputs, a stored (m, k))
]


def kernels(dtype, out_dtype=None) -> list[str]:
    """ "auto" and the tensor-core kernels listed for dtype -> out_dtype: every
    one that the kernel table admits on this GPU's compute capability."""
    names = [k for k in jax_tiled.kernels("gpu", dtype, out_dtype) if k in TENSOR_CORE_KERNELS]
    assert names == list(tensor_cores_of_this_gpu()), names
    return ["auto", *names]


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("out_kind", ["same", "float32"])
@pytest.mark.parametrize("shape", ALIGNED_SHAPES, ids=str)
def test_every_layout_against_float64(rng, dtype, out_kind, shape):
    m, n, k = shape
    out_dtype = np.float32 if out_kind == "float32" else dtype
    for ta, tb in LAYOUTS:
        a, b, a_op, b_op = operands(rng, m, n, k, ta, tb, dtype)
        for kernel in kernels(dtype, out_dtype):
            out = bind_product(a, b, ta, tb, kernel=kernel, out_dtype=out_dtype)
            assert_matmul_close(out, a_op, b_op, platform="cuda", out_dtype=out_dtype)
            assert relative_norm_error(out, a_op, b_op) <= NORM_ERROR[np.dtype(dtype)]


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=lambda d: np.dtype(d).name)
def test_bit_exact_on_small_integers(rng, dtype):
    """Integers in [-8, 8], K = 512: every partial sum is exact in float32,
    whatever order or grouping the tensor cores add in."""
    for ta, tb in LAYOUTS:
        a, b, a_op, b_op = operands(rng, 136, 264, 512, ta, tb, dtype, 2, 2, integers=True)
        ref = np.matmul(a_op.astype(np.float64), b_op.astype(np.float64))
        for kernel in kernels(dtype, np.float32):
            out = bind_product(a, b, ta, tb, kernel=kernel, out_dtype=np.float32)
            np.testing.assert_array_equal(np.asarray(out, np.float64), ref)


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=lambda d: np.dtype(d).name)
def test_error_class_at_depth(rng, dtype):
    """K = 8192 in 16-bit output: rounding of the result dominates, not accumulation."""
    a, b, a_op, b_op = operands(rng, 256, 512, 8192, False, False, dtype)
    for kernel in kernels(dtype):
        error = relative_norm_error(bind_product(a, b, kernel=kernel), a_op, b_op)
        assert error <= NORM_ERROR[np.dtype(dtype)], (kernel, error)


def test_jit_grad_vmap_through_every_kernel(rng):
    """The VJP's products are the transposed layouts; vmap adds a batch."""
    a = random_array(rng, (4, 64, 136), jnp.bfloat16)
    b = random_array(rng, (136, 72), jnp.bfloat16)

    def loss(mm):
        return lambda a, b: jnp.sum(mm(a, b).astype(jnp.float32) ** 2)

    reference = lambda a, b: jnp.matmul(
        a.astype(jnp.float32), b.astype(jnp.float32), precision="highest"
    )
    want = jax.grad(loss(reference), (0, 1))(a, b)
    for kernel in kernels(jnp.bfloat16):
        mm = lambda a, b: jax_tiled.matmul(a, b, preferred_element_type=jnp.float32, kernel=kernel)
        got = jax.jit(jax.grad(loss(mm), (0, 1)))(a, b)
        for g, w in zip(got, want):
            np.testing.assert_allclose(
                np.asarray(g, np.float32),
                np.asarray(w),
                rtol=2e-2,
                atol=2e-2 * float(jnp.abs(w).max()),
            )
        mapped = jax.vmap(mm, in_axes=(0, None))(a, b)
        assert_matmul_close(mapped, a, b, platform="cuda", out_dtype=np.float32)


def test_auto_picks_wgmma_where_the_copy_engine_reads_and_mma_elsewhere():
    S = jax.ShapeDtypeStruct
    aligned = jax_tiled.explain(S((4096, 4096), jnp.bfloat16), S((4096, 4096), jnp.bfloat16))
    # Not a small product (which auto runs on mma whatever the layout).
    odd = jax_tiled.explain(S((2048, 17), jnp.bfloat16), S((17, 2048), jnp.bfloat16))
    skinny = jax_tiled.explain(S((11400, 136), jnp.bfloat16), S((136, 40), jnp.bfloat16))
    # TF32 computes C^T = B^T A^T for a @ b: a's 40 rows are its 40 columns.
    skinny_tf32 = jax_tiled.explain(S((40, 200), jnp.float32), S((200, 11400), jnp.float32))
    if _ffi.cuda_compute_capability() == _ffi.HOPPER:
        # K padded to whole 16-byte lines (17 -> 24) for the copy engine.
        assert odd.kernel == "wgmma" and "2048x17x2048 as 2048x24x2048);" in odd.reason, odd
        assert aligned.kernel == "wgmma" and aligned.plan.startswith("128 x 256 tiles"), aligned
        assert skinny.kernel == "wgmma" and skinny.plan.startswith("128 x 64 tiles"), skinny
        assert skinny_tf32.plan.startswith("128 x 64 tiles") and "C^T" in skinny_tf32.plan
        few_rows = jax_tiled.explain(S((40, 136), jnp.bfloat16), S((136, 11400), jnp.bfloat16))
        assert few_rows.plan.startswith("128 x 64 tiles") and "C^T" in few_rows.plan, few_rows
    else:
        assert odd.kernel == "mma" and "a's rows are 17 elements" in odd.reason, odd


def test_unaligned_rows_run_on_mma_and_wgmma_refuses_them(rng):
    """K = 17: no row of a (m, 17) bfloat16 matrix but the first starts on 16 bytes."""
    a = random_array(rng, (33, 17), jnp.bfloat16)
    b = random_array(rng, (17, 65), jnp.bfloat16)
    for kernel in ("auto", "mma"):
        assert_matmul_close(jax_tiled.matmul(a, b, kernel=kernel), a, b, platform="cuda")
    if "wgmma" in jax_tiled.kernels("gpu", jnp.bfloat16):
        with pytest.raises(
            ValueError,
            match="kernel 'wgmma' reads operands with the TMA copy engine.*a's rows are 17",
        ):
            jax_tiled.matmul(a, b, kernel="wgmma")
        with pytest.raises(ValueError, match="kernel 'wgmma'"):
            jax_tiled.explain(a, b, kernel="wgmma")
        # The handler refuses too, for callers that bypass the primitive.
        with pytest.raises(Exception, match="kernel 'wgmma' reads operands"):
            jax.block_until_ready(
                handler_call(
                    "cuda",
                    jnp.asarray(a)[None],
                    jnp.asarray(b)[None],
                    (1, 33, 65),
                    jnp.bfloat16,
                    kernel="wgmma",
                )
            )


def test_tensor_core_kernels_refuse_true_fp32_and_float64_results(rng):
    """float32 runs on them as TF32 or 3xTF32 (test_precision.py); the true fp32
    arithmetic of precision HIGHEST, and float64 results, they refuse: through
    matmul, under jit, on the primitive and in explain."""
    a = random_array(rng, (64, 64), F32)
    assert kernels(np.float32)[1:] == tensor_core_kernels()
    for kernel in tensor_core_kernels():
        for call in (
            jax_tiled.matmul,
            jax.jit(jax_tiled.matmul, static_argnames=("precision", "kernel")),
        ):
            with pytest.raises(ValueError, match=f"(?s)kernel '{kernel}'.*fp32.*HIGHEST"):
                call(a, a, precision="highest", kernel=kernel)
        with pytest.raises(ValueError, match="HIGHEST"):
            bind_product(a[None], a[None], precision="highest", kernel=kernel)
        with pytest.raises(ValueError, match="HIGHEST"):
            jax_tiled.explain(a, a, precision="highest", kernel=kernel)
        with jax.enable_x64(True):
            with pytest.raises(TypeError, match=f"kernel '{kernel}'.*float32 -> float64"):
                jax_tiled.matmul(a, a, kernel=kernel, preferred_element_type=jnp.float64)
        # 16-bit inputs: precision changes nothing.
        a16 = a.astype(jnp.bfloat16)
        assert_matmul_close(
            jax_tiled.matmul(a16, a16, precision="highest", kernel=kernel),
            a16,
            a16,
            platform="cuda",
        )
