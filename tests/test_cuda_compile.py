"""The Hopper kernels as ptxas compiles them: no wgmma issued one at a time.

ptxas serialises a kernel's wgmmas (each waits for the one before) where it
finds too few registers for their pipeline, and says so only as information
under -v ("C7511 ... wgmma.mma_async instructions are serialized"): the
build stays green while the products run slower. It did so to every kernel
that staged a float32 C until 2026-11-25 (cpp/cuda/NOTES.md, "wgmma
serialised by its float32 output"). Each per-input unit of a Hopper-only
kernel of the table is compiled here for sm_90a, as cmake/cuda.cmake
generates it, and ptxas's report read. Needs nvcc and a checkout (the C++
sources); CI has both.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import jax
import pytest

from jax_tiled import _ffi

ROOT = Path(__file__).resolve().parent.parent
NVCC = shutil.which("nvcc")
# The input types cmake/cuda.cmake instantiates each launcher for.
INPUT_TYPES = ("__half", "__nv_bfloat16", "float")


def per_input_launchers() -> dict[str, str]:
    """{kernel file stem: its launcher}, cmake/cuda.cmake's JAX_TILED_PER_INPUT_LAUNCHERS."""
    cmake = (ROOT / "cmake" / "cuda.cmake").read_text()
    return dict(re.findall(r'"(\d+_\w+):(Launch\w+)"', cmake))


def hopper_units() -> list[tuple[str, str, str]]:
    """(kernel name, file stem, launcher) of every Hopper-only kernel of the
    table with per-input units."""
    if not (_ffi.cuda_module_built() and (ROOT / "cmake" / "cuda.cmake").is_file()):
        return []
    launchers = per_input_launchers()
    units = []
    for kernel in _ffi.kernel_table("cuda"):
        if not kernel.hopper_only:
            continue
        stem = next(s for s in launchers if int(s.split("_")[0]) == kernel.rung)
        units.append((kernel.name, stem, launchers[stem]))
    return units


def test_the_hopper_kernels_have_per_input_units():
    """The list below is not empty where it can be built: a kernel table
    without a Hopper kernel, or a renamed launcher, fails here, not by
    skipping every compile."""
    if not _ffi.cuda_module_built():
        pytest.skip("this build has no CUDA module")
    assert [name for name, _, _ in hopper_units()] == ["wgmma"]


@pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH")
@pytest.mark.parametrize("input_type", INPUT_TYPES)
@pytest.mark.parametrize("name,stem,launcher", hopper_units(), ids=[u[0] for u in hopper_units()])
def test_ptxas_issues_wgmma_back_to_back(tmp_path, name, stem, launcher, input_type):
    unit = tmp_path / f"{stem}_{input_type}.cu"
    unit.write_text(
        f'#include "cuda/kernels/{stem}.cuh"\n'
        "namespace jax_tiled::cuda {\n"
        f"template JAX_TILED_PER_INPUT_LAUNCHER({launcher}, {input_type});\n"
        "}\n"
    )
    command = [
        NVCC,
        "-std=c++17",
        "-O3",
        "-DNDEBUG",
        "--expt-relaxed-constexpr",
        "--generate-code=arch=compute_90a,code=sm_90a",
        "-Xptxas",
        "-v",
        "-I",
        str(ROOT / "cpp"),
        "-isystem",
        jax.ffi.include_dir(),
        "-c",
        str(unit),
        "-o",
        str(tmp_path / "unit.o"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-4000:]
    serialised = sorted(set(re.findall(r"C7511\).*function '(\w+)'", report)))
    assert "C7511" not in report, f"{name} ({input_type}): ptxas serialises the wgmmas of " + (
        ", ".join(serialised) or report[-4000:]
    )
