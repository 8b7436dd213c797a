"""How XLA runs the CUDA custom call inside loops: the handler carries XLA's
command-buffer trait, so a jitted loop's call is captured into a CUDA graph
(checked in a subprocess, with command buffers forced on and XLA's thunk
sequence dumped); and a call on a slice of stacked weights in a `lax.scan`
is not wrapped in XLA's dynamic-slice fusion (_lowering.ffi_product)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled

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
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
        f" --xla_gpu_graph_min_graph_size=1 --xla_dump_to={tmp_path}"
    ).strip()
    script = os.path.join(os.path.dirname(__file__), "scripts", "command_buffer_case.py")
    result = subprocess.run(
        [sys.executable, script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    error = float(re.search(r"max error (\S+)", result.stdout).group(1))
    assert error < 1e-5
    dumps = list(tmp_path.glob("*jit_loop*thunk_sequence_after_thunk_passes.txt"))
    assert dumps, sorted(p.name for p in tmp_path.iterdir())
    sequence = dumps[0].read_text()
    assert _captured_custom_calls(sequence) == 1, sequence


def _computation_holding(hlo_text: str, needle: str) -> str:
    """The name of the HLO computation whose body has a line with `needle`."""
    name = ""
    for line in hlo_text.splitlines():
        header = re.match(r"(?:ENTRY )?%(\S+) \(", line)
        if header:
            name = header.group(1)
        elif needle in line:
            return name
    raise AssertionError(f"{needle} not in the compiled program:\n{hlo_text}")


def test_scan_over_stacked_weights_is_not_a_dynamic_slice_fusion(on_gpu, rng):
    # XLA's dynamic-slice fusion would run the call in a thunk that computes
    # ws[i]'s offset on the host at every step.
    x = rng.standard_normal((128, 128)).astype(np.float32)
    ws = (rng.standard_normal((4, 128, 128)) / np.sqrt(128)).astype(np.float32)

    @jax.jit
    def chain(x, ws):
        return lax.scan(lambda x, w: (jnp.tanh(jax_tiled.matmul(x, w)), None), x, ws)[0]

    hlo = chain.lower(x, ws).compile().as_text()
    holder = _computation_holding(hlo, 'custom_call_target="tiled_matmul_cuda"')
    assert not re.search(rf"kind=kCustom, calls=%{re.escape(holder)}\b", hlo), hlo
    truth = x.astype(np.float64)
    for w in ws:
        truth = np.tanh(truth @ w)
    got = np.asarray(chain(x, ws), np.float64)
    assert np.linalg.norm(got - truth) / np.linalg.norm(truth) < 1e-2  # TF32 products
