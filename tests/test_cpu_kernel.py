"""The CPU kernel against a float64 reference where its blocking has edges:
register blocks (12 rows x 32 float32 / 16 float64 columns with AVX-512, 6 x
16 / 6 x 8 with AVX2), the slabs (at most 256 deep, 128 for float64 with
AVX-512, and of equal depth), the L2 column block and the 1024-row and -column tiles; and its
determinism (the result of an element does not depend on how the output was
cut into tiles, nor on whether an operand was packed or read where it is
stored)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import CPU_KERNELS, HIGHEST, LAYOUTS, bind_product, operands, x64

EDGE_ROWS = (1, 7, 12, 13)
EDGE_COLS = (1, 9, 16, 17, 32, 33)
EDGE_DEPTHS = (1, 128, 129, 255, 256, 257)


def run(a, b, ta, tb, out_dtype=None):
    with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(
            bind_product(
                a, b, ta, tb, precision=HIGHEST, kernel=CPU_KERNELS[0], out_dtype=out_dtype
            )
        )


def check(out, opa, opb, eps):
    """|out - exact| within the worst-case bound of a k-term float sum (plus the
    rounding of the result), relative to sum |a||b|."""
    exact = np.matmul(opa.astype(np.float64), opb.astype(np.float64))
    scale = np.matmul(np.abs(opa).astype(np.float64), np.abs(opb).astype(np.float64))
    k = opa.shape[-1]
    np.testing.assert_array_less(
        np.abs(out.astype(np.float64) - exact), (k + 2) * eps * scale + 1e-30
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ta,tb", LAYOUTS)
def test_register_block_edges(rng, dtype, ta, tb):
    with x64():
        eps = np.finfo(dtype).eps
        for m, n in itertools.product(EDGE_ROWS, EDGE_COLS):
            k = 257 if m * n % 2 else 1
            a, b, opa, opb = operands(rng, m, n, k, ta, tb, dtype)
            check(run(a, b, ta, tb), opa, opb, eps)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k", EDGE_DEPTHS + (513, 777))
def test_slab_edges(rng, dtype, k):
    with x64():
        for ta, tb in LAYOUTS:
            a, b, opa, opb = operands(rng, 13, 33, k, ta, tb, dtype)
            check(run(a, b, ta, tb), opa, opb, np.finfo(dtype).eps)


def three_level_sum(b: np.ndarray, slab: int, partial: int, equal: bool = True) -> np.float32:
    """sum(b) as the float32 FMA kernel adds it (kernel_impl.h): K cut into
    slabs at most `slab` deep (of equal depth, or `slab`-deep ones and a
    remainder); in each, chains of at most `partial` terms, their sums added
    in order; then the slab sums in order."""
    k = len(b)
    slabs = -(-k // slab)
    depth = -(-k // slabs) if equal else slab
    total = None
    for s0 in range(0, k, depth):
        slab_sum = None
        for p0 in range(s0, min(s0 + depth, k), partial):
            chain = np.float32(0)
            for x in b[p0 : min(p0 + partial, s0 + depth, k)]:
                chain = np.float32(chain + x)
            slab_sum = chain if slab_sum is None else np.float32(slab_sum + chain)
        total = slab_sum if total is None else np.float32(total + slab_sum)
    return total


# (K, where 2^24 is planted among ones): each plant tells every cut below apart.
PLANTED = [(257, [0, 128]), (263, [0, 131]), (300, [0, 150]), (513, [0, 256]), (777, [0])]


@pytest.mark.parametrize("k,planted", PLANTED, ids=[str(k) for k, _ in PLANTED])
def test_the_sums_are_three_level(k, planted):
    """float32 sums over K: slabs of equal depth (at most 256 on every
    instruction set; kernel_impl.h, SlabDepth), each the sum of chains of at
    most 64 (Config::kChainDepth), as three_level_sum says. Seen through rounding:
    2^24 followed by ones loses every one of its own chain (2^24 + 1 rounds
    back to 2^24) and keeps the others, so where chains and slabs begin shows
    in the result, and each other cut gives another."""
    b = np.ones(k, np.float32)
    b[planted] = 2.0**24
    expected = three_level_sum(b, 256, 64)
    for other in ((256, 256), (256, 64, False), (256, 32), (128, 64)):
        assert three_level_sum(b, *other) != expected, other
    out = run(np.ones((1, 1, k), np.float32), b.reshape(1, k, 1), False, False)
    assert out[0, 0, 0] == expected


@pytest.mark.parametrize(
    "m,n,k", [(1025, 40, 70), (30, 1025, 70), (37, 513, 300), (37, 257, 300), (1100, 1100, 20)]
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tile_and_column_block_edges(rng, m, n, k, dtype):
    with x64():
        for ta, tb in ((False, False), (True, True)):
            a, b, opa, opb = operands(rng, m, n, k, ta, tb, dtype)
            check(run(a, b, ta, tb), opa, opb, np.finfo(dtype).eps)


@pytest.mark.parametrize("batch_a,batch_b", [(3, 3), (1, 3), (3, 1)])
def test_batches(rng, batch_a, batch_b):
    for ta, tb in LAYOUTS:
        a, b, opa, opb = operands(rng, 14, 35, 260, ta, tb, batch_a=batch_a, batch_b=batch_b)
        out = run(a, b, ta, tb)
        assert out.shape == (3, 14, 35)
        check(out, opa, opb, np.finfo(np.float32).eps)


@pytest.mark.parametrize(
    "in_dtype,out_dtype",
    [
        ("bfloat16", "float32"),
        ("float16", "float16"),
        ("bfloat16", "bfloat16"),
        ("float32", "float64"),
        ("float64", "float32"),
        ("float16", "float64"),
    ],
)
def test_dtype_pairs(rng, in_dtype, out_dtype):
    with x64():
        a, b, opa, opb = operands(rng, 13, 33, 300, False, True, np.dtype(in_dtype))
        out = run(a, b, False, True, out_dtype=np.dtype(out_dtype))
        assert out.dtype == np.dtype(out_dtype)
        eps = float(jnp.finfo(out_dtype).eps)
        if out_dtype != "float64" and in_dtype != "float64":
            eps = max(eps, float(jnp.finfo(np.float32).eps))  # float32 accumulation
        check(out, opa.astype(np.float64), opb.astype(np.float64), eps)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_empty_depth_gives_zeros(rng, dtype):
    with x64():
        for ta, tb in LAYOUTS:
            a, b, _, _ = operands(rng, 5, 7, 0, ta, tb, dtype, batch_a=2, batch_b=2)
            out = run(a, b, ta, tb)
            assert out.shape == (2, 5, 7) and not np.any(out)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_result_does_not_depend_on_tiling(rng, dtype):
    """Rows and columns computed as part of a large product and on their own
    (other tiles, other threads) are bitwise equal: no sum is split by tile."""
    with x64():
        a, b, _, _ = operands(rng, 700, 1100, 600, False, False, dtype)
        whole = run(a, b, False, False)
        np.testing.assert_array_equal(run(a, b, False, False), whole)
        np.testing.assert_array_equal(run(a[:, 100:113], b, False, False), whole[:, 100:113])
        np.testing.assert_array_equal(
            run(a, b[:, :, 1000:1037], False, False), whole[:, :, 1000:1037]
        )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_operands_read_in_place_give_the_packed_bits(rng, dtype):
    """A product short enough that the kernel reads B where it is stored (40
    rows), or narrow enough that it reads A so (29 columns; on AVX-512's
    6-row blocks 50, and 100 for float32), gives the bits of the same rows or columns of
    a product large enough to pack both, in every layout (transposed
    operands are packed), and is within the sum's bound of float64."""
    with x64():
        for ta, tb in LAYOUTS:
            a, b, opa, opb = operands(rng, 300, 96, 700, ta, tb, dtype)
            whole = run(a, b, ta, tb)
            rows = slice(37, 77)
            a_rows = a[:, :, rows] if ta else a[:, rows]
            short = run(a_rows, b, ta, tb)
            np.testing.assert_array_equal(short, whole[:, rows])
            check(short, opa[:, rows], opb, np.finfo(dtype).eps)
            for cols in (slice(5, 34), slice(200, 250), slice(200, 300)):
                b_cols = b[:, cols] if tb else b[:, :, cols]
                narrow = run(a, b_cols, ta, tb)
                np.testing.assert_array_equal(narrow, whole[:, :, cols])
                check(narrow, opa, opb[:, :, cols], np.finfo(dtype).eps)
