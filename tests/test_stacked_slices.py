"""A slice of a stacked array is read in place (`_lowering._stacked_source`).

`x @ ws[3]` reaches the lowering as a `stablehlo.slice` of the stack; where
the kernel that runs it reads stacks in place (the kernel table's
`stack_slices`: the CPU kernel, CUDA's `mma` and `wgmma`), the FFI call takes the stack,
reshaped to (L, batch, rows, cols), and an int32 index instead of XLA's copy
of the slice. The handler also takes a stack for any other kernel (on CUDA
it gathers the slice first), and clamps the index as `dynamic_slice` does.
Results must be bitwise those of the same kernel on the slice copied out.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from helpers import F32, assert_matmul_close, handler_call, kernels_on, random_array
from jax_tiled import _ffi, _lowering, _presets

BF16 = jnp.bfloat16
_CALL = re.compile(r"stablehlo\.custom_call @tiled_matmul_\w+\(.*?\).*?: \((.*?)\) ->")


def call_operand_types(text: str) -> list[list[str]]:
    """The operand types of each tiled_matmul FFI call in lowered text."""
    return [re.findall(r"tensor<[^>]*>", m.group(1)) for m in _CALL.finditer(text)]


def stacked_calls(text: str) -> int:
    """How many FFI calls take an operand as a stack (a rank-4 tensor)."""
    return sum(any(t.count("x") == 4 for t in types) for types in call_operand_types(text))


def lowered(f, *args, platform):
    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def folds_transposed_b(platform, x, w) -> bool:
    """Whether the lowering runs x @ w.T on w as stored (`reads_as_stored`)."""
    run = _presets.resolve(platform, lax.Precision.DEFAULT, x.dtype, x.dtype)
    (m, k), n = x.shape, w.shape[0]
    stored, copied = ((1, 1, m, n, k, False, transposed) for transposed in (True, False))
    return _lowering.reads_as_stored(platform, "auto", run, stored, copied)


def reads_in_place(platform, kernel, x, w) -> bool:
    """The kernel table's word on whether the kernel that runs x @ w reads
    a stack in place (auto: the kernel explain names)."""
    if kernel == "auto":
        kernel = jax_tiled.explain(x, w, backend="gpu" if platform == "cuda" else "cpu").kernel
    return {k.name: k for k in _ffi.kernel_table(platform)}[kernel].stack_slices


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_static_slice_is_read_in_place(platform, rng, dtype):
    """x @ ws[j] for every j of the stack: one call on the stack where the
    kernel reads stacks, and the result bitwise that of the same kernel on
    the slice copied out."""
    m, k, n, stack = 33, 72, 40, 3
    x = jnp.asarray(random_array(rng, (m, k), dtype))
    ws = jnp.asarray(random_array(rng, (stack, k, n), dtype))
    problem = (1, 1, m, n, k, False, False)
    in_place = 0
    for kernel in kernels_on(platform, dtype, problem=problem):
        for j in range(stack):

            def f(x, ws, j=j, kernel=kernel):
                return jax_tiled.matmul(x, ws[j], kernel=kernel)

            folded = stacked_calls(lowered(f, x, ws, platform=platform))
            assert folded == reads_in_place(platform, kernel, x, ws[j]), kernel
            in_place += folded
            copied = jax_tiled.matmul(x, jnp.array(np.asarray(ws)[j]), kernel=kernel)
            np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, ws)), np.asarray(copied))
    assert in_place, "no kernel read the stack in place"


@pytest.mark.parametrize(
    "x_shape,ws_shape,pick",
    [
        ((5, 16, 24), (3, 5, 24, 8), "b"),  # a batch of slices: ws (L, H, K, N)
        ((16, 24), (3, 5, 24, 8), "b"),  # one a broadcast against them
        ((3, 5, 16, 24), (5, 24, 8), "a"),  # a stacked
        ((3, 16, 24), (3, 24, 8), "ab"),  # both
    ],
)
def test_stacks_of_batches_and_either_operand(platform, rng, x_shape, ws_shape, pick):
    x = jnp.asarray(random_array(rng, x_shape, BF16))
    ws = jnp.asarray(random_array(rng, ws_shape, BF16))
    j = 1

    def f(x, ws):
        a = x[j] if "a" in pick else x
        b = ws[j] if "b" in pick else ws
        return jax_tiled.matmul(a, b)

    a = np.asarray(x)[j] if "a" in pick else np.asarray(x)
    b = np.asarray(ws)[j] if "b" in pick else np.asarray(ws)
    ((a_type, b_type, *indices),) = call_operand_types(lowered(f, x, ws, platform=platform))
    if reads_in_place(platform, "auto", jnp.asarray(a), jnp.asarray(b)):
        assert (a_type.count("x"), b_type.count("x")) == (3 + ("a" in pick), 3 + ("b" in pick))
        assert indices == ["tensor<i32>"] * len(pick)
    copied = jax_tiled.matmul(jnp.array(a), jnp.array(b))
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, ws)), np.asarray(copied))
    assert_matmul_close(copied, a, b, platform=platform)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "x_shape,ws_shape,pick,transpose_b",
    [
        ((2048, 128), (3, 128, 2048), "b", False),  # wide tiles in pairs; TF32 swaps A and B
        ((3, 2048, 128), (128, 2048), "a", False),
        ((3, 2048, 128), (3, 128, 2048), "ab", False),
        ((2048, 128), (3, 2048, 128), "b", True),  # b read as stored, (n, k)
        ((16, 128), (3, 128, 2048), "b", False),  # a few rows: 16-bit swaps them onto N
        ((4, 256, 128), (3, 4, 128, 512), "b", False),  # a slice of a batch
        ((100, 72), (3, 72, 40), "b", False),  # odd, one tile
    ],
    ids=["b", "a", "both", "b transposed", "few rows", "batched", "odd"],
)
def test_wgmma_reads_stacks_in_place(on_gpu, rng, dtype, x_shape, ws_shape, pick, transpose_b):
    """wgmma's descriptors span the stack and its producer starts at the
    chosen slice's batches: the FFI call takes the stack, and the result is
    bitwise wgmma's on the slices copied out, for the last slice (the
    largest offset), in every arrangement the kernel has (C^T for TF32 and
    for a few rows, both operands, batches, a transposed b)."""
    x = jnp.asarray(random_array(rng, x_shape, dtype))
    ws = jnp.asarray(random_array(rng, ws_shape, dtype))

    def product(a, b):  # b transposed by the lowering's fold, read as stored either way
        return jax_tiled.matmul(a, jnp.swapaxes(b, -1, -2) if transpose_b else b, kernel="wgmma")

    def f(x, ws):
        return product(x[-1] if "a" in pick else x, ws[-1] if "b" in pick else ws)

    assert stacked_calls(lowered(f, x, ws, platform="cuda")) == 1
    a = jnp.array(np.asarray(x)[-1] if "a" in pick else np.asarray(x))
    b = jnp.array(np.asarray(ws)[-1] if "b" in pick else np.asarray(ws))
    copied = jax.jit(product)(a, b)
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, ws)), np.asarray(copied))
    b_np = np.swapaxes(np.asarray(b), -1, -2) if transpose_b else np.asarray(b)
    assert_matmul_close(copied, np.asarray(a), b_np, platform="cuda")


def test_other_slices_are_left_to_xla(platform, rng):
    """A slice along another axis, a sum of two leading slices, a traced
    index: not folded, and still right. A slice then a transpose is folded
    where the lowering reads the transpose as stored."""
    x = jnp.asarray(random_array(rng, (8, 24), F32))
    ws = jnp.asarray(random_array(rng, (4, 24, 24), F32))
    cases = {
        "columns": lambda ws, i: ws[1, :, :16],
        "two": lambda ws, i: ws[1:3].sum(0),
        "traced": lambda ws, i: ws[i],
        "transposed": lambda ws, i: ws[2].T,
    }
    i = jnp.int32(3)
    for name, operand in cases.items():

        def f(x, ws, i, operand=operand):
            return jax_tiled.matmul(x, operand(ws, i))

        folded = name == "transposed" and folds_transposed_b(platform, x, ws[2])
        in_place = folded and reads_in_place(platform, "auto", x, ws[2].T)
        assert stacked_calls(lowered(f, x, ws, i, platform=platform)) == in_place, name
        assert_matmul_close(
            jax.jit(f)(x, ws, i), np.asarray(x), np.asarray(operand(ws, 3)), platform=platform
        )


def test_gradients_and_vmap_match_the_copied_slices(platform, rng):
    """Through grad and vmap, a chain on ws[j] gives bitwise what the same
    chain gives on the slices passed as separate arrays (never folded)."""
    m, k, stack = 8, 48, 3
    x = jnp.asarray(random_array(rng, (m, k), BF16))
    ws = jnp.asarray(random_array(rng, (stack, k, k), BF16) / 4)

    def chain(x, slices):
        for w in slices:
            x = jnp.tanh(jax_tiled.matmul(x, w)).astype(x.dtype)
        return jnp.sum(x.astype(F32) ** 2)

    def on_stack(x, ws):
        return chain(x, [ws[j] for j in range(stack)])

    assert stacked_calls(lowered(on_stack, x, ws, platform=platform)) == stack * reads_in_place(
        platform, "auto", x, ws[0]
    )
    got_x, got_ws = jax.jit(jax.grad(on_stack, argnums=(0, 1)))(x, ws)
    slices = [jnp.array(np.asarray(ws)[j]) for j in range(stack)]
    want_x, want_slices = jax.jit(jax.grad(chain, argnums=(0, 1)))(x, slices)
    np.testing.assert_array_equal(np.asarray(got_x), np.asarray(want_x))
    np.testing.assert_array_equal(
        np.asarray(got_ws), np.stack([np.asarray(w) for w in want_slices])
    )

    xs = jnp.asarray(random_array(rng, (4, m, k), BF16))
    got = jax.jit(jax.vmap(lambda x, ws: jax_tiled.matmul(x, ws[1]), (0, None)))(xs, ws)
    want = jax.jit(jax.vmap(jax_tiled.matmul, (0, None)))(xs, slices[1])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("index", [-3, 0, 2, 40])
def test_the_handler_clamps_the_index_for_every_kernel(platform, rng, index):
    """The FFI call itself, with b a stack (4, 1, k, n) and a stack a (3, 1,
    m, k): every kernel, those that read stacks in place and those that get
    the slice gathered, picks the slice dynamic_slice would (the index
    clamped to the stack) and gives bitwise what it gives on that slice."""
    m, k, n = 20, 40, 24
    a_stack = random_array(rng, (3, 1, m, k), BF16)
    b_stack = random_array(rng, (4, 1, k, n), BF16)
    pick_a, pick_b = min(max(index, 0), 2), min(max(index, 0), 3)
    problem = (1, 1, m, n, k, False, False)
    for kernel in kernels_on(platform, BF16, problem=problem):
        got = jax.jit(
            lambda a, b, i, kernel=kernel: handler_call(
                platform, a, b, (1, m, n), F32, i, i, kernel=kernel
            )
        )(a_stack, b_stack, jnp.int32(index))
        want = jax.jit(
            lambda a, b, kernel=kernel: handler_call(platform, a, b, (1, m, n), F32, kernel=kernel)
        )(a_stack[pick_a], b_stack[pick_b])
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=kernel)
        assert_matmul_close(
            want, a_stack[pick_a], b_stack[pick_b], platform=platform, out_dtype=F32
        )


def test_a_sharded_stack_is_left_to_the_partitioner(rng):
    """Under a mesh of several devices the slice is not folded (the stack's
    sharding is the partitioner's), and the product is still right."""
    devices = jax.devices("cpu")[:4]
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "d"))
    x = jnp.asarray(random_array(rng, (8, 16), F32))
    ws = jax.device_put(jnp.asarray(random_array(rng, (3, 16, 32), F32)), sharding)

    def f(x, ws):
        return jax_tiled.matmul(x, ws[2])

    assert stacked_calls(jax.jit(f).lower(x, ws).as_text()) == 0
    assert_matmul_close(jax.jit(f)(x, ws), np.asarray(x), np.asarray(ws)[2])


