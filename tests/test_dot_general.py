"""jax_tiled.dot_general against lax.dot_general: any dimension numbers, values
in full against float64, dtypes, gradients, transformations, the copies it
makes, and proof that no product runs anywhere but on this package's kernels."""

from __future__ import annotations

import re
import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from helpers import EPS, HIGHEST, count_equations, equations, kernels_on, random_array, x64


def dims(lc, rc, lb=(), rb=()):
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


# (lhs shape, rhs shape, dimension numbers, transposes the canonical form needs)
CASES = [
    ((3, 4), (4, 5), dims([1], [0]), 0),  # a @ b
    ((3, 4), (5, 4), dims([1], [1]), 0),  # a @ b.T: transpose_b
    ((4, 3), (4, 5), dims([0], [0]), 0),  # a.T @ b: transpose_a
    ((4, 3), (5, 4), dims([0], [1]), 0),  # a.T @ b.T
    ((2, 3, 4), (4, 5), dims([2], [0]), 0),  # Dense on (batch, seq, features)
    ((2, 3, 4), (2, 4, 5), dims([2], [1], [0], [0]), 0),  # batched
    ((2, 3, 5, 4), (2, 3, 6, 4), dims([3], [3], [0, 1], [0, 1]), 0),  # attention scores
    ((2, 3, 5, 6), (2, 3, 6, 4), dims([3], [2], [0, 1], [0, 1]), 0),  # attention values
    ((2, 3, 4, 5), (4, 5, 6), dims([2, 3], [0, 1]), 0),  # DenseGeneral, two contracted
    ((3, 4, 5), (5, 4, 6), dims([1, 2], [1, 0]), 1),  # pairs stored in opposite orders
    ((3, 5, 4), (5, 4, 6), dims([2, 1], [1, 0]), 0),  # listed out of order, stored alike
    ((4, 3, 5), (4, 5, 6), dims([0, 2], [0, 1]), 1),  # free between contracted: copy
    ((3, 2, 4), (4, 2, 5), dims([2], [0], [1], [1]), 2),  # batch not leading: copies
    ((2, 3, 4), (4, 5, 2), dims([2], [0], [0], [2]), 1),  # rhs batch last
    ((2, 3, 4, 5), (3, 2, 5, 6), dims([3], [2], [0, 1], [1, 0]), 1),  # batch pairs reordered
    ((6, 2, 3, 4), (6, 4, 2, 5), dims([3], [1], [0, 1], [0, 2]), 1),  # LinearGeneral batch_axis
    ((1, 3, 1, 4), (4, 1, 5), dims([3], [0]), 0),  # size-1 dimensions anywhere
    ((3, 1, 4), (1, 4, 5), dims([2, 1], [1, 0]), 0),
    ((3,), (4,), dims([], []), 0),  # outer product (K = 1)
    ((7,), (7,), dims([0], [0]), 0),  # inner product
    ((), (), dims([], []), 0),  # scalars
    ((2, 3), (4,), dims([], []), 0),  # tensor product
    ((0, 4), (4, 5), dims([1], [0]), 0),  # M = 0
    ((3, 0), (0, 5), dims([1], [0]), 0),  # K = 0: zeros
    ((2, 3, 4), (2, 4, 0), dims([2], [1], [0], [0]), 0),  # N = 0
    ((0, 3, 4), (0, 4, 5), dims([2], [1], [0], [0]), 0),  # batch 0
    ((5, 17, 33), (33, 9, 5), dims([2], [0], [0], [2]), 1),  # odd sizes
]
IDS = [f"{a}x{b}-{d}" for a, b, d, _ in CASES]


def reference(lhs, rhs, dimension_numbers):
    """lax.dot_general's result in float64, through np.einsum."""
    (lc, rc), (lb, rb) = dimension_numbers
    letters = iter(string.ascii_letters)
    lsub = [next(letters) for _ in range(lhs.ndim)]
    rsub = [next(letters) for _ in range(rhs.ndim)]
    for i, j in zip((*lc, *lb), (*rc, *rb)):
        rsub[j] = lsub[i]
    out = (
        [lsub[i] for i in lb]
        + [lsub[i] for i in range(lhs.ndim) if i not in (*lc, *lb)]
        + [rsub[j] for j in range(rhs.ndim) if j not in (*rc, *rb)]
    )
    spec = f"{''.join(lsub)},{''.join(rsub)}->{''.join(out)}"
    return np.einsum(spec, np.asarray(lhs, np.float64), np.asarray(rhs, np.float64))


