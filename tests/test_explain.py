"""jax_tiled.explain: what kernel="auto" runs and why, from the same code that
chooses at run time (the CUDA module answers without a GPU)."""

from __future__ import annotations

import jax
import numpy as np
import jax.numpy as jnp
import pytest

import jax_tiled
from jax_tiled import _ffi

S = jax.ShapeDtypeStruct

needs_cuda_module = pytest.mark.skipif(not _ffi.cuda_module_built(),
                                       reason="this build has no CUDA module")


def test_cpu():
    text = jax_tiled.explain(jnp.ones((3, 4, 5)), jnp.ones((5, 6)), backend="cpu")
    assert text.startswith("cpu: 1 x (12 x 5) @ (5 x 6), float32 -> float32")
    assert text.endswith("blocked: the cache-blocked CPU kernel, the only CPU rung")


def test_forced_kernel_and_promotion():
    text = jax_tiled.explain(S((4, 5), jnp.bfloat16), S((5, 6), jnp.float16), kernel="blocked",
                             precision="highest", preferred_element_type=jnp.float16, backend="cpu")
    assert "float32 -> float16, precision HIGHEST: blocked: forced by kernel='blocked'" in text


def test_bad_input_raises_like_matmul():
    with pytest.raises(ValueError, match="contracting dimensions differ"):
        jax_tiled.explain(S((4, 5), jnp.float32), S((6, 7), jnp.float32))


@needs_cuda_module
@pytest.mark.parametrize("a,b,expected", [
    ((4096, 4096), (4096, 4096), "warptile: 128 x 128 blocks of 8 warps fill the"),
    ((256, 256), (256, 256), "pipelined: 64 x 64 blocks of 2 warps"),
    ((16, 8192), (8192, 8192), "smem16: fewer than 64 rows or columns"),
    ((8192, 64), (64, 40), "smem16: fewer than 64 rows or columns"),
], ids=str)
def test_cuda_auto_by_shape(a, b, expected):
    assert expected in jax_tiled.explain(S(a, jnp.float32), S(b, jnp.float32), backend="gpu")


@needs_cuda_module
def test_cuda_auto_float64():
    with jax.enable_x64(True):
        text = jax_tiled.explain(S((512, 512), jnp.float64), S((512, 512), jnp.float64), backend="gpu")
    assert "smem16: float64" in text


@needs_cuda_module
def test_cuda_auto_by_dtype():
    """16-bit inputs go to the tensor cores; cp.async cannot convert, so
    float64 results go to warptile."""
    text = jax_tiled.explain(S((512, 512), jnp.bfloat16), S((512, 512), jnp.bfloat16),
                             backend="gpu")
    if _ffi.cuda_compute_capability() == _ffi.HOPPER:
        assert "wgmma: 16-bit inputs on a Hopper GPU" in text
    else:
        assert "mma: 16-bit inputs: mma.sync tensor cores, since wgmma needs a Hopper GPU" in text
    with jax.enable_x64(True):
        text = jax_tiled.explain(S((512, 512), jnp.float32), S((512, 512), jnp.float32),
                                 preferred_element_type=jnp.float64, backend="gpu")
    assert "float32 -> float64 needs warptile's converting copies" in text


@needs_cuda_module
@pytest.mark.parametrize("a,b,transpose_a,rows", [
    ((512, 17), (17, 512), False, 17),  # a's rows are K = 17 long
    ((512, 17), (512, 512), True, 17),  # a stored (K, M): rows of M = 17
], ids=str)
def test_cuda_auto_routes_rows_the_copy_engine_cannot_read_to_mma(a, b, transpose_a, rows):
    (m, k), n = ((a[1], a[0]) if transpose_a else a), b[1]
    problem = (1, 1, m, n, k, transpose_a, False)
    text = _ffi.cuda_explain("bfloat16", "bfloat16", problem, 132)
    if _ffi.cuda_compute_capability() == _ffi.HOPPER:
        assert text.startswith("mma: 16-bit inputs: mma.sync tensor cores, since the TMA copy "
                               f"engine needs rows and batches that start at multiples of 16 "
                               f"bytes (a's rows are {rows} elements")
    assert _ffi.refusal("cuda", "mma", jnp.bfloat16, jnp.bfloat16, problem) == ""


@needs_cuda_module
def test_refusal_names_the_kernel_and_dtypes():
    assert _ffi.refusal("cuda", "pipelined", np.float32, np.float32) == ""
    assert _ffi.refusal("cuda", "pipelined", np.float32, jnp.bfloat16) == ""
    why = _ffi.refusal("cuda", "pipelined", jnp.float16, np.float32)
    assert "kernel 'pipelined'" in why and "got float16 -> float32" in why
    assert "got float32 -> float64" in _ffi.refusal("cuda", "pipelined", np.float32, np.float64)
    assert _ffi.refusal("cuda", "warptile", jnp.float16, np.float32) == ""
    for kernel in ("mma", "wgmma"):
        assert "got float32 -> float32" in _ffi.refusal("cuda", kernel, np.float32, np.float32)
        assert "got bfloat16 -> float64" in _ffi.refusal("cuda", kernel, jnp.bfloat16, np.float64)
    assert _ffi.refusal("cuda", "mma", jnp.float16, np.float32) == ""
    batch_stride_odd = (3, 3, 9, 64, 64, True, False)  # a stored (3, 64, 9): rows of 9
    assert "kernel 'wgmma' reads operands with the TMA copy engine" in _ffi.refusal(
        "cuda", "wgmma", jnp.bfloat16, jnp.bfloat16, batch_stride_odd)
