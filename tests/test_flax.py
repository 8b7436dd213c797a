"""Flax layers with `dot_general=jax_tiled.dot_general` (and nnx.Einsum with
`einsum_op=jax_tiled.einsum`) compute what the stock layers compute, with
every product of the forward and backward pass on tiled_matmul, and train alike
(the digits example's model and step, examples/mlp_digits.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Test dependencies (README: "Test"); imported outright, so that a missing one fails.
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jax_tiled
from helpers import assert_trees_close as assert_close
from helpers import load_repository_module


def no_dot_general(f, *args):
    text = str(jax.make_jaxpr(f)(*args))
    assert "tiled_matmul[" in text and "dot_general[" not in text, text


X = jax.random.normal(jax.random.key(0), (3, 5, 4, 6))


# ---- linen ----

LINEN = {
    "Dense": lambda **kw: nn.Dense(7, **kw),
    "DenseGeneral": lambda **kw: nn.DenseGeneral((2, 3), axis=(-2, -1), **kw),
    "DenseGeneral-batch": lambda **kw: nn.DenseGeneral(3, axis=-1, batch_dims=(0,), **kw),
}


@pytest.mark.parametrize("name", LINEN)
def test_linen_layers_match_stock(name):
    ours = LINEN[name](dot_general=jax_tiled.dot_general, precision="highest")
    stock = LINEN[name](precision="highest")
    params = stock.init(jax.random.key(1), X)
    assert_close(ours.apply(params, X), stock.apply(params, X))
    loss = lambda layer: lambda p, x: jnp.sum(jnp.sin(layer.apply(p, x)))
    assert_close(
        jax.jit(jax.grad(loss(ours), (0, 1)))(params, X),
        jax.jit(jax.grad(loss(stock), (0, 1)))(params, X),
    )
    no_dot_general(jax.grad(loss(ours), (0, 1)), params, X)


# ---- nnx ----

NNX = {
    "Linear": lambda rngs, **kw: nnx.Linear(6, 7, rngs=rngs, **kw),
    "LinearGeneral": lambda rngs, **kw: nnx.LinearGeneral(
        (4, 6), (2, 3), axis=(-2, -1), rngs=rngs, **kw
    ),
    "LinearGeneral-batch": lambda rngs, **kw: nnx.LinearGeneral(
        6, 3, axis=-1, batch_axis={0: 3}, rngs=rngs, **kw
    ),
}


def split_params(module):
    return nnx.split(module, nnx.Param)


@pytest.mark.parametrize("name", NNX)
def test_nnx_layers_match_stock(name):
    ours = NNX[name](nnx.Rngs(1), dot_general=jax_tiled.dot_general, precision="highest")
    stock = NNX[name](nnx.Rngs(1), precision="highest")
    assert_close(ours(X), stock(X))
    loss = lambda m, x: jnp.sum(jnp.sin(m(x)))
    g_ours = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(ours, X)
    g_stock = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(stock, X)
    assert_close(nnx.state(g_ours[0]), nnx.state(g_stock[0]))
    assert_close(g_ours[1], g_stock[1])
    graphdef, state = nnx.split(ours)
    no_dot_general(jax.grad(lambda s, x: loss(nnx.merge(graphdef, s), x), (0, 1)), state, X)


def test_nnx_einsum_with_einsum_op():
    make = lambda **kw: nnx.Einsum(
        "bthd,hdk->btk", (4, 6, 5), (5,), rngs=nnx.Rngs(2), precision="highest", **kw
    )
    ours, stock = make(einsum_op=jax_tiled.einsum), make()
    assert_close(ours(X), stock(X))
    graphdef, state = nnx.split(ours)
    loss = lambda s, x: jnp.sum(jnp.sin(nnx.merge(graphdef, s)(x)))
    no_dot_general(jax.grad(loss, (0, 1)), state, X)
    g = jax.jit(jax.grad(loss, (0, 1)))(state, X)
    graphdef_s, state_s = nnx.split(stock)
    h = jax.jit(jax.grad(lambda s, x: jnp.sum(jnp.sin(nnx.merge(graphdef_s, s)(x))), (0, 1)))(
        state_s, X
    )
    assert_close(g, h)


def test_nnx_passes_out_sharding_under_an_explicit_mesh():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh(
        (2, 2),
        ("data", "model"),
        axis_types=(AxisType.Explicit,) * 2,
        devices=jax.devices("cpu")[:4],
    )
    with jax.set_mesh(mesh):
        ours = nnx.Linear(6, 8, dot_general=jax_tiled.dot_general, rngs=nnx.Rngs(3))
        stock = nnx.Linear(6, 8, rngs=nnx.Rngs(3))
        x = jax.device_put(np.asarray(X.reshape(-1, 6)), NamedSharding(mesh, P("data")))
        for out_sharding in (None, P("data", "model"), P(None, "model")):
            y = ours(x, out_sharding=out_sharding)
            want = stock(x, out_sharding=out_sharding)
            assert jax.typeof(y).sharding.spec == jax.typeof(want).sharding.spec
            assert_close(y, want, rtol=1e-5)


# ---- Training alike ----


def _digits_example():
    return load_repository_module("examples/mlp_digits.py")


def train(dot_general, steps=30):
    """The digits example's MLP and step, small, on random data."""
    digits = _digits_example()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6)).astype(np.float32)
    y = (x[:, :3] @ rng.standard_normal((3, 3)) > 0).argmax(-1)
    model = digits.MLP(dot_general, nnx.Rngs(0), inputs=6, hidden=32, classes=3)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return [float(digits.train_step(model, optimizer, x, y)) for _ in range(steps)]


def test_nnx_mlp_trains_as_the_stock_layers():
    with jax.default_matmul_precision("highest"):
        ours, stock = train(jax_tiled.dot_general), train(None)
    assert ours[-1] < 0.5 * ours[0]
    np.testing.assert_allclose(ours, stock, rtol=1e-3)
