"""Scale-out: `tiled_matmul` partitions itself under `jit` and inside `shard_map`.

Meshes are built from `jax.devices(platform)` explicitly, so that the CPU cases
(four devices, from conftest's XLA_FLAGS) also run where the default backend is
a GPU. Every case checks values in full, the compiled HLO's collectives against
`jnp.matmul`'s for the same shardings, and where batch, M or N is split, that
the result stays split. A split K, and an operand whose split the product
cannot keep, run as rings of collective-permutes (`jax_tiled.overlap`): no
all-gather of an operand, and with the overlap turned off, one collective.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_tiled
from helpers import (
    FORBIDDEN,
    HIGHEST,
    assert_matmul_close,
    assert_trees_close,
    bind_product,
    loss_of,
    random_array,
    reference,
    tiled,
)
from jax_tiled import _canonical, _lowering, _rings

TARGETS = {"cpu": "tiled_matmul_cpu", "cuda": "tiled_matmul_cuda"}


def make_mesh(platform, shape, names, axis_type=AxisType.Auto):
    devices = jax.devices(platform)
    if len(devices) < math.prod(shape):
        if platform == "cpu":
            pytest.fail(
                f"{len(devices)} CPU devices; conftest sets XLA_FLAGS="
                "--xla_force_host_platform_device_count=4 before jax starts"
            )
        pytest.skip(f"needs {math.prod(shape)} {platform} devices, found {len(devices)}")
    grid = np.array(devices[: math.prod(shape)]).reshape(shape)
    return Mesh(grid, names, axis_types=(axis_type,) * len(names))


def put(rng, mesh, shape, spec, dtype=np.float32):
    x = random_array(rng, shape, dtype)
    return x, jax.device_put(x, NamedSharding(mesh, spec))


_COLLECTIVE = re.compile(
    r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


def collectives(jitted, *args) -> set[str]:
    return set(_COLLECTIVE.findall(jitted.lower(*args).compile().as_text()))


# Collectives that move operand data rather than sum partial results. The rings
# move data by collective-permutes only, so an all-gather or all-to-all in a
# program that runs them is an operand (or a result) gathered around the product.
GATHERS = {"all-gather", "all-to-all", "collective-permute"}
BULK_GATHERS = {"all-gather", "all-to-all"}
RING = "collective-permute"

# name: mesh shape and axis names, a's shape and spec, b's shape and spec, the
# result's spec, and whether K is split (the product then ends in a sum).
CASES = {
    "batch": ((4,), ("x",), (4, 8, 16), P("x"), (4, 16, 12), P("x"), P("x"), False),
    "batch_shared_weight": ((4,), ("x",), (4, 8, 16), P("x"), (16, 12), P(), P("x"), False),
    "batch_2d": ((4,), ("x",), (4, 2, 8, 16), P("x"), (4, 2, 16, 12), P("x"), P("x"), False),
    "M": ((4,), ("x",), (8, 16), P("x"), (16, 12), P(), P("x"), False),
    "N": ((4,), ("x",), (8, 16), P(), (16, 12), P(None, "x"), P(None, "x"), False),
    "K": ((4,), ("x",), (8, 16), P(None, "x"), (16, 12), P("x"), P(), True),
    "K_a_only": ((4,), ("x",), (8, 16), P(None, "x"), (16, 12), P(), P(), True),
    "K_vector": ((4,), ("x",), (16,), P("x"), (16, 12), P("x"), P(), True),
    "K_two_axes": (
        (2, 2),
        ("x", "y"),
        (8, 16),
        P(None, ("x", "y")),
        (16, 12),
        P(("x", "y")),
        P(),
        True,
    ),
    "MxN": ((2, 2), ("x", "y"), (8, 16), P("x"), (16, 12), P(None, "y"), P("x", "y"), False),
    "MxK": ((2, 2), ("x", "y"), (8, 16), P("x", "y"), (16, 12), P("y"), P("x"), True),
    "batchxK": (
        (2, 2),
        ("x", "y"),
        (4, 8, 16),
        P("x", None, "y"),
        (4, 16, 12),
        P("x", "y"),
        P("x"),
        True,
    ),
}


def gradient_f64(a, b):
    """The gradients of loss_of's sum(sin(a @ b)) in float64 NumPy, as float32."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    g = np.cos(a64 @ b64)
    if a64.ndim == 1:
        return (b64 @ g).astype(np.float32), np.outer(a64, g).astype(np.float32)
    ga = g @ np.swapaxes(b64, -1, -2)
    gb = np.swapaxes(a64, -1, -2) @ g
    # A weight shared over a batch takes the sum of the batch's gradients.
    if b64.ndim < a64.ndim:
        gb = gb.reshape(-1, *gb.shape[-2:]).sum(0)
    return ga.astype(np.float32), gb.astype(np.float32)


def _case(platform, rng, name, axis_type=AxisType.Auto):
    mesh_shape, names, a_shape, a_spec, b_shape, b_spec, out_spec, k_split = CASES[name]
    mesh = make_mesh(platform, mesh_shape, names, axis_type)
    a_np, a = put(rng, mesh, a_shape, a_spec)
    b_np, b = put(rng, mesh, b_shape, b_spec)
    return mesh, a_np, a, b_np, b, out_spec, k_split


def _same_spec(sharding, spec, ndim):
    pad = lambda s: tuple(s) + (None,) * (ndim - len(s))
    return pad(sharding.spec) == pad(spec)


@pytest.fixture(params=["shardy", "gspmd"])
def partitioner(request):
    """Both of XLA's partitioners: Shardy reads the sharding rule, GSPMD the callbacks."""
    saved = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
    yield request.param
    jax.config.update("jax_use_shardy_partitioner", saved)


@pytest.mark.parametrize("name", CASES)
def test_sharded_product_and_gradient(platform, partitioner, rng, name):
    mesh, a_np, a, b_np, b, out_spec, k_split = _case(platform, rng, name)
    ours, ref = jax.jit(tiled), jax.jit(reference)

    out = ours(a, b)
    assert_matmul_close(out, a_np, b_np, platform=platform, precision="highest")
    assert _same_spec(out.sharding, out_spec, out.ndim), out.sharding
    if any(out_spec):  # batch, M or N split: the result is not gathered either
        assert not out.sharding.is_fully_replicated

    used, reference_used = collectives(ours, a, b), collectives(ref, a, b)
    if k_split:  # local products whose partial sums are added across K's devices
        # Every K case leaves the result replicated over K's axes: a ring of
        # collective-permutes, or all-reduces where the library chooses its
        # collectives (on GPUs: overlap.Settings.ring).
        k_axes = CASES[name][3][-1]  # a's spec names K's axes last
        k_axes = k_axes if isinstance(k_axes, tuple) else (k_axes,)
        k_devices = math.prod(mesh.shape[x] for x in k_axes)
        gpu = platform == "cuda"
        copy_engines = gpu and jax_tiled.overlap.permutes_by_copy_engines()
        ring = jax_tiled.overlap.current().ring(k_devices, True, gpu, copy_engines)
        assert used == ({RING} if ring == "sums" else {"all-reduce"}), (ring, used)
    else:
        assert not used, used

    grad, ref_grad = (jax.jit(jax.grad(loss_of(f), (0, 1))) for f in (tiled, reference))
    assert_trees_close(grad(a, b), ref_grad(a, b))
    assert_trees_close(grad(a, b), gradient_f64(a_np, b_np))
    used, reference_used = collectives(grad, a, b), collectives(ref_grad, a, b)
    assert used & BULK_GATHERS <= reference_used & BULK_GATHERS, (used, reference_used)


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[-1]])
def test_overlap_off_runs_one_collective(rng, name):
    """jax_tiled.overlap.settings(enabled=False): local products and one sum."""
    mesh, a_np, a, b_np, b, out_spec, _ = _case("cpu", rng, name)
    with jax_tiled.overlap.settings(enabled=False):
        f = jax.jit(tiled)
        assert_matmul_close(f(a, b), a_np, b_np, precision="highest")
        used = collectives(f, a, b)
    assert used == {"all-reduce"}, used
    assert collectives(jax.jit(tiled), a, b) == {RING}  # outside the block: the cache is not reused


