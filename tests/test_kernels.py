"""Which kernels there are and which one runs: `kernels()` by backend, dtype and
precision; the refusals behind it; and `explain`, what kernel="auto" runs and
why, from the same code that chooses at run time (the CUDA module answers
without a GPU), read field by field."""

from __future__ import annotations

import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from helpers import (
    CPU_KERNELS,
    CUDA_TABLE,
    F32,
    SIMT_KERNELS,
    TENSOR_CORE_KERNELS,
    admits,
    needs_cuda_module,
    tensor_cores_of_this_gpu,
)
from jax_tiled import _ffi

S = jax.ShapeDtypeStruct


def test_cpu():
    found = jax_tiled.explain(jnp.ones((3, 4, 5)), jnp.ones((5, 6)), backend="cpu")
    assert isinstance(found, jax_tiled.Explanation)
    assert found.platform == "cpu" and found.problem == (1, 1, 12, 6, 5, False, False)
    assert (found.dtype, found.out_dtype, found.precision) == ("float32", "float32", "DEFAULT")
    assert found.kernel == "blocked" and found.plan == "" and found.runs_as == ""
    assert found.reason == "the cache-blocked CPU kernel, the only CPU kernel"
    assert str(found) == (
        "cpu: 1 x (12 x 5) @ (5 x 6), float32 -> float32, precision DEFAULT: "
        "blocked: the cache-blocked CPU kernel, the only CPU kernel"
    )


def test_a_broadcast_batch_is_a_batch_of_one():
    found = jax_tiled.explain(S((7, 5), jnp.float32), S((3, 5, 6), jnp.float32), backend="cpu")
    assert found.problem == (1, 3, 7, 6, 5, False, False) and found.batch == 3
    assert str(found).startswith("cpu: 3 x (7 x 5) @ (5 x 6), float32 -> float32")


def test_forced_kernel_and_promotion():
    found = jax_tiled.explain(
        S((4, 5), jnp.bfloat16),
        S((5, 6), jnp.float16),
        kernel="blocked",
        precision="highest",
        preferred_element_type=jnp.float16,
        backend="cpu",
    )
    assert (found.dtype, found.out_dtype, found.precision) == ("float32", "float16", "HIGHEST")
    assert (found.kernel, found.reason) == ("blocked", "forced by kernel='blocked'")
    assert "float32 -> float16, precision HIGHEST: blocked: forced by kernel='blocked'" in str(
        found
    )


@pytest.mark.parametrize(
    "precision,name",
    [
        (None, "DEFAULT"),
        ("high", "HIGH"),
        ("tensorfloat32", "HIGH"),
        ("bfloat16", "DEFAULT"),
        ("float32", "HIGHEST"),
        (("default", "highest"), "HIGHEST"),
    ],
    ids=str,
)
def test_head_names_the_precision(precision, name):
    found = jax_tiled.explain(
        S((8, 16), jnp.float32), S((16, 4), jnp.float32), precision=precision, backend="cpu"
    )
    assert (found.precision, found.kernel) == (name, "blocked")


def test_head_honours_default_matmul_precision():
    with jax.default_matmul_precision("tensorfloat32"):
        found = jax_tiled.explain(S((8, 16), jnp.float32), S((16, 4), jnp.float32), backend="cpu")
    assert (found.precision, found.kernel) == ("HIGH", "blocked")


def test_bad_input_raises_like_matmul():
    with pytest.raises(ValueError, match="contracting dimensions differ"):
        jax_tiled.explain(S((4, 5), jnp.float32), S((6, 7), jnp.float32))