def assert_dot_close(out, lhs, rhs, dimension_numbers, out_dtype=None, input_eps=0.0):
    ref = reference(lhs, rhs, dimension_numbers)
    mag = reference(
        np.abs(np.asarray(lhs, np.float64)), np.abs(np.asarray(rhs, np.float64)), dimension_numbers
    )
    expected = jax.eval_shape(
        lambda: lax.dot_general(
            jnp.asarray(lhs), jnp.asarray(rhs), dimension_numbers, preferred_element_type=out_dtype
        )
    )
    assert out.shape == expected.shape and out.dtype == expected.dtype, (jax.typeof(out), expected)
    k = int(np.prod([lhs.shape[i] for i in dimension_numbers[0][0]]))
    acc = (
        EPS[np.dtype(np.float64)]
        if np.float64 in (lhs.dtype, rhs.dtype, out.dtype)
        else EPS[np.dtype(np.float32)]
    )
    tol = ((k + 2) * acc + 2 * input_eps) * mag + EPS[np.dtype(out.dtype)] * np.abs(ref) + 1e-30
    err = np.abs(np.asarray(out, np.float64) - ref)
    assert np.all(err <= tol), (
        f"max error {err.max()}, tolerance there {tol.flat[np.argmax(err - tol)]}"
    )


def operands(rng, lhs_shape, rhs_shape, dtype=np.float32):
    return random_array(rng, lhs_shape, dtype), random_array(rng, rhs_shape, dtype)


FORBIDDEN = re.compile(r"\bdot_general\[")


@pytest.mark.parametrize("lhs_shape,rhs_shape,dimension_numbers,copies", CASES, ids=IDS)
def test_values_shapes_and_dtype_match_lax(
    platform, rng, lhs_shape, rhs_shape, dimension_numbers, copies
):
    lhs, rhs = operands(rng, lhs_shape, rhs_shape)
    for kernel in kernels_on(platform, precision=HIGHEST):
        f = lambda a, b: jax_tiled.dot_general(
            a, b, dimension_numbers, precision=HIGHEST, kernel=kernel
        )
        assert_dot_close(f(lhs, rhs), lhs, rhs, dimension_numbers)
        assert_dot_close(jax.jit(f)(lhs, rhs), lhs, rhs, dimension_numbers)


@pytest.mark.parametrize("lhs_shape,rhs_shape,dimension_numbers,copies", CASES, ids=IDS)
def test_products_run_on_tiled_matmul_with_at_most_one_copy_per_operand(
    lhs_shape, rhs_shape, dimension_numbers, copies
):
    lhs, rhs = jnp.ones(lhs_shape), jnp.ones(rhs_shape)
    f = lambda a, b: jax_tiled.dot_general(a, b, dimension_numbers)
    loss = lambda a, b: jnp.sum(jnp.sin(f(a, b)))
    value = jax.make_jaxpr(f)(lhs, rhs)
    grad = jax.make_jaxpr(jax.grad(loss, (0, 1)))(lhs, rhs)
    for jaxpr in (value, grad):
        assert not FORBIDDEN.search(str(jaxpr)), jaxpr
    # Counted by equation: a jaxpr prints a nested jit's body once however
    # often it is called.
    assert count_equations(value, "tiled_matmul") == 1, value
    assert count_equations(grad, "tiled_matmul") == 3, grad
    # Only transposes of the operands copy; reshapes of row-major arrays are free.
    assert count_equations(value, "transpose") == copies, value


def test_contractions_against_transposed_operands_use_the_transpose_flags():
    x, w = jnp.ones((8, 16)), jnp.ones((32, 16))
    jaxpr = jax.make_jaxpr(lambda x, w: jax_tiled.dot_general(x, w, dims([1], [1])))(x, w)
    (eqn,) = equations(jaxpr, "tiled_matmul")
    assert eqn.params["transpose_b"] and not eqn.params["transpose_a"]
    jaxpr = jax.make_jaxpr(lambda x, w: jax_tiled.dot_general(x, w, dims([0], [0])))(w, w)
    (eqn,) = equations(jaxpr, "tiled_matmul")
    assert eqn.params["transpose_a"] and not eqn.params["transpose_b"]


GRAD_CASES = [c for c in CASES if all(np.prod(s) > 0 for s in c[:2])]