@pytest.mark.parametrize(
    "transpose_a,transpose_b", [(False, False), (True, False), (False, True), (True, True)]
)
@pytest.mark.parametrize("factor", ["batch", "broadcast_batch", "m", "n", "k"])
def test_primitive_transpose_flags_each_factor_split(rng, transpose_a, transpose_b, factor):
    """The sharding rule follows the stored layout for every pair of transpose flags."""
    mesh = make_mesh("cpu", (4,), ("x",))
    size = dict(batch=4, m=8, n=12, k=16)
    split = "batch" if factor == "broadcast_batch" else factor

    def operand(factors, batch):
        shape = [batch, *(size[f] for f in factors[1:])]
        spec = P(*("x" if f == split and n > 1 else None for f, n in zip(factors, shape)))
        return put(rng, mesh, shape, spec)

    a_np, a = operand(
        ("batch", "k", "m") if transpose_a else ("batch", "m", "k"),
        1 if factor == "broadcast_batch" else size["batch"],
    )
    b_np, b = operand(("batch", "n", "k") if transpose_b else ("batch", "k", "n"), size["batch"])
    prim = jax.jit(lambda a, b: bind_product(a, b, transpose_a, transpose_b, precision=HIGHEST))
    out = prim(a, b)
    stored = lambda x, transposed: np.swapaxes(x, 1, 2) if transposed else x
    assert_matmul_close(
        out, stored(a_np, transpose_a), stored(b_np, transpose_b), precision="highest"
    )
    used = collectives(prim, a, b)
    if split == "k":
        assert used == {RING}, used
    else:
        assert not used and not out.sharding.is_fully_replicated, (used, out.sharding)


def test_reduce_scatter_where_the_result_is_wanted_split(rng):
    mesh = make_mesh("cpu", (4,), ("x",))
    a_np, a = put(rng, mesh, (8, 16), P(None, "x"))
    b_np, b = put(rng, mesh, (16, 12), P("x"))
    f = jax.jit(tiled, out_shardings=NamedSharding(mesh, P("x")))
    out = f(a, b)
    assert_matmul_close(out, a_np, b_np, precision="highest")
    assert _same_spec(out.sharding, P("x"), 2)
    used = collectives(f, a, b)
    assert used == {RING}, used
    with jax_tiled.overlap.settings(enabled=False):
        assert collectives(jax.jit(tiled, out_shardings=NamedSharding(mesh, P("x"))), a, b) == {
            "reduce-scatter"
        }


def test_uneven_split_of_k(rng):
    """A K that its mesh axes do not divide: the padded tails must not reach the sums."""
    mesh = make_mesh("cpu", (4,), ("x",))
    a_np, a = put(rng, mesh, (8, 16), P(None, "x"))
    b_np, b = put(rng, mesh, (16, 12), P("x"))
    cut = lambda mm: lambda a, b: mm(a[:, :14], b[:14, :7])
    out = jax.jit(cut(tiled))(a, b)
    assert_matmul_close(out, a_np[:, :14], b_np[:14, :7], precision="highest")
    assert not collectives(jax.jit(cut(tiled)), a, b) & BULK_GATHERS
    grad, ref_grad = (jax.jit(jax.grad(loss_of(cut(f)), (0, 1))) for f in (tiled, reference))
    assert_trees_close(grad(a, b), ref_grad(a, b))


# ---- Rings: communication that overlaps the products ----


def ring_steps(jitted, *args) -> int:
    return len(
        re.findall(r"\bcollective-permute(?:-start)?\(", jitted.lower(*args).compile().as_text())
    )


# The all-gather pattern: a split along M (the sequence), b along N (columns of
# a weight). name: a's shape and spec, b's, the result's wanted spec (None: left
# to propagation) and the spec it gets.
ALL_GATHER = {
    "result_N": ((8, 16), P("x"), (16, 12), P(None, "x"), P(None, "x"), P(None, "x")),
    "result_M": ((8, 16), P("x"), (16, 12), P(None, "x"), P("x"), P("x")),
    "propagated": ((8, 16), P("x"), (16, 12), P(None, "x"), None, None),
    "batched": (
        (3, 8, 16),
        P(None, "x"),
        (3, 16, 12),
        P(None, None, "x"),
        P(None, None, "x"),
        P(None, None, "x"),
    ),
}


@pytest.mark.parametrize("name", ALL_GATHER)
def test_all_gather_pattern_runs_a_ring(partitioner, rng, name):
    a_shape, a_spec, b_shape, b_spec, wanted, got = ALL_GATHER[name]
    mesh = make_mesh("cpu", (4,), ("x",))
    a_np, a = put(rng, mesh, a_shape, a_spec)
    b_np, b = put(rng, mesh, b_shape, b_spec)
    f = jax.jit(tiled, out_shardings=None if wanted is None else NamedSharding(mesh, wanted))
    out = f(a, b)
    assert_matmul_close(out, a_np, b_np, precision="highest")
    if got is not None:
        assert _same_spec(out.sharding, got, out.ndim), out.sharding
    assert not out.sharding.is_fully_replicated
    # The operand is gathered by 3 collective-permutes overlapping 4 products.
    assert collectives(f, a, b) == {RING} and ring_steps(f, a, b) == 3
    grad = jax.jit(jax.grad(loss_of(tiled), (0, 1)))
    assert_trees_close(grad(a, b), gradient_f64(a_np, b_np))
    with jax_tiled.overlap.settings(enabled=False):  # the partitioner gathers the operand
        plain = jax.jit(
            tiled, out_shardings=None if wanted is None else NamedSharding(mesh, wanted)
        )
        assert collectives(plain, a, b) == {"all-gather"}


@pytest.mark.parametrize("chunks", [None, 1, 3, 16])
@pytest.mark.parametrize("name", ALL_GATHER)
def test_all_gather_pattern_by_collectives(partitioner, rng, name, chunks):
    """gather_ring="collectives": each device's block cut into `chunks` pieces
    (COLLECTIVE_PIECES where None, no more than its rows), each gathered by one
    all-gather and multiplied: float64's values and gradient, no ring."""
    a_shape, a_spec, b_shape, b_spec, wanted, got = ALL_GATHER[name]
    mesh = make_mesh("cpu", (4,), ("x",))
    a_np, a = put(rng, mesh, a_shape, a_spec)
    b_np, b = put(rng, mesh, b_shape, b_spec)
    with jax_tiled.overlap.settings(gather_ring="collectives", chunks=chunks):
        f = jax.jit(tiled, out_shardings=None if wanted is None else NamedSharding(mesh, wanted))
        out = f(a, b)
        assert_matmul_close(out, a_np, b_np, precision="highest")
        if got is not None:
            assert _same_spec(out.sharding, got, out.ndim), out.sharding
        text = f.lower(a, b).compile().as_text()
        assert set(_COLLECTIVE.findall(text)) == {"all-gather"}, text
        # A result split along N gathered a (its rows), one split along M b.
        spec = tuple(out.sharding.spec) + (None,) * (out.ndim - len(out.sharding.spec))
        block = (a_shape[-2] if spec[-1] == "x" else b_shape[-1]) // 4
        pieces = min(chunks or jax_tiled.overlap.COLLECTIVE_PIECES, block)
        assert text.count('custom_call_target="tiled_matmul_cpu"') == pieces, text
        grad = jax.jit(jax.grad(loss_of(tiled), (0, 1)))
        assert_trees_close(grad(a, b), gradient_f64(a_np, b_np))


def test_all_gather_pieces_pair_each_gather_with_the_product_before():
    """Piece p + 1's all-gather and piece p's product pass through one barrier,
    and every product but the last carries `beside_transfer`."""
    ring = lambda call, product, beside, a, b: _rings.all_gather_pieces(
        call, product, a, b, axes=("x",), n=4, gathered="a", dims=ROWS, size=16, pieces=4,
        beside_transfer=beside,
    )  # fmt: skip
    in_specs = (P(None, "x"), P(None, None, "x"))
    assert _barriers(ring, in_specs, P(None, None, "x")) == [["all_gather", "dot_general"]] * 3
    assert _ring_spares(np.random.default_rng(0), ring, in_specs, P(None, None, "x")) == [
        32, 32, 32, 0,
    ]  # fmt: skip


@pytest.mark.parametrize("m,n,k", [(7, 10, 16), (9, 4, 16), (8, 12, 14), (7, 10, 13)])
@pytest.mark.parametrize(
    "chunks,k_ring", [(None, "sums"), (1, "sums"), (3, "sums"), (None, "operands")]
)
def test_rings_on_sizes_that_do_not_divide(rng, m, n, k, chunks, k_ring):
    """Blocks of ceil(size / devices) rows, pieces of ceil(block / chunks): the
    padded rows are computed and dropped, the padded K zeroed (both K rings)."""
    mesh = make_mesh("cpu", (4,), ("x",))
    cut = lambda mm: lambda a, b: mm(a[:m, :k], b[:k, :n])
    for a_spec, b_spec in ((P(None, "x"), P("x")), (P("x"), P(None, "x"))):
        a_np, a = put(rng, mesh, (12, 16), a_spec)
        b_np, b = put(rng, mesh, (16, 12), b_spec)
        with jax_tiled.overlap.settings(chunks=chunks, k_ring=k_ring):
            # jit refuses an output sharding that does not divide the result.
            for out_spec in (
                None,
                *[P(*[None] * d, "x") for d, size in enumerate((m, n)) if size % 4 == 0],
            ):
                out_sharding = None if out_spec is None else NamedSharding(mesh, out_spec)
                f = jax.jit(cut(tiled), out_shardings=out_sharding)
                assert_matmul_close(f(a, b), a_np[:m, :k], b_np[:k, :n], precision="highest")
            grad = jax.jit(jax.grad(loss_of(cut(tiled)), (0, 1)))
            expected = [np.zeros_like(a_np), np.zeros_like(b_np)]
            ga, gb = gradient_f64(a_np[:m, :k], b_np[:k, :n])
            expected[0][:m, :k], expected[1][:k, :n] = ga, gb
            assert_trees_close(grad(a, b), tuple(expected))