@needs_cuda_module
@pytest.mark.parametrize(
    "a,b,kernel,reason",
    [
        ((4096, 4096), (4096, 4096), "warptile", "128 x 128 blocks of 8 warps fill the"),
        ((256, 256), (256, 256), "pipelined", "64 x 64 blocks of 2 warps"),
        ((48, 8192), (8192, 8192), "smem16", "fewer than 64 rows or columns"),
        ((16, 8192), (8192, 8192), "warptile", "at most 32 rows"),
        ((8192, 64), (64, 40), "smem16", "fewer than 64 rows or columns"),
    ],
    ids=str,
)
def test_cuda_auto_by_shape(a, b, kernel, reason):
    """float32 at HIGHEST: true fp32, on the SIMT kernels."""
    found = jax_tiled.explain(
        S(a, jnp.float32), S(b, jnp.float32), precision="highest", backend="gpu"
    )
    assert found.kernel == kernel and found.reason.startswith(reason), found
    assert "tiles" in found.plan, found
    assert str(found).endswith(f"{kernel}: {found.reason}; runs {found.plan}")


@needs_cuda_module
def test_cuda_auto_float64():
    with jax.enable_x64(True):
        found = jax_tiled.explain(
            S((512, 512), jnp.float64), S((512, 512), jnp.float64), backend="gpu"
        )
    assert found.kernel == "smem16" and found.reason.startswith("float64"), found


@needs_cuda_module
def test_cuda_auto_by_dtype():
    """16-bit inputs go to the tensor cores; cp.async cannot convert, so
    float64 results go to warptile."""
    found = jax_tiled.explain(
        S((1024, 1024), jnp.bfloat16), S((1024, 1024), jnp.bfloat16), backend="gpu"
    )
    if _ffi.cuda_compute_capability() == _ffi.HOPPER:
        assert found.kernel == "wgmma" and found.reason.startswith("16-bit inputs on a Hopper GPU")
    else:
        assert found.kernel == "mma" and found.reason.startswith(
            "16-bit inputs: mma.sync tensor cores, since wgmma needs a Hopper GPU"
        ), found
    with jax.enable_x64(True):
        found = jax_tiled.explain(
            S((512, 512), jnp.float32),
            S((512, 512), jnp.float32),
            preferred_element_type=jnp.float64,
            precision="highest",
            backend="gpu",
        )
        assert found.kernel == "warptile", found
        assert found.reason.endswith("float32 -> float64 needs warptile's converting copies")
        found = jax_tiled.explain(
            S((512, 512), jnp.float32),
            S((512, 512), jnp.float32),
            preferred_element_type=jnp.float64,
            backend="gpu",
        )
        assert found.kernel == "warptile"  # the tensor cores never give float64


@needs_cuda_module
@pytest.mark.parametrize(
    "a,b,transpose_a,rows",
    [
        ((2048, 17), (17, 2048), False, 17),  # a's rows are K = 17 long
        ((2048, 17), (2048, 2048), True, 17),  # a stored (K, M): rows of M = 17
    ],
    ids=str,
)
def test_cuda_auto_routes_rows_the_copy_engine_cannot_read_to_mma(a, b, transpose_a, rows):
    (m, k), n = ((a[1], a[0]) if transpose_a else a), b[1]
    problem = (1, 1, m, n, k, transpose_a, False)
    kernel, reason, _ = _ffi.cuda_explain("bfloat16", "bfloat16", problem, 132)
    if _ffi.cuda_compute_capability() == _ffi.HOPPER:
        assert kernel == "mma"
        assert reason.startswith(
            "16-bit inputs: mma.sync tensor cores, since the TMA copy "
            f"engine needs rows and batches that start at multiples of 16 "
            f"bytes (a's rows are {rows} elements"
        )
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
        assert "got float32 -> float64" in _ffi.refusal("cuda", kernel, np.float32, np.float64)
        assert "got bfloat16 -> float64" in _ffi.refusal("cuda", kernel, jnp.bfloat16, np.float64)
    assert _ffi.refusal("cuda", "mma", jnp.float16, np.float32) == ""
    batch_stride_odd = (3, 3, 9, 64, 64, True, False)  # a stored (3, 64, 9): rows of 9
    assert "kernel 'wgmma' reads operands with the TMA copy engine" in _ffi.refusal(
        "cuda", "wgmma", jnp.bfloat16, jnp.bfloat16, batch_stride_odd
    )


