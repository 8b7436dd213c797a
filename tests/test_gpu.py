"""GPU-only checks: CUDA-graph capture, operands past 2**31 elements, and the
kernel list. Everything else runs on the GPU through the `platform` fixture."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tiled

pytestmark = pytest.mark.gpu

# A jitted loop whose body XLA may capture into a CUDA graph (command buffer):
# our custom call must be inside it, which it only can be with the
# command-buffer trait, and the loop's result must be right.
COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import re, jax, jax.numpy as jnp, numpy as np, jax_tiled
    rng = np.random.default_rng(0)
    a = rng.standard_normal((96, 80)).astype(np.float32)
    w = (rng.standard_normal((80, 80)) / 9).astype(np.float32)

    def loop(a, w):
        body = lambda i, x: jnp.tanh(jax_tiled.matmul(x, w, precision="highest")) * 1.5 + 0.1
        return jax.lax.fori_loop(0, 4, body, a)

    f = jax.jit(loop)
    hlo = f.lower(a, w).compile().as_text()
    computations = re.split(r"\\n\\s*\\n", hlo)
    captured = [c for c in computations if "command_buffer" in c.split("\\n", 1)[0]
                and "tiled_matmul_cuda" in c]
    print("captured computations:", len(captured))
    if not captured:
        print(hlo)
    x = a.astype(np.float64)
    for _ in range(4):
        x = np.tanh(x @ w) * 1.5 + 0.1
    np.testing.assert_allclose(np.asarray(f(a, w)), x, rtol=1e-5, atol=1e-5)
    assert captured, "tiled_matmul_cuda was not captured into a command buffer"
    print("OK")
""")


def test_custom_call_is_captured_into_a_cuda_graph(tmp_path):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        " --xla_gpu_graph_min_graph_size=1").strip()
    result = subprocess.run([sys.executable, "-c", COMMAND_BUFFER_SCRIPT], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-4000:] + result.stderr[-4000:]


def test_operand_over_2_31_elements():
    """bfloat16 (2**21 + 1) x 1024 @ 1024 x 64: a has 2**31 + 1024 elements, so
    any 32-bit index arithmetic would wrap. Spot-check first and last rows."""
    m, k, n = 2**21 + 1, 1024, 64
    key_a, key_b = jax.random.split(jax.random.key(0))
    with jax.default_device(jax.devices("cuda")[0]):
        a = jax.random.normal(key_a, (m, k), jnp.bfloat16)
        b = jax.random.normal(key_b, (k, n), jnp.bfloat16)
        for kernel in jax_tiled.kernels("gpu"):
            out = jax.jit(lambda a, b: jax_tiled.matmul(a, b, preferred_element_type=jnp.float32,
                                                        kernel=kernel))(a, b)
            rows = np.r_[0:4, m // 2, m - 4:m]
            ref = np.asarray(a[rows], np.float64) @ np.asarray(b, np.float64)
            np.testing.assert_allclose(np.asarray(out[rows]), ref, rtol=1e-4, atol=1e-3)
            del out


def test_cuda_kernels_listed():
    names = jax_tiled.kernels("gpu")
    assert "smem" in names and "smem16" in names
    assert "smem_racy_for_testing" not in names
