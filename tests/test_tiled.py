"""jax_tiled.tiled(fn): every floating-point dot_general inside fn runs on
tiled_matmul, under jit, grad, vmap and checkpoint, through control flow and
custom derivatives; integer products are left as they are."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import helpers
import jax_tiled
from helpers import count_equations, equations, random_array, x64

# Routed products are held to 1e-5 of the stock computation unless a test says otherwise.
assert_trees_close = functools.partial(helpers.assert_trees_close, rtol=1e-5)


def float_dots(jaxpr) -> int:
    return sum(
        1
        for e in equations(jaxpr, "dot_general")
        if jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating)
    )


def products(jaxpr) -> int:
    return count_equations(jaxpr, "tiled_matmul")


def assert_routed(f, *args):
    """f's jaxpr has products on tiled_matmul and no floating-point dot_general."""
    jaxpr = jax.make_jaxpr(f)(*args)
    assert products(jaxpr) > 0 and float_dots(jaxpr) == 0, jaxpr
    return jaxpr


# ---- A model built from every way of writing a product ----


def model(params, x):
    h = x @ params["w1"]  # @
    h = jax.nn.gelu(jnp.matmul(h, params["w2"]))  # jnp.matmul
    q = jnp.einsum("btd,dhk->bthk", h, params["wq"])  # einsum
    k = jnp.einsum("btd,dhk->bthk", h, params["wk"])
    v = jnp.einsum("btd,dhk->bthk", h, params["wv"])
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # attention
    a = jnp.dot(a.reshape(*a.shape[:2], -1), params["wo"])  # jnp.dot
    a = lax.dot_general(a, params["w1"], (((2,), (1,)), ((), ())))  # x @ w.T
    return jnp.tanh(a)


def make_params(rng, d=8, heads=2, k=4):
    r = lambda *s: random_array(rng, s, np.float32) / np.sqrt(s[0])
    return {
        "w1": r(d, d),
        "w2": r(d, d),
        "wq": r(d, heads, k),
        "wk": r(d, heads, k),
        "wv": r(d, heads, k),
        "wo": r(heads * k, d),
    }


def loss(f):
    return lambda params, x: jnp.sum(f(params, x) ** 2)


def test_model_values_and_jaxpr(rng):
    params, x = make_params(rng), random_array(rng, (2, 5, 8), np.float32)
    routed = jax_tiled.tiled(model)
    with jax.default_matmul_precision("highest"):
        want = model(params, x)
        assert_trees_close(routed(params, x), want)
        assert_trees_close(jax.jit(routed)(params, x), want)
    jaxpr = assert_routed(routed, params, x)
    assert products(jaxpr) == float_dots(jax.make_jaxpr(model)(params, x)) == 9


def test_model_under_grad_vmap_jit(rng):
    params, x = make_params(rng), random_array(rng, (2, 5, 8), np.float32)
    routed = jax_tiled.tiled(model)
    jit = jax.jit  # outside jit, routed functions run op by op: correct, but slow to test
    with jax.default_matmul_precision("highest"):
        want = jit(jax.grad(loss(model)))(params, x)
        assert_trees_close(jax.grad(loss(routed))(params, x), want)
        assert_trees_close(jit(jax.grad(loss(routed)))(params, x), want)
        xs = np.stack([x, -x])
        assert_trees_close(
            jit(jax.vmap(routed, (None, 0)))(params, xs),
            jit(jax.vmap(model, (None, 0)))(params, xs),
        )
        assert_trees_close(
            jit(jax.vmap(jax.grad(loss(routed)), (None, 0)))(params, xs),
            jit(jax.vmap(jax.grad(loss(model)), (None, 0)))(params, xs),
        )
        # tiled outside the transformations: the products they emit are routed too.
        assert_trees_close(jit(jax_tiled.tiled(jax.grad(loss(model))))(params, x), want)
    assert_routed(jax.grad(loss(routed)), params, x)
    assert_routed(jax_tiled.tiled(jax.grad(loss(model))), params, x)
    assert_routed(jax.vmap(routed, (None, 0)), params, np.stack([x, x]))
    assert_routed(jax.checkpoint(routed), params, x)
    assert_routed(jax.grad(loss(jax.checkpoint(routed))), params, x)