@needs_cuda_module
def test_refusal_float32_by_precision():
    """The tensor-core kernels take float32 at DEFAULT (TF32) and HIGH (3xTF32),
    not at HIGHEST (true fp32); the SIMT kernels take it at every precision."""
    for kernel in tensor_cores_of_this_gpu():
        for precision in ("default", "high", jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGH):
            assert (
                _ffi.refusal("cuda", kernel, np.float32, np.float32, precision=precision) == ""
            ), (kernel, precision)
        for out_dtype in (np.float32, jnp.bfloat16, jnp.float16):
            assert _ffi.refusal("cuda", kernel, np.float32, out_dtype) == ""
            why = _ffi.refusal("cuda", kernel, np.float32, out_dtype, precision="highest")
            assert f"kernel '{kernel}'" in why and "HIGHEST" in why and "fp32" in why, why
        # 16-bit inputs: precision changes nothing.
        assert _ffi.refusal("cuda", kernel, jnp.bfloat16, jnp.bfloat16, precision="highest") == ""
    for kernel in SIMT_KERNELS:
        for precision in ("default", "high", "highest"):
            assert (
                _ffi.refusal("cuda", kernel, np.float32, np.float32, precision=precision) == ""
            ), (kernel, precision)


@needs_cuda_module
@pytest.mark.parametrize("precision", ["default", "high"])
def test_wgmma_float32_takes_every_layout_but_3xtf32_with_both_mn_major(precision):
    """TF32 wgmma reads B K-major only: with both operands stored MN-major
    (transpose_a without transpose_b, the weight gradient's layout) one TF32
    pass rewrites B K-major in shared memory, and explain says so; 3xTF32
    would need B both rewritten and split, which is not built: refused, and
    auto runs it on mma."""
    if _ffi.cuda_compute_capability() != _ffi.HOPPER:
        pytest.skip("wgmma needs a Hopper GPU")
    for transpose_a, transpose_b in ((False, False), (False, True), (True, True)):
        problem = (1, 1, 256, 256, 1024, transpose_a, transpose_b)
        assert _ffi.refusal("cuda", "wgmma", np.float32, np.float32, problem, precision) == ""
    both_mn_major = (1, 1, 256, 256, 1024, True, False)  # K too deep for a small product
    why = _ffi.refusal("cuda", "wgmma", np.float32, np.float32, both_mn_major, precision)
    kernel, reason, plan = _ffi.cuda_explain("float32", "float32", both_mn_major, 132, precision)
    if precision == "default":
        assert why == "", why
        assert kernel == "wgmma" and "K-major" in reason, reason
        assert "B rewritten K-major in shared memory" in plan, plan
    else:
        assert "wgmma" in why and "3xTF32" in why and "transpose_a=True" in why, why
        assert kernel == "mma" and "wgmma" in reason and "hi and lo" in reason, reason
    assert _ffi.refusal("cuda", "mma", np.float32, np.float32, both_mn_major, precision) == ""
    # 16-bit wgmma takes every layout.
    assert _ffi.refusal("cuda", "wgmma", jnp.bfloat16, jnp.bfloat16, both_mn_major) == ""


@needs_cuda_module
@needs_cuda_module
@pytest.mark.parametrize(
    "dtype,problem,precision,small",
    [
        ("bfloat16", (1, 1, 64, 64, 64, False, False), "default", True),
        ("bfloat16", (1, 1, 256, 256, 256, False, False), "default", True),
        ("float16", (1, 1, 512, 512, 512, True, True), "default", True),  # 64 tiles, 1 KB rows
        ("bfloat16", (1, 1, 768, 768, 768, False, False), "default", False),  # 144 tiles
        ("bfloat16", (1, 1, 256, 256, 520, False, False), "default", False),  # rows past 1 KB
        ("bfloat16", (8, 8, 256, 256, 256, False, False), "default", False),  # 128 tiles
        ("float32", (1, 1, 256, 256, 256, True, False), "default", True),
        ("float32", (1, 1, 384, 384, 384, False, False), "default", False),  # 1.5 KB rows
        ("float32", (1, 1, 128, 128, 128, False, False), "high", False),  # 3xTF32: not measured
    ],
    ids=str,
)
def test_cuda_auto_runs_small_products_on_mma(dtype, problem, precision, small):
    """On a Hopper GPU, auto runs a product on mma's 64 x 64 tiles where they
    take at most half the SMs and a row of A is at most 1 KB (NOTES.md, "Small
    products"), and on wgmma otherwise."""
    if _ffi.cuda_compute_capability() != _ffi.HOPPER:
        pytest.skip("the rule chooses between mma and the Hopper kernel")
    kernel, reason, _ = _ffi.cuda_explain(dtype, dtype, problem, 132, precision)
    assert kernel == ("mma" if small else "wgmma"), (kernel, reason)
    assert ("a small product" in reason) == small, reason


