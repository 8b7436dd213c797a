"""The tensor-core kernels as ptxas compiles them: no wgmma issued one at a
time, and no register spilled.

ptxas serialises a kernel's wgmmas (each waits for the one before) where it
finds too few registers for their pipeline, and says so only as information
under -v ("C7511 ... wgmma.mma_async instructions are serialized"): the
build stays green while the products run slower. It did so to every kernel
that staged a float32 C until 2026-11-25 (cpp/cuda/NOTES.md, "wgmma
serialised by its float32 output"). A spill is as quiet: mma's small blocks
for 16-bit inputs spilled 8 bytes a thread until 2026-11-26. Each per-input
unit of a tensor-core kernel of the table is compiled here for sm_90a, as
cmake/cuda.cmake generates it, and ptxas's report read. Needs nvcc and a
checkout (the C++ sources); CI has both.
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


def tensor_core_units() -> list[tuple[str, str, str]]:
    """(kernel name, file stem, launcher) of every tensor-core kernel of the
    table with per-input units."""
    if not (_ffi.cuda_module_built() and (ROOT / "cmake" / "cuda.cmake").is_file()):
        return []
    launchers = per_input_launchers()
    units = []
    for kernel in _ffi.kernel_table("cuda"):
        stem = next((s for s in launchers if int(s.split("_")[0]) == kernel.rung), None)
        if kernel.tensor_cores and stem:
            units.append((kernel.name, stem, launchers[stem]))
    return units


def test_the_tensor_core_kernels_have_per_input_units():
    """The list below is not empty where it can be built: a kernel table
    without them, or a renamed launcher, fails here, not by skipping every
    compile."""
    if not _ffi.cuda_module_built():
        pytest.skip("this build has no CUDA module")
    assert [name for name, _, _ in tensor_core_units()] == ["mma", "wgmma"]


@pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH")
@pytest.mark.parametrize("input_type", INPUT_TYPES)
@pytest.mark.parametrize(
    "name,stem,launcher", tensor_core_units(), ids=[u[0] for u in tensor_core_units()]
)
def test_ptxas_neither_serialises_nor_spills(tmp_path, name, stem, launcher, input_type):
    report = ptxas_report(
        tmp_path,
        f'#include "cuda/kernels/{stem}.cuh"\n'
        "namespace jax_tiled::cuda {\n"
        f"template JAX_TILED_PER_INPUT_LAUNCHER({launcher}, {input_type});\n"
        "}\n",
    )
    serialised = sorted(set(re.findall(r"C7511\).*function '(\w+)'", report)))
    assert "C7511" not in report, f"{name} ({input_type}): ptxas serialises the wgmmas of " + (
        ", ".join(serialised) or report[-4000:]
    )
    spilling = spills(report)
    known = KNOWN_SPILLS.get((name, input_type))
    unknown = [(f, n) for f, n in spilling if not (known and known in f)]
    assert not unknown, f"{name} ({input_type}): ptxas spills in " + ", ".join(
        f"{function} ({stores} bytes)" for function, stores in unknown
    )
    if known:
        assert any(known in f for f, _ in spilling), f"{known} no longer spills: drop it here"


@pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH")
def test_warptile_float32_mainloop_does_not_spill(tmp_path):
    """warptile's float32 mainloop (WarpTiledFloat32) holds 64 partial sums,
    two sets of fragments and the next slab's quads in the 128 registers its
    two 128 x 128 blocks an SM allow, with a register or two to spare:
    zeroing the shared totals before the mainloop, or keeping the tile's
    place through it, made ptxas spill (cpp/cuda/NOTES.md, "warptile's
    float32 mainloop"); its 64 x 128 blocks, four an SM, spilled (they run
    three; its 32 x 128 blocks six). Its four layouts on each, as the
    launcher instantiates them."""
    layouts = ("true", "false")
    instances = "".join(
        f"template __global__ void WarpTiledFloat32<{config}, {a}, {b}>"
        "(MatmulDims, const float*, const float*, float*, KParts);\n"
        for config in ("WarpTileLarge", "WarpTileWide", "WarpTileThin")
        for a in layouts
        for b in layouts
    )
    assert_warptile_kernels_do_not_spill(tmp_path, instances, "WarpTiledFloat32", 12)


@pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH")
def test_warptile_row_blocks_do_not_spill(tmp_path):
    """warptile's one-row kernel (RowProduct) holds its double sums and the
    loads in flight (k contiguous: 8 of a warp's 16 columns at a time, a quad
    of each a lane) in registers, in both of B's layouts, quads as one load
    or four, float32 and bfloat16 into C or into the parts' double slots, as
    the launcher instantiates them."""
    flags = ("true", "false")
    instances = "".join(
        f"template __global__ void RowProduct<{k_contiguous}, {vector}, {in_type}, {sum_type}>"
        f"(MatmulDims, const {in_type}*, const {in_type}*, {sum_type}*, KParts);\n"
        for k_contiguous in flags
        for vector in flags
        for in_type in ("float", "__nv_bfloat16")
        for sum_type in (in_type, "double")
    )
    assert_warptile_kernels_do_not_spill(tmp_path, instances, "RowProduct", 16)


def assert_warptile_kernels_do_not_spill(tmp_path: Path, instances: str, kernel: str, count: int):
    """ptxas compiles `count` entry functions of `kernel` from warptile's
    `instances` (explicit instantiations), none of them spilling."""
    report = ptxas_report(
        tmp_path,
        '#include "cuda/kernels/3_simt_warptiled.cuh"\n'
        f"namespace jax_tiled::cuda {{\n{instances}}}\n",
    )
    compiled = re.findall(rf"Compiling entry function '(\w*{kernel}\w*)'", report)
    assert len(compiled) == count, report[-4000:]
    assert not spills(report), spills(report)


def ptxas_report(tmp_path: Path, source: str) -> str:
    """ptxas -v's report on `source` compiled for sm_90a as the build compiles
    the kernels (a failed compile fails the test)."""
    unit = tmp_path / "unit.cu"
    unit.write_text(source)
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
    return report


# Spills found and not yet fixed, by unit: (kernel, input type) -> the part
# of the spilling functions' mangled names that names them. None now.
KNOWN_SPILLS: dict[tuple[str, str], str] = {}


def spills(report: str) -> list[tuple[str, int]]:
    """(function, bytes) of every function ptxas -v reports a spill store in:
    "Compiling entry function 'F'", later its "N bytes spill stores"."""
    found, function = [], None
    for line in report.splitlines():
        if entry := re.search(r"Compiling entry function '(\w+)'", line):
            function = entry.group(1)
        elif (stores := re.search(r"(\d+) bytes spill stores", line)) and int(stores.group(1)):
            found.append((function, int(stores.group(1))))
    return found


def test_spills_reads_ptxas_reports():
    """The reader above on a report of the spill it was written for (mma's
    small 16-bit blocks at four an SM), and on a clean one."""
    entry = "ptxas info    : Compiling entry function '_Z3mmav' for 'sm_90a'"
    properties = "ptxas info    : Function properties for _Z3mmav"
    spilled = "    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads"
    clean = "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
    assert spills("\n".join([entry, properties, spilled])) == [("_Z3mmav", 8)]
    assert spills("\n".join([entry, properties, clean])) == []