@pytest.mark.parametrize(
    "lhs_shape,rhs_shape,dimension_numbers,copies",
    GRAD_CASES,
    ids=[f"{a}x{b}-{d}" for a, b, d, _ in GRAD_CASES],
)
def test_grad_jvp_vmap_match_lax(platform, rng, lhs_shape, rhs_shape, dimension_numbers, copies):
    lhs, rhs = operands(rng, lhs_shape, rhs_shape)
    tl, tr = operands(rng, lhs_shape, rhs_shape)
    ours = lambda a, b: jax_tiled.dot_general(a, b, dimension_numbers, precision=HIGHEST)
    theirs = lambda a, b: lax.dot_general(a, b, dimension_numbers, precision=HIGHEST)
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))
    close = lambda x, y: jax.tree.map(
        lambda u, v: np.testing.assert_allclose(
            u, v, rtol=2e-5, atol=2e-5 * max(1.0, float(np.abs(v).max(initial=0)))
        ),
        x,
        y,
    )
    close(jax.grad(loss(ours), (0, 1))(lhs, rhs), jax.grad(loss(theirs), (0, 1))(lhs, rhs))
    close(jax.jvp(ours, (lhs, rhs), (tl, tr)), jax.jvp(theirs, (lhs, rhs), (tl, tr)))
    stacked = np.stack([lhs, 2 * lhs])
    close(jax.vmap(ours, (0, None))(stacked, rhs), jax.vmap(theirs, (0, None))(stacked, rhs))
    close(
        jax.jit(jax.vmap(ours, (None, 0)))(lhs, np.stack([rhs, -rhs])),
        jax.vmap(theirs, (None, 0))(lhs, np.stack([rhs, -rhs])),
    )


@pytest.mark.parametrize(
    "dtype", [jnp.bfloat16, jnp.float16, np.float32], ids=lambda d: np.dtype(d).name
)
def test_dtypes(platform, rng, dtype):
    lhs, rhs = operands(rng, (3, 17, 40), (40, 3, 9), dtype)
    d = dims([2], [0], [0], [1])
    out = jax_tiled.dot_general(lhs, rhs, d, precision=HIGHEST)
    assert_dot_close(out, lhs, rhs, d)
    wide = jax_tiled.dot_general(lhs, rhs, d, precision=HIGHEST, preferred_element_type=jnp.float32)
    assert_dot_close(wide, lhs, rhs, d, out_dtype=jnp.float32)


def test_float64(platform, rng):
    with x64():
        lhs, rhs = operands(rng, (6, 5, 7), (7, 6, 3), np.float64)
        d = dims([2], [0], [0], [1])
        assert_dot_close(jax_tiled.dot_general(lhs, rhs, d), lhs, rhs, d)


@pytest.mark.parametrize(
    "lhs_dtype,rhs_dtype",
    [
        (np.float32, jnp.bfloat16),
        (jnp.float16, jnp.bfloat16),
        (np.int32, np.float32),
        (np.int8, jnp.bfloat16),
        (np.bool_, jnp.float16),
        (np.float32, np.uint8),
    ],
    ids=str,
)
def test_mixed_dtypes_give_lax_result_dtype(rng, lhs_dtype, rhs_dtype):
    lhs = random_array(rng, (4, 6), np.float64, integers=True).astype(lhs_dtype)
    rhs = random_array(rng, (6, 3), np.float64, integers=True).astype(rhs_dtype)
    d = dims([1], [0])
    out = jax_tiled.dot_general(lhs, rhs, d)
    want = lax.dot_general(jnp.asarray(lhs), jnp.asarray(rhs), d)
    assert out.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(want, np.float64))


def test_errors_name_shapes_and_dtypes():
    a, b = jnp.ones((3, 4)), jnp.ones((5, 6))
    with pytest.raises(
        TypeError,
        match=r"contracting dimensions differ: lhs\(3, 4\) has 4 .*"
        r"rhs\(5, 6\) has 5",
    ):
        jax_tiled.dot_general(a, b, dims([1], [0]))
    with pytest.raises(TypeError, match=r"batch dimensions differ"):
        jax_tiled.dot_general(jnp.ones((2, 3, 4)), jnp.ones((3, 4, 5)), dims([2], [1], [0], [0]))
    with pytest.raises(TypeError, match=r"rhs dimensions \[2\] out of range .*\(5, 6\)"):
        jax_tiled.dot_general(a, b, dims([1], [2]))
    with pytest.raises(TypeError, match="as many contracting"):
        jax_tiled.dot_general(a, b, dims([1], []))
    with pytest.raises(TypeError, match="distinct"):
        jax_tiled.dot_general(jnp.ones((4, 4)), jnp.ones((4, 4)), dims([0], [0], [0], [1]))
    with pytest.raises(TypeError, match="dimension_numbers must be"):
        jax_tiled.dot_general(a, b, (1, 0))
    with pytest.raises(TypeError, match=r"integer-only.*int32"):
        jax_tiled.dot_general(
            jnp.ones((3, 4), jnp.int32), jnp.ones((4, 5), jnp.int32), dims([1], [0])
        )
    with pytest.raises(TypeError, match="complex64"):
        jax_tiled.dot_general(jnp.ones((3, 4), jnp.complex64), jnp.ones((4, 5)), dims([1], [0]))
    with pytest.raises(ValueError, match="unknown kernel"):
        jax_tiled.dot_general(a, jnp.ones((4, 5)), dims([1], [0]), kernel="nope")


