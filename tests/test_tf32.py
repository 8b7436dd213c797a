"""float32 by precision (issue 6). On CUDA, DEFAULT runs on TF32 tensor cores
(one pass, error class ~1e-3), HIGH in 3xTF32 split arithmetic (within 2x of
true fp32's error), HIGHEST in true fp32 on the SIMT rungs; the tensor-core
rungs "mma" and "wgmma" refuse HIGHEST, and "wgmma" refuses float32 with both
operands MN-major (transpose_a without transpose_b). On CPU every precision is
exact fp32. Tests taking the `platform` fixture check both: on CPU that every
precision gives the same fp32 result, on CUDA the error class of each."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from jax_tiled import _ffi
from conftest import assert_matmul_close, kernels_on, matmul_problem, random_array

F32 = np.dtype(np.float32)
TENSOR_CORE_RUNGS = ("mma", "wgmma")
SIMT_RUNGS = ("regblock", "warptile", "pipelined", "smem", "smem16")
# The true-fp32 rung whose error HIGH is held to, per platform.
FP32_RUNG = {"cpu": "blocked", "cuda": "warptile"}
LAYOUTS = list(itertools.product((False, True), repeat=2))  # (transpose_a, transpose_b)
TF32_PRECISIONS = (lax.Precision.DEFAULT, lax.Precision.HIGH)

# (m, n, k): K from one slab to deep; in each pair one shape whose rows are all
# multiples of 16 bytes (the Hopper rung's copy engine reads them) and one odd.
SHAPES = [(136, 264, 64), (257, 129, 64), (200, 136, 1000), (131, 299, 1000),
          (256, 128, 4096), (129, 257, 4096)]

TF32_NORM_ERROR = 3e-3  # DEFAULT: the TF32 class, ~1e-3


def fp32_norm_error(k: int) -> float:
    """Relative Frobenius error of true fp32 with serial accumulation on random
    normal inputs, ~ 2^-24 sqrt(K) / 4, with room: 1e-6 up to K = 1024."""
    return 1e-6 * max(1.0, np.sqrt(k / 1024))


def operands(rng, m, n, k, ta, tb, batch_a=1, batch_b=1):
    """Stored a and b of a canonical problem, and op(a), op(b) for the reference."""
    a = random_array(rng, (batch_a, k, m) if ta else (batch_a, m, k), F32)
    b = random_array(rng, (batch_b, n, k) if tb else (batch_b, k, n), F32)
    return a, b, np.swapaxes(a, 1, 2) if ta else a, np.swapaxes(b, 1, 2) if tb else b


def product(a, b, ta, tb, precision, kernel, out_dtype=F32):
    return jax_tiled.tiled_matmul_p.bind(
        jnp.asarray(a), jnp.asarray(b), transpose_a=ta, transpose_b=tb,
        out_dtype=np.dtype(out_dtype), precision=lax.Precision(precision), kernel=kernel)


def norm_error(out, a_op, b_op) -> float:
    ref = np.matmul(np.asarray(a_op, np.float64), np.asarray(b_op, np.float64))
    return float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref))


def tensor_core_rungs(problem=None, precision=lax.Precision.DEFAULT, out_dtype=F32) -> list[str]:
    """The tensor-core rungs listed for float32 on this GPU that take `problem`'s layout."""
    listed = jax_tiled.kernels("gpu", F32, out_dtype, precision)
    names = [k for k in TENSOR_CORE_RUNGS if k in listed]
    if lax.Precision(precision) != lax.Precision.HIGHEST:
        assert "mma" in names, listed  # sm_80+: every GPU this package builds for
    if problem is not None:
        names = [k for k in names
                 if not _ffi.refusal("cuda", k, F32, out_dtype, problem, precision)]
    return names


def rungs_under_test(platform, problem, precision) -> list[str]:
    """'auto' and the rungs that run float32 at DEFAULT or HIGH differently
    from HIGHEST: on CUDA the tensor-core rungs, on CPU the one CPU rung."""
    if platform == "cpu":
        return ["auto", "blocked"]
    return ["auto", *tensor_core_rungs(problem, precision)]