def test_integer_products_are_left_alone(rng):
    a = jnp.asarray(rng.integers(-5, 5, (4, 6)), jnp.int32)
    b = jnp.asarray(rng.integers(-5, 5, (6, 3)), jnp.int32)
    x = random_array(rng, (3, 2), np.float32)
    f = lambda a, b, x: ((a @ b).astype(jnp.float32) @ x, a @ b)
    routed = jax_tiled.tiled(f)
    jaxpr = jax.make_jaxpr(routed)(a, b, x)
    assert products(jaxpr) == 1 and float_dots(jaxpr) == 0
    assert (
        count_equations(jaxpr, "dot_general") == 2
    )  # the integer ones, exact as jnp computes them
    with jax.default_matmul_precision("highest"):  # true fp32 on GPUs too
        for u, v in zip(routed(a, b, x), f(a, b, x)):
            assert u.dtype == v.dtype
            np.testing.assert_allclose(u, v, rtol=1e-6)


def test_integer_operands_into_a_float_result_are_routed(rng):
    """As jax_tiled.matmul computes them: exactly jnp's result for int8."""
    a = rng.integers(-128, 128, (16, 64)).astype(np.int8)
    b = rng.integers(-128, 128, (64, 8)).astype(np.int8)
    f = lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32)
    routed = jax_tiled.tiled(f)
    assert_routed(routed, a, b)
    np.testing.assert_array_equal(routed(a, b), f(a, b))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, np.float32])
def test_dtypes_and_preferred_element_type(rng, dtype):
    a = jnp.asarray(random_array(rng, (4, 16), dtype))
    b = jnp.asarray(random_array(rng, (16, 3), dtype))
    f = lambda a, b: (a @ b, jnp.matmul(a, b, preferred_element_type=jnp.float32))
    routed = jax_tiled.tiled(f)
    assert_routed(routed, a, b)
    for u, v in zip(routed(a, b), f(a, b)):
        assert u.dtype == v.dtype
        assert_trees_close(u, v, rtol=1e-2 if np.dtype(dtype).itemsize == 2 else 1e-5)


# ---- Control flow and custom derivatives ----


@jax.custom_jvp
def custom_jvp_product(x, w):
    return x @ w


custom_jvp_product.defjvp(lambda p, t: (custom_jvp_product(*p), t[0] @ p[1] + p[0] @ t[1]))


@jax.custom_vjp
def custom_vjp_product(x, w):
    return x @ w


custom_vjp_product.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))


def control_flow(x, w):
    y = jax.jit(lambda x: x @ w)(x)
    y = jax.checkpoint(lambda y: jnp.sin(y @ w.T))(y)
    y = lax.scan(lambda c, _: (jnp.tanh(c @ w.T @ w), None), y, None, length=2)[0]
    y = lax.cond(y.sum() > 0, lambda y: y @ w.T @ w, lambda y: -y, y)
    y = lax.fori_loop(0, 2, lambda i, c: jnp.tanh(c @ w.T @ w), y)
    y = jnp.tanh(custom_jvp_product(y, w.T) @ w)
    y = jnp.tanh(custom_vjp_product(y, w.T) @ w)
    return jnp.einsum("ij,kj->ik", y, w).sum()