@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("out_spec", [P(), P("x"), P(None, "x")])
def test_k_ring_pieces(rng, chunks, out_spec):
    """Each piece of each device's block has its own ring of 3 steps; a
    replicated result gathers each piece around the ring too."""
    mesh = make_mesh("cpu", (4,), ("x",))
    a_np, a = put(rng, mesh, (24, 16), P(None, "x"))
    b_np, b = put(rng, mesh, (16, 24), P("x"))
    with jax_tiled.overlap.settings(chunks=chunks):
        f = jax.jit(tiled, out_shardings=NamedSharding(mesh, out_spec))
        out = f(a, b)
        assert_matmul_close(out, a_np, b_np, precision="highest")
        assert _same_spec(out.sharding, out_spec, 2)
        replicated = not any(out_spec)
        assert collectives(f, a, b) == {RING}
        assert ring_steps(f, a, b) == 3 * chunks * (2 if replicated else 1)


# A tiled_matmul FFI call in compiled HLO: its operands' shapes (the layout
# constraints list them, in order).
_FFI_OPERANDS = re.compile(
    r'custom_call_target="tiled_matmul\w*", operand_layout_constraints=\{(.*?)\}, '
)


@pytest.mark.parametrize("k_ring", ["sums", "collectives"])
@pytest.mark.parametrize(
    "a_shape,a_spec,b_shape,b_spec,stacked",
    [
        ((64, 32), P(None, "x"), (32, 48), P("x"), True),  # a (m, k): rows contiguous
        ((32, 64), P("x"), (32, 48), P("x"), False),  # a stored (k, m): rows strided
        ((2, 64, 32), P(None, None, "x"), (2, 32, 48), P(None, "x"), False),  # batches of rows
    ],
    ids=["rows", "a transposed", "batched"],
)
def test_k_rings_hand_contiguous_rows_as_stacks(
    rng, k_ring, a_shape, a_spec, b_shape, b_spec, stacked
):
    """Where each ring step's rows of a are contiguous (a stored (m, k), no
    batch) and every slice is whole, the K rings give the kernel the operand
    as a stack and the slice's index (`_rings._as_stack`), and the program
    slices nothing for it; else XLA's slices, as before. Four CPU devices;
    the sums ring's result reduce-scattered along M, the collectives' all
    reduced (their pieces cut the longer of M and N, here M; reduce-scattered
    along M they cut N, strided in b (k, n)); right either way."""
    mesh = make_mesh("cpu", (4,), ("x",))
    a_np, a = put(rng, mesh, a_shape, a_spec)
    b_np, b = put(rng, mesh, b_shape, b_spec)
    transposed = a_shape[-2] == 32 and a_spec == P("x")
    operand = (lambda x: jnp.swapaxes(x, -1, -2)) if transposed else (lambda x: x)
    out_spec = P(*[None] * (len(a_shape) - 2), "x") if k_ring == "sums" else P()
    with jax_tiled.overlap.settings(k_ring=k_ring):
        f = jax.jit(lambda a, b: tiled(operand(a), b), out_shardings=NamedSharding(mesh, out_spec))
        text = f.lower(a, b).compile().as_text()
        ranks = [  # each call's largest operand rank: 4 for a stack
            max(len(dims.split(",")) for dims in re.findall(r"\[([\d,]+)\]", operands))
            for operands in _FFI_OPERANDS.findall(text)
        ]
        assert ranks and all((rank == 4) == stacked for rank in ranks), (ranks, k_ring)
        if stacked:
            assert "dynamic-slice" not in text and " slice(" not in text, k_ring
        a_full = np.swapaxes(a_np, -1, -2) if transposed else a_np
        assert_matmul_close(f(a, b), a_full, b_np, precision="highest")


# What each K ring other than the sums moves the sums (or operands) with.
MOVED_BY = {"operands": {RING}, "collectives": {"reduce-scatter", "all-reduce"}}


@pytest.mark.parametrize("k_ring", list(MOVED_BY))
@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[-1]])
def test_other_k_rings_product_and_gradient(partitioner, rng, name, k_ring):
    """k_ring="operands" and "collectives": every K-sharded case and its
    gradient against float64; the operand ring moves the operands by
    collective-permutes and no sum by a collective, the collectives move the
    sums by reduce-scatters or all-reduces and nothing by a ring or gather."""
    mesh, a_np, a, b_np, b, out_spec, _ = _case("cpu", rng, name)
    with jax_tiled.overlap.settings(k_ring=k_ring):
        f = jax.jit(tiled)
        out = f(a, b)
        assert_matmul_close(out, a_np, b_np, precision="highest")
        assert _same_spec(out.sharding, out_spec, out.ndim), out.sharding
        moved = collectives(f, a, b)
        assert moved and moved <= MOVED_BY[k_ring], moved
        grad = jax.jit(jax.grad(loss_of(tiled), (0, 1)))
        assert_trees_close(grad(a, b), gradient_f64(a_np, b_np))


def _stored_k_split(rng, out_spec, m, n, k, transpose_a, transpose_b):
    """An m x k by k x n product on 4 CPU devices, each operand stored
    transposed or not and split along K: (a, b, mm, the result's sharding
    (out_spec where the result divides, else None), a and b as multiplied)."""
    mesh = make_mesh("cpu", (4,), ("x",))
    divides = out_spec == P() or (m if out_spec == P("x") else n) % 4 == 0
    a_np = random_array(rng, (k, m) if transpose_a else (m, k), np.float32)
    b_np = random_array(rng, (n, k) if transpose_b else (k, n), np.float32)
    k_spec = lambda transposed, first: P("x") if transposed == first else P(None, "x")
    a = jax.device_put(a_np, NamedSharding(mesh, k_spec(transpose_a, True)))
    b = jax.device_put(b_np, NamedSharding(mesh, k_spec(transpose_b, False)))
    mm = lambda x, y: tiled(x.T if transpose_a else x, y.T if transpose_b else y)
    out_sharding = NamedSharding(mesh, out_spec) if divides else None
    a_math = a_np.T if transpose_a else a_np
    b_math = b_np.T if transpose_b else b_np
    return a, b, mm, out_sharding, a_math, b_math


@pytest.mark.parametrize("out_spec", [P(), P("x"), P(None, "x")])
@pytest.mark.parametrize("m,n,k", [(24, 24, 16), (7, 10, 16), (9, 4, 32)])
@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, True)])
def test_operand_ring_blocks_and_layouts(rng, out_spec, m, n, k, transpose_a, transpose_b):
    """The operand ring on blocks that do not divide, stored layouts, a replicated
    or reduce-scattered result (along M or N): the same values as the sums'
    ring, and per step one transfer of each operand (a replicated result
    gathers its blocks after)."""
    k_split = _stored_k_split(rng, out_spec, m, n, k, transpose_a, transpose_b)
    a, b, mm, out_sharding, a_math, b_math = k_split
    with jax_tiled.overlap.settings(k_ring="operands"):
        f = jax.jit(mm, out_shardings=out_sharding)
        out = f(a, b)
        steps = ring_steps(f, a, b)
    assert_matmul_close(out, a_math, b_math, precision="highest")
    sums = jax.jit(mm, out_shardings=out_sharding)(a, b)
    np.testing.assert_allclose(np.asarray(out), np.asarray(sums), rtol=1e-5, atol=1e-5)
    replicated = out_sharding is None or not any(out_spec)
    assert steps == 2 * 3 + (3 if replicated else 0), steps


@pytest.mark.parametrize("a_shape", [(4, 8, 16), (8, 16)])  # a batch of its own, or broadcast
@pytest.mark.parametrize("out_spec", [P(), P("x")])
def test_operand_ring_on_batches(rng, a_shape, out_spec):
    """A batched K split scattered along the batch (or replicated): each
    operand with the batch is sent in pieces, a broadcast one whole (two
    transfers a step either way), and the product matches float64's."""
    mesh = make_mesh("cpu", (4,), ("x",))
    a_np, a = put(rng, mesh, a_shape, P(*[None] * (len(a_shape) - 1), "x"))
    b_np, b = put(rng, mesh, (4, 16, 12), P(None, "x"))
    with jax_tiled.overlap.settings(k_ring="operands"):
        f = jax.jit(tiled, out_shardings=NamedSharding(mesh, out_spec))
        out = f(a, b)
        steps = ring_steps(f, a, b)
    assert_matmul_close(out, a_np, b_np, precision="highest")
    assert steps == 2 * 3 + (0 if any(out_spec) else 3), steps