@pytest.fixture
def on_gpu():
    with jax.default_device(jax.devices("cuda")[0]):
        yield


# ---- Error class by precision ----

@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_error_class_by_precision_every_layout(platform, rng, shape):
    """DEFAULT: TF32 class, and at least 10x true fp32's error (so the TF32 path
    ran, not a silent fp32 one); HIGH: within 2x of true fp32's error (the
    issue's criterion). On CPU both are true fp32, bit for bit. Every rung and
    layout is measured before the test fails, and the failure lists them all."""
    m, n, k = shape
    off = []
    for ta, tb in LAYOUTS:
        a, b, a_op, b_op = operands(rng, m, n, k, ta, tb)
        problem = (1, 1, m, n, k, ta, tb)
        exact = product(a, b, ta, tb, "highest", FP32_RUNG[platform])
        fp32 = norm_error(exact, a_op, b_op)
        assert 0 < fp32 <= fp32_norm_error(k), (ta, tb, fp32)
        for precision in TF32_PRECISIONS:
            for kernel in rungs_under_test(platform, problem, precision):
                out = product(a, b, ta, tb, precision, kernel)
                assert_matmul_close(out, a_op, b_op, platform=platform, precision=precision)
                error = norm_error(out, a_op, b_op)
                if platform == "cpu":
                    np.testing.assert_array_equal(np.asarray(out), np.asarray(exact))
                    continue
                if precision == lax.Precision.DEFAULT:
                    fits = 10 * fp32 <= error <= TF32_NORM_ERROR
                else:
                    fits = error <= 2 * fp32 and error <= fp32_norm_error(k)
                if not fits:
                    off.append(f"{kernel} {precision.name} transpose_a={ta} transpose_b={tb}: "
                               f"error {error:.2e}, {error / fp32:.1f}x fp32's {fp32:.2e}")
    assert not off, "\n".join(off)


@pytest.mark.gpu
def test_highest_through_auto_runs_true_fp32_on_a_simt_rung(rng, on_gpu):
    for m, n, k in SHAPES:
        a = random_array(rng, (m, k), F32)
        b = random_array(rng, (k, n), F32)
        text = jax_tiled.explain(a, b, precision="highest")
        assert text.split(": ")[2] in SIMT_RUNGS, text
        out = jax_tiled.matmul(a, b, precision="highest")
        assert_matmul_close(out, a, b, platform="cuda", precision="highest")
        fp32 = norm_error(jax_tiled.matmul(a, b, precision="highest", kernel="warptile"), a, b)
        assert norm_error(out, a, b) <= max(2 * fp32, fp32_norm_error(k) / 4), (m, n, k)


@pytest.mark.gpu
def test_explain_names_a_tensor_core_rung_for_default_and_high(on_gpu):
    a, b = jax.ShapeDtypeStruct((1000, 800), F32), jax.ShapeDtypeStruct((800, 1200), F32)
    for precision in ("default", "high", "bfloat16", "tensorfloat32"):
        text = jax_tiled.explain(a, b, precision=precision)
        assert text.split(": ")[2] in tensor_core_rungs(precision=precision), text


# ---- jax.default_matmul_precision ----

@pytest.mark.parametrize("setting,explicit", [("bfloat16", "default"), ("tensorfloat32", "high"),
                                              ("float32", "highest")])
