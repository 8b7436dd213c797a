"""Small products with K in parts summed by XLA (`_lowering.k_parts_summed_by_xla`):
on a Hopper GPU `auto` runs a small unbatched float32 product at DEFAULT as one
batched call of K's parts and leaves their sum to XLA, which fuses it with
what follows. The regrouping is checked on any host, the rule and the
lowered program for CUDA without a GPU (the planners need none), the products
on the GPU against float64 under jit, grad, jvp and vmap."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from helpers import F32, LAYOUTS, assert_matmul_close, needs_cuda_module, random_array, x64
from jax_tiled import _ffi, _lowering

BF16 = np.dtype(jnp.bfloat16)
DEFAULT = lax.Precision.DEFAULT


@pytest.mark.parametrize("transpose_a,transpose_b", LAYOUTS)
def test_the_parts_multiply_to_the_product(rng, transpose_a, transpose_b):
    """in_k_parts regroups canonical operands, stored either way, into a batch
    whose products add up to the product (float64, so exactly up to rounding)."""
    m, n, k, parts = 5, 7, 24, 4
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    stored_a = (a.T if transpose_a else a)[None]
    stored_b = (b.T if transpose_b else b)[None]
    with x64():
        a_parts, b_parts = (
            np.asarray(x)
            for x in _lowering.in_k_parts(
                jnp.asarray(stored_a), jnp.asarray(stored_b), parts, transpose_a, transpose_b
            )
        )
    assert a_parts.shape[0] == b_parts.shape[0] == parts
    total = sum(
        (a_parts[p].T if transpose_a else a_parts[p])
        @ (b_parts[p].T if transpose_b else b_parts[p])
        for p in range(parts)
    )
    np.testing.assert_allclose(total, a @ b, rtol=1e-12, atol=1e-12)


# (dtype, precision, (batch_a, batch_b, m, n, k, transpose_a, transpose_b), parts):
# the fewest parts of at most 256 bytes of K, in whole 16-byte lines, for
# float32 within 256-512 on every side; none for 16-bit operands, outside
# those sizes, batched, or at other precisions.
RULE_CASES = [
    (F32, DEFAULT, (1, 1, 256, 256, 256, False, True), 4),
    (F32, DEFAULT, (1, 1, 512, 512, 512, False, False), 8),
    (F32, DEFAULT, (1, 1, 512, 256, 384, True, True), 8),
    (F32, DEFAULT, (1, 1, 264, 256, 260, False, False), 1),  # no part in whole lines
    (F32, DEFAULT, (1, 1, 128, 128, 128, False, False), 1),  # below 256
    (F32, DEFAULT, (1, 1, 256, 1024, 256, False, False), 1),  # above 512
    (F32, DEFAULT, (2, 2, 256, 256, 256, False, False), 1),  # batched
    (BF16, DEFAULT, (1, 1, 256, 256, 256, False, False), 1),  # 16-bit
    (BF16, DEFAULT, (1, 1, 512, 512, 512, False, False), 1),
    (F32, lax.Precision.HIGH, (1, 1, 256, 256, 256, False, False), 1),
    (F32, lax.Precision.HIGHEST, (1, 1, 256, 256, 256, False, False), 1),
]


@needs_cuda_module
@pytest.mark.parametrize("dtype,precision,problem,parts", RULE_CASES)
def test_the_rule(monkeypatch, dtype, precision, problem, parts):
    monkeypatch.setattr(_ffi, "cuda_compute_capability", lambda: _ffi.HOPPER)
    rule = _lowering.k_parts_summed_by_xla
    assert rule("cuda", "auto", dtype, dtype, precision, problem) == parts
    # Only auto's choice, only on CUDA, only on Hopper.
    assert rule("cuda", "mma", dtype, dtype, precision, problem) == 1
    assert rule("cpu", "auto", dtype, dtype, precision, problem) == 1
    monkeypatch.setattr(_ffi, "cuda_compute_capability", lambda: 80)
    assert rule("cuda", "auto", dtype, dtype, precision, problem) == 1


def _calls(lowered: str) -> list[tuple[list[str], str]]:
    """(operand types, result type) of each tiled_matmul custom call."""
    found = []
    for line in lowered.splitlines():
        if "custom_call @tiled_matmul" in line:
            operands, result = re.search(r":\s*\((.*)\)\s*->\s*(tensor<[^>]+>)", line).groups()
            found.append((re.findall(r"tensor<([^>]+)>", operands), result))
    return found


@needs_cuda_module
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_the_lowered_program_and_explain(dtype):
    """For CUDA on any host (Hopper assumed without a GPU): a float32 call
    takes the parts as a batch, XLA sums them, explain says so; 16-bit
    operands, a large product and a forced kernel take K whole."""
    if _ffi.cuda_compute_capability() != _ffi.HOPPER:
        pytest.skip("the rule is for Hopper GPUs")
    short = "bf16" if dtype == BF16 else "f32"
    for (m, k, n), parts, kernel in (
        ((256, 256, 256), 4 if dtype == F32 else 1, "auto"),
        ((1024, 1024, 1024), 1, "auto"),
        ((256, 256, 256), 1, "mma"),
    ):
        specs = [jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype)]

        def f(a, b, kernel=kernel):
            return jnp.tanh(jax_tiled.matmul(a, b, kernel=kernel))

        lowered = jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
        explained = jax_tiled.explain(*specs, kernel=kernel, backend="gpu")
        (call,) = _calls(lowered)
        if parts == 1:
            assert call == (
                [f"1x{m}x{k}x{short}", f"1x{k}x{n}x{short}"],
                f"tensor<1x{m}x{n}x{short}>",
            )
            assert "parts" not in explained.reason, explained
            continue
        depth = k // parts
        assert call == (
            [f"{parts}x{m}x{depth}x{short}", f"{parts}x{depth}x{n}x{short}"],
            f"tensor<{parts}x{m}x{n}xf32>",
        ), lowered
        assert "stablehlo.reduce" in lowered, lowered
        assert f"K cut into {parts} parts of {depth}" in explained.reason, explained


@needs_cuda_module
def test_the_gradients_products_take_parts_too():
    """The VJP's products of a small product are small products too: each
    call of the lowered gradient takes its contraction in parts."""
    if _ffi.cuda_compute_capability() != _ffi.HOPPER:
        pytest.skip("the rule is for Hopper GPUs")
    m = k = n = 256
    specs = [jax.ShapeDtypeStruct((m, k), F32), jax.ShapeDtypeStruct((k, n), F32)]

    def loss(a, b):
        return jnp.sum(jax_tiled.matmul(a, b) ** 2)

    lowered = (
        jax.jit(jax.grad(loss, argnums=(0, 1)))
        .trace(*specs)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    calls = _calls(lowered)
    assert len(calls) == 3, lowered
    assert all(result.startswith("tensor<4x") and result.endswith("xf32>") for _, result in calls)


# On the GPU: (m, k, n) within the rule's sizes, each layout.
GPU_SHAPES = [(256, 256, 256), (512, 384, 256), (512, 512, 512)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=["x".join(map(str, s)) for s in GPU_SHAPES])
def test_products_in_parts_against_float64(on_gpu, rng, shape):
    """Every layout against float64 with inf and NaN in the last row and
    column (the parts' sum keeps them where they belong), bitwise the same
    run to run; then jvp, grad and vmap on finite inputs."""
    m, k, n = shape
    for transpose_a, transpose_b in LAYOUTS:
        a = random_array(rng, (m, k), np.float32)
        b = random_array(rng, (k, n), np.float32)
        a[m - 1, k - 1], b[k - 1, n - 1] = np.inf, np.nan
        a, b = jnp.asarray(a), jnp.asarray(b)
        stored_a, stored_b = (a.T if transpose_a else a), (b.T if transpose_b else b)

        def f(x, y, ta=transpose_a, tb=transpose_b):
            return jax_tiled.matmul(x.T if ta else x, y.T if tb else y)

        f = jax.jit(f)
        result = f(stored_a, stored_b)
        out = np.asarray(result, np.float64)
        np.testing.assert_array_equal(out, np.asarray(f(stored_a, stored_b), np.float64))
        ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
        # Away from the special values' row and column: the product's own error.
        assert_matmul_close(np.asarray(result)[:-1, :-1], a[:-1], b[:, :-1], platform="cuda")
    a = jnp.asarray(random_array(rng, (m, k), np.float32))
    b = jnp.asarray(random_array(rng, (k, n), np.float32))
    da = jnp.asarray(random_array(rng, (m, k), np.float32))
    _, tangent = jax.jvp(jax_tiled.matmul, (a, b), (da, jnp.zeros_like(b)))
    assert_matmul_close(np.asarray(tangent), da, b, platform="cuda")

    def loss(mm):
        return lambda x, y: jnp.sum(mm(x, y).astype(jnp.float32) ** 2) / (m * n)

    ours = jax.grad(loss(jax_tiled.matmul), argnums=(0, 1))(a, b)
    theirs = jax.grad(loss(jnp.matmul), argnums=(0, 1))(a, b)
    for mine, peer in zip(ours, theirs):
        np.testing.assert_allclose(
            np.asarray(mine, np.float64), np.asarray(peer, np.float64), rtol=0.05, atol=1e-3
        )
    stacked = jax.vmap(jax_tiled.matmul)(jnp.stack([a, a]), jnp.stack([b, b]))
    assert_matmul_close(np.asarray(stacked[1]), a, b, platform="cuda")
