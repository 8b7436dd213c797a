"""Scale-out: `tiled_matmul` partitions itself under `jit` and inside `shard_map`.

Meshes are built from `jax.devices(platform)` explicitly, so that the CPU cases
(four devices, from conftest's XLA_FLAGS) also run where the default backend is
a GPU. Every case checks values in full, the compiled HLO's collectives against
`jnp.matmul`'s for the same shardings, and where batch, M or N is split, that
the result stays split.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_tiled
from helpers import (FORBIDDEN, HIGHEST, assert_matmul_close, assert_trees_close, bind_product,
                     loss_of, random_array, reference, tiled)

TARGETS = {"cpu": "tiled_matmul_cpu", "cuda": "tiled_matmul_cuda"}


def make_mesh(platform, shape, names, axis_type=AxisType.Auto):
    devices = jax.devices(platform)
    if len(devices) < math.prod(shape):
        if platform == "cpu":
            pytest.fail(f"{len(devices)} CPU devices; conftest sets XLA_FLAGS="
                        "--xla_force_host_platform_device_count=4 before jax starts")
        pytest.skip(f"needs {math.prod(shape)} {platform} devices, found {len(devices)}")
    grid = np.array(devices[:math.prod(shape)]).reshape(shape)
    return Mesh(grid, names, axis_types=(axis_type,) * len(names))


def put(rng, mesh, shape, spec, dtype=np.float32):
    x = random_array(rng, shape, dtype)
    return x, jax.device_put(x, NamedSharding(mesh, spec))


_COLLECTIVE = re.compile(
    r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def collectives(jitted, *args) -> set[str]:
    return set(_COLLECTIVE.findall(jitted.lower(*args).compile().as_text()))


# Collectives that move operand data rather than sum partial results.
GATHERS = {"all-gather", "all-to-all", "collective-permute"}

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
    "K_two_axes": ((2, 2), ("x", "y"), (8, 16), P(None, ("x", "y")), (16, 12), P(("x", "y")),
                   P(), True),
    "MxN": ((2, 2), ("x", "y"), (8, 16), P("x"), (16, 12), P(None, "y"), P("x", "y"), False),
    "MxK": ((2, 2), ("x", "y"), (8, 16), P("x", "y"), (16, 12), P("y"), P("x"), True),
    "batchxK": ((2, 2), ("x", "y"), (4, 8, 16), P("x", None, "y"), (4, 16, 12), P("x", "y"),
                P("x"), True),
}


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
    assert used & GATHERS <= reference_used & GATHERS, (used, reference_used)
    if k_split:  # local products, then a sum of partial results
        assert used & {"all-reduce", "reduce-scatter"}, used
    else:
        assert not used, used

    grad, ref_grad = (jax.jit(jax.grad(loss_of(f), (0, 1))) for f in (tiled, reference))
    assert_trees_close(grad(a, b), ref_grad(a, b))
    used, reference_used = collectives(grad, a, b), collectives(ref_grad, a, b)
    assert used & GATHERS <= reference_used & GATHERS, (used, reference_used)


@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, False),
                                                     (False, True), (True, True)])
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

    a_np, a = operand(("batch", "k", "m") if transpose_a else ("batch", "m", "k"),
                      1 if factor == "broadcast_batch" else size["batch"])
    b_np, b = operand(("batch", "n", "k") if transpose_b else ("batch", "k", "n"), size["batch"])
    prim = jax.jit(lambda a, b: bind_product(a, b, transpose_a, transpose_b, precision=HIGHEST))
    out = prim(a, b)
    stored = lambda x, transposed: np.swapaxes(x, 1, 2) if transposed else x
    assert_matmul_close(out, stored(a_np, transpose_a), stored(b_np, transpose_b),
                        precision="highest")
    used = collectives(prim, a, b)
    if split == "k":
        assert used == {"all-reduce"}, used
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
    assert "reduce-scatter" in used and not used & GATHERS, used


def test_uneven_split_of_k(rng):
    """A K that its mesh axes do not divide: the padded tails must not reach the sums."""
    mesh = make_mesh("cpu", (4,), ("x",))
    a_np, a = put(rng, mesh, (8, 16), P(None, "x"))
    b_np, b = put(rng, mesh, (16, 12), P("x"))
    cut = lambda mm: lambda a, b: mm(a[:, :14], b[:14, :7])
    out = jax.jit(cut(tiled))(a, b)
    assert_matmul_close(out, a_np[:, :14], b_np[:14, :7], precision="highest")
    assert not collectives(jax.jit(cut(tiled)), a, b) & GATHERS
    grad, ref_grad = (jax.jit(jax.grad(loss_of(cut(f)), (0, 1))) for f in (tiled, reference))
    assert_trees_close(grad(a, b), ref_grad(a, b))


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
    assert not collectives(jax.jit(tiled), a, b) & GATHERS
    assert_trees_close(jax.jit(jax.grad(loss_of(tiled), (0, 1)))(a, b),
                       jax.grad(loss_of(reference), (0, 1))(a, b), rtol=1e-4)


# ---- shard_map ----

@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_gradient_of_replicated_weight(rng, check_vma):
    """The weight's cotangent is summed over the data axis (jax-finufft#226)."""
    mesh = make_mesh("cpu", (4,), ("x",))
    x, w = random_array(rng, (16, 12), np.float32), random_array(rng, (12, 5), np.float32)

    def loss(mm):
        f = jax.shard_map(mm, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"),
                          check_vma=check_vma)
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
        f = jax.shard_map(mm, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"),
                          axis_names={"x"})
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)))

    assert_trees_close(jax.jit(jax.grad(loss(tiled), (0, 1)))(x, w),
                       jax.grad(loss_of(reference), (0, 1))(x_np, w_np))


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
EXPLICIT = {"batch": False, "batch_shared_weight": False, "M": False, "N": False, "MxN": False,
            "K_a_only": False, "K": True, "MxK": True, "batchxK": True}


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


@pytest.mark.parametrize("a_spec,b_spec,message", [
    (P("x"), P(None, "x"), r"split over one mesh axis twice.*jax.sharding.reshard"),
    (P(None, "x"), P("y"), r"split the k dimension differently.*jax.sharding.reshard"),
])
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