def test_control_flow_and_custom_derivatives(rng):
    x = random_array(rng, (2, 3), np.float32)
    w = random_array(rng, (3, 3), np.float32) / 2
    routed = jax_tiled.tiled(control_flow)
    with jax.default_matmul_precision("highest"):
        assert_trees_close(routed(x, w), control_flow(x, w))
        want = jax.jit(jax.grad(control_flow, (0, 1)))(x, w)
        assert_trees_close(jax.jit(jax.grad(routed, (0, 1)))(x, w), want)
        assert_trees_close(jax.jit(jax_tiled.tiled(jax.grad(control_flow, (0, 1))))(x, w), want)
    # Every product, the custom rules' included, runs on tiled_matmul.
    assert_routed(routed, x, w)
    assert_routed(jax.grad(routed, (0, 1)), x, w)
    assert_routed(jax_tiled.tiled(jax.grad(control_flow, (0, 1))), x, w)
    assert_routed(lambda x, w: jax.jvp(routed, (x, w), (x, w)), x, w)


def test_while_loop(rng):
    x = random_array(rng, (2, 3), np.float32)
    w = random_array(rng, (3, 3), np.float32) / 2
    f = lambda x, w: lax.while_loop(
        lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x)
    )[1]
    routed = jax_tiled.tiled(f)
    assert_routed(routed, x, w)
    with jax.default_matmul_precision("highest"):
        assert_trees_close(routed(x, w), f(x, w))


def test_shard_map_inside(rng):
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh(
        (2, 2),
        ("data", "model"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
        devices=jax.devices("cpu")[:4],
    )
    f = jax.shard_map(
        lambda x, w: lax.psum(x @ w, "model"),
        mesh=mesh,
        in_specs=(P("data", "model"), P("model")),
        out_specs=P("data"),
    )
    x = random_array(rng, (8, 4), np.float32)
    w = random_array(rng, (4, 6), np.float32)
    routed = jax_tiled.tiled(f)
    assert_routed(routed, x, w)
    # tiled inside shard_map, on the per-device body.
    inside = jax.shard_map(
        jax_tiled.tiled(lambda x, w: lax.psum(x @ w, "model")),
        mesh=mesh,
        in_specs=(P("data", "model"), P("model")),
        out_specs=P("data"),
    )
    assert_routed(inside, x, w)
    with jax.default_matmul_precision("highest"):
        assert_trees_close(routed(x, w), f(x, w))
        assert_trees_close(inside(x, w), f(x, w))
        want = jax.grad(lambda x, w: f(x, w).sum(), (0, 1))(x, w)
        assert_trees_close(jax.grad(lambda x, w: routed(x, w).sum(), (0, 1))(x, w), want)
        assert_trees_close(jax.grad(lambda x, w: inside(x, w).sum(), (0, 1))(x, w), want)


MORE = {
    "custom_linear_solve": lambda a, b: jnp.linalg.solve(a, b),
    "grad of custom_linear_solve": jax.grad(lambda a, b: jnp.linalg.solve(a, b).sum()),
    "lax.map": lambda a, b: lax.map(lambda r: r @ a, a),
    "associative_scan": lambda a, b: lax.associative_scan(jnp.matmul, jnp.stack([a, a / 2, a])),
    "pure_callback": lambda a, b: jax.pure_callback(
        lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct((4,), np.float32), a @ b
    ),
    "debug callback": lambda a, b: (jax.debug.callback(lambda v: None, a @ b), a @ b)[1],
    "random keys": lambda a, b: jax.random.normal(jax.random.key(0), (4, 4)) @ a,
}


@pytest.mark.parametrize("name", MORE)
def test_more_primitives(rng, name):
    a = random_array(rng, (4, 4), np.float32) + 4 * np.eye(4, dtype=np.float32)
    b = random_array(rng, (4,), np.float32)
    f = MORE[name]
    routed = jax_tiled.tiled(f)
    assert_routed(routed, a, b)
    with jax.default_matmul_precision("highest"):
        assert_trees_close(jax.jit(routed)(a, b), jax.jit(f)(a, b), rtol=1e-4)


# ---- Transformations applied from outside ----


def _spd(a):
    return a @ a.T + 4 * jnp.eye(a.shape[0], dtype=a.dtype)


LINALG = {
    "qr": lambda a: sum(jnp.sum(jnp.sin(m)) for m in jnp.linalg.qr(a)),
    "eigh": lambda a: jnp.sum(jnp.linalg.eigh(_spd(a))[1] ** 3) + jnp.sum(jnp.linalg.eigvalsh(a)),
    "svd": lambda a: (
        jnp.sum(jnp.linalg.svd(a, compute_uv=False) ** 2) + jnp.sum(jnp.linalg.svd(a)[0] ** 3)
    ),
    "cho_solve": lambda a: jnp.sum(
        jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(_spd(a)), jnp.sin(a))
    ),
}


