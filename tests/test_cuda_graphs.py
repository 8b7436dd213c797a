"""The CUDA handler carries XLA's command-buffer trait: a jitted loop's custom
call is captured into a CUDA graph (checked in a subprocess, with command
buffers forced on and XLA's thunk sequence dumped)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

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
