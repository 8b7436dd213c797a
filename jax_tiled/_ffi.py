"""Load the compiled extension modules and register their FFI targets with XLA.

The CPU module is always built; the CUDA module exists only where the package
was built with nvcc. Each module exports its kernel table's facts (no GPU
needed), from which the kernel names, and the tests' lists of kernels, derive.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import numpy as np
from jax import lax

# platform name as jax.ffi.register_ffi_target spells it -> extension module
_MODULES = {"cpu": "jax_tiled._cpu", "CUDA": "jax_tiled._cuda"}

# FFI target per lowering platform (as jax.ffi.ffi_lowering / mlir lowering name it)
TARGETS = {"cpu": "tiled_matmul_cpu", "cuda": "tiled_matmul_cuda"}


@functools.cache
def _load(platform: str):
    """The extension module for `platform`, with its targets registered, or None."""
    try:
        module = importlib.import_module(_MODULES[platform])
    except ImportError as error:
        if platform == "cpu":  # always built: without it the package is not installed
            raise ImportError(
                f"jax_tiled's compiled CPU module is missing ({error}). Install the package "
                f"with `pip install .`, and import it from outside the source tree "
                f"(this jax_tiled is {__file__})."
            ) from error
        return None
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return module


def load_all() -> None:
    for platform in _MODULES:
        _load(platform)


def cuda_module_built() -> bool:
    return _load("CUDA") is not None


@dataclasses.dataclass(frozen=True)
class KernelFacts:
    """One kernel of a module's table (the CUDA ladder: cpp/cuda/kernel_table.cu)."""

    name: str
    listed: bool  # offered by jax_tiled.kernels(); False: for the test suite only
    tensor_cores: bool  # computes on the tensor cores (mma.sync, wgmma)
    true_fp32: bool  # float32 at precision HIGHEST; else TF32 (DEFAULT) or 3xTF32 (HIGH)
    min_capability: int  # CUDA compute capability, major * 10 + minor (0 on CPU)
    hopper_only: bool  # sm_90a instructions: compute capability 9.0 exactly
    # Reads an operand given as a slice of a stack (cpp/stack_slice.h) in place;
    # for the others the CUDA handler copies the slice out first.
    stack_slices: bool
    # Reads an operand stored transposed as fast as one stored plainly, so the
    # lowering passes a transpose as the kernel's flag, not as XLA's copy.
    reads_transposes: bool
    inputs: tuple[str, ...]  # the operand dtypes it computes (numpy names)
    outputs: tuple[str, ...]  # the result dtypes it writes
    # CPU: the paths bfloat16 inputs (into a non-float64 result) can take, preferred
    # first, and those this machine runs; JAX_TILED_CPU_BF16 names one (docs/api.md).
    bf16_paths: tuple[str, ...] = ()
    bf16_paths_here: tuple[str, ...] = ()
    # CUDA: the kernel's rung of the ladder, its file's number
    # (cpp/cuda/kernels/<rung>_<technique>.cu); None on CPU.
    rung: int | None = None


@functools.cache
def kernel_table(platform: str) -> tuple[KernelFacts, ...]:
    """Every kernel compiled for a lowering platform ('cpu' or 'cuda'), in
    ladder order: () where this build has no module for it."""
    module = _load("cpu" if platform == "cpu" else "CUDA")
    if module is None:
        return ()
    tuples = ("inputs", "outputs", "bf16_paths", "bf16_paths_here")
    return tuple(
        KernelFacts(**{**row, **{key: tuple(row[key]) for key in tuples if key in row}})
        for row in module.kernel_table()
    )


def cpu_bf16_path() -> str:
    """The path the CPU kernel takes for bfloat16 inputs into a non-float64 result
    now, as its handler decides it (JAX_TILED_CPU_BF16, or the first of the CPU
    table's bf16_paths that this machine runs and "auto" takes). ValueError if
    the variable names a path this build lacks or this machine cannot run."""
    return _load("cpu").bf16_path()


def kernel_names(platform: str) -> tuple[str, ...]:
    """The kernels offered on a lowering platform ('cpu' or 'cuda')."""
    return tuple(k.name for k in kernel_table(platform) if k.listed)


@functools.cache
def cuda_ladder_names() -> tuple[str, ...]:
    """Every kernel of the CUDA ladder by name (cpp/cuda/kernel_names.h), from
    the CPU module, so that an install without the CUDA module knows them."""
    return tuple(_load("cpu").cuda_kernel_names())


# lax.Precision -> the FFI attribute the handlers decode (problem.h: Precision).
PRECISION_CODES = {lax.Precision.DEFAULT: 0, lax.Precision.HIGH: 1, lax.Precision.HIGHEST: 2}

# A problem every kernel can run, for questions about dtypes alone:
# (batch_a, batch_b, m, n, k, transpose_a, transpose_b).
ANY_PROBLEM = (1, 1, 64, 64, 64, False, False)