def test_default_matmul_precision_is_honoured(platform, rng, setting, explicit):
    """precision=None under the setting gives the explicit precision's result,
    bit for bit, through the same kernel."""
    a = random_array(rng, (3, 72, 520), F32)
    b = random_array(rng, (520, 136), F32)
    problem = matmul_problem(a, b)
    for kernel in kernels_on(platform, problem=problem, precision=explicit):
        want = np.asarray(jax_tiled.matmul(a, b, precision=explicit, kernel=kernel))
        with jax.default_matmul_precision(setting):
            assert kernels_on(platform, problem=problem) == kernels_on(
                platform, problem=problem, precision=explicit)
            got = np.asarray(jax_tiled.matmul(a, b, kernel=kernel))
            jitted = np.asarray(jax.jit(lambda a, b: jax_tiled.matmul(a, b, kernel=kernel))(a, b))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(jitted, want)
        assert_matmul_close(got, a, b, platform=platform, precision=explicit)
    if platform == "cuda":  # and the setting made a difference: TF32 is not fp32
        with jax.default_matmul_precision(setting):
            auto = np.asarray(jax_tiled.matmul(a, b))
        highest = np.asarray(jax_tiled.matmul(a, b, precision="highest"))
        assert (explicit == "highest") == np.array_equal(auto, highest)


@pytest.mark.gpu
def test_forcing_a_tensor_core_rung_under_float32_setting_raises(rng, on_gpu):
    a = random_array(rng, (64, 64), F32)
    for kernel in tensor_core_rungs():
        with jax.default_matmul_precision("float32"):
            with pytest.raises(ValueError, match=f"(?s)kernel '{kernel}'.*HIGHEST"):
                jax_tiled.matmul(a, a, kernel=kernel)
        with jax.default_matmul_precision("tensorfloat32"):
            assert_matmul_close(jax_tiled.matmul(a, a, kernel=kernel), a, a, platform="cuda",
                                precision="high")


# ---- Output dtypes, edges, zero sizes, batches ----

@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16, np.float32],
                         ids=lambda d: np.dtype(d).name)
def test_float32_into_every_output_dtype(platform, rng, out_dtype):
    m, n, k = 136, 200, 520
    for ta, tb in LAYOUTS:
        a, b, a_op, b_op = operands(rng, m, n, k, ta, tb)
        problem = (1, 1, m, n, k, ta, tb)
        for precision in TF32_PRECISIONS:
            for kernel in kernels_on(platform, F32, out_dtype, problem, precision):
                out = product(a, b, ta, tb, precision, kernel, out_dtype)
                assert_matmul_close(out, a_op, b_op, platform=platform, precision=precision,
                                    out_dtype=out_dtype)


# (m, k, n) off every tile size, K = 1, and single rows and columns.
EDGE_SHAPES = [(1, 1, 1), (1, 7, 65), (7, 1, 129), (65, 129, 1), (129, 257, 7), (257, 65, 129),
               (65, 1, 65), (1, 257, 1), (129, 7, 257), (257, 257, 257), (64, 1, 64),
               (128, 8, 256), (68, 132, 260)]


@pytest.mark.parametrize("precision", ["default", "high"])
def test_edge_shapes(platform, rng, precision):
    for m, k, n in EDGE_SHAPES:
        a = random_array(rng, (m, k), F32)
        b = random_array(rng, (k, n), F32)
        for kernel in kernels_on(platform, problem=matmul_problem(a, b), precision=precision):
            out = jax_tiled.matmul(a, b, precision=precision, kernel=kernel)
            assert_matmul_close(out, a, b, platform=platform, precision=precision)


@pytest.mark.parametrize("a_shape,b_shape", [
    ((0, 5), (5, 7)), ((5, 0), (0, 7)), ((5, 7), (7, 0)), ((2, 0, 4), (1, 4, 5)),
    ((0, 3, 4), (4, 5)), ((2, 3, 0), (2, 0, 5))], ids=str)
def test_zero_sizes(platform, rng, a_shape, b_shape):
    a = random_array(rng, a_shape, F32)
    b = random_array(rng, b_shape, F32)
    ref = np.matmul(a, b)
    for precision in ("default", "high"):
        for kernel in kernels_on(platform, problem=matmul_problem(a, b), precision=precision):
            out = jax_tiled.matmul(a, b, precision=precision, kernel=kernel)
            assert out.shape == ref.shape and out.dtype == F32
            np.testing.assert_array_equal(out, ref)  # empty, or exact zeros when K == 0