def test_operand_ring_rounds_a_16_bit_result_once(rng):
    """The operand ring's partial sums stay in float32 on the device that adds
    them: a bfloat16 result is within one rounding of the float64 product."""
    mesh = make_mesh("cpu", (4,), ("x",))
    a_np, a = put(rng, mesh, (16, 256), P(None, "x"), jnp.bfloat16)
    b_np, b = put(rng, mesh, (256, 16), P("x"), jnp.bfloat16)
    with jax_tiled.overlap.settings(k_ring="operands"):
        for out_spec in (P(), P("x")):
            out = jax.jit(jax_tiled.matmul, out_shardings=NamedSharding(mesh, out_spec))(a, b)
            assert out.dtype == jnp.bfloat16
            assert_matmul_close(out, a_np, b_np)


def _sliced(a, b, p, indices):
    """A ring's call's operands as arrays: a stack's chosen slice taken
    (`_rings._call` hands stacks on with their indices)."""
    indices = list(indices)
    return (
        a[indices.pop(0)] if p.a_stacked else a,
        b[indices.pop(0)] if p.b_stacked else b,
    )


def _ring_on_four(body, in_specs, out_spec):
    """body(a, b), a ring on its per-device blocks, over 4 CPU devices."""
    mesh = make_mesh("cpu", (4,), ("x",))
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)


def _ring_spares(rng, ring, in_specs, out_spec):
    """Runs `ring(call, product, beside, a, b)` on 4 CPU devices for a
    (1, 16, 32) by b (1, 32, 24), `call` recording the spared SMs of the
    product it is given (`product` spares none, `beside` 32); checks the
    result and returns what it recorded, in order."""
    product, beside = _rings_product(spare_sms=0), _rings_product(spare_sms=32)
    seen = []

    def call(a, b, p, out_dtype, *indices):
        a, b = _sliced(a, b, p, indices)
        seen.append(p.spare_sms)
        return jnp.matmul(a, b).astype(out_dtype)

    a_np = random_array(rng, (1, 16, 32), np.float32)
    b_np = random_array(rng, (1, 32, 24), np.float32)
    f = _ring_on_four(lambda a, b: ring(call, product, beside, a, b), in_specs, out_spec)
    out = jax.jit(f)(a_np, b_np)
    assert_matmul_close(out[0], a_np[0], b_np[0], precision="highest")
    return seen


K_SPLIT = (P(None, None, "x"), P(None, "x"))  # a's K and b's K split over the ring
ROWS = _canonical.positions(False, False)


@pytest.mark.parametrize("gather", [False, True])
def test_k_ring_products_beside_a_transfer_leave_sms_to_it(rng, gather):
    """Every product of a K ring that runs while a transfer is in flight (the
    previous step's sum, or the previous piece's gather) carries
    `beside_transfer` (on CUDA: SMs left free for NCCL's kernel); the first
    overlaps none. 4 devices, 2 pieces a block: 8 products."""
    ring = lambda call, product, beside, a, b: _rings.reduce_scatter_ring(
        call, product, a, b, axes=("x",), n=4, factor="m", dims=ROWS, pieces=2,
        gather=gather, acc_dtype=np.float32, beside_transfer=beside,
    )  # fmt: skip
    assert _ring_spares(rng, ring, K_SPLIT, P() if gather else P(None, "x")) == [0] + [32] * 7


@pytest.mark.parametrize("gather", [False, True])
def test_operand_ring_products_beside_a_transfer_leave_sms_to_it(rng, gather):
    """Every transfer of the operand ring depends only on the operands, so every
    product but the last may run beside one and carries `beside_transfer`."""
    ring = lambda call, product, beside, a, b: _rings.operand_ring(
        call, product, a, b, axes=("x",), n=4, factor="m", dims=ROWS, gather=gather,
        acc_dtype=np.float32, beside_transfer=beside,
    )  # fmt: skip
    assert _ring_spares(rng, ring, K_SPLIT, P() if gather else P(None, "x")) == [32, 32, 32, 0]


def test_all_gather_ring_products_beside_a_transfer_leave_sms_to_it(rng):
    """The all-gather ring's products but the last run beside the transfer of
    the next block and carry `beside_transfer`; the last overlaps none."""
    ring = lambda call, product, beside, a, b: _rings.all_gather_ring(
        call, product, a, b, axes=("x",), n=4, gathered="a", dims=ROWS, size=16,
        beside_transfer=beside,
    )  # fmt: skip
    in_specs = (P(None, "x"), P(None, None, "x"))
    assert _ring_spares(rng, ring, in_specs, P(None, None, "x")) == [32, 32, 32, 0]


RESHAPES = ("convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "transpose")


def _ring_jaxpr(ring, in_specs, out_spec):
    """The per-device jaxpr of `ring(call, product, beside, a, b)` on 4 CPU
    devices for a (1, 16, 32) by b (1, 32, 24), the products as jnp.matmul."""
    product = _rings_product(spare_sms=0)

    def call(a, b, p, out_dtype, *indices):
        a, b = _sliced(a, b, p, indices)
        return jnp.matmul(a, b).astype(out_dtype)

    f = _ring_on_four(lambda a, b: ring(call, product, product, a, b), in_specs, out_spec)
    a = jax.ShapeDtypeStruct((1, 16, 32), np.float32)
    b = jax.ShapeDtypeStruct((1, 32, 24), np.float32)
    (outer,) = jax.make_jaxpr(f)(a, b).jaxpr.eqns
    return outer.params["jaxpr"]


@pytest.mark.parametrize("chunks", [None, 1, 3, 32])
@pytest.mark.parametrize("out_spec", [P(), P("x"), P(None, "x")])
@pytest.mark.parametrize("m,n,k", [(24, 24, 16), (7, 10, 16), (8, 4, 32)])
@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, True)])
def test_collective_pieces_blocks_and_layouts(
    rng, chunks, out_spec, m, n, k, transpose_a, transpose_b
):
    """k_ring="collectives" on stored layouts, a replicated or reduce-scattered
    result (along M or N): the same values as the sums' ring, one collective a
    piece, the pieces cut across the scattered dimension (the longer of M and
    N for a replicated result), `chunks` of them (COLLECTIVE_PIECES where
    None), no more than its rows or columns."""
    k_split = _stored_k_split(rng, out_spec, m, n, k, transpose_a, transpose_b)
    a, b, mm, out_sharding, a_math, b_math = k_split
    with jax_tiled.overlap.settings(k_ring="collectives", chunks=chunks):
        f = jax.jit(mm, out_shardings=out_sharding)
        out = f(a, b)
        text = f.lower(a, b).compile().as_text()
    assert_matmul_close(out, a_math, b_math, precision="highest")
    sums = jax.jit(mm, out_shardings=out_sharding)(a, b)
    np.testing.assert_allclose(np.asarray(out), np.asarray(sums), rtol=1e-5, atol=1e-5)
    replicated = out_sharding is None or not any(out_spec)
    across = (m if m >= n else n) if replicated else (n if out_spec == P("x") else m)
    pieces = min(chunks or jax_tiled.overlap.COLLECTIVE_PIECES, across)
    # A product a piece (XLA:CPU may combine the collectives that follow them).
    assert text.count('custom_call_target="tiled_matmul_cpu"') == pieces, text
    assert _COLLECTIVE.findall(text) == ["all-reduce" if replicated else "reduce-scatter"] * len(
        _COLLECTIVE.findall(text)
    ), text


def test_collective_pieces_leave_sms_and_pair_each_collective_with_the_next_product(rng):
    """Each piece's collective and the next piece's product pass through one
    optimization barrier (so that XLA's scheduler does not end the collective
    first), and every product but the first carries `beside_transfer`."""
    ring = lambda call, product, beside, a, b: _rings.collective_pieces(
        call, product, a, b, axes=("x",), dims=ROWS, scatter=1, across="n", pieces=4,
        sum_dtype=np.float32, beside_transfer=beside,
    )  # fmt: skip
    assert _ring_spares(rng, ring, K_SPLIT, P(None, "x")) == [0, 32, 32, 32]
    assert _barriers(ring, K_SPLIT, P(None, "x")) == [["dot_general", "reduce_scatter"]] * 3