HOPPER = 90  # compute capability (major * 10 + minor) assumed where no GPU is visible
H100_MULTIPROCESSORS = 132  # SMs assumed where no GPU is visible (an H100's, an H200's)


def cuda_multiprocessors() -> int:
    """The SM count of the first CUDA device, or an H100's without one."""
    try:
        return getattr(jax.devices("cuda")[0], "core_count", None) or H100_MULTIPROCESSORS
    except RuntimeError:
        return H100_MULTIPROCESSORS


def cuda_compute_capability() -> int:
    """major * 10 + minor of the first CUDA device, or HOPPER without one."""
    try:
        text = getattr(jax.devices("cuda")[0], "compute_capability", None)
    except RuntimeError:
        return HOPPER
    if not text:
        return HOPPER
    major, minor = (int(part) for part in str(text).split(".")[:2])
    return 10 * major + minor


def refusal(
    platform: str,
    kernel: str,
    dtype,
    out_dtype,
    problem=ANY_PROBLEM,
    precision=lax.Precision.DEFAULT,
) -> str:
    """Why `kernel` cannot run a dtype -> out_dtype product of this shape
    (ANY_PROBLEM's fields) at this precision (a lax.Precision or its name) on
    `platform`'s first device, or '' if it can."""
    if platform == "cpu" or kernel == "auto":
        return ""  # the CPU kernel and "auto" take every supported problem
    code = PRECISION_CODES[lax.Precision(precision)]
    return _load("CUDA").kernel_refusal(
        kernel,
        np.dtype(dtype).name,
        np.dtype(out_dtype).name,
        *problem,
        code,
        cuda_compute_capability(),
    )


def cuda_explain(
    dtype: str,
    out_dtype: str,
    problem,
    multiprocessors: int,
    precision=lax.Precision.DEFAULT,
    laid_terms: int = 1,
) -> tuple[str, str, str]:
    """The CUDA module's own account of what kernel="auto" runs at this precision
    (a lax.Precision or its name; no GPU needed): (kernel, why, launch plan).
    laid_terms > 1: the operands are parts laid along K (`_presets.PartsLaid`)."""
    code = PRECISION_CODES[lax.Precision(precision)]
    kernel, reason, plan = _load("CUDA").explain_auto(
        dtype,
        out_dtype,
        *problem,
        code,
        multiprocessors,
        cuda_compute_capability(),
        laid_terms=laid_terms,
    )
    return kernel, reason, plan


@dataclasses.dataclass(frozen=True)
class CudaPlan:
    """The launch plan a CUDA kernel runs one product with (cpp/cuda/kernel.h,
    LaunchPlan): its words, as explain prints them, and its tiling."""

    text: str
    block_m: int  # each block's output tile (1 x 1: the naive kernel, no tiles)
    block_n: int
    stages: int  # slabs its pipeline keeps in shared memory (0: none)
    cluster_m: int  # blocks of a cluster that share each B tile (TMA multicast)
    split_k: int  # > 1: K split among a cluster's blocks
    # > 1: ... and among this many clusters a tile (through scratch); with
    # split_k 1 (the SIMT kernels), this many parts of K, a block each
    split_groups: int
    swap_ab: bool  # computes C^T = B^T A^T (block_m, block_n tile C^T)
    persistent_blocks: int  # a persistent grid's blocks (0: one block per tile)
    # loads each operand row as whole 16-byte lines (the lowering pads rows
    # off them where that moves auto onto such a plan: padding_to_whole_lines)
    reads_whole_lines: bool
    # reads an operand stored transposed as fast as one stored plainly (its
    # kernel, for every product), or faster than XLA's copy and the product
    # on it (this plan): the lowering then passes a transpose as the kernel's
    # flag (reads_as_stored)
    reads_transposes: bool


def cuda_plan(
    kernel: str,
    dtype,
    out_dtype,
    problem=ANY_PROBLEM,
    precision=lax.Precision.DEFAULT,
    *,
    multiprocessors: int | None = None,
    shared_bytes_per_block: int = 0,
    max_threads_per_block: int = 0,
    laid_terms: int = 1,
) -> CudaPlan | None:
    """The plan `kernel` runs a dtype -> out_dtype product of this shape
    (ANY_PROBLEM's fields) with at this precision, on a GPU of this many SMs
    (default: the first CUDA device's, an H100's without one) and this compute
    capability (cuda_compute_capability()), with these per-block limits (0:
    an H100's, which every sm_80+ GPU has), for operands laid as `laid_terms`
    says (cuda_explain's): the planner the handler calls, no GPU needed. None
    where the kernel refuses the product."""
    code = PRECISION_CODES[lax.Precision(precision)]
    found = _load("CUDA").kernel_plan(
        kernel,
        np.dtype(dtype).name,
        np.dtype(out_dtype).name,
        *problem,
        code,
        cuda_multiprocessors() if multiprocessors is None else multiprocessors,
        cuda_compute_capability(),
        shared_bytes_per_block,
        max_threads_per_block,
        laid_terms,
    )
    return None if found is None else CudaPlan(**found)
