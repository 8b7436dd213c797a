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
    """cp.async cannot convert: 16-bit inputs and float64 results go elsewhere."""
    text = jax_tiled.explain(S((512, 512), jnp.bfloat16), S((512, 512), jnp.bfloat16),
                             backend="gpu")
    assert "warptile: 64 x 64 blocks" in text
    assert "bfloat16 -> bfloat16 needs warptile's converting copies" in text
    with jax.enable_x64(True):
        text = jax_tiled.explain(S((512, 512), jnp.float32), S((512, 512), jnp.float32),
                                 preferred_element_type=jnp.float64, backend="gpu")
    assert "float32 -> float64 needs warptile's converting copies" in text


@needs_cuda_module
def test_kernel_dtype_mismatch_named():
    assert jax_tiled._ffi.dtype_mismatch("cuda", "pipelined", np.float32, np.float32) == ""
    assert jax_tiled._ffi.dtype_mismatch("cuda", "pipelined", np.float32, jnp.bfloat16) == ""
    why = jax_tiled._ffi.dtype_mismatch("cuda", "pipelined", jnp.float16, np.float32)
    assert "kernel 'pipelined'" in why and "got float16 -> float32" in why
    assert "got float32 -> float64" in jax_tiled._ffi.dtype_mismatch("cuda", "pipelined",
                                                                      np.float32, np.float64)
    assert jax_tiled._ffi.dtype_mismatch("cuda", "warptile", jnp.float16, np.float32) == ""