@pytest.mark.parametrize("k_sums", jax_tiled.overlap.K_SUMS)
def test_collective_pieces_sum_in_the_k_sums_type(rng, k_sums):
    """A bfloat16 result's pieces are computed (and summed) in bfloat16 with
    k_sums="output" (the default; the class of jnp's own reduce-scatter of
    bfloat16 partial products), in float32 with "accumulation"; either way
    within (devices + 1) bfloat16 roundings of the float64 product."""
    mesh = make_mesh("cpu", (4,), ("x",))
    a_np, a = put(rng, mesh, (16, 256), P(None, "x"), jnp.bfloat16)
    b_np, b = put(rng, mesh, (256, 16), P("x"), jnp.bfloat16)
    a64, b64 = np.asarray(a_np, np.float64), np.asarray(b_np, np.float64)
    bound = 5 * 2.0**-8 * (np.abs(a64) @ np.abs(b64))
    with jax_tiled.overlap.settings(k_ring="collectives", k_sums=k_sums):
        for out_spec in (P(), P("x")):
            f = jax.jit(jax_tiled.matmul, out_shardings=NamedSharding(mesh, out_spec))
            out = f(a, b)
            assert out.dtype == jnp.bfloat16
            assert np.all(np.abs(np.asarray(out, np.float64) - a64 @ b64) <= bound)
            # What each piece's product is computed in is what its collective
            # sums (XLA:CPU then computes a bfloat16 collective in float32).
            text = f.lower(a, b).compile().as_text()
            made = set(re.findall(r"= (\w+)\[[\d,]*\]\S* custom-call\(", text))
            assert made == {"bf16" if k_sums == "output" else "f32"}, (made, text)


def _barriers(ring, in_specs, out_spec):
    """What each `lax.optimization_barrier` of `ring(call, product, beside, a,
    b)` on 4 CPU devices holds: per barrier, per operand, the primitive that
    made it ("ppermute", or "dot_general" for a product)."""
    inner = _ring_jaxpr(ring, in_specs, out_spec)
    made_by, held = {}, []
    origin = lambda v: "literal" if hasattr(v, "val") else made_by.get(v, "input")
    for eqn in inner.eqns:
        made = eqn.primitive.name
        if made in RESHAPES:  # the product's cast or broadcast: look through it
            made = origin(eqn.invars[0])
        if eqn.primitive.name == "optimization_barrier":
            held.append(sorted(map(origin, eqn.invars)))
        for v in eqn.outvars:
            made_by[v] = made
    return held


def _primitives(ring, in_specs, out_spec):
    """The primitives, in order, of `ring(call, product, beside, a, b)` on 4
    CPU devices (the products as jnp.matmul), those of nested jits in their place."""

    def names(jaxpr):
        for eqn in jaxpr.eqns:
            inner = eqn.params.get("jaxpr")
            yield from names(inner.jaxpr) if inner is not None else [eqn.primitive.name]

    return list(names(_ring_jaxpr(ring, in_specs, out_spec)))


@pytest.mark.parametrize("barrier", [True, False])
def test_all_gather_ring_makes_each_transfer_and_its_product_ready_together(barrier):
    """With `gather_barrier` (the default), every step but the last passes the
    block in transit and that step's product through one optimization barrier,
    so that XLA's scheduler can end the transfer only with the product; without
    it, none."""
    ring = lambda call, product, beside, a, b: _rings.all_gather_ring(
        call, product, a, b, axes=("x",), n=4, gathered="a", dims=ROWS, size=16,
        beside_transfer=beside, barrier=barrier,
    )  # fmt: skip
    held = _barriers(ring, (P(None, "x"), P(None, None, "x")), P(None, None, "x"))
    assert held == ([["dot_general", "ppermute"]] * 3 if barrier else [])


def test_all_gather_ring_writes_its_result_once():
    """The ring's blocks are put in order by one gather at the end, not written
    a block a step into a zero-filled buffer (two passes over the result and a
    copy, on two H100s 5% of the bfloat16 8192^3 pattern's time)."""
    ring = lambda call, product, beside, a, b: _rings.all_gather_ring(
        call, product, a, b, axes=("x",), n=4, gathered="a", dims=ROWS, size=16,
        beside_transfer=beside,
    )  # fmt: skip
    ops = _primitives(ring, (P(None, "x"), P(None, None, "x")), P(None, None, "x"))
    assert ops.count("gather") == 1 and "dynamic_update_slice" not in ops, ops


def test_operand_ring_makes_each_step_s_operands_ready_with_the_product_before():
    """The operand ring's step s + 1 operands (both received) pass through one
    barrier with step s's product, so that they are not all received before
    the first product."""
    ring = lambda call, product, beside, a, b: _rings.operand_ring(
        call, product, a, b, axes=("x",), n=4, factor="m", dims=ROWS, gather=False,
        acc_dtype=np.float32, beside_transfer=beside,
    )  # fmt: skip
    held = _barriers(ring, K_SPLIT, P(None, "x"))
    assert held == [["dot_general", "ppermute", "ppermute"]] * 3


def test_collectives_cut_the_result_in_collective_pieces_by_default():
    settings = jax_tiled.overlap.Settings
    assert settings().gather_pieces() == jax_tiled.overlap.COLLECTIVE_PIECES
    assert settings(chunks=3).gather_pieces() == 3
    assert settings().pieces("collectives") == jax_tiled.overlap.COLLECTIVE_PIECES > 1
    assert settings(chunks=2).pieces("collectives") == 2
    assert settings().pieces("sums") == settings().pieces("operands") == 1


def test_the_k_ring_follows_the_devices_unless_named():
    """k_ring None (the default): on GPUs the sums ring for a result
    reduce-scattered over two devices, the collectives for a replicated one
    or over more devices; on CPU devices the sums ring; a ring named is kept."""
    ring = jax_tiled.overlap.Settings().ring
    assert ring(2, replicated=False, gpu=True) == "sums"
    assert ring(2, replicated=True, gpu=True) == "collectives"
    assert ring(4, replicated=False, gpu=True) == ring(8, replicated=True, gpu=True)
    assert ring(4, replicated=False, gpu=True) == "collectives"
    assert {ring(d, replicated=r, gpu=False) for d in (2, 4) for r in (False, True)} == {"sums"}
    for named in jax_tiled.overlap.K_RINGS:
        assert jax_tiled.overlap.Settings(k_ring=named).ring(4, replicated=True, gpu=True) == named


@pytest.mark.parametrize(
    "flags,expected",
    [
        ("", False),
        ("--xla_gpu_collective_permute_mode=peer", True),
        (
            "--xla_force_host_platform_device_count=4"
            " --xla_gpu_collective_permute_mode=COLLECTIVES_PEER_MEMORY",
            True,
        ),
        (
            "--xla_gpu_collective_permute_mode=peer --xla_gpu_collective_permute_mode=symmetric",
            False,
        ),
        ("--xla_gpu_collective_permute_mode=private --xla_gpu_collective_permute_mode=peer", True),
        ("--xla_gpu_collective_permute_mode=peers", False),
    ],
    ids=["none", "peer", "enum name", "last wins: symmetric", "last wins: peer", "not a mode"],
)
def test_permutes_by_copy_engines_reads_xlas_last_permute_mode(monkeypatch, flags, expected):
    """The rings' transfers run on the copy engines where the last
    --xla_gpu_collective_permute_mode of the XLA flags is peer (either of
    its spellings); read from XLA_FLAGS unless given."""
    assert jax_tiled.overlap.permutes_by_copy_engines(flags) is expected
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert jax_tiled.overlap.permutes_by_copy_engines() is expected


def test_rings_on_the_copy_engines_spare_no_sms_and_ring_a_replicated_k_split_on_two():
    """With the transfers on the copy engines the K rings' and the all-gather
    ring's products spare no SM (the collectives, NCCL's kernels on SMs, keep
    SPARE_SMS and GATHER_SPARE_SMS), two devices sum a replicated K split by
    the sums ring too, more devices keep the collectives; numbers and rings
    named are kept."""
    settings, overlap = jax_tiled.overlap.Settings, jax_tiled.overlap
    assert settings().ring(2, replicated=True, gpu=True, copy_engines=True) == "sums"
    assert settings().ring(2, replicated=False, gpu=True, copy_engines=True) == "sums"
    assert settings().ring(4, replicated=True, gpu=True, copy_engines=True) == "collectives"
    assert settings().ring(4, replicated=False, gpu=True, copy_engines=True) == "collectives"
    assert settings(k_ring="operands").ring(2, True, True, copy_engines=True) == "operands"
    for ring in ("sums", "operands"):
        assert settings().spares(ring) == overlap.SPARE_SMS > 0
        assert settings().spares(ring, copy_engines=True) == 0
    assert settings().spares("collectives", copy_engines=True) == overlap.SPARE_SMS
    assert settings(spare_sms=8).spares("sums", copy_engines=True) == 8
    assert settings().gather_spares(copy_engines=True) == 0
    assert settings(gather_ring="collectives").gather_spares(True) == overlap.GATHER_SPARE_SMS
    assert settings(gather_spare_sms=16).gather_spares(copy_engines=True) == 16