def test_einsum_runs_its_contractions_on_the_kernels(rng):
    q, k = operands(rng, (2, 5, 3, 8), (2, 7, 3, 8))
    f = lambda q, k: jax_tiled.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST)
    want = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST)
    np.testing.assert_allclose(f(q, k), want, rtol=1e-5, atol=1e-5)
    text = str(jax.make_jaxpr(jax.grad(lambda q, k: f(q, k).sum(), (0, 1)))(q, k))
    assert "tiled_matmul[" in text and not FORBIDDEN.search(text)


# ---- out_sharding (flax.nnx passes it on every call) ----


def explicit_mesh():
    if len(jax.devices("cpu")) < 4:
        pytest.fail("conftest asks XLA for 4 CPU devices")
    return jax.make_mesh(
        (2, 2),
        ("data", "model"),
        axis_types=(jax.sharding.AxisType.Explicit,) * 2,
        devices=jax.devices("cpu")[:4],
    )


@pytest.mark.parametrize(
    "out_spec",
    [
        jax.sharding.PartitionSpec(None, "model"),
        jax.sharding.PartitionSpec("data", None),
        jax.sharding.PartitionSpec(),
    ],
    ids=str,
)
def test_out_sharding_as_jnp(rng, out_spec):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = explicit_mesh()
    x_np, w_np = operands(rng, (8, 16), (16, 4))
    with jax.set_mesh(mesh):
        x = jax.device_put(x_np, NamedSharding(mesh, P("data")))
        w = jax.device_put(w_np, NamedSharding(mesh, P()))
        calls = {
            "matmul": (
                lambda x, w: jax_tiled.matmul(x, w, out_sharding=out_spec),
                lambda x, w: jnp.matmul(x, w, out_sharding=out_spec),
            ),
            "dot_general": (
                lambda x, w: jax_tiled.dot_general(x, w, dims([1], [0]), out_sharding=out_spec),
                lambda x, w: lax.dot_general(x, w, dims([1], [0]), out_sharding=out_spec),
            ),
        }
        for name, (ours, theirs) in calls.items():
            for wrap in (lambda f: f, jax.jit):
                out, want = wrap(ours)(x, w), wrap(theirs)(x, w)
                assert jax.typeof(out).sharding.spec == jax.typeof(want).sharding.spec, name
                assert out.sharding.spec == want.sharding.spec, name
                np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
            loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
            g = jax.jit(jax.grad(loss(ours), (0, 1)))(x, w)
            h = jax.jit(jax.grad(loss(theirs), (0, 1)))(x, w)
            for u, v in zip(g, h):
                assert u.sharding.spec == v.sharding.spec, name
                np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)


def test_out_sharding_over_automatic_axes_is_refused_as_jnp_refuses_it():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh(
        (2, 2),
        ("data", "model"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
        devices=jax.devices("cpu")[:4],
    )
    x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
    with pytest.raises(ValueError, match="Auto"):
        jnp.matmul(x, w, out_sharding=NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match="Auto"):
        jax_tiled.matmul(x, w, out_sharding=NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match="Auto"):
        jax_tiled.dot_general(x, w, dims([1], [0]), out_sharding=NamedSharding(mesh, P("data")))


def test_gradient_of_an_operand_broadcast_over_an_empty_batch():
    """(m, k) @ (0, k, n): the cotangent of the broadcast operand is a sum over
    no products, zeros of its own shape."""
    a, b = jnp.ones((3, 4)), jnp.ones((0, 4, 5))
    ga, gb = jax.grad(lambda a, b: jax_tiled.matmul(a, b).sum(), (0, 1))(a, b)
    assert ga.shape == a.shape and gb.shape == b.shape
    np.testing.assert_array_equal(ga, np.zeros(a.shape))
