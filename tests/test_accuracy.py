"""Accuracy against `jnp.matmul` on the GPU: every CUDA kernel at every
precision is at least as accurate as the product a user would otherwise get.

Error is ||out - ref|| / ||ref|| and bias mean(out - ref) / mean(|ref|), ref
being the float64 product of the same (already rounded) inputs; ours must stay
within 1.2x jnp's error and 2x its bias (the targets of the performance
protocol, docs/performance.md). Inputs uniform in [0.5, 1.5] expose bias
(rounding or truncation that leans one way adds up instead of averaging out),
normal ones the error of cancelling sums; K is long enough for an
accumulation order that grows with K to show (it did: one running sum over
K = 8192 was 7.6x cuBLAS's error on an H100, truncated TF32 operands 14-57x).

The CPU kernel is not held to this here: with jax 0.10.2 it meets it, but
XLA:CPU in jax 0.11.2 sums more accurately (1.4-1.8x less error than the CPU
kernel's slabs of 256 at K = 1000 and 6144), which is the CPU kernel's to
answer, not this GPU test's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from helpers import TENSOR_CORE_KERNELS, kernels_on

F32, BF16, F16 = (np.dtype(t) for t in (np.float32, jnp.bfloat16, np.float16))

# (input dtype, output dtype, precision): float32 at each precision, 16-bit
# inputs into a float32 result (the accumulator shows) and into themselves.
CONFIGS = [(F32, F32, p) for p in ("default", "high", "highest")] + [
    (BF16, F32, None),
    (F16, F32, None),
    (BF16, BF16, None),
]

# (m, k, n): a long K over few output tiles (where cuBLAS splits K), and an
# odd shape.
LONG_K, ODD = (512, 8192, 512), (197, 1000, 263)
SHAPES = [LONG_K, ODD]
# 16-bit operands into float32 over a long K are left out: there XLA's
# autotuner picks among products that split K many ways, differently from
# one compilation to the next, and the deepest splits (4e-8 at 512 x 8192 x
# 512 on an H100, against 8e-7 in another process) are 2-4x more accurate
# than two-level partial sums. Splitting K is the shapes issue's.
LEFT_OUT = {(BF16, F32, LONG_K), (F16, F32, LONG_K)}


def inputs(rng, m, k, n, dtype, distribution):
    if distribution == "positive":
        a, b = rng.uniform(0.5, 1.5, (m, k)), rng.uniform(0.5, 1.5, (k, n))
    else:
        a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    return a.astype(dtype), b.astype(dtype)


def error_and_bias(out, ref):
    diff = np.asarray(out, np.float64) - ref
    return np.linalg.norm(diff) / np.linalg.norm(ref), np.mean(diff) / np.mean(np.abs(ref))


CASES = [
    pytest.param(i, o, p, shape, id=f"{i.name}-{o.name}-{p}-{'x'.join(map(str, shape))}")
    for i, o, p in CONFIGS
    for shape in SHAPES
    if (i, o, shape) not in LEFT_OUT
]

# (transpose_a, transpose_b): the plain product, and the weight gradient's
# layout (a stored (k, m), b (k, n)), where TF32 wgmma rewrites B in shared
# memory rather than read it as it landed.
LAYOUTS = [pytest.param(False, False, id="a@b"), pytest.param(True, False, id="aT@b")]


@pytest.mark.gpu
@pytest.mark.parametrize("transpose_a,transpose_b", LAYOUTS)
@pytest.mark.parametrize("distribution", ["positive", "normal"])
@pytest.mark.parametrize("in_dtype,out_dtype,precision,shape", CASES)
def test_every_kernel_is_as_accurate_as_jnp(
    on_gpu, rng, in_dtype, out_dtype, precision, shape, distribution, transpose_a, transpose_b
):
    m, k, n = shape
    a, b = inputs(rng, m, k, n, in_dtype, distribution)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    # Each operand as stored for the layout, and op() of it under jit, where
    # XLA hands cuBLAS the transposed layout rather than copying.
    a_stored, b_stored = (a.T.copy() if transpose_a else a), (b.T.copy() if transpose_b else b)

    def op(x, transposed):
        return x.T if transposed else x

    peer_error, peer_bias = error_and_bias(
        jax.jit(
            lambda x, y: jnp.matmul(
                op(x, transpose_a),
                op(y, transpose_b),
                precision=precision,
                preferred_element_type=out_dtype,
            )
        )(a_stored, b_stored),
        ref,
    )
    misses = kernels_missing(
        a_stored,
        b_stored,
        transpose_a,
        transpose_b,
        precision,
        out_dtype,
        ref,
        peer_error,
        peer_bias,
    )
    assert not misses, f"jnp.matmul: error {peer_error:.2e}, bias {peer_bias:+.1e}; " + "; ".join(
        misses
    )


def kernels_missing(
    a_stored,
    b_stored,
    transpose_a,
    transpose_b,
    precision,
    out_dtype,
    ref,
    peer_error,
    peer_bias,
    only=None,
) -> list[str]:
    """Every CUDA kernel (and auto; of those, the ones in `only` if given) that
    runs the product at `precision` and is more than 1.2x the peer's error or
    2x its bias away from ref."""
    m, n = ref.shape
    k = a_stored.shape[0 if transpose_a else 1]
    # Room for the rounding of the result itself, which neither side avoids
    # (a quarter of the output's epsilon: far below any accumulation effect);
    # for the bias also for chance: a mean of m n errors of rms `error`
    # wanders by error / sqrt(m n), and 3 such steps are no evidence of a lean.
    floor = float(jnp.finfo(out_dtype).eps) / 4
    bias_floor = floor + 3 * 1.2 * peer_error / np.sqrt(m * n)
    misses = []
    problem = (1, 1, m, n, k, transpose_a, transpose_b)
    in_dtype = a_stored.dtype
    for kernel in kernels_on("cuda", in_dtype, out_dtype, problem=problem, precision=precision):
        if only is not None and kernel not in only:
            continue
        out = jax_tiled.dot_general(
            a_stored,
            b_stored,
            (((0 if transpose_a else 1,), (1 if transpose_b else 0,)), ((), ())),
            precision=precision,
            preferred_element_type=out_dtype,
            kernel=kernel,
        )
        error, bias = error_and_bias(out, ref)
        if error > 1.2 * peer_error + floor or abs(bias) > 2 * abs(peer_bias) + bias_floor:
            misses.append(f"{kernel}: error {error:.2e}, bias {bias:+.1e}")
    return misses


# HIGH held to jnp's HIGHEST over the long K (docs/performance.md: "`HIGH` ≤
# HIGHEST's error"). A kernel meets it where its plan splits K (wgmma at this
# shape: 5.4e-8 on positive inputs against HIGHEST's 1.6e-7, an H100,
# 2026-11-25). One that sums the whole K in one running float32 total (mma)
# is 1.9x HIGHEST's error there on positive inputs, as the model of the sums
# predicts (cpp/cuda/NOTES.md, "HIGH as four TF32 products, K split"): that
# is asserted too, so the day it meets the target this test says so.
@pytest.mark.gpu
@pytest.mark.parametrize("distribution", ["positive", "normal"])
def test_high_is_as_accurate_as_highest(on_gpu, rng, distribution):
    m, k, n = LONG_K
    a, b = inputs(rng, m, k, n, F32, distribution)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    highest = jax.jit(lambda x, y: jnp.matmul(x, y, precision=lax.Precision.HIGHEST))
    peer_error, peer_bias = error_and_bias(highest(a, b), ref)
    misses = kernels_missing(a, b, False, False, "high", F32, ref, peer_error, peer_bias)
    # The kernels that run HIGH as split TF32 on the tensor cores (the SIMT
    # kernels compute true fp32 at every precision) and sum K in one running
    # total, as explain plans them.
    plans = {
        kernel: jax_tiled.explain(a, b, precision="high", kernel=kernel, backend="gpu")
        for kernel in kernels_on(
            "cuda", F32, problem=(1, 1, m, n, k, False, False), precision="high"
        )
    }
    one_running_total = {
        kernel
        for kernel, plan in plans.items()
        if plan.kernel in TENSOR_CORE_KERNELS and "K split" not in plan.plan
    }
    expected = one_running_total if distribution == "positive" else set()
    assert {miss.split(":")[0] for miss in misses} == expected, (
        f"HIGHEST: error {peer_error:.2e}, bias {peer_bias:+.1e}; misses expected of "
        f"{sorted(expected)}; found: " + ("; ".join(misses) or "none")
    )


# Few rows over a long K (a decoding step's product), 16-bit operands into
# float32: wgmma runs them as C^T on 128 x 64 tiles, K split in two, each
# block's 64 partial sums added in groups (blocked_sum.cuh,
# kPartialsPerGroup). Added one by one into the running total they were
# 2.0-2.7x jnp's error on positive inputs (8.3e-8 against 3.1e-8 on an H100,
# cpp/cuda/NOTES.md, "Partial sums in groups"). jnp's error here moved
# between processes (3.1e-8, 4.1e-8), far less than at LONG_K's deep splits.
# Held: auto, what users get. mma sums the whole K in one running total,
# which the model of the sums (tools/tensor_core_sums.py) puts above the
# target on positive bfloat16 inputs; not measured yet.
FEW_ROWS = (16, 8192, 8192)


@pytest.mark.gpu
@pytest.mark.parametrize("distribution", ["positive", "normal"])
@pytest.mark.parametrize("in_dtype", [BF16, F16], ids=lambda t: t.name)
def test_few_rows_over_a_long_k_are_as_accurate_as_jnp(on_gpu, rng, in_dtype, distribution):
    m, k, n = FEW_ROWS
    a, b = inputs(rng, m, k, n, in_dtype, distribution)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    peer = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=F32))
    peer_error, peer_bias = error_and_bias(peer(a, b), ref)
    misses = kernels_missing(
        a, b, False, False, None, F32, ref, peer_error, peer_bias, only={"auto"}
    )
    assert not misses, f"jnp.matmul: error {peer_error:.2e}, bias {peer_bias:+.1e}; " + "; ".join(
        misses
    )


def test_the_check_sees_a_biased_product(rng):
    """The measure above catches what it is for: operands truncated to TF32
    (what the Hopper kernel's shared-memory operand was before it was rounded)
    are 10x jnp's float32 error, with the bias showing."""
    m, k, n = SHAPES[0]
    a, b = inputs(rng, m, k, n, F32, "positive")
    ref = a.astype(np.float64) @ b.astype(np.float64)
    truncated = (b.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
    error, bias = error_and_bias(a.astype(np.float64) @ truncated.astype(np.float64), ref)
    peer_error, peer_bias = error_and_bias(jnp.matmul(a, b, precision=lax.Precision.HIGHEST), ref)
    assert error > 10 * peer_error and bias < -10 * abs(peer_bias)