@needs_cuda_module
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (1000, 800, 1200), (256, 256, 256)], ids=str)
def test_cuda_auto_float32_by_precision(shape):
    """DEFAULT and HIGH go to the tensor cores, HIGHEST to a SIMT kernel; the
    head names the precision either way."""
    m, k, n = shape
    a, b = S((m, k), jnp.float32), S((k, n), jnp.float32)
    for precision in ("default", "high", "highest"):
        found = jax_tiled.explain(a, b, precision=precision, backend="gpu")
        assert found.precision == precision.upper(), found
        expected = SIMT_KERNELS if precision == "highest" else tensor_cores_of_this_gpu()
        assert found.kernel in expected, found
    with jax.default_matmul_precision("float32"):
        found = jax_tiled.explain(a, b, backend="gpu")
    assert found.precision == "HIGHEST" and found.kernel in SIMT_KERNELS, found


@needs_cuda_module
def test_forced_tensor_core_kernel_at_highest_raises():
    """explain checks a forced kernel as matmul does: float32 at HIGHEST on a
    tensor-core kernel is a ValueError naming the precision."""
    a = S((256, 256), jnp.float32)
    for kernel in tensor_cores_of_this_gpu():
        found = jax_tiled.explain(a, a, kernel=kernel, backend="gpu")
        assert (found.kernel, found.reason) == (kernel, f"forced by kernel={kernel!r}")
        with pytest.raises(ValueError, match="(?s)HIGHEST.*precision HIGHEST"):
            jax_tiled.explain(a, a, kernel=kernel, precision="highest", backend="gpu")


# ---- Forced kernels' plans: the naive rung, and smem's width chosen at run time ----


def smem_plan(m, n, k=256, dtype="float32", batch=1, **gpu) -> _ffi.CudaPlan:
    """smem's plan for a batch x (m x k) @ (k x n) product, on an H100-sized GPU
    unless `gpu` says otherwise (multiprocessors, per-block limits)."""
    gpu = {"multiprocessors": 132, **gpu}
    return _ffi.cuda_plan("smem", dtype, dtype, (batch, batch, m, n, k, False, False), **gpu)


@needs_cuda_module
def test_smem_takes_the_widest_width_the_block_limits_admit():
    """32 x 32 where 1024 threads and two 32 x 33 tiles fit a block (every sm_80+
    GPU), narrower where the limits would not take them; explain says why."""
    plan = smem_plan(4096, 4096)
    assert (plan.block_m, plan.block_n) == (32, 32)
    assert plan.text == (
        "32 x 32 tiles, width chosen at run time: the widest whose block (1024 threads) and "
        "two tiles (8448 bytes) fit this GPU's 1024 threads and 48 KB of shared memory per "
        "block, 16384 tiles for 132 SMs"
    )
    # Threads: a block of 32 x 32 needs 1024.
    assert smem_plan(4096, 4096, max_threads_per_block=1023).block_m == 16
    assert smem_plan(4096, 4096, max_threads_per_block=255).block_m == 8
    # Shared memory: two 32 x 33 float32 tiles are 8448 bytes, float64 ones 16896.
    assert smem_plan(4096, 4096, shared_bytes_per_block=8448).block_m == 32
    assert smem_plan(4096, 4096, shared_bytes_per_block=8447).block_m == 16
    with jax.enable_x64(True):
        assert smem_plan(4096, 4096, dtype="float64", shared_bytes_per_block=16896).block_m == 32
        narrow = smem_plan(4096, 4096, dtype="float64", shared_bytes_per_block=16895)
        assert narrow.block_m == 16 and "two tiles (4352 bytes)" in narrow.text, narrow
    # bfloat16 tiles hold float32 accumulators: the same widths as float32.
    assert smem_plan(4096, 4096, dtype="bfloat16", shared_bytes_per_block=8447).block_m == 16
    # None fits: the narrowest, which the launcher refuses; explain says so.
    none = smem_plan(4096, 4096, max_threads_per_block=63)
    assert none.block_m == 8 and "no width fits this GPU's 63 threads" in none.text, none


