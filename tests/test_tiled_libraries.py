"""jax_tiled.tiled over real libraries' code: lineax's and optimistix's
implicit solvers (Equinox primitives carrying open jaxprs with constants),
numpyro's log densities under grad from outside, and a Flax NNX training step
whose batch statistics and RNG counts must be updated as nnx.jit updates them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import optimistix as optx
import pytest
from flax import nnx
from numpyro.infer.util import log_density

import helpers
import jax_tiled
from helpers import count_equations, random_array

assert_trees_close = functools.partial(helpers.assert_trees_close, rtol=1e-4)


def assert_routed(f, *args):
    """f's jaxpr has products on tiled_matmul and no floating-point dot_general."""
    jaxpr = jax.make_jaxpr(f)(*args)
    float_dots = [
        e
        for e in helpers.equations(jaxpr, "dot_general")
        if jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating)
    ]
    assert count_equations(jaxpr, "tiled_matmul") > 0 and not float_dots, jaxpr


def sum_grad(f):
    return jax.grad(lambda *args: jnp.sum(f(*args)), tuple(range(2)))


# ---- Implicit solvers: Equinox primitives with open jaxprs and constants ----


def linear_solve(m, b):
    """The issue's reproducer: a matrix-free operator closing over m."""
    operator = lx.FunctionLinearOperator(lambda v: m @ v, jax.ShapeDtypeStruct(b.shape, b.dtype))
    return lx.linear_solve(operator, b).value


def root_find(w, c):
    """y with tanh(w y) + y = c, by Newton's method (a lineax solve per step,
    the gradient by the implicit function theorem)."""
    fn = lambda y, args: jnp.tanh(args[0] @ y) + y - args[1]
    solver = optx.Newton(rtol=1e-6, atol=1e-6)
    return optx.root_find(fn, solver, jnp.zeros_like(c), args=(w, c)).value


SOLVERS = {"lineax linear_solve": linear_solve, "optimistix root_find": root_find}


def solver_operands(rng, name):
    n = 4
    if name == "lineax linear_solve":
        m = random_array(rng, (n, n), np.float32) + 4 * np.eye(n, dtype=np.float32)
        return m, random_array(rng, (n,), np.float32)
    return random_array(rng, (n, n), np.float32) / 4, random_array(rng, (n,), np.float32)


@pytest.mark.parametrize("name", SOLVERS)
def test_implicit_solvers(rng, name):
    f = SOLVERS[name]
    args = solver_operands(rng, name)
    routed = jax_tiled.tiled(f)
    assert_routed(routed, *args)
    assert_routed(sum_grad(routed), *args)  # grad from outside
    assert_routed(jax_tiled.tiled(sum_grad(f)), *args)  # grad inside
    with jax.default_matmul_precision("highest"):
        assert_trees_close(routed(*args), f(*args))
        assert_trees_close(jax.jit(routed)(*args), f(*args))
        want = sum_grad(f)(*args)
        assert_trees_close(sum_grad(routed)(*args), want)
        assert_trees_close(jax.jit(jax_tiled.tiled(sum_grad(f)))(*args), want)


# ---- numpyro: a log density, differentiated from outside ----


def regression(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    covariance = x.T @ x / x.shape[0] + jnp.eye(x.shape[1])
    numpyro.sample("prior", dist.MultivariateNormal(jnp.zeros(x.shape[1]), covariance), obs=w)
    numpyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)


def test_numpyro_log_density_under_grad(rng):
    """The products of the multivariate normal's gradient (its Cholesky
    factor's and triangular solves' rules create them) run on the kernels."""
    x = random_array(rng, (20, 3), np.float32)
    y = random_array(rng, (20,), np.float32)
    w = random_array(rng, (3,), np.float32)
    log_p = lambda w, x: log_density(regression, (x, y), {}, {"w": w})[0]
    assert count_equations(jax.make_jaxpr(sum_grad(log_p))(w, x), "dot_general") > 0
    routed = jax_tiled.tiled(log_p)
    assert_routed(sum_grad(routed), w, x)
    with jax.default_matmul_precision("highest"):
        assert_trees_close(routed(w, x), log_p(w, x))
        assert_trees_close(sum_grad(routed)(w, x), sum_grad(log_p)(w, x))


# ---- Flax NNX: the state a training step updates ----


class Classifier(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(jax.nn.relu(self.norm(self.hidden(x)))))


def mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def train(route, x, y, steps=5):
    """Losses of `steps` SGD steps under nnx.jit, each computing its loss and
    gradient through `route(nnx.value_and_grad(mse))`; and the model."""
    model = Classifier(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = route(nnx.value_and_grad(mse))(model, x, y)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer, x, y)) for _ in range(steps)], model


def test_nnx_training_step_updates_the_module_as_nnx_jit_does(rng):
    """Batch statistics move and dropout draws a new mask each step, as
    without tiled, and the losses are the same."""
    x = random_array(rng, (32, 8), np.float32)
    y = random_array(rng, (32, 1), np.float32)
    with jax.default_matmul_precision("highest"):
        want, stock = train(lambda f: f, x, y)
        losses, model = train(jax_tiled.tiled, x, y)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    assert len(set(want)) == len(want)  # the steps do differ
    for ours, theirs in ((model.norm.mean, stock.norm.mean), (model.norm.var, stock.norm.var)):
        assert not np.allclose(theirs[...], 0 if theirs is stock.norm.mean else 1)
        assert_trees_close(ours[...], theirs[...])
    assert int(model.dropout.rngs.count[...]) == int(stock.dropout.rngs.count[...]) == 5


def test_nnx_module_as_the_function(rng):
    """tiled(module): a module that reads its variables works in any trace; one
    that updates them is updated."""
    x = random_array(rng, (4, 8), np.float32)
    model = Classifier(nnx.Rngs(0))
    model.eval()
    with jax.default_matmul_precision("highest"):
        assert_trees_close(jax.jit(jax_tiled.tiled(model))(x), model(x))
    assert_routed(jax_tiled.tiled(model), x)
    model.train()
    reference = Classifier(nnx.Rngs(0))
    reference.train()
    with jax.default_matmul_precision("highest"):
        assert_trees_close(jax_tiled.tiled(model)(x), reference(x))
    assert_trees_close(model.norm.mean[...], reference.norm.mean[...])
    assert int(model.dropout.rngs.count[...]) == int(reference.dropout.rngs.count[...]) == 1