@pytest.mark.parametrize("batch_a,batch_b", [(3, 3), (1, 3), (3, 1)], ids=str)
@pytest.mark.parametrize("shape", [(72, 136, 200), (33, 65, 17)], ids=str)
def test_batches_and_broadcast_batches(platform, rng, batch_a, batch_b, shape):
    m, n, k = shape
    for ta, tb in LAYOUTS:
        a, b, a_op, b_op = operands(rng, m, n, k, ta, tb, batch_a, batch_b)
        problem = (batch_a, batch_b, m, n, k, ta, tb)
        for precision in TF32_PRECISIONS:
            for kernel in rungs_under_test(platform, problem, precision):
                out = product(a, b, ta, tb, precision, kernel)
                assert out.shape == (3, m, n)
                assert_matmul_close(out, np.broadcast_to(a_op, (3, m, k)),
                                    np.broadcast_to(b_op, (3, k, n)), platform=platform,
                                    precision=precision)


def test_batched_api_products(platform, rng):
    """Batches through jnp.matmul's broadcasting, on 'auto'."""
    for a_shape, b_shape in [((4, 65, 33), (33, 17)), ((2, 1, 40, 24), (3, 24, 36)),
                             ((65, 33), (2, 33, 17))]:
        a = random_array(rng, a_shape, F32)
        b = random_array(rng, b_shape, F32)
        for precision in ("default", "high"):
            out = jax_tiled.matmul(a, b, precision=precision)
            assert_matmul_close(out, a, b, platform=platform, precision=precision)


# ---- Transformations keep the precision ----

def tiled_products(closed_jaxpr) -> list:
    """Every tiled_matmul equation, in nested jaxprs too."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive is jax_tiled.tiled_matmul_p:
                found.append(eqn)
            assert eqn.primitive.name != "dot_general", eqn
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed_jaxpr.jaxpr)
    return found


def assert_products_at(closed_jaxpr, precision, count):
    products = tiled_products(closed_jaxpr)
    assert len(products) == count, closed_jaxpr
    assert all(e.params["precision"] == precision for e in products), [
        e.params["precision"] for e in products]


def weighted_sum(mm, w):
    return lambda a, b: jnp.sum(mm(a, b) * w)


@pytest.mark.parametrize("precision", list(lax.Precision), ids=lambda p: p.name)
def test_transforms_keep_the_precision(precision):
    """grad (both cotangent products), jvp (two tangent products), vmap and jit:
    every product is tiled_matmul at the precision asked for."""
    a, b, w = jnp.ones((2, 5, 6)), jnp.ones((6, 4)), jnp.ones((2, 5, 4))
    mm = lambda a, b: jax_tiled.matmul(a, b, precision=precision)
    assert_products_at(jax.make_jaxpr(jax.grad(weighted_sum(mm, w), (0, 1)))(a, b), precision, 3)
    assert_products_at(jax.make_jaxpr(jax.grad(weighted_sum(mm, w)))(a, b), precision, 2)
    assert_products_at(jax.make_jaxpr(lambda a, b: jax.jvp(mm, (a, b), (a, b)))(a, b),
                       precision, 3)
    assert_products_at(jax.make_jaxpr(jax.vmap(mm, in_axes=(0, None)))(a, b), precision, 1)
    assert_products_at(jax.make_jaxpr(jax.jit(jax.vmap(jax.grad(weighted_sum(mm, w[0]), 1),
                                                       in_axes=(0, None))))(a, b), precision, 2)


@pytest.mark.parametrize("setting,precision", [
    ("bfloat16", lax.Precision.DEFAULT), ("tensorfloat32", lax.Precision.HIGH),
    ("float32", lax.Precision.HIGHEST), ("default", lax.Precision.DEFAULT),
    ("high", lax.Precision.HIGH), ("highest", lax.Precision.HIGHEST)])
def test_default_matmul_precision_reaches_every_product(setting, precision):
    a, b, w = jnp.ones((3, 5, 6)), jnp.ones((3, 6, 4)), jnp.ones((3, 5, 4))
    with jax.default_matmul_precision(setting):
        grad = jax.make_jaxpr(jax.grad(weighted_sum(jax_tiled.matmul, w), (0, 1)))(a, b)
        jvp = jax.make_jaxpr(lambda a, b: jax.jvp(jax_tiled.matmul, (a, b), (a, b)))(a, b)
        assert precision.name in jax_tiled.explain(a, b)
    assert_products_at(grad, precision, 3)
    assert_products_at(jvp, precision, 3)


# Shapes of the transforms' values tests: a batch of rows against one b (the
# API stacks it into one taller product), and one a against a batch of b.
TRANSFORM_SHAPES = [((2, 65, 136), (136, 72)), ((65, 136), (2, 136, 72))]


def grad_kernels(platform, a, b, precision) -> list[str]:
    """The rungs under test that take the forward product's layout and its
    VJP's: b's cotangent a^T @ ct (transpose_a) and a's ct @ b^T (transpose_b)."""
    forward = matmul_problem(a, b)
    m, n, k = forward[2:5]
    vjp = [(1, 1, m, k, n, False, True), (1, 1, k, n, m, True, False)]
    return [kernel for kernel in rungs_under_test(platform, forward, precision)
            if not any(_ffi.refusal(platform, kernel, F32, F32, problem, precision)
                       for problem in vjp)]


