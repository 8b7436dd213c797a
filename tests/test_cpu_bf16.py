"""The CPU kernel's bfloat16 paths (docs/precision.md, "bfloat16 on CPU"): AMX
tiles, vdpbf16ps (AVX512_BF16) and the fallback that converts to float32 for
the FMA kernel, each forced with JAX_TILED_CPU_BF16.

The paths come from the CPU kernel's table (`bf16_paths`, those compiled into
this build); a path this machine cannot run (`bf16_paths_here`) is skipped,
and the fallback runs everywhere. Each path is checked against a float64
product where its blocking has edges, on special values, for determinism,
under jit/grad/vmap, and for accuracy against jnp.matmul.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from test_special_values import assert_special_values, special_operands, stored

import jax_tiled
from helpers import LAYOUTS, bind_product, operands, x64
from jax_tiled import _ffi

BF16, F16, F32, F64 = (np.dtype(t) for t in (jnp.bfloat16, np.float16, np.float32, np.float64))
VARIABLE = "JAX_TILED_CPU_BF16"
(CPU_KERNEL,) = _ffi.kernel_table("cpu")
PATHS, HERE = CPU_KERNEL.bf16_paths, CPU_KERNEL.bf16_paths_here


@pytest.fixture(params=PATHS)
def bf16_path(request, monkeypatch):
    """Runs the test with JAX_TILED_CPU_BF16 naming each path of this build;
    skips a path this machine cannot run."""
    if request.param not in HERE:
        pytest.skip(f"this CPU (or its OS) cannot run the {request.param} path")
    monkeypatch.setenv(VARIABLE, request.param)
    assert _ffi.cpu_bf16_path() == request.param
    with jax.default_device(jax.devices("cpu")[0]):
        yield request.param


def run(a, b, ta=False, tb=False, out_dtype=F32):
    return np.asarray(bind_product(a, b, ta, tb, kernel="blocked", out_dtype=out_dtype))


def check(out, opa, opb, out_dtype=F32):
    """Every element within a k-term float32 sum's worst-case bound relative to
    sum |a||b|, plus the rounding of the result to out_dtype."""
    a64, b64 = opa.astype(np.float64), opb.astype(np.float64)
    exact, scale = np.matmul(a64, b64), np.matmul(np.abs(a64), np.abs(b64))
    k = opa.shape[-1]
    out_eps = float(jnp.finfo(out_dtype).eps) / 2
    tol = (k + 2) * 2.0**-24 * scale + out_eps * np.abs(exact) + 1e-30
    np.testing.assert_array_less(np.abs(out.astype(np.float64) - exact), tol)


# ---- The table and the variable ----


def test_the_table_lists_the_paths_and_auto_takes_one_that_runs(monkeypatch):
    assert PATHS[-1] == "fallback" and "fallback" in HERE
    assert set(HERE) <= set(PATHS) and list(HERE) == [p for p in PATHS if p in HERE]
    assert set(PATHS) <= {"amx", "avx512_bf16", "fallback"}
    monkeypatch.delenv(VARIABLE, raising=False)
    chosen = _ffi.cpu_bf16_path()
    assert chosen in HERE
    monkeypatch.setenv(VARIABLE, "auto")
    assert _ffi.cpu_bf16_path() == chosen
    # AMX, where it runs, is the first choice (the other two depend on the vendor).
    if "amx" in HERE:
        assert chosen == "amx"


def test_explain_names_the_path(bf16_path):
    a, b = jax.ShapeDtypeStruct((8, 16), jnp.bfloat16), jax.ShapeDtypeStruct((16, 4), jnp.bfloat16)
    found = jax_tiled.explain(a, b, backend="cpu")
    assert found.plan == f"the {bf16_path} bfloat16 path"
    assert str(found).endswith(f"; runs the {bf16_path} bfloat16 path")
    # Other dtypes, and bfloat16 into float64 (float64 accumulation), have one path.
    assert jax_tiled.explain(jnp.ones((8, 16)), jnp.ones((16, 4)), backend="cpu").plan == ""


def test_a_path_that_is_not_here_or_not_a_path_is_an_error(monkeypatch, rng):
    # On the CPU: a GPU's products do not read the variable.
    cpu = jax.devices("cpu")[0]
    a, b = (
        jax.device_put(rng.standard_normal(s).astype(jnp.bfloat16), cpu) for s in ((5, 7), (7, 3))
    )
    for value in ["avx9000", *(p for p in PATHS if p not in HERE)]:
        monkeypatch.setenv(VARIABLE, value)
        with pytest.raises(ValueError, match=VARIABLE):
            _ffi.cpu_bf16_path()
        with pytest.raises(Exception, match=f"{VARIABLE}={value}"):
            np.asarray(jax_tiled.matmul(a, b))
    # float32 inputs do not read the variable.
    out = jax_tiled.matmul(np.ones((5, 7), np.float32), np.ones((7, 3), np.float32))
    np.testing.assert_array_equal(np.asarray(out), np.full((5, 3), 7, np.float32))


# ---- Edges of every path's blocking ----

# Rows: AMX's 16-row tiles and 32-row blocks, the 12-row vdpbf16ps and FMA
# blocks; columns: 16-column tiles, 32-column blocks; depths: pairs (odd
# depths pad one), AMX's 32-deep groups, 256-deep slabs.
EDGE_ROWS = (1, 12, 13, 16, 17, 33)
EDGE_COLS = (1, 16, 17, 32, 33)
EDGE_DEPTHS = (1, 2, 31, 33, 256, 257, 1025)


@pytest.mark.parametrize("ta,tb", LAYOUTS)
def test_register_block_edges(bf16_path, rng, ta, tb):
    for m, n in itertools.product(EDGE_ROWS, EDGE_COLS):
        k = 65 if (m + n) % 2 else 2
        a, b, opa, opb = operands(rng, m, n, k, ta, tb, BF16)
        check(run(a, b, ta, tb), opa, opb)


@pytest.mark.parametrize("k", EDGE_DEPTHS)
def test_depth_edges(bf16_path, rng, k):
    for ta, tb in LAYOUTS:
        a, b, opa, opb = operands(rng, 35, 49, k, ta, tb, BF16)
        check(run(a, b, ta, tb), opa, opb)


@pytest.mark.parametrize(
    "m,n,k",
    [
        (1025, 40, 70),  # tiles of 1024 rows
        (30, 1025, 70),  # and columns
        (300, 600, 300),  # AMX's 256-row and 256-column blocks of C
        (37, 50, 2100),  # AMX's 1024-deep packs, three of them
        (1100, 1100, 20),
    ],
)
def test_tile_and_block_edges(bf16_path, rng, m, n, k):
    for ta, tb in ((False, False), (True, True)):
        a, b, opa, opb = operands(rng, m, n, k, ta, tb, BF16)
        check(run(a, b, ta, tb), opa, opb)


@pytest.mark.parametrize("batch_a,batch_b", [(3, 3), (1, 3), (3, 1)])
def test_batches(bf16_path, rng, batch_a, batch_b):
    for ta, tb in LAYOUTS:
        a, b, opa, opb = operands(rng, 14, 35, 260, ta, tb, BF16, batch_a=batch_a, batch_b=batch_b)
        out = run(a, b, ta, tb)
        assert out.shape == (3, 14, 35)
        check(out, opa, opb)


@pytest.mark.parametrize("out_dtype", [BF16, F16, F32, F64])
def test_result_dtypes(bf16_path, rng, out_dtype):
    """Into bfloat16 and float16 through a float32 tile, into float32 in place;
    into float64 on the float64 FMA kernel whatever the path."""
    with x64():
        a, b, opa, opb = operands(rng, 45, 70, 300, False, True, BF16)
        out = run(a, b, False, True, out_dtype=out_dtype)
        assert out.dtype == out_dtype
        check(out, opa, opb, out_dtype)
        if out_dtype == F64:
            exact = opa.astype(np.float64) @ opb.astype(np.float64)
            np.testing.assert_allclose(out, exact, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("out_dtype", [BF16, F16])
@pytest.mark.parametrize("m,n,k", [(300, 520, 64), (70, 300, 1024), (40, 90, 1025)], ids=str)
def test_16_bit_results_are_the_float32_results_rounded(bf16_path, rng, out_dtype, m, n, k):
    """A 16-bit result is rounded from the float32 sums block by block, as each
    block's last slab ends (kernel_impl.h, RunTile): with K in one slab from
    a reused block of accumulators, with K past one slab from the tile's.
    Every element is its float32 result rounded, past block and tile edges."""
    a, b, _, _ = operands(rng, m, n, k, False, False, BF16)
    wide = run(a, b, out_dtype=F32)
    np.testing.assert_array_equal(run(a, b, out_dtype=out_dtype), wide.astype(out_dtype))


def test_zero_size_dimensions(bf16_path):
    for m, k, n in [(0, 5, 3), (4, 5, 0), (4, 0, 3)]:
        out = jax_tiled.matmul(jnp.ones((m, k), jnp.bfloat16), jnp.ones((k, n), jnp.bfloat16))
        assert out.shape == (m, n) and out.dtype == BF16 and not np.any(np.asarray(out))


# ---- Determinism ----


def test_bitwise_deterministic_and_independent_of_tiling(bf16_path, rng):
    """The same product twice is bitwise the same, and rows and columns computed
    as part of a large product (other tiles, other threads, other blocks of C)
    equal the same rows and columns computed alone."""
    a, b, _, _ = operands(rng, 700, 1100, 1300, False, False, BF16)
    whole = run(a, b)
    np.testing.assert_array_equal(run(a, b), whole)
    np.testing.assert_array_equal(run(a[:, 100:113], b), whole[:, 100:113])
    np.testing.assert_array_equal(run(a[:, 290:310], b), whole[:, 290:310])
    np.testing.assert_array_equal(run(a, b[:, :, 1000:1037]), whole[:, :, 1000:1037])


# ---- Special values and subnormals ----


@pytest.mark.parametrize("out_dtype", [BF16, F32])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: f"tA{int(t[0])}tB{int(t[1])}")
def test_special_values(bf16_path, rng, out_dtype, layout):
    """NaN, +-inf and overflow where true arithmetic gives them (the cases of
    test_special_values, with its checks)."""
    m, k, n = 197, 263, 131
    ta, tb = layout
    a, b, sub_rows = special_operands(rng, m, k, n, BF16)
    out = jax.jit(
        lambda a, b: jax_tiled.tiled_matmul_p.bind(
            a,
            b,
            transpose_a=ta,
            transpose_b=tb,
            out_dtype=out_dtype,
            precision=lax.Precision.DEFAULT,
            kernel="auto",
        )[0]
    )(stored(a, ta), stored(b, tb))
    assert_special_values(
        out,
        a,
        b,
        platform="cpu",
        precision=None,
        out_dtype=out_dtype,
        subnormal_rows=sub_rows,
    )


def test_subnormals_are_flushed_as_xla_cpu_flushes_them(bf16_path):
    """vdpbf16ps and AMX read subnormal inputs as zero and flush subnormal
    results to zero whatever MXCSR says; XLA:CPU runs its computations, and
    with them the fallback, with MXCSR flushing both as well. So every path
    gives what jnp.matmul gives here: zero."""
    tiny = float(jnp.finfo(jnp.bfloat16).tiny)  # the smallest normal, 2^-126
    a = jnp.asarray([[tiny / 4, 1.0], [1e-20, 0.0], [tiny, 0.0]], jnp.bfloat16)
    b = jnp.asarray([[1.0, 1e-20], [0.0, 0.0]], jnp.bfloat16)
    assert float(a[0, 0]) != 0  # a subnormal operand ...
    out = np.asarray(jax_tiled.matmul(a, b, preferred_element_type=jnp.float32))
    peer = np.asarray(jnp.matmul(a, b, preferred_element_type=jnp.float32))
    # ... read as zero; 1e-20 * 1e-20 and 2^-126 * 1e-20 are subnormal results.
    assert out[0, 0] == 0 and out[1, 1] == 0 and out[2, 1] == 0
    assert out[2, 0] == np.float32(tiny)  # the smallest normal stays
    if bf16_path == "fallback":
        np.testing.assert_array_equal(out, peer)


# ---- Under transformations ----


def test_jit_grad_and_vmap(bf16_path, rng):
    x = jnp.asarray(rng.standard_normal((64, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 40)) / 10, jnp.bfloat16)

    def loss(mm):
        return lambda x, w: jnp.sum(jnp.tanh(mm(x, w).astype(jnp.float32)))

    got = jax.jit(jax.grad(loss(jax_tiled.matmul), argnums=(0, 1)))(x, w)
    want = jax.grad(loss(jnp.matmul), argnums=(0, 1))(x, w)
    for g, h in zip(got, want):
        assert g.dtype == h.dtype == BF16
        np.testing.assert_allclose(np.asarray(g, F32), np.asarray(h, F32), rtol=0.05, atol=0.05)
    batched = jax.vmap(jax_tiled.matmul, in_axes=(0, None))(jnp.stack([x, -x]), w)
    np.testing.assert_array_equal(np.asarray(batched[0]), np.asarray(jax_tiled.matmul(x, w)))
    np.testing.assert_array_equal(np.asarray(batched[1]), -np.asarray(batched[0]))


# ---- Accuracy against jnp.matmul ----


@pytest.mark.parametrize("distribution", ["positive", "normal"])
@pytest.mark.parametrize("out_dtype", [F32, BF16])
def test_as_accurate_as_jnp(bf16_path, rng, distribution, out_dtype):
    """Error against float64 within 1.2x jnp.matmul's and bias within 2x (the
    protocol's targets, with test_accuracy's room for the output's rounding
    and for chance), over K = 8192, on positive inputs (which expose a lean)
    and normal ones."""
    m, k, n = 128, 8192, 96
    if distribution == "positive":
        a, b = rng.uniform(0.5, 1.5, (m, k)), rng.uniform(0.5, 1.5, (k, n))
    else:
        a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    a, b = jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)

    def error_and_bias(out):
        diff = np.asarray(out, np.float64) - ref
        return np.linalg.norm(diff) / np.linalg.norm(ref), np.mean(diff) / np.mean(np.abs(ref))

    peer_error, peer_bias = error_and_bias(jnp.matmul(a, b, preferred_element_type=out_dtype))
    error, bias = error_and_bias(jax_tiled.matmul(a, b, preferred_element_type=out_dtype))
    floor = float(jnp.finfo(out_dtype).eps) / 4
    bias_floor = floor + 3 * 1.2 * peer_error / np.sqrt(m * n)
    assert error <= 1.2 * peer_error + floor, (error, peer_error)
    assert abs(bias) <= 2 * abs(peer_bias) + bias_floor, (bias, peer_bias)