def test_gather_spared_sms_follow_the_barrier():
    """`gather_spare_sms` None: GATHER_SPARE_SMS with the barrier, none without
    (a product that spares SMs before the transfer's end only runs slower);
    a number given is kept either way."""
    settings = jax_tiled.overlap.Settings
    assert settings().gather_spares() == jax_tiled.overlap.GATHER_SPARE_SMS > 0
    assert settings(gather_barrier=False).gather_spares() == 0
    assert settings(gather_spare_sms=16, gather_barrier=False).gather_spares() == 16
    assert settings(gather_spare_sms=0).gather_spares() == 0


def _copy_engines() -> bool:
    """Whether this process's XLA flags run the GPU rings' transfers on the copy engines."""
    return jax_tiled.overlap.permutes_by_copy_engines()


def _rings_product(spare_sms):
    return dataclasses.replace(
        _lowering.Product("tiled_matmul_cpu", False, False, np.dtype(np.float32), 0, "auto"),
        spare_sms=spare_sms,
    )


@pytest.mark.gpu
def test_cuda_ring_products_carry_the_spared_sms(rng):
    """On GPUs, the K ring's second product asks the handler for
    `overlap.Settings.spare_sms` fewer SMs; the first asks for none."""
    mesh = make_mesh("cuda", (2,), ("x",))
    a_np, a = put(rng, mesh, (64, 256), P(None, "x"))
    b_np, b = put(rng, mesh, (256, 48), P("x"))
    for spare in (jax_tiled.overlap.SPARE_SMS, 7):
        with jax_tiled.overlap.settings(chunks=1, spare_sms=spare):
            f = jax.jit(tiled, out_shardings=NamedSharding(mesh, P("x")))
            assert_matmul_close(f(a, b), a_np, b_np, platform="cuda", precision="highest")
            text = f.lower(a, b).compile().as_text()
        assert sorted(map(int, re.findall(r"spare_sms = (\d+)", text))) == [0, spare], text


@pytest.mark.gpu
@pytest.mark.parametrize("out_spec", [P(), P("x")])
def test_cuda_operand_ring(rng, out_spec):
    """k_ring="operands" on GPUs: a bfloat16 K split, replicated or
    reduce-scattered, within one rounding of the float64 product; the
    product beside a transfer spares `spare_sms`, the last none."""
    mesh = make_mesh("cuda", (2,), ("x",))
    a_np, a = put(rng, mesh, (256, 512), P(None, "x"), jnp.bfloat16)
    b_np, b = put(rng, mesh, (512, 192), P("x"), jnp.bfloat16)
    with jax_tiled.overlap.settings(k_ring="operands"):
        f = jax.jit(jax_tiled.matmul, out_shardings=NamedSharding(mesh, out_spec))
        assert_matmul_close(f(a, b), a_np, b_np, platform="cuda")
        text = f.lower(a, b).compile().as_text()
    spared = jax_tiled.overlap.Settings().spares("operands", _copy_engines())
    assert sorted(map(int, re.findall(r"spare_sms = (\d+)", text))) == [0, spared], text


@pytest.mark.gpu
def test_cuda_k_ring_sums_in_the_output_dtype(rng):
    """k_sums="output" on GPUs: a bfloat16 K split's ring moves bfloat16 sums
    (float32 by default), and its result, replicated or reduce-scattered, is
    within one bfloat16 rounding a device (and one more) of the float64 product."""
    mesh = make_mesh("cuda", (2,), ("x",))
    a_np, a = put(rng, mesh, (256, 512), P(None, "x"), jnp.bfloat16)
    b_np, b = put(rng, mesh, (512, 192), P("x"), jnp.bfloat16)
    a64, b64 = np.asarray(a_np, np.float64), np.asarray(b_np, np.float64)
    bound = 3 * 2.0**-8 * (np.abs(a64) @ np.abs(b64))
    moved = {}
    for k_sums in jax_tiled.overlap.K_SUMS:
        with jax_tiled.overlap.settings(k_sums=k_sums):
            for out_spec in (P(), P("x")):
                f = jax.jit(jax_tiled.matmul, out_shardings=NamedSharding(mesh, out_spec))
                out = np.asarray(f(a, b), np.float64)
                assert np.all(np.abs(out - a64 @ b64) <= bound), (k_sums, out_spec)
            text = f.lower(a, b).compile().as_text()  # reduce-scattered: the sums alone move
        # The type each transfer moves: a collective-permute's, or on GPUs an
        # async start's tuple (of tuples), whose first element is the one sent.
        sent = r"= \(*(\w+)\[[^\n]*? collective-permute(?:-start)?\("
        moved[k_sums] = set(re.findall(sent, text))
        transfers = [line for line in text.splitlines() if "collective-permute" in line]
    assert moved == {"accumulation": {"f32"}, "output": {"bf16"}}, (moved, transfers[:4])


@pytest.mark.gpu
def test_cuda_collective_pieces(rng):
    """k_ring="collectives" on GPUs: a bfloat16 K split, replicated or
    reduce-scattered, within one bfloat16 rounding a device (and one more) of
    the float64 product, its sums moved by NCCL's all-reduce or reduce-scatter
    alone, the products after the first leaving `spare_sms` to them."""
    mesh = make_mesh("cuda", (2,), ("x",))
    a_np, a = put(rng, mesh, (256, 512), P(None, "x"), jnp.bfloat16)
    b_np, b = put(rng, mesh, (512, 192), P("x"), jnp.bfloat16)
    a64, b64 = np.asarray(a_np, np.float64), np.asarray(b_np, np.float64)
    bound = 3 * 2.0**-8 * (np.abs(a64) @ np.abs(b64))
    with jax_tiled.overlap.settings(k_ring="collectives"):
        for out_spec, collective in ((P(), "all-reduce"), (P("x"), "reduce-scatter")):
            f = jax.jit(jax_tiled.matmul, out_shardings=NamedSharding(mesh, out_spec))
            out = np.asarray(f(a, b), np.float64)
            assert np.all(np.abs(out - a64 @ b64) <= bound), out_spec
            text = f.lower(a, b).compile().as_text()
            assert set(_COLLECTIVE.findall(text)) == {collective}, text
            spared = sorted(map(int, re.findall(r"spare_sms = (\d+)", text)))
            pieces = jax_tiled.overlap.COLLECTIVE_PIECES
            assert spared == [0] + [jax_tiled.overlap.SPARE_SMS] * (pieces - 1), spared


@pytest.mark.gpu
def test_cuda_all_gather_pattern_by_collectives(rng):
    """gather_ring="collectives" on GPUs: the all-gather pattern by one
    all-gather a piece, against float64, the products beside a gather leaving
    `gather_spares()` SMs to it."""
    mesh = make_mesh("cuda", (2,), ("x",))
    a_np, a = put(rng, mesh, (256, 128), P("x"))
    b_np, b = put(rng, mesh, (128, 192), P(None, "x"))
    with jax_tiled.overlap.settings(gather_ring="collectives"):
        f = jax.jit(tiled, out_shardings=NamedSharding(mesh, P(None, "x")))
        assert_matmul_close(f(a, b), a_np, b_np, platform="cuda", precision="highest")
        text = f.lower(a, b).compile().as_text()
        spared = jax_tiled.overlap.current().gather_spares()
    assert set(_COLLECTIVE.findall(text)) == {"all-gather"}, text
    pieces = jax_tiled.overlap.COLLECTIVE_PIECES
    assert sorted(map(int, re.findall(r"spare_sms = (\d+)", text))) == [0] + [spared] * (
        pieces - 1
    ), text


@pytest.mark.gpu
@pytest.mark.parametrize("devices", [2, 4])
def test_cuda_k_split_sums_as_the_devices_say(rng, devices):
    """By default a K split sums as `overlap.Settings.ring` says for the
    devices and the transfers: the sums ring by collective-permutes, or the
    collectives by reduce-scatters or all-reduces (without the copy engines'
    flag: the sums ring for a reduce-scattered result on two GPUs only)."""
    mesh = make_mesh("cuda", (devices,), ("x",))
    a_np, a = put(rng, mesh, (256, 128 * devices), P(None, "x"), jnp.bfloat16)
    b_np, b = put(rng, mesh, (128 * devices, 192), P("x"), jnp.bfloat16)
    a64, b64 = np.asarray(a_np, np.float64), np.asarray(b_np, np.float64)
    # a bfloat16 rounding a device, and one
    bound = (devices + 1) * 2.0**-8 * (np.abs(a64) @ np.abs(b64))
    ring = functools.partial(
        jax_tiled.overlap.Settings().ring, devices, gpu=True, copy_engines=_copy_engines()
    )
    if not _copy_engines():
        assert ring(replicated=False) == ("sums" if devices == 2 else "collectives")
        assert ring(replicated=True) == "collectives"
    scattered = RING if ring(replicated=False) == "sums" else "reduce-scatter"
    replicated = RING if ring(replicated=True) == "sums" else "all-reduce"
    for out_spec, moved in ((P("x"), {scattered}), (P(), {replicated})):
        f = jax.jit(jax_tiled.matmul, out_shardings=NamedSharding(mesh, out_spec))
        assert np.all(np.abs(np.asarray(f(a, b), np.float64) - a64 @ b64) <= bound), out_spec
        assert collectives(f, a, b) == moved, out_spec