def stacked(x, y):
    """sum_i x[i] @ y[i] as one product: the batches stacked along K."""
    return np.concatenate(list(x), axis=-1), np.concatenate(list(y), axis=-2)


@pytest.mark.parametrize("precision", ["default", "high"])
@pytest.mark.parametrize("a_shape,b_shape", TRANSFORM_SHAPES, ids=str)
def test_jit_grad_jvp_vmap_values(platform, rng, precision, a_shape, b_shape):
    """Gradients of sum(matmul(a, b) * w) are the products w @ b^T and a^T @ w
    (summed over the batch an operand broadcasts along), and the tangent is
    da @ b + a @ db: each held to the precision's elementwise bound."""
    a, da = (random_array(rng, a_shape, F32) for _ in range(2))
    b, db = (random_array(rng, b_shape, F32) for _ in range(2))
    batch = 2
    full = lambda x: np.broadcast_to(x, (batch, *x.shape[-2:]))
    w = random_array(rng, (batch, a_shape[-2], b_shape[-1]), F32)
    mT = lambda x: np.swapaxes(x, -1, -2)

    def close(out, x, y):
        assert_matmul_close(out, x, y, platform=platform, precision=precision)

    kernels = grad_kernels(platform, a, b, precision)
    assert "auto" in kernels and (platform == "cpu" or "mma" in kernels), kernels
    for kernel in kernels:
        mm = lambda a, b: jax_tiled.matmul(a, b, precision=precision, kernel=kernel)
        close(jax.jit(mm)(a, b), a, b)
        ga, gb = jax.jit(jax.grad(weighted_sum(mm, w), (0, 1)))(a, b)
        assert ga.shape == a.shape and gb.shape == b.shape
        close(ga, *(stacked(w, mT(full(b))) if a.ndim == 2 else (w, mT(b))))
        close(gb, *(stacked(mT(full(a)), w) if b.ndim == 2 else (mT(a), w)))
        primal, tangent = jax.jvp(mm, (a, b), (da, db))
        close(primal, a, b)
        close(tangent, np.concatenate([full(da), full(a)], axis=-1),
              np.concatenate([full(b), full(db)], axis=-2))
        axes = (0, None) if a.ndim == 3 else (None, 0)
        close(jax.vmap(mm, in_axes=axes)(a, b), full(a), full(b))