@needs_cuda_module
@pytest.mark.parametrize(
    "m,n,batch,sms,width",
    [
        (4096, 4096, 1, 132, 32),  # 16384 tiles of 32 x 32
        (384, 352, 1, 132, 32),  # 12 x 11 = 132 tiles: one per SM
        (384, 320, 1, 132, 16),  # 120 tiles of 32 x 32; 480 of 16 x 16
        (256, 256, 1, 132, 16),  # 64 tiles of 32 x 32
        (128, 128, 8, 132, 16),  # 8 x 16 = 128 of 32 x 32; the batch counts
        (128, 128, 9, 132, 32),  # 144
        (64, 64, 1, 132, 8),  # 4, 16, then the narrowest: 64
        (64, 64, 1, 4, 32),  # 4 tiles for 4 SMs
        (1, 1, 1, 132, 8),
    ],
)
def test_smem_narrows_its_tiles_until_they_fill_the_sms(m, n, batch, sms, width):
    plan = smem_plan(m, n, batch=batch, multiprocessors=sms)
    assert (plan.block_m, plan.block_n) == (width, width), plan
    tiles = lambda w: batch * -(-m // w) * -(-n // w)
    if width == 32:
        assert plan.text.endswith(f", {tiles(32)} tiles for {sms} SMs"), plan
    else:
        assert plan.text.endswith(
            f"32 x 32, the widest whose block (1024 threads) and two tiles (8448 bytes) fit this "
            f"GPU's 1024 threads and 48 KB of shared memory per block, makes {tiles(32)} tiles "
            f"for {sms} SMs; {width} x {width} makes {tiles(width)}"
        ), plan


@needs_cuda_module
def test_forced_kernels_plans_in_explain():
    """explain names a forced CUDA kernel's plan as its launcher runs it: smem's
    width chosen at run time, smem16's and the planted race's fixed tiles, the
    naive rung's one thread per output; auto's choices are unchanged."""
    a, b = S((4096, 4096), jnp.float32), S((4096, 4096), jnp.float32)
    found = jax_tiled.explain(a, b, kernel="smem", precision="highest", backend="gpu")
    assert found.plan == smem_plan(4096, 4096, multiprocessors=_ffi.cuda_multiprocessors()).text
    assert found.plan.startswith("32 x 32 tiles, width chosen at run time: the widest whose")
    assert str(found).endswith(f"smem: forced by kernel='smem'; runs {found.plan}")
    found = jax_tiled.explain(a, b, kernel="smem16", precision="highest", backend="gpu")
    assert found.plan == "16 x 16 tiles"
    assert _ffi.cuda_plan("smem_racy_for_testing", "float32", "float32").text == "32 x 32 tiles"
    naive = _ffi.cuda_plan("naive", "float32", "float32", (2, 1, 300, 200, 100, True, True))
    assert (naive.block_m, naive.block_n) == (1, 1)
    assert naive.text == (
        "one thread per output element in 16 x 16 thread blocks, A and B read from global memory"
    )
    with jax.enable_x64(True):  # auto's float64 kernel keeps its fixed 16 x 16 tiles
        found = jax_tiled.explain(
            S((512, 512), jnp.float64), S((512, 512), jnp.float64), backend="gpu"
        )
    assert (found.kernel, found.plan) == ("smem16", "16 x 16 tiles")
    # A kernel that refuses the product has no plan.
    assert _ffi.cuda_plan("pipelined", "bfloat16", "bfloat16") is None


@needs_cuda_module
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_auto_never_runs_the_naive_rung(dtype):
    """naive is listed (kernels() offers it, the suites run it) and first in the
    ladder, but no product, dtype or precision makes auto choose it."""
    assert [k.name for k in CUDA_TABLE][:2] == ["naive", "smem"]
    assert CUDA_TABLE[0].rung == 0 and CUDA_TABLE[0].true_fp32
    shapes = [(1, 1, 1), (16, 8192, 8192), (256, 256, 256), (4096, 4096, 4096), (33, 17, 65)]
    with jax.enable_x64(True):
        for (m, k, n), precision in itertools.product(shapes, ("default", "high", "highest")):
            for batch in (1, 8):
                problem = (batch, batch, m, n, k, False, False)
                kernel, _, _ = _ffi.cuda_explain(dtype, dtype, problem, 132, precision)
                assert kernel not in ("", "naive"), (dtype, problem, precision, kernel)


# ---- The kernel tables, and kernels(): what is listed ----

DTYPES = ("float16", "bfloat16", "float32", "float64")


def test_the_cpu_table_is_the_one_cpu_kernel():
    (blocked,) = _ffi.kernel_table("cpu")
    assert blocked == _ffi.KernelFacts(
        name="blocked",
        listed=True,
        tensor_cores=False,
        true_fp32=True,
        min_capability=0,
        hopper_only=False,
        stack_slices=True,
        reads_transposes=True,
        inputs=DTYPES,
        outputs=DTYPES,
        bf16_paths=blocked.bf16_paths,  # by build and machine: tests/test_cpu_bf16.py
        bf16_paths_here=blocked.bf16_paths_here,
    )
    assert CPU_KERNELS == ("blocked",) and jax_tiled.kernels("cpu") == ["blocked"]


@needs_cuda_module
def test_the_cuda_table_without_a_gpu():
    """A build with the CUDA module lists its kernels with no GPU present: the
    ladder in order, a kernel for the test suite only (the planted race)
    unlisted, and the tensor-core kernels neither true fp32 nor float64."""
    table = _ffi.kernel_table("cuda")
    names = [k.name for k in table]
    assert len(set(names)) == len(names) and not set(names) & set(CPU_KERNELS)
    assert _ffi.kernel_names("cuda") == tuple(k.name for k in CUDA_TABLE)
    assert [k.name for k in table if not k.listed] == ["smem_racy_for_testing"]
    # The CPU module names the same ladder (cpp/cuda/kernel_names.h), for an
    # install without the CUDA module to say what it lacks.
    assert _ffi.cuda_ladder_names() == tuple(names)
    # Each kernel's rung is its file's number (kernels/<rung>_<technique>.cu),
    # rising along the ladder from the naive rung.
    rungs = [k.rung for k in table]
    assert rungs[0] == 0 and rungs == sorted(rungs), rungs
    files = Path(__file__).resolve().parent.parent / "cpp" / "cuda" / "kernels"
    if files.is_dir():  # tests run from a checkout
        assert set(rungs) == {int(f.name.split("_")[0]) for f in files.glob("*.cu")}
    assert TENSOR_CORE_KERNELS and SIMT_KERNELS
    # Reading a slice of a stack in place (cpp/stack_slice.h): the tensor-core
    # kernels' (mma offsets its pointers, wgmma's descriptors span the stack).
    assert [k.name for k in table if k.stack_slices] == ["mma", "wgmma"]
    # Transposes read as stored, not copied by XLA first, on the tensor-core
    # kernels: the SIMT kernels' transposed layouts were not measured as fast
    # (NOTES.md).
    assert [k.name for k in table if k.reads_transposes] == ["mma", "wgmma"]
    for kernel in table:
        assert set(kernel.inputs) | set(kernel.outputs) <= set(DTYPES), kernel
        if kernel.tensor_cores:
            assert not kernel.true_fp32 and "float64" not in kernel.outputs, kernel
            assert kernel.min_capability >= 80, kernel
        else:
            assert kernel.true_fp32, kernel


@needs_cuda_module
@pytest.mark.parametrize("precision", ["default", "high", "highest"])
def test_the_table_facts_are_the_refusals(precision):
    """What each kernel takes by the table's facts (dtypes, true fp32,
    capability) is what its refusals say, on this GPU (a Hopper one where none
    is visible)."""
    capability = _ffi.cuda_compute_capability()
    for kernel in _ffi.kernel_table("cuda"):
        for dtype, out_dtype in itertools.product(DTYPES, DTYPES):
            takes = (
                dtype in kernel.inputs
                and out_dtype in kernel.outputs
                and admits(kernel, capability)
                and (kernel.true_fp32 or dtype != "float32" or precision != "highest")
            )
            why = _ffi.refusal("cuda", kernel.name, dtype, out_dtype, precision=precision)
            assert (why == "") == takes, (kernel.name, dtype, out_dtype, why)


@pytest.mark.parametrize(
    "precision",
    [
        None,
        "default",
        "high",
        "highest",
        "bfloat16",
        "tensorfloat32",
        "float32",
        lax.Precision.HIGH,
        ("default", "highest"),
    ],
    ids=str,
)
def test_cpu_listing_by_precision(precision):
    assert jax_tiled.kernels("cpu", F32, precision=precision) == ["blocked"]
    assert jax_tiled.kernels("cpu", jnp.bfloat16, F32, precision) == ["blocked"]


@pytest.mark.gpu
def test_cuda_listing_by_dtype_and_precision():
    names = jax_tiled.kernels("gpu")
    assert names == [k.name for k in CUDA_TABLE]  # the listed ones: not the planted race
    capability = _ffi.cuda_compute_capability()
    here = tensor_cores_of_this_gpu()
    assert here  # sm_80+: every GPU this package builds for has tensor-core kernels
    for dtype, out_dtype in itertools.product(DTYPES, DTYPES):
        listed = jax_tiled.kernels("gpu", dtype, out_dtype)
        assert listed == [
            k.name
            for k in CUDA_TABLE
            if dtype in k.inputs and out_dtype in k.outputs and admits(k, capability)
        ], (dtype, out_dtype)
    for precision in ("default", "high", "highest"):  # 16-bit: precision changes nothing
        assert set(here) <= set(jax_tiled.kernels("gpu", jnp.bfloat16, precision=precision))
    # float32 runs on the tensor cores as TF32 (DEFAULT) or 3xTF32 (HIGH), never
    # as the true fp32 that HIGHEST asks for.
    default = jax_tiled.kernels("gpu", F32)
    assert set(here) <= set(default)
    assert default == jax_tiled.kernels("gpu", F32, precision="default")
    assert set(here) <= set(jax_tiled.kernels("gpu", F32, precision="high"))
    assert set(here) <= set(jax_tiled.kernels("gpu", F32, precision=lax.Precision.HIGH))
    highest = set(jax_tiled.kernels("gpu", F32, precision="highest"))
    assert set(SIMT_KERNELS) <= highest
    for out_dtype in (jnp.bfloat16, jnp.float16, np.float32):
        highest = jax_tiled.kernels("gpu", F32, out_dtype, precision="highest")
        assert not set(TENSOR_CORE_KERNELS) & set(highest), highest
        assert [k.name for k in CUDA_TABLE if k.true_fp32 and admits(k, capability)] == highest
        assert set(here) <= set(jax_tiled.kernels("gpu", F32, out_dtype, precision="tensorfloat32"))
    with jax.default_matmul_precision("float32"):  # precision=None honours it
        assert not set(TENSOR_CORE_KERNELS) & set(jax_tiled.kernels("gpu", F32))
