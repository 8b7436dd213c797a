"""Small odd-shaped products for compute-sanitizer (not a pytest module).

    XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool racecheck \\
        --error-exitcode 1 python3 tests/scripts/sanitizer_cases.py smem

runs the named CUDA kernel on every dtype, layout and float32 precision it
takes, checking each result against float64 NumPy; one float32 and one bfloat16 product are large
enough for the kernels' large-block configurations. `--racy` instead runs the planted race (the smem
kernel without its second barrier) through the FFI target directly, since the
public API refuses that name: racecheck must report it.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_tiled
from jax_tiled import _ffi, _presets

# (m, k, n). The odd ones take every kernel but the Hopper one, whose copy
# engine needs rows of a multiple of 16 bytes: the aligned ones take it too.
# (72, 600, 136): K past two blocked-sum partials of 256 and into a third; on
# the Hopper kernel, K split across clusters of 4 blocks (C written transposed
# for TF32).
# (11400, 72, 40) and (40, 72, 11400): the Hopper kernel's 128 x 64 tiles (for TF32's
# a @ b the second, as C^T), enough of them to fill the SMs.
SHAPES = [
    (33, 17, 65),
    (1, 47, 9),
    (70, 3, 33),
    (72, 136, 264),
    (8, 72, 40),
    (72, 600, 136),
    (11400, 72, 40),
    (40, 72, 11400),
]
LARGE_SHAPE = (1025, 41, 4100)  # 9 x 33 blocks of 128 x 128: enough to fill 132 SMs twice
# The same blocks with every row on 16-byte lines: warptile's float32 mainloop
# (WarpTiledFloat32), tiles off both edges, K of 70 slabs from 4 zeros
# (totals added twice in shared memory, a partial sum being 32 slabs, then
# the rest).
LARGE_ALIGNED_SHAPE = (1028, 556, 4100)
# The float32 mainloop with K in 13 parts (20 tiles, off both edges, on an
# H100), part 0 from 4 zeros.
LARGE_PARTS_SHAPE = (516, 8196, 388)
# Its 64 x 128 blocks (64 rows; K in 3 parts).
NARROW_SHAPE = (64, 1004, 4100)
# More than one tile per SM for the persistent wgmma grid, on 132 SMs: 5 x 22
# pairs of 128 x 192 tiles (2 waves of 66 clusters, as 128 x 256 tiles' 5 x 17
# would take: WgmmaEndsSooner), the last column 72 wide; and 9 x 12 pairs of
# 128 x 256 tiles (2 waves, where 128 x 192 tiles would take 3).
LARGE_SIXTEEN_BIT_SHAPE = (1032, 72, 4104)
LARGE_SIXTEEN_BIT_256_SHAPE = (2200, 72, 3000)
# Two 128 x 128 tiles over a deep K: the Hopper kernel splits K across several
# clusters a tile, whose partial sums meet in scratch (a second kernel adds them).
DEEP_SHAPE = (136, 40000, 72)
# A 16-bit product into a 16-bit result that splits K on 128 x 256 tiles (on
# an H100: across 2 clusters of 2 a tile; within one cluster of 4 where 132
# SMs hold 33 clusters of 4).
WIDE_SHAPE = (1024, 8192, 1024)
# 16 rows over a deep K: warptile's thin 32 x 128 blocks, K cut into parts
# (in float32, on its float32 mainloop).
THIN_DEEP_SHAPE = (16, 9000, 136)
# One row over a deep, odd K: warptile's row blocks (sums in double), K cut
# into parts, B's quads as single loads where K is contiguous, N off the
# 128-column block.
ONE_ROW_DEEP_SHAPE = (1, 9001, 260)
# One column (a matrix times a vector): the transposed product's row; and
# over a K whole in quads, which move as one load (16 bytes of float32, 8 of
# bfloat16) in either of B's layouts.
ONE_COLUMN_DEEP_SHAPE = (260, 9001, 1)
ONE_COLUMN_QUADS_SHAPE = (260, 9000, 1)
DTYPES = [jnp.float16, jnp.bfloat16, np.float32, np.float64]
# The emulation presets CUDA runs as products of parts laid along K (their
# operands split by our CUDA split, blocks/split_parts.cuh, odd columns too; on
# the Hopper kernel: 128 x 128 tiles whose partial sums hold a chunk group, K
# split across clusters for K of 600): K of 41 in one short chunk, 4000 deep.
LAID_SHAPES = [(72, 600, 136), (33, 41, 65), (136, 4000, 72)]
EMULATIONS = [preset for preset, mode in _presets.PRESETS["cuda"].items() if mode.split]


def precisions(kernel: str, dtype, out_dtype, problem) -> list:
    """HIGHEST where the kernel takes it (it then computes the same at every
    precision), else float32's TF32 (DEFAULT) and 3xTF32 (HIGH) paths on the
    tensor-core kernels; none where the kernel refuses the problem."""
    if not _ffi.refusal("cuda", kernel, dtype, out_dtype, problem, lax.Precision.HIGHEST):
        return [lax.Precision.HIGHEST]
    return [
        p
        for p in (lax.Precision.DEFAULT, lax.Precision.HIGH)
        if not _ffi.refusal("cuda", kernel, dtype, out_dtype, problem, p)
    ]


def run_kernel(kernel: str) -> None:
    rng = np.random.default_rng(0)
    cases = [(shape, dtype, dtype) for shape in SHAPES for dtype in DTYPES] + [
        (LARGE_SHAPE, np.float32, np.float32),
        (LARGE_ALIGNED_SHAPE, np.float32, np.float32),
        (LARGE_PARTS_SHAPE, np.float32, np.float32),
        (NARROW_SHAPE, np.float32, np.float32),
        (LARGE_SIXTEEN_BIT_SHAPE, jnp.bfloat16, jnp.bfloat16),
        # 16-bit inputs into float32: the Hopper kernel's wider staged output.
        (LARGE_SIXTEEN_BIT_SHAPE, jnp.bfloat16, np.float32),
        (LARGE_SIXTEEN_BIT_256_SHAPE, jnp.bfloat16, jnp.bfloat16),
        (LARGE_SIXTEEN_BIT_256_SHAPE, jnp.bfloat16, np.float32),
        (DEEP_SHAPE, np.float32, np.float32),
        (DEEP_SHAPE, jnp.bfloat16, jnp.bfloat16),
        (WIDE_SHAPE, jnp.bfloat16, jnp.bfloat16),
        (THIN_DEEP_SHAPE, np.float32, np.float32),
        # 16 rows in 16-bit inputs on the Hopper kernel: C^T on 128 x 64 tiles, K split.
        (THIN_DEEP_SHAPE, jnp.bfloat16, jnp.bfloat16),
        (ONE_ROW_DEEP_SHAPE, np.float32, np.float32),
        (ONE_ROW_DEEP_SHAPE, jnp.bfloat16, np.float32),
        (ONE_COLUMN_DEEP_SHAPE, np.float32, np.float32),
        (ONE_COLUMN_QUADS_SHAPE, np.float32, np.float32),
        (ONE_COLUMN_QUADS_SHAPE, jnp.bfloat16, jnp.bfloat16),
        (ONE_COLUMN_QUADS_SHAPE, jnp.bfloat16, np.float32),
    ]
    layouts = list(itertools.product((False, True), repeat=2))
    cases = [
        ((m, k, n), dtype, out_dtype, ta, tb, precision)
        for (m, k, n), dtype, out_dtype in cases
        for ta, tb in layouts
        for precision in precisions(kernel, dtype, out_dtype, (1, 1, m, n, k, ta, tb))
    ]
    with jax.enable_x64(True):
        for (m, k, n), dtype, out_dtype, ta, tb, precision in cases:
            a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
            b = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
            out = jax_tiled.tiled_matmul_p.bind(
                jnp.asarray(a)[None],
                jnp.asarray(b)[None],
                transpose_a=ta,
                transpose_b=tb,
                out_dtype=np.dtype(out_dtype),
                precision=precision,
                kernel=kernel,
            )[0]
            ref = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
            tf32 = np.dtype(dtype) == np.float32 and precision == lax.Precision.DEFAULT
            tol = 2e-2 if np.dtype(dtype).itemsize == 2 else 5e-3 if tf32 else 1e-5
            np.testing.assert_allclose(
                np.asarray(out, np.float64), ref, rtol=tol, atol=tol * np.sqrt(k)
            )
    assert cases, f"no case runs on {kernel}"
    laid = run_laid(kernel, rng)
    stacked = run_stacked(kernel, rng)
    print(
        f"{kernel}: {len(cases)} plain, {laid} laid parts' and {stacked} stacks' slices' "
        "products correct"
    )


# Slices of stacks that a kernel reads in place (cpp/stack_slice.h): the last
# slice (the largest offset) of a, of b, of both, of a batched b, on odd
# shapes and on one large enough for the Hopper kernel's wide tiles; (x, ws,
# which operands are slices).
STACKED = [
    ((33, 72), (3, 72, 40), "b"),
    ((3, 130, 72), (72, 40), "a"),
    ((3, 33, 72), (3, 72, 136), "ab"),
    ((4, 33, 72), (3, 4, 72, 40), "b"),
    ((1032, 72), (2, 72, 4104), "b"),
]


def run_stacked(kernel: str, rng) -> int:
    """Each STACKED case where `kernel` reads stacks in place, bfloat16 and
    float32, against float64; the number run."""
    if not {k.name: k for k in _ffi.kernel_table("cuda")}[kernel].stack_slices:
        return 0
    taken = 0
    for (x_shape, ws_shape, pick), dtype in itertools.product(STACKED, (jnp.bfloat16, np.float32)):
        x = rng.standard_normal(x_shape).astype(dtype)
        ws = rng.standard_normal(ws_shape).astype(dtype)

        def operands(x, ws, pick=pick):  # the last slice of each stacked operand
            return (x[-1] if "a" in pick else x), (ws[-1] if "b" in pick else ws)

        a, b = operands(x, ws)
        out = jax.jit(lambda x, ws: jax_tiled.matmul(*operands(x, ws), kernel=kernel))(x, ws)
        ref = a.astype(np.float64) @ b.astype(np.float64)
        tol = 2e-2 if np.dtype(dtype).itemsize == 2 else 5e-3
        np.testing.assert_allclose(
            np.asarray(out, np.float64), ref, rtol=tol, atol=tol * np.sqrt(a.shape[-1])
        )
        taken += 1
    return taken


def run_laid(kernel: str, rng) -> int:
    """The emulation presets on `kernel`, each layout, against float64; the
    number run (none where the kernel refuses the parts)."""
    taken = 0
    for (m, k, n), preset, (ta, tb) in itertools.product(
        LAID_SHAPES, EMULATIONS, itertools.product((False, True), repeat=2)
    ):
        run = _presets.resolve("cuda", preset, np.float32, np.float32)
        parts = run.kernel_run()  # what the kernel itself is given: the parts, over K x terms
        laid = run.kernel_problem((1, 1, m, n, k, ta, tb))
        if _ffi.refusal(
            "cuda", kernel, parts.operand_dtype, parts.product_dtype, laid, parts.precision
        ):
            continue
        a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
        b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
        dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
        out = jax_tiled.dot_general(a, b, dims, precision=preset, kernel=kernel)
        ref = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
        np.testing.assert_allclose(
            np.asarray(out, np.float64), ref, rtol=1e-4, atol=1e-4 * np.sqrt(k)
        )
        taken += 1
    return taken


def run_racy() -> None:
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((1, 64, 200)).astype(np.float32))
    b = jnp.asarray(rng.standard_normal((1, 200, 64)).astype(np.float32))
    call = jax.ffi.ffi_call("tiled_matmul_cuda", jax.ShapeDtypeStruct((1, 64, 64), jnp.float32))
    out = call(
        a,
        b,
        transpose_a=np.bool_(False),
        transpose_b=np.bool_(False),
        precision=np.int32(2),
        kernel="smem_racy_for_testing",
        spare_sms=np.int32(0),
        laid_terms=np.int32(1),
    )
    jax.block_until_ready(out)
    print("racy kernel ran (racecheck should have reported hazards above)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", nargs="?", default="smem")
    parser.add_argument("--racy", action="store_true")
    args = parser.parse_args(argv)
    assert jax.default_backend() == "gpu", "run this on a CUDA machine"
    run_racy() if args.racy else run_kernel(args.kernel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