@pytest.mark.gpu
def test_wgmma_refuses_float32_with_both_operands_mn_major(rng, on_gpu):
    """a^T @ ct, b's cotangent, is that layout: grad of b on a forced 'wgmma'
    is refused, the forward product and a's gradient are not; 'auto' runs it on 'mma'."""
    if "wgmma" not in tensor_core_rungs():
        pytest.skip("wgmma needs a Hopper GPU")
    m, n, k = 136, 72, 200
    a, b, a_op, b_op = operands(rng, m, n, k, True, False)
    for precision in TF32_PRECISIONS:
        with pytest.raises(ValueError, match="(?s)wgmma.*K-major.*transpose_a=True"):
            product(a, b, True, False, precision, "wgmma")
        explained = _ffi.cuda_explain("float32", "float32", (1, 1, m, n, k, True, False), 132,
                                      precision)
        assert explained.startswith("mma: "), explained
        assert_matmul_close(product(a, b, True, False, precision, "auto"), a_op, b_op,
                            platform="cuda", precision=precision)
        x = random_array(rng, (m, k), F32)
        w = random_array(rng, (m, n), F32)
        y = b_op[0]
        mm = lambda x, y: jax_tiled.matmul(x, y, precision=precision, kernel="wgmma")
        assert_matmul_close(jax.grad(weighted_sum(mm, w))(x, y), w, y.T, platform="cuda",
                            precision=precision)
        with pytest.raises(ValueError, match="wgmma"):
            jax.grad(weighted_sum(mm, w), 1)(x, y)


# ---- Refusals and listings ----

@pytest.mark.gpu
def test_tensor_core_rungs_refuse_highest(rng, on_gpu):
    a = random_array(rng, (64, 64), F32)
    for kernel in tensor_core_rungs():
        for call in (jax_tiled.matmul, jax.jit(jax_tiled.matmul, static_argnames=("precision",
                                                                                  "kernel"))):
            with pytest.raises(ValueError, match=f"(?s)kernel '{kernel}'.*fp32.*HIGHEST"):
                call(a, a, precision="highest", kernel=kernel)
        with pytest.raises(ValueError, match="HIGHEST"):
            product(a[None], a[None], False, False, "highest", kernel)
        with pytest.raises(ValueError, match="HIGHEST"):
            jax_tiled.explain(a, a, precision="highest", kernel=kernel)
        # 16-bit inputs: precision changes nothing.
        a16 = a.astype(jnp.bfloat16)
        assert_matmul_close(jax_tiled.matmul(a16, a16, precision="highest", kernel=kernel), a16,
                            a16, platform="cuda")


@pytest.mark.gpu
def test_kernel_listing_by_precision_on_gpu():
    default = jax_tiled.kernels("gpu", F32)
    assert "mma" in default and default == jax_tiled.kernels("gpu", F32, precision="default")
    assert "mma" in jax_tiled.kernels("gpu", F32, precision=lax.Precision.HIGH)
    for out_dtype in (jnp.bfloat16, jnp.float16, np.float32):
        highest = jax_tiled.kernels("gpu", F32, out_dtype, precision="highest")
        assert not set(TENSOR_CORE_RUNGS) & set(highest), highest
        assert "warptile" in highest
        assert "mma" in jax_tiled.kernels("gpu", F32, out_dtype, precision="tensorfloat32")
    for precision in ("default", "high", "highest"):  # 16-bit: precision changes nothing
        assert "mma" in jax_tiled.kernels("gpu", jnp.bfloat16, precision=precision)


@pytest.mark.parametrize("precision", [None, "default", "high", "highest", "bfloat16",
                                       "tensorfloat32", "float32", lax.Precision.HIGH,
                                       ("default", "highest")], ids=str)
def test_kernel_listing_by_precision_on_cpu(precision):
    assert jax_tiled.kernels("cpu", F32, precision=precision) == ["blocked"]
    assert jax_tiled.kernels("cpu", jnp.bfloat16, F32, precision) == ["blocked"]

