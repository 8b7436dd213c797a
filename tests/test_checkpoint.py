"""jax_tiled.checkpoint_policies: under jax.checkpoint, the dot policies save
tiled_matmul's results, so the backward pass runs no forward product again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tiled
from helpers import count_equations as count
from helpers import random_array
from jax_tiled import checkpoint_policies as policies


def products_in_grad(f, *args) -> int:
    return count(jax.make_jaxpr(jax.grad(f, tuple(range(len(args)))))(*args).jaxpr, "tiled_matmul")


def dense(x, w):  # (batch, seq, features) @ (features, out): canonical batch 1
    return jnp.sum(jnp.sin(jax_tiled.matmul(x, w)))


def batched(x, y):  # (batch, m, k) @ (batch, k, n): canonical batch > 1
    return jnp.sum(jnp.sin(jax_tiled.matmul(x, y)))


X, W = jnp.ones((2, 8, 16)), jnp.ones((16, 4))
Y = jnp.ones((2, 16, 4))


@pytest.mark.parametrize("name", ["dots_saveable", "checkpoint_dots"])
def test_dots_saveable_saves_the_products(name):
    ours = getattr(policies, name)
    assert products_in_grad(jax.checkpoint(dense, policy=ours), X, W) == 3
    assert products_in_grad(jax.checkpoint(batched, policy=ours), X, Y) == 3
    # jax's own policy does not know tiled_matmul and recomputes the forward product.
    theirs = getattr(jax.checkpoint_policies, name)
    assert products_in_grad(jax.checkpoint(dense, policy=theirs), X, W) == 4
    assert products_in_grad(jax.checkpoint(dense), X, W) == 4
    assert products_in_grad(dense, X, W) == 3


@pytest.mark.parametrize(
    "name", ["dots_with_no_batch_dims_saveable", "checkpoint_dots_with_no_batch_dims"]
)
def test_no_batch_dims_policy_saves_layers_not_batched_products(name):
    ours = getattr(policies, name)
    assert products_in_grad(jax.checkpoint(dense, policy=ours), X, W) == 3
    assert products_in_grad(jax.checkpoint(batched, policy=ours), X, Y) == 4
    assert (
        products_in_grad(jax.checkpoint(dense, policy=getattr(jax.checkpoint_policies, name)), X, W)
        == 4
    )


def test_policies_still_know_dot_general():
    f = lambda x, w: jnp.sum(jnp.sin(x @ w))
    for policy in (policies.dots_saveable, policies.dots_with_no_batch_dims_saveable):
        jaxpr = jax.make_jaxpr(jax.grad(jax.checkpoint(f, policy=policy), (0, 1)))(X, W).jaxpr
        assert count(jaxpr, "dot_general") == 3


def test_offload_policy_offloads_products_without_batch_dims():
    policy = policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    prim = jax_tiled.tiled_matmul_p
    a1, b1 = (
        jax.core.ShapedArray((1, 8, 16), np.float32),
        jax.core.ShapedArray((1, 16, 4), np.float32),
    )
    a2 = jax.core.ShapedArray((2, 8, 16), np.float32)
    # The parameters jax.checkpoint hands a policy: the equation's.
    params = dict(
        transpose_a=False,
        transpose_b=False,
        out_dtype=np.dtype(np.float32),
        precision=jax.lax.Precision.DEFAULT,
        kernel="auto",
    )
    saved = policy(prim, a1, b1, **params)
    assert (saved.src, saved.dst) == ("device", "pinned_host")
    jax_answer = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")(
        jax.lax.sin_p, a1
    )
    # recompute, as jax answers for any non-dot
    assert policy(prim, a2, b1, **params) == jax_answer
    assert policy(jax.lax.sin_p, a1) == jax_answer


def test_gradients_are_unchanged_by_the_policy(rng):
    x = random_array(rng, (2, 8, 16), np.float32)
    w = random_array(rng, (16, 4), np.float32)
    plain = jax.grad(dense, (0, 1))(x, w)
    for policy in (policies.dots_saveable, policies.dots_with_no_batch_dims_saveable):
        saved = jax.jit(jax.grad(jax.checkpoint(dense, policy=policy), (0, 1)))(x, w)
        for u, v in zip(saved, plain):
            np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-6)


def test_tiled_translates_jax_policies_inside_the_function():
    f = lambda x, w: jnp.sum(jnp.sin(x @ w))
    for policy in (
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    ):
        routed = jax_tiled.tiled(jax.checkpoint(f, policy=policy))
        jaxpr = jax.make_jaxpr(jax.grad(routed, (0, 1)))(X, W).jaxpr
        assert count(jaxpr, "tiled_matmul") == 3 and count(jaxpr, "dot_general") == 0
    routed = jax_tiled.tiled(jax.checkpoint(f))
    assert count(jax.make_jaxpr(jax.grad(routed, (0, 1)))(X, W).jaxpr, "tiled_matmul") == 4