@pytest.mark.parametrize("name", LINALG)
def test_transformations_outside_route_the_products_their_rules_create(rng, name):
    """grad, jvp and vjp of tiled(f): the products that the differentiation
    rules of qr, eigh, svd and triangular_solve create, after tiled has
    rewritten f, run on tiled_matmul as well."""
    f = LINALG[name]
    a = random_array(rng, (4, 4), np.float32)
    t = random_array(rng, (4, 4), np.float32)
    routed = jax_tiled.tiled(f)
    transformations = {
        "grad": lambda f: jax.grad(f),
        "jvp": lambda f: lambda a: jax.jvp(f, (a,), (t,)),
        "vjp": lambda f: lambda a: jax.vjp(f, a)[1](np.float32(1.5)),
        "linearize": lambda f: lambda a: jax.linearize(f, a)[1](t),
    }
    for transform in transformations.values():
        # Their rules do create products: the stock jaxpr has some to route.
        assert float_dots(jax.make_jaxpr(transform(f))(a)) > 0
        assert_routed(transform(routed), a)
        with jax.default_matmul_precision("highest"):
            assert_trees_close(jax.jit(transform(routed))(a), jax.jit(transform(f))(a), rtol=1e-4)


@jax.custom_batching.custom_vmap
def _rows_times(x, w):
    return x @ w


@_rows_times.def_vmap
def _rows_times_vmap(axis_size, in_batched, x, w):
    x_batched, w_batched = in_batched
    if w_batched:
        return jnp.einsum("...k,bkn->bn", x, w), True
    return jnp.einsum("bk,kn->bn", x, w), True


def test_vmap_of_a_custom_vmap_function(rng):
    """vmap runs a custom_vmap function's own rule, which creates its products
    when vmap is applied to tiled(g), after the rewrite: routed too."""
    x = random_array(rng, (5, 3), np.float32)
    w = random_array(rng, (3, 4), np.float32)
    ws = random_array(rng, (5, 3, 4), np.float32)
    g = lambda x, w: jnp.tanh(_rows_times(x, w))
    for in_axes, args in (((0, None), (x, w)), ((0, 0), (x, ws))):
        stock = jax.vmap(g, in_axes)
        assert float_dots(jax.make_jaxpr(stock)(*args)) > 0
        routed = jax.vmap(jax_tiled.tiled(g), in_axes)
        assert_routed(routed, *args)
        assert_routed(jax.grad(lambda *a: routed(*a).sum(), (0, 1)), *args)
        with jax.default_matmul_precision("highest"):
            assert_trees_close(routed(*args), stock(*args))


# ---- Eager calls: traced and compiled once per argument signature ----


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kwargs: _compiles.update([event])
)


def test_eager_calls_trace_and_compile_once(rng):
    """tiled(f)(x, w) outside jit: the first call traces f and compiles; later
    calls with the same signature do neither (f's inner jit was compiled
    again on every call before)."""
    # Eighths: exact in TF32 too, so a GPU's default precision agrees with the
    # reference.
    x = random_array(rng, (8, 8), np.float32, integers=True) / 8
    w = random_array(rng, (8, 8), np.float32, integers=True) / 8
    inner = jax.jit(lambda x, w: jnp.tanh(x @ w))
    traces = []

    def f(x, w, scale):
        traces.append(scale)
        return inner(x, w).sum() * scale

    routed = jax_tiled.tiled(f)
    routed(x, w, 2.0).block_until_ready()
    assert traces == [2.0]
    before = _compiles[COMPILE_EVENT]
    for _ in range(3):
        out = routed(x, w, 2.0)
    assert traces == [2.0] and _compiles[COMPILE_EVENT] == before
    with jax.default_matmul_precision("highest"):
        assert_trees_close(out, jnp.tanh(x @ w).sum() * 2.0)
    # Another signature (a static argument, a shape) is another trace.
    routed(x, w, 3.0)
    routed(x[:4], w, 2.0)
    assert traces == [2.0, 3.0, 2.0]
    # Eager grad of it compiles nothing new on a second call either.
    grad = jax.grad(routed, (0, 1))
    grad(x, w, 2.0)
    before = _compiles[COMPILE_EVENT]
    grad(x, w, 2.0)
    assert _compiles[COMPILE_EVENT] == before


