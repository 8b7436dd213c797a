"""Transformations: jit, grad, jvp, second order, hessian, vmap in every
combination, and proof that every product in them runs on this package's kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_tiled
from helpers import (
    FORBIDDEN,
    HIGHEST,
    assert_matmul_close,
    assert_trees_close,
    bind_product,
    kernels_on,
    loss_of,
    random_array,
    reference,
    tiled,
    x64,
)

GRAD_SHAPES = [
    ((7, 13), (13, 5)),
    ((3, 7, 13), (13, 5)),
    ((7, 13), (3, 13, 5)),
    ((1, 7, 13), (4, 13, 5)),
    ((4, 7, 13), (1, 13, 5)),
    ((2, 1, 7, 13), (3, 13, 5)),
    ((13,), (13, 5)),
    ((7, 13), (13,)),
    ((13,), (13,)),
]


@pytest.mark.parametrize("a_shape,b_shape", GRAD_SHAPES, ids=str)
def test_jit_grad_jvp_match_jnp(platform, rng, a_shape, b_shape):
    a = random_array(rng, a_shape, np.float32)
    b = random_array(rng, b_shape, np.float32)
    da = random_array(rng, a_shape, np.float32)
    db = random_array(rng, b_shape, np.float32)
    for kernel in kernels_on(platform, precision=HIGHEST):
        mm = lambda a, b: tiled(a, b, kernel)
        assert_trees_close(jax.jit(mm)(a, b), reference(a, b))
        assert_trees_close(
            jax.grad(loss_of(mm), (0, 1))(a, b), jax.grad(loss_of(reference), (0, 1))(a, b)
        )
        assert_trees_close(jax.jvp(mm, (a, b), (da, db)), jax.jvp(reference, (a, b), (da, db)))
        assert_trees_close(
            jax.jit(jax.grad(loss_of(mm), (0, 1)))(a, b), jax.grad(loss_of(reference), (0, 1))(a, b)
        )


@pytest.mark.parametrize(
    "a_shape,b_shape", [((5, 6), (6, 4)), ((2, 5, 6), (1, 6, 4)), ((6,), (2, 6, 3))], ids=str
)
def test_check_grads_second_order(platform, rng, a_shape, b_shape):
    with x64():
        a = random_array(rng, a_shape, np.float64)
        b = random_array(rng, b_shape, np.float64)
        for kernel in kernels_on(platform, np.float64, precision=HIGHEST):
            check_grads(lambda a, b: tiled(a, b, kernel), (a, b), order=2, modes=("fwd", "rev"))
            check_grads(
                loss_of(lambda a, b: tiled(a, b, kernel)), (a, b), order=2, modes=("fwd", "rev")
            )


def test_hessian_jacfwd_jacrev_linearize(platform, rng):
    a = random_array(rng, (4, 3), np.float32)
    b = random_array(rng, (3, 5), np.float32)
    f, g = loss_of(tiled), loss_of(reference)
    assert_trees_close(jax.hessian(f, (0, 1))(a, b), jax.hessian(g, (0, 1))(a, b), rtol=1e-4)
    assert_trees_close(jax.jacfwd(tiled)(a, b), jax.jacfwd(reference)(a, b))
    assert_trees_close(jax.jacrev(tiled, 1)(a, b), jax.jacrev(reference, 1)(a, b))
    _, f_lin = jax.linearize(tiled, a, b)
    _, g_lin = jax.linearize(reference, a, b)
    assert_trees_close(f_lin(a, b), g_lin(a, b))


@pytest.mark.parametrize(
    "a_axis,b_axis",
    [(0, None), (None, 0), (0, 0), (1, None), (None, 2), (2, 1), (1, 0), (-1, -1)],
    ids=str,
)
def test_vmap_any_axis(platform, rng, a_axis, b_axis):
    v = 3
    a_shape, b_shape = [2, 7, 9], [9, 5]
    if a_axis is not None:
        a_shape.insert(a_axis % (len(a_shape) + 1), v)
    if b_axis is not None:
        b_shape.insert(b_axis % (len(b_shape) + 1), v)
    a = random_array(rng, a_shape, np.float32)
    b = random_array(rng, b_shape, np.float32)
    for kernel in kernels_on(platform, precision=HIGHEST):
        out = jax.vmap(lambda a, b: tiled(a, b, kernel), in_axes=(a_axis, b_axis))(a, b)
        ref = jax.vmap(reference, in_axes=(a_axis, b_axis))(a, b)
        assert_trees_close(out, ref)


def test_vmap_of_batched_primitive(platform, rng):
    """vmap over the primitive when its own batch is broadcast, full, or both."""
    for a_batch, b_batch in [(1, 4), (4, 1), (4, 4), (1, 1)]:
        a = random_array(rng, (3, a_batch, 6, 5), np.float32)
        b = random_array(rng, (b_batch, 5, 7), np.float32)
        prim = lambda a, b: bind_product(a, b, precision=HIGHEST)
        out = jax.vmap(prim, in_axes=(0, None))(a, b)
        assert_matmul_close(
            out, a, np.broadcast_to(b, (3, *b.shape)), platform=platform, precision="highest"
        )


def test_vmap_of_grad_and_grad_of_vmap(platform, rng):
    a = random_array(rng, (4, 6, 5), np.float32)
    b = random_array(rng, (5, 3), np.float32)
    f, g = loss_of(tiled), loss_of(reference)
    assert_trees_close(
        jax.vmap(jax.grad(f, (0, 1)), in_axes=(0, None))(a, b),
        jax.vmap(jax.grad(g, (0, 1)), in_axes=(0, None))(a, b),
    )
    vf = lambda a, b: jnp.sum(jax.vmap(tiled, in_axes=(0, None))(a, b) ** 2)
    vg = lambda a, b: jnp.sum(jax.vmap(reference, in_axes=(0, None))(a, b) ** 2)
    assert_trees_close(jax.grad(vf, (0, 1))(a, b), jax.grad(vg, (0, 1))(a, b))


def test_grad_with_16bit_inputs_and_float32_output(platform, rng):
    a = random_array(rng, (8, 16), jnp.bfloat16)
    b = random_array(rng, (16, 4), jnp.bfloat16)
    f = lambda a, b: jnp.sum(jax_tiled.matmul(a, b, preferred_element_type=jnp.float32) ** 2)
    g = lambda a, b: jnp.sum(
        jnp.matmul(a, b, preferred_element_type=jnp.float32, precision=HIGHEST) ** 2
    )
    ga, gb = jax.grad(f, (0, 1))(a, b)
    assert ga.dtype == jnp.bfloat16 and gb.dtype == jnp.bfloat16
    assert_trees_close((ga, gb), jax.grad(g, (0, 1))(a, b), rtol=2e-2)


# ---- Every product runs on this package's kernels ----


def _jaxprs(a, b):
    da, db = jnp.ones_like(a), jnp.ones_like(b)
    return {
        "matmul": jax.make_jaxpr(jax_tiled.matmul)(a, b),
        "grad": jax.make_jaxpr(jax.grad(loss_of(jax_tiled.matmul), (0, 1)))(a, b),
        "jvp": jax.make_jaxpr(lambda a, b: jax.jvp(jax_tiled.matmul, (a, b), (da, db)))(a, b),
    }


@pytest.mark.parametrize("a_shape,b_shape", GRAD_SHAPES, ids=str)
def test_no_dot_general_or_transpose_in_jaxprs(a_shape, b_shape):
    a, b = jnp.ones(a_shape), jnp.ones(b_shape)
    for name, jaxpr in _jaxprs(a, b).items():
        text = str(jaxpr)
        assert "tiled_matmul" in text, name
        assert not FORBIDDEN.search(text), f"{name} jaxpr:\n{text}"


def test_gradient_hlo_has_only_our_custom_calls(platform):
    a, b = jnp.ones((3, 7, 13)), jnp.ones((13, 5))
    hlo = jax.jit(jax.grad(loss_of(jax_tiled.matmul), (0, 1))).lower(a, b).as_text()
    target = "tiled_matmul_cpu" if platform == "cpu" else "tiled_matmul_cuda"
    assert "dot_general" not in hlo and "stablehlo.dot" not in hlo
    assert hlo.count(f"@{target}") == 3  # forward and one product per operand
