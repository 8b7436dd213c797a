"""GPU-only checks: CUDA-graph capture, operands past 2**31 elements, and the
kernel list. Everything else runs on the GPU through the `platform` fixture."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tiled
from conftest import assert_matmul_close

pytestmark = pytest.mark.gpu


def _captured_custom_calls(thunk_sequence: str) -> int:
    """Custom-call thunks nested (indented) under a command-buffer thunk."""
    count, buffer_indent = 0, None
    for line in thunk_sequence.splitlines():
        indent = len(line) - len(line.lstrip())
        if buffer_indent is not None and indent <= buffer_indent:
            buffer_indent = None
        if "kCommandBuffer" in line:
            buffer_indent = indent
        elif buffer_indent is not None and "kCustomCall" in line:
            count += 1
    return count


def test_custom_call_is_captured_into_a_cuda_graph(tmp_path):
    # This process holds jax's preallocated share of the GPU; the child must
    # not ask for another (two 75% shares do not fit an 80 GB card).
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        f" --xla_gpu_graph_min_graph_size=1 --xla_dump_to={tmp_path}").strip()
    script = os.path.join(os.path.dirname(__file__), "command_buffer_case.py")
    result = subprocess.run([sys.executable, script], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    error = float(re.search(r"max error (\S+)", result.stdout).group(1))
    assert error < 1e-5
    dumps = list(tmp_path.glob("*jit_loop*thunk_sequence_after_thunk_passes.txt"))
    assert dumps, sorted(p.name for p in tmp_path.iterdir())
    sequence = dumps[0].read_text()
    assert _captured_custom_calls(sequence) == 1, sequence


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: np.dtype(d).name)
def test_operand_over_2_31_elements(dtype):
    """(2**21 + 1) x 1024 @ 1024 x 64: a has 2**31 + 1024 elements, so any
    32-bit index arithmetic would wrap. Spot-check first and last rows."""
    m, k, n = 2**21 + 1, 1024, 64
    key_a, key_b = jax.random.split(jax.random.key(0))
    with jax.default_device(jax.devices("cuda")[0]):
        a = jax.random.normal(key_a, (m, k), dtype)
        b = jax.random.normal(key_b, (k, n), dtype)
        true_fp32 = jax_tiled.kernels("gpu", dtype, jnp.float32, precision="highest")
        for kernel in jax_tiled.kernels("gpu", dtype, jnp.float32):
            # Each rung at the precision it computes: float32 on the tensor-core
            # rungs is TF32 (DEFAULT), on the others true fp32 (HIGHEST).
            precision = "highest" if kernel in true_fp32 else "default"
            out = jax.jit(lambda a, b: jax_tiled.matmul(a, b, preferred_element_type=jnp.float32,
                                                        precision=precision, kernel=kernel))(a, b)
            rows = np.r_[0:4, m // 2, m - 4:m]
            assert_matmul_close(out[rows], a[rows], b, platform="cuda", precision=precision,
                                out_dtype=np.float32)
            del out


def test_cuda_kernels_listed():
    names = jax_tiled.kernels("gpu")
    assert {"smem", "smem16", "regblock", "warptile", "pipelined", "mma"} <= set(names)
    assert "pipelined" not in jax_tiled.kernels("gpu", jnp.bfloat16)
    assert "mma" in jax_tiled.kernels("gpu", jnp.bfloat16)
    # float32 runs on the tensor cores as TF32 (DEFAULT) or 3xTF32 (HIGH), never
    # as the true fp32 that HIGHEST asks for.
    assert "mma" in jax_tiled.kernels("gpu", jnp.float32)
    assert "mma" in jax_tiled.kernels("gpu", jnp.float32, precision="high")
    highest = set(jax_tiled.kernels("gpu", jnp.float32, precision="highest"))
    assert not {"mma", "wgmma"} & highest
    assert {"smem", "smem16", "regblock", "warptile", "pipelined"} <= highest
    with jax.default_matmul_precision("float32"):  # precision=None honours it
        assert not {"mma", "wgmma"} & set(jax_tiled.kernels("gpu", jnp.float32))
    assert "mma" not in jax_tiled.kernels("gpu", jnp.float32, jnp.float64)
    assert "smem_racy_for_testing" not in names


def test_forced_kernel_refuses_dtypes_it_cannot_compute():
    a = jnp.ones((8, 8), jnp.bfloat16)
    with jax.default_device(jax.devices("cuda")[0]):
        with pytest.raises(TypeError, match="'pipelined'.*got bfloat16 -> bfloat16"):
            jax_tiled.matmul(a, a, kernel="pipelined")
        # The handler refuses too, for callers that bypass the primitive.
        call = jax.ffi.ffi_call("tiled_matmul_cuda", jax.ShapeDtypeStruct((1, 8, 8), jnp.bfloat16))
        with pytest.raises(Exception, match="'pipelined'.*got bfloat16 -> bfloat16"):
            jax.block_until_ready(call(a[None], a[None], transpose_a=False, transpose_b=False,
                                       precision=np.int32(2), kernel="pipelined"))