@pytest.mark.gpu
def test_cuda_all_gather_ring_products_carry_the_spared_sms(rng):
    """On GPUs, the all-gather ring's product beside its transfer asks the
    handler for `overlap.Settings.gather_spares()` fewer SMs (by default
    GATHER_SPARE_SMS with the barrier, none without); the last asks for none."""
    mesh = make_mesh("cuda", (2,), ("x",))
    a_np, a = put(rng, mesh, (64, 256), P("x"))
    b_np, b = put(rng, mesh, (256, 48), P(None, "x"))
    cases = (
        ({}, [0, jax_tiled.overlap.Settings().gather_spares(_copy_engines())]),
        (dict(gather_barrier=False), [0, 0]),
        (dict(gather_spare_sms=16), [0, 16]),
    )
    for kwargs, expected in cases:
        with jax_tiled.overlap.settings(**kwargs):
            f = jax.jit(tiled, out_shardings=NamedSharding(mesh, P(None, "x")))
            assert_matmul_close(f(a, b), a_np, b_np, platform="cuda", precision="highest")
            text = f.lower(a, b).compile().as_text()
        assert sorted(map(int, re.findall(r"spare_sms = (\d+)", text))) == expected, text


@pytest.fixture
def copy_engine_flag(monkeypatch):
    """XLA_FLAGS that put the rings' transfers on the copy engines, as the
    library reads them when it lowers a product. The flag is no part of
    jit's cache key (XLA reads it once, at start), so the caches are cleared
    on the way in and out: no program compiled without it is reused here,
    and none compiled with it after."""
    monkeypatch.setenv(
        "XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_gpu_collective_permute_mode=peer"
    )
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.mark.gpu
def test_cuda_rings_on_the_copy_engines(rng, copy_engine_flag):
    """Where XLA_FLAGS put the rings' transfers on the copy engines (as the
    library reads them when lowering), two GPUs sum a replicated K split by
    the sums ring, and no product of the K and all-gather rings spares SMs;
    the results as before."""
    mesh = make_mesh("cuda", (2,), ("x",))
    cases = {
        "K split, replicated": (P(None, "x"), P("x"), P(), {RING}),
        "all-gather pattern": (P("x"), P(None, "x"), P(None, "x"), {RING}),
    }
    for name, (a_spec, b_spec, out_spec, moved) in cases.items():
        a_np, a = put(rng, mesh, (64, 256), a_spec)
        b_np, b = put(rng, mesh, (256, 48), b_spec)
        f = jax.jit(tiled, out_shardings=NamedSharding(mesh, out_spec))
        assert_matmul_close(f(a, b), a_np, b_np, platform="cuda", precision="highest")
        assert collectives(f, a, b) == moved, name
        text = f.lower(a, b).compile().as_text()
        spared = set(map(int, re.findall(r"spare_sms = (\d+)", text)))
        assert spared == {0}, (name, text)


@pytest.mark.gpu
def test_cuda_all_gather_ring_runs_its_product_inside_the_transfer(rng):
    """What the barrier is for, in the program XLA compiles for two GPUs: the
    first product is scheduled between the transfer's start and its end (XLA's
    default scheduler, without the barrier, ended the transfer first:
    docs/sharding.md)."""
    mesh = make_mesh("cuda", (2,), ("x",))
    a_np, a = put(rng, mesh, (4096, 4096), P("x"), jnp.bfloat16)
    b_np, b = put(rng, mesh, (4096, 4096), P(None, "x"), jnp.bfloat16)
    f = jax.jit(jax_tiled.matmul, out_shardings=NamedSharding(mesh, P(None, "x")))
    assert_matmul_close(f(a, b), a_np, b_np, platform="cuda")
    entry = f.lower(a, b).compile().as_text().split("\nENTRY", 1)[1]
    # An instruction's opcode follows its result's shape (a tuple's in parentheses).
    order = re.findall(
        r"= (?:\(.*?\)|\S+) (collective-permute-start|collective-permute-done|custom-call)\(",
        entry,
    )
    assert order[:3] == ["collective-permute-start", "custom-call", "collective-permute-done"], (
        order
    )


def test_k_ring_rounds_a_16_bit_result_once(rng):
    """k_sums="accumulation": the partial sums travel in float32, so bfloat16
    rounding once is within one bfloat16 rounding of the float64 product
    (rounding each partial sum is not)."""
    mesh = make_mesh("cpu", (4,), ("x",))
    a_np, a = put(rng, mesh, (16, 256), P(None, "x"), jnp.bfloat16)
    b_np, b = put(rng, mesh, (256, 16), P("x"), jnp.bfloat16)
    for out_spec in (P(), P("x")):
        f = jax.jit(jax_tiled.matmul, out_shardings=NamedSharding(mesh, out_spec))
        with jax_tiled.overlap.settings(k_sums="accumulation"):
            out = f(a, b)
            text = f.lower(a, b).compile().as_text()
        assert out.dtype == jnp.bfloat16
        assert_matmul_close(out, a_np, b_np)
        moved = set(re.findall(r"= (\w+)\[[\d,]*\]\S* collective-permute(?:-start)?\(", text))
        # Partial sums move in float32 (a replicated result's gather moves the
        # rounded pieces, but XLA:CPU computes bfloat16 collectives in float32).
        assert moved == {"f32"}, moved


def test_k_ring_sums_in_the_output_dtype(rng):
    """k_sums="output" (the default): each device rounds its running sum to
    bfloat16 before sending it, one rounding a device, within (devices + 1)
    bfloat16 roundings of the float64 product, as jnp's all-reduce of bfloat16
    partial products; and not the result of rounding once ("accumulation"),
    on the same inputs."""
    mesh = make_mesh("cpu", (4,), ("x",))
    a_np, a = put(rng, mesh, (16, 256), P(None, "x"), jnp.bfloat16)
    b_np, b = put(rng, mesh, (256, 16), P("x"), jnp.bfloat16)
    a64, b64 = np.asarray(a_np, np.float64), np.asarray(b_np, np.float64)
    bound = 5 * 2.0**-8 * (np.abs(a64) @ np.abs(b64))
    for out_spec in (P(), P("x")):
        f = jax.jit(jax_tiled.matmul, out_shardings=NamedSharding(mesh, out_spec))
        with jax_tiled.overlap.settings(k_sums="output"):
            out = f(a, b)
        assert out.dtype == jnp.bfloat16
        assert np.all(np.abs(np.asarray(out, np.float64) - a64 @ b64) <= bound)
        np.testing.assert_array_equal(np.asarray(f(a, b)), np.asarray(out))  # the default
        with jax_tiled.overlap.settings(k_sums="accumulation"):
            once = f(a, b)
        assert not np.array_equal(np.asarray(out), np.asarray(once)), out_spec


@pytest.mark.parametrize("send_dtype", [None, np.float32, jnp.bfloat16])
def test_k_ring_sends_its_sums_in_send_dtype(rng, send_dtype):
    """The sums ring's transfers carry send_dtype (acc_dtype where it is None
    or the same); where narrower, each piece's first product is computed
    straight into it and the others in acc_dtype, added to what arrives."""
    product = _rings_product(spare_sms=0)
    asked = []

    def call(a, b, p, out_dtype, *indices):
        a, b = _sliced(a, b, p, indices)
        asked.append(np.dtype(out_dtype))
        return jnp.matmul(a, b).astype(out_dtype)

    ring = lambda a, b: _rings.reduce_scatter_ring(
        call, product, a, b, axes=("x",), n=4, factor="m", dims=ROWS, pieces=2, gather=False,
        acc_dtype=np.float32, beside_transfer=product, send_dtype=send_dtype,
    )  # fmt: skip
    a_np = random_array(rng, (1, 16, 32), np.float32)
    b_np = random_array(rng, (1, 32, 24), np.float32)
    text = str(jax.make_jaxpr(_ring_on_four(ring, K_SPLIT, P(None, "x")))(a_np, b_np))
    sent = re.findall(r"(\w+)\[[\d,]*\] = ppermute", text)
    narrow = send_dtype is jnp.bfloat16
    assert sent == ["bf16" if narrow else "f32"] * 6, sent
    first = np.dtype(jnp.bfloat16) if narrow else np.dtype(np.float32)
    assert asked == [first, np.float32, np.float32, np.float32] * 2, asked