@pytest.mark.skipif(not _ffi.cuda_module_built(), reason="the CUDA module is not built")
def test_the_cuda_lowering_folds_for_the_kernels_that_read_stacks():
    """Checked without a GPU (planned for an H100 where none is visible): a
    small product, which auto runs on mma, and a large one, on wgmma, take
    the stack; forced kernels follow the table; with a symbolic M
    (jax.export) auto's choice is unknown and the slice is left to XLA."""
    (symbolic_m,) = jax.export.symbolic_shape("m")
    small = (64, (4, 128, 64))
    large = (4096, (2, 4096, 4096))
    cases = [
        (small, "auto", 1),
        (large, "auto", 1),
        (large, "mma", 1),
        (large, "wgmma", 1),
        (small, "warptile", 0),
        ((symbolic_m, (4, 128, 64)), "auto", 0),
    ]
    for (m, ws_shape), kernel, expected in cases:

        def f(x, ws, kernel=kernel):
            return jax_tiled.matmul(x, ws[1], kernel=kernel, precision="default")

        x = jax.ShapeDtypeStruct((m, ws_shape[1]), BF16)
        ws = jax.ShapeDtypeStruct(ws_shape, BF16)
        exported = jax.export.export(
            jax.jit(f), platforms=("cuda",), disabled_checks=jax_tiled.export_disabled_checks()
        )(x, ws)
        assert stacked_calls(exported.mlir_module()) == expected, (m, kernel)