def test_eager_cache_follows_the_configuration(rng):
    """jax's configuration is part of a trace's signature, as of jit's: with
    x64 enabled, f's constants are float64 and its results too."""
    x = random_array(rng, (4, 8), np.float32)
    w = random_array(rng, (8, 2), np.float32)
    routed = jax_tiled.tiled(lambda x, w: x @ w + jnp.ones(2))
    assert routed(x, w).dtype == np.float32
    with x64():
        assert routed(x, w).dtype == np.float64
    assert routed(x, w).dtype == np.float32


# ---- Primitives that carry jaxprs ----


def test_pallas_kernels_are_left_alone(rng):
    """A Pallas kernel's body is compiled by Pallas, which lowers its own
    products: tiled routes the products around it and not those inside."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], w_ref[...])

    def f(x, w):
        y = pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((8, 8), jnp.float32), interpret=True
        )(x, w)
        return y @ w

    x = random_array(rng, (8, 8), np.float32)
    w = random_array(rng, (8, 8), np.float32)
    jaxpr = jax.make_jaxpr(jax_tiled.tiled(f))(x, w)
    (call,) = equations(jaxpr, "pallas_call")
    body = call.params["jaxpr"]
    assert count_equations(body, "dot_general") == 1 and count_equations(body, "tiled_matmul") == 0
    assert products(jaxpr) == 1
    with jax.default_matmul_precision("highest"):
        assert_trees_close(jax_tiled.tiled(f)(x, w), f(x, w))


# ---- Calling conventions ----


def test_closed_over_values_and_tracers(rng):
    x = random_array(rng, (4, 3), np.float32)
    w = random_array(rng, (3, 2), np.float32)

    def outer(w):  # the routed function closes over w, a tracer of grad
        return jnp.sum(jax_tiled.tiled(lambda x: jnp.sin(x @ w))(x))

    with jax.default_matmul_precision("highest"):
        assert_trees_close(jax.grad(outer)(w), jax.grad(lambda w: jnp.sum(jnp.sin(x @ w)))(w))
    assert_routed(jax.grad(outer), w)


def test_pytrees_static_arguments_and_outputs(rng):
    x = random_array(rng, (4, 3), np.float32)
    params = {"w": random_array(rng, (3, 2), np.float32), "scale": 2.0, "name": "layer"}

    def f(params, x, *, activate=True, repeat=2):
        assert isinstance(activate, bool) and isinstance(repeat, int)  # passed as they are
        y = x @ params["w"] * params["scale"]
        for _ in range(repeat):
            y = jnp.tanh(y) if activate else y
        return {"y": y, "nothing": None, "name": params["name"], "count": repeat}

    routed = jax_tiled.tiled(f)
    with jax.default_matmul_precision("highest"):  # true fp32 on GPUs too
        out = routed(params, x, activate=False, repeat=3)
        want = f(params, x, activate=False, repeat=3)
    assert out["nothing"] is None and out["name"] == "layer" and out["count"] == 3
    assert_trees_close(out["y"], want["y"])
    assert routed.__name__ == "f"


def test_transposed_operands_are_read_as_stored(rng):
    x = random_array(rng, (4, 8), np.float32)
    w = random_array(rng, (6, 8), np.float32)
    routed = jax_tiled.tiled(lambda x, w: x @ w.T)
    jaxpr = assert_routed(routed, x, w)
    assert not count_equations(jaxpr, "transpose"), jaxpr
    (eqn,) = equations(jaxpr, "tiled_matmul")
    assert eqn.params["transpose_b"]
    with jax.default_matmul_precision("highest"):
        assert_trees_close(routed(x, w), x @ w.T)
    # A transpose that is also used as a value is still computed.
    both = jax_tiled.tiled(lambda x, w: (x @ w.T, w.T + 1))
    assert_trees_close(both(x, w)[1], w.T + 1)


def test_weak_types_are_kept():
    def f(n):
        x = lax.full((3, 3), 0.5)  # weakly typed, as is its product with itself
        return lax.fori_loop(0, n, lambda i, c: c @ x, x)

    want = jax.make_jaxpr(f)(3).out_avals
    got = jax.make_jaxpr(jax_tiled.tiled(f))(3)
    assert got.out_avals == want and products(got) == 1


@jax.tree_util.register_pytree_node_class
class _Box:
    """A mutable pytree: what a function puts into it, jax.jit would lose."""

    def __init__(self, value):
        self.value = value

    def tree_flatten(self):
        return (self.value,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def test_an_update_to_an_argument_is_not_lost_silently(rng):
    x = random_array(rng, (3, 3), np.float32)

    def step(box, x):
        box.value = box.value @ x  # into the copy tiled passes, as jit would
        return box.value.sum()

    with pytest.raises(ValueError, match=r"step updated its arguments in place"):
        jax_tiled.tiled(step)(_Box(x), x)


# ---- Flax ----


def test_flax_linen_model():
    from flax import linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16)(x)
            x = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(x)
            x = nn.DenseGeneral((2, 4))(nn.LayerNorm()(x))
            return nn.Einsum((2, 4, 3), "btnk,nkd->btd")(x)

    block = Block()
    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    params = block.init(jax.random.key(1), x)
    routed = jax_tiled.tiled(block.apply)
    with jax.default_matmul_precision("highest"):
        assert_trees_close(jax.jit(routed)(params, x), jax.jit(block.apply)(params, x))
        grad = lambda apply: jax.grad(lambda p: jnp.sum(apply(p, x) ** 2))
        assert_trees_close(jax.jit(grad(routed))(params), jax.jit(grad(block.apply))(params))
    assert_routed(grad(routed), params)


def test_flax_nnx_module_and_its_state():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(8, 16, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(
                num_heads=2, in_features=16, decode=False, rngs=rngs
            )
            self.norm = nnx.BatchNorm(16, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.attention(self.dense(x)))

    block = Block(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    block.eval()
    with jax.default_matmul_precision("highest"):
        assert_trees_close(jax_tiled.tiled(block)(x), block(x))  # a module that keeps its state
    assert_routed(jax_tiled.tiled(block), x)

    # A call that updates state (batch statistics in training): route a
    # function of the module's state, as docs/usage.md shows.
    block.train()
    graphdef, state = nnx.split(block)

    @jax.jit
    def forward(state, x):
        def pure(state, x):
            module = nnx.merge(graphdef, state)
            y = module(x)
            return y, nnx.state(module)

        return jax_tiled.tiled(pure)(state, x)

    with jax.default_matmul_precision("highest"):  # true fp32 on GPUs too
        y, new_state = forward(state, x)
    nnx.update(block, new_state)
    assert_routed(
        lambda s, x: jax_tiled.tiled(lambda s, x: nnx.merge(graphdef, s)(x))(s, x), state, x
    )
    reference = Block(nnx.Rngs(0))
    reference.train()
    with jax.default_matmul_precision("highest"):
        assert_trees_close(y, reference(x))
        assert_trees_close(block.norm.mean[...], reference.norm.mean[...])
    assert not np.allclose(reference.norm.mean[...], 0)  # the statistics did move
