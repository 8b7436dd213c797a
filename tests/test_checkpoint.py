"""jax_tiled.checkpoint_policies: under jax.checkpoint, the dot policies save
tiled_matmul's results, so the backward pass runs no forward product again."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

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


# ---- Every policy, composite or written by hand ----


def layer(x, w1, w2, y):
    """A layer's products (no batch dimensions), a named value and a batched product."""
    h = checkpoint_name(jnp.sin(x @ w1), "h")
    scores = jnp.einsum("bik,bjk->bij", h, y)  # batched, as attention's scores
    return jnp.sum(jnp.tanh(scores) @ w2)


def mine(prim, *avals, **params):
    """A user's policy: save the products that contract 16 or more elements."""
    if prim is not jax.lax.dot_general_p:
        return False
    (contracting, _), _ = params["dimension_numbers"]
    return math.prod(avals[0].shape[d] for d in contracting) >= 16


_cp = jax.checkpoint_policies
POLICIES = {
    "dots_saveable": _cp.dots_saveable,
    "no batch dims": _cp.dots_with_no_batch_dims_saveable,
    "both(dots, names)": _cp.save_from_both_policies(
        _cp.dots_saveable, _cp.save_only_these_names("h")
    ),
    "both(no batch dims, names)": _cp.save_from_both_policies(
        _cp.dots_with_no_batch_dims_saveable, _cp.save_only_these_names("h")
    ),
    "names": _cp.save_only_these_names("h"),
    "nothing": _cp.nothing_saveable,
    "everything": _cp.everything_saveable,
    "user's": mine,
    "user's lambda": lambda prim, *avals, **params: prim is jax.lax.dot_general_p,
}


def layer_operands():
    return jnp.ones((2, 8, 16)), jnp.ones((16, 8)), jnp.ones((3, 4)), jnp.ones((2, 3, 8))


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_counts_tiled_matmul_where_it_counts_dot_general(name):
    """Under tiled, any policy saves the products it saves of the stock
    function: the backward pass runs as many tiled_matmul as the stock one
    runs dot_general, none recomputed that the policy saves."""
    policy = POLICIES[name]
    args = layer_operands()
    stock = jax.make_jaxpr(jax.grad(jax.checkpoint(layer, policy=policy), (0, 1, 2, 3)))(*args)
    routed = jax_tiled.tiled(jax.checkpoint(layer, policy=policy))
    jaxpr = jax.make_jaxpr(jax.grad(routed, (0, 1, 2, 3)))(*args)
    assert count(jaxpr, "dot_general") == 0
    assert count(jaxpr, "tiled_matmul") == count(stock, "dot_general")
    # Outside tiled, the same through knowing_tiled_matmul.
    ours = jax.checkpoint(jax_tiled.tiled(layer), policy=policies.knowing_tiled_matmul(policy))
    jaxpr = jax.make_jaxpr(jax.grad(ours, (0, 1, 2, 3)))(*args)
    assert count(jaxpr, "tiled_matmul") == count(stock, "dot_general")


def test_policies_that_differ_save_different_products():
    """The comparison above can fail: the policies do not all save alike."""
    args = layer_operands()
    counts = {
        name: count(
            jax.make_jaxpr(
                jax.grad(jax_tiled.tiled(jax.checkpoint(layer, policy=POLICIES[name])), (0, 1))
            )(*args),
            "tiled_matmul",
        )
        for name in ("dots_saveable", "no batch dims", "nothing", "both(dots, names)")
    }
    assert counts["nothing"] > counts["no batch dims"] > counts["dots_saveable"], counts


def test_knowing_tiled_matmul_is_one_function_per_policy():
    """Converting a policy again gives the same function, so that jit finds a
    checkpoint's jaxpr compiled on a second call; ours pass through."""
    policy = POLICIES["user's"]
    assert policies.knowing_tiled_matmul(policy) is policies.knowing_tiled_matmul(policy)
    assert policies.knowing_tiled_matmul(policies.dots_saveable) is policies.dots_saveable
    assert policies.knowing_tiled_matmul(None) is None