def test_rings_are_deterministic(rng):
    mesh = make_mesh("cpu", (4,), ("x",))
    _, a = put(rng, mesh, (32, 64), P(None, "x"))
    _, b = put(rng, mesh, (64, 24), P("x"))
    f = jax.jit(tiled)
    first = np.asarray(f(a, b))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(a, b)), first)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(chunks=0), ValueError, r"chunks must be at least 1, got 0"),
        (dict(chunks=2.0), TypeError, r"chunks must be an int or None, got 2.0"),
        (dict(enabled="yes"), TypeError, r"enabled must be a bool"),
        (dict(spare_sms=-1), ValueError, r"spare_sms must be at least 0, got -1"),
        (dict(spare_sms="8"), TypeError, r"spare_sms must be an int or None, got '8'"),
        (dict(gather_spare_sms=-2), ValueError, r"gather_spare_sms must be at least 0, got -2"),
        (
            dict(gather_spare_sms=True),
            TypeError,
            r"gather_spare_sms must be an int or None, got True",
        ),
        (dict(k_ring="partials"), ValueError, r"k_ring must be None or one of 'sums', 'operands'"),
        (
            dict(gather_ring="ring"),
            ValueError,
            r"gather_ring must be one of 'blocks', 'collectives'",
        ),
        (dict(gather_barrier=1), TypeError, r"gather_barrier must be a bool, got 1"),
        (dict(k_sums="bfloat16"), ValueError, r"k_sums must be one of 'accumulation', 'output'"),
    ],
)
def test_overlap_settings_are_checked(kwargs, error, message):
    with pytest.raises(error, match=message):
        with jax_tiled.overlap.settings(**kwargs):
            pass
    with pytest.raises(error, match=message):
        jax_tiled.overlap.set_default(**kwargs)
    assert jax_tiled.overlap.current() == jax_tiled.overlap.Settings()


def test_unsharded_lowering_is_the_plain_custom_call(platform, rng):
    a, b = random_array(rng, (8, 16), np.float32), random_array(rng, (16, 12), np.float32)
    text = jax.jit(jax_tiled.matmul).lower(a, b).as_text()
    assert f"@{TARGETS[platform]}" in text and "CustomSPMDPartitioning" not in text


def test_replicated_operands_on_a_mesh_run_one_plain_call_each(platform, rng):
    mesh = make_mesh(platform, (2,) if platform == "cuda" else (4,), ("x",))
    a_np, a = put(rng, mesh, (8, 16), P())
    b_np, b = put(rng, mesh, (16, 12), P())
    f = jax.jit(tiled)
    assert_matmul_close(f(a, b), a_np, b_np, platform=platform, precision="highest")
    hlo = f.lower(a, b).compile().as_text()
    assert not _COLLECTIVE.search(hlo)
    assert re.findall(r'custom_call_target="([^"]+)"', hlo) == [TARGETS[platform]]


def test_on_every_platform_with_two_devices(platform, rng):
    """M split on one mesh axis and K on another, forward and backward."""
    mesh = make_mesh(platform, (2, 1) if platform == "cuda" else (2, 2), ("x", "y"))
    a_np, a = put(rng, mesh, (64, 32), P("x", "y"))
    b_np, b = put(rng, mesh, (32, 48), P("y"))
    out = jax.jit(tiled)(a, b)
    assert_matmul_close(out, a_np, b_np, platform=platform, precision="highest")
    assert not out.sharding.is_fully_replicated
    assert not collectives(jax.jit(tiled), a, b) & BULK_GATHERS
    assert_trees_close(
        jax.jit(jax.grad(loss_of(tiled), (0, 1)))(a, b),
        jax.grad(loss_of(reference), (0, 1))(a, b),
        rtol=1e-4,
    )


# ---- shard_map ----


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_gradient_of_replicated_weight(rng, check_vma):
    """The weight's cotangent is summed over the data axis (jax-finufft#226)."""
    mesh = make_mesh("cpu", (4,), ("x",))
    x, w = random_array(rng, (16, 12), np.float32), random_array(rng, (12, 5), np.float32)

    def loss(mm):
        f = jax.shard_map(
            mm, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"), check_vma=check_vma
        )
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)))

    ours = jax.jit(jax.grad(loss(tiled), (0, 1)))(x, w)
    assert_trees_close(ours, jax.jit(jax.grad(loss(reference), (0, 1)))(x, w))
    assert_trees_close(ours, jax.grad(loss_of(reference), (0, 1))(x, w))  # = unsharded
    jaxpr = str(jax.make_jaxpr(jax.grad(loss(tiled), (0, 1)))(x, w))
    assert "tiled_matmul" in jaxpr and not FORBIDDEN.search(jaxpr)


def test_shard_map_over_some_mesh_axes(rng):
    """A shard_map manual over x, with y left to the partitioner inside."""
    mesh = make_mesh("cpu", (2, 2), ("x", "y"))
    x_np, x = put(rng, mesh, (8, 16), P("x", "y"))
    w_np, w = put(rng, mesh, (16, 12), P("y"))

    def loss(mm):
        f = jax.shard_map(mm, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"), axis_names={"x"})
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)))

    assert_trees_close(
        jax.jit(jax.grad(loss(tiled), (0, 1)))(x, w),
        jax.grad(loss_of(reference), (0, 1))(x_np, w_np),
    )


def test_primitive_rejects_operands_varying_over_different_axes():
    mesh = make_mesh("cpu", (4,), ("x",))
    a, b = jnp.ones((4, 8, 16)), jnp.ones((1, 16, 12))
    bind = lambda a, b: bind_product(a, b, precision=HIGHEST)
    f = jax.shard_map(bind, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
    with pytest.raises(TypeError, match=r"vary over different manual mesh axes.*pcast"):
        jax.jit(f)(a, b)


# ---- Explicit mesh axes: the result's sharding is part of its type ----

# The cases, and whether jnp.matmul refuses them (K split on both operands
# needs its out_sharding, which jax_tiled.matmul does not have: it sums).
EXPLICIT = {
    "batch": False,
    "batch_shared_weight": False,
    "M": False,
    "N": False,
    "MxN": False,
    "K_a_only": False,
    "K": True,
    "MxK": True,
    "batchxK": True,
}


@pytest.mark.parametrize("name", EXPLICIT)
def test_explicit_axes(rng, name):
    mesh, a_np, a, b_np, b, out_spec, _ = _case("cpu", rng, name, AxisType.Explicit)
    with jax.set_mesh(mesh):
        out = jax.jit(tiled)(a, b)
        assert_matmul_close(out, a_np, b_np, precision="highest")
        assert _same_spec(jax.typeof(out).sharding, out_spec, out.ndim), jax.typeof(out)
        if not EXPLICIT[name]:
            assert jax.typeof(out) == jax.typeof(jax.jit(reference)(a, b))
        grads = jax.jit(jax.grad(loss_of(tiled), (0, 1)))(a, b)
        for g, x in zip(grads, (a, b)):
            assert jax.typeof(g) == jax.typeof(x)
        jaxpr = str(jax.make_jaxpr(jax.grad(loss_of(tiled), (0, 1)))(a, b))
        assert "tiled_matmul" in jaxpr and not FORBIDDEN.search(jaxpr)
    assert_trees_close(grads, jax.grad(loss_of(reference), (0, 1))(a_np, b_np))


@pytest.mark.parametrize(
    "a_spec,b_spec,message",
    [
        (P("x"), P(None, "x"), r"split over one mesh axis twice.*jax.sharding.reshard"),
        (P(None, "x"), P("y"), r"split the k dimension differently.*jax.sharding.reshard"),
    ],
)
def test_explicit_axes_conflicts_name_the_fix(rng, a_spec, b_spec, message):
    mesh = make_mesh("cpu", (2, 2), ("x", "y"), AxisType.Explicit)
    _, a = put(rng, mesh, (8, 16), a_spec)
    _, b = put(rng, mesh, (16, 12), b_spec)
    with jax.set_mesh(mesh), pytest.raises(TypeError, match=message):
        jax.jit(tiled)(a, b)


def test_explicit_axes_on_a_later_batch_dimension_name_the_fix(rng):
    mesh = make_mesh("cpu", (4,), ("x",), AxisType.Explicit)
    _, a = put(rng, mesh, (3, 4, 8, 16), P(None, "x"))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"first.*jax.sharding.reshard"):
        jax.jit(tiled)(a, jnp.ones((16, 12)))
