"""float32 by precision. On CUDA, DEFAULT runs on TF32 tensor cores (one pass,
error class ~1e-3), HIGH in 3xTF32 split arithmetic (within 2x of true fp32's
error), HIGHEST in true fp32 on the SIMT kernels; the tensor-core kernels
"mma" and "wgmma" refuse HIGHEST, and "wgmma" refuses HIGH with both
operands MN-major (transpose_a without transpose_b). On CPU every precision is
exact fp32. Tests taking the `platform` fixture check both: on CPU that every
precision gives the same fp32 result, on CUDA the error class of each.

Also: how a product's precision is chosen (the argument, a pair, and
`jax.default_matmul_precision`) and that it reaches every product under
transformations. Tile edges, zero sizes and batches at DEFAULT and HIGH are
test_matmul.py's; the tensor-core kernels' refusals, test_tensor_cores.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import helpers
import jax_tiled
from helpers import (
    CPU_KERNELS,
    F32,
    LAYOUTS,
    SIMT_KERNELS,
    TENSOR_CORE_KERNELS,
    assert_matmul_close,
    bind_product,
    kernels_on,
    matmul_problem,
    needs_cuda_module,
    operands,
    random_array,
    relative_norm_error,
    tensor_core_kernels,
    tensor_kernels_on,
)
from jax_tiled import _ffi

# The true-fp32 kernel whose error HIGH is held to, per platform.
FP32_KERNEL = {"cpu": CPU_KERNELS[0], "cuda": "warptile"}
TF32_PRECISIONS = (lax.Precision.DEFAULT, lax.Precision.HIGH)

# (m, n, k): K from one slab to deep; in each pair one shape whose rows are all
# multiples of 16 bytes (the Hopper kernel's copy engine reads them) and one odd.
SHAPES = [
    (136, 264, 64),
    (257, 129, 64),
    (200, 136, 1000),
    (131, 299, 1000),
    (256, 128, 4096),
    (129, 257, 4096),
    (40, 11400, 200),  # a @ b on wgmma: C^T on 128 x 64 tiles (40 of its columns)
]

TF32_NORM_ERROR = 3e-3  # DEFAULT: the TF32 class, ~1e-3


def fp32_norm_error(k: int) -> float:
    """Relative Frobenius error of true fp32 with serial accumulation on random
    normal inputs, ~ 2^-24 sqrt(K) / 4, with room: 1e-6 up to K = 1024."""
    return 1e-6 * max(1.0, np.sqrt(k / 1024))


# ---- Error class by precision ----


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_error_class_by_precision_every_layout(platform, rng, shape):
    """DEFAULT: TF32 class, and at least 10x true fp32's error (so the TF32 path
    ran, not a silent fp32 one); HIGH: within 2x of true fp32's error (what
    3xTF32 promises). On CPU both are true fp32, bit for bit. Every kernel and
    layout is measured before the test fails, and the failure lists them all."""
    m, n, k = shape
    off = []
    for ta, tb in LAYOUTS:
        a, b, a_op, b_op = operands(rng, m, n, k, ta, tb)
        problem = (1, 1, m, n, k, ta, tb)
        exact = bind_product(a, b, ta, tb, precision="highest", kernel=FP32_KERNEL[platform])
        fp32 = relative_norm_error(exact, a_op, b_op)
        assert 0 < fp32 <= fp32_norm_error(k), (ta, tb, fp32)
        for precision in TF32_PRECISIONS:
            for kernel in tensor_kernels_on(platform, problem, precision):
                out = bind_product(a, b, ta, tb, precision=precision, kernel=kernel)
                assert_matmul_close(out, a_op, b_op, platform=platform, precision=precision)
                error = relative_norm_error(out, a_op, b_op)
                if platform == "cpu":
                    np.testing.assert_array_equal(np.asarray(out), np.asarray(exact))
                    continue
                if precision == lax.Precision.DEFAULT:
                    fits = 10 * fp32 <= error <= TF32_NORM_ERROR
                else:
                    fits = error <= 2 * fp32 and error <= fp32_norm_error(k)
                if not fits:
                    off.append(
                        f"{kernel} {precision.name} transpose_a={ta} transpose_b={tb}: "
                        f"error {error:.2e}, {error / fp32:.1f}x fp32's {fp32:.2e}"
                    )
    assert not off, "\n".join(off)


@pytest.mark.gpu
def test_highest_through_auto_runs_true_fp32_on_a_simt_kernel(rng, on_gpu):
    for m, n, k in SHAPES:
        a = random_array(rng, (m, k), F32)
        b = random_array(rng, (k, n), F32)
        found = jax_tiled.explain(a, b, precision="highest")
        assert found.kernel in SIMT_KERNELS, found
        out = jax_tiled.matmul(a, b, precision="highest")
        assert_matmul_close(out, a, b, platform="cuda", precision="highest")
        fp32 = relative_norm_error(
            jax_tiled.matmul(a, b, precision="highest", kernel="warptile"), a, b
        )
        assert relative_norm_error(out, a, b) <= max(2 * fp32, fp32_norm_error(k) / 4), (m, n, k)


@pytest.mark.gpu
def test_explain_names_a_tensor_core_kernel_for_default_and_high(on_gpu):
    a, b = jax.ShapeDtypeStruct((1000, 800), F32), jax.ShapeDtypeStruct((800, 1200), F32)
    for precision in ("default", "high", "bfloat16", "tensorfloat32"):
        found = jax_tiled.explain(a, b, precision=precision)
        assert found.kernel in tensor_core_kernels(precision=precision), found


# ---- How a product's precision is chosen ----


def _precision_of(fn, *args):
    (eqn,) = helpers.equations(jax.make_jaxpr(fn)(*args), "tiled_matmul")
    return eqn.params["precision"]


def test_precision_arguments_reach_the_primitive(rng):
    """None (without a setting: DEFAULT), a setting, a pair (the more precise
    wins) and an explicit value, as the bound primitive's param."""
    a = random_array(rng, (4, 8), np.float32)
    b = random_array(rng, (8, 3), np.float32)
    assert _precision_of(jax_tiled.matmul, a, b) == lax.Precision.DEFAULT
    with jax.default_matmul_precision("float32"):
        assert _precision_of(jax_tiled.matmul, a, b) == lax.Precision.HIGHEST
    with jax.default_matmul_precision("tensorfloat32"):
        assert _precision_of(jax_tiled.matmul, a, b) == lax.Precision.HIGH
    pair = lambda a, b: jax_tiled.matmul(a, b, precision=("default", "high"))
    assert _precision_of(pair, a, b) == lax.Precision.HIGH
    explicit = lambda a, b: jax_tiled.matmul(a, b, precision=lax.Precision.HIGHEST)
    assert _precision_of(explicit, a, b) == lax.Precision.HIGHEST


@pytest.mark.parametrize(
    "setting,explicit", [("bfloat16", "default"), ("tensorfloat32", "high"), ("float32", "highest")]
)
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
                platform, problem=problem, precision=explicit
            )
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
def test_forcing_a_tensor_core_kernel_under_float32_setting_raises(rng, on_gpu):
    a = random_array(rng, (64, 64), F32)
    for kernel in tensor_core_kernels():
        with jax.default_matmul_precision("float32"):
            with pytest.raises(ValueError, match=f"(?s)kernel '{kernel}'.*HIGHEST"):
                jax_tiled.matmul(a, a, kernel=kernel)
        with jax.default_matmul_precision("tensorfloat32"):
            assert_matmul_close(
                jax_tiled.matmul(a, a, kernel=kernel), a, a, platform="cuda", precision="high"
            )


# ---- Every output dtype ----


@pytest.mark.parametrize(
    "out_dtype", [jnp.bfloat16, jnp.float16, np.float32], ids=lambda d: np.dtype(d).name
)
def test_float32_into_every_output_dtype(platform, rng, out_dtype):
    m, n, k = 136, 200, 520
    for ta, tb in LAYOUTS:
        a, b, a_op, b_op = operands(rng, m, n, k, ta, tb)
        problem = (1, 1, m, n, k, ta, tb)
        for precision in TF32_PRECISIONS:
            for kernel in kernels_on(platform, F32, out_dtype, problem, precision):
                out = bind_product(
                    a, b, ta, tb, precision=precision, kernel=kernel, out_dtype=out_dtype
                )
                assert_matmul_close(
                    out, a_op, b_op, platform=platform, precision=precision, out_dtype=out_dtype
                )


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
        e.params["precision"] for e in products
    ]


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
    assert_products_at(jax.make_jaxpr(lambda a, b: jax.jvp(mm, (a, b), (a, b)))(a, b), precision, 3)
    assert_products_at(jax.make_jaxpr(jax.vmap(mm, in_axes=(0, None)))(a, b), precision, 1)
    assert_products_at(
        jax.make_jaxpr(jax.jit(jax.vmap(jax.grad(weighted_sum(mm, w[0]), 1), in_axes=(0, None))))(
            a, b
        ),
        precision,
        2,
    )


@pytest.mark.parametrize(
    "setting,precision",
    [
        ("bfloat16", lax.Precision.DEFAULT),
        ("tensorfloat32", lax.Precision.HIGH),
        ("float32", lax.Precision.HIGHEST),
        ("default", lax.Precision.DEFAULT),
        ("high", lax.Precision.HIGH),
        ("highest", lax.Precision.HIGHEST),
    ],
)
def test_default_matmul_precision_reaches_every_product(setting, precision):
    a, b, w = jnp.ones((3, 5, 6)), jnp.ones((3, 6, 4)), jnp.ones((3, 5, 4))
    with jax.default_matmul_precision(setting):
        grad = jax.make_jaxpr(jax.grad(weighted_sum(jax_tiled.matmul, w), (0, 1)))(a, b)
        jvp = jax.make_jaxpr(lambda a, b: jax.jvp(jax_tiled.matmul, (a, b), (a, b)))(a, b)
        assert jax_tiled.explain(a, b).precision == precision.name
    assert_products_at(grad, precision, 3)
    assert_products_at(jvp, precision, 3)


# Shapes of the transforms' values tests: a batch of rows against one b (the
# API stacks it into one taller product), and one a against a batch of b.
TRANSFORM_SHAPES = [((2, 65, 136), (136, 72)), ((65, 136), (2, 136, 72))]


def grad_kernels(platform, a, b, precision) -> list[str]:
    """The kernels under test that take the forward product's layout and its
    VJP's: b's cotangent a^T @ ct (transpose_a) and a's ct @ b^T (transpose_b)."""
    forward = matmul_problem(a, b)
    m, n, k = forward[2:5]
    vjp = [(1, 1, m, k, n, False, True), (1, 1, k, n, m, True, False)]
    return [
        kernel
        for kernel in tensor_kernels_on(platform, forward, precision)
        if not any(_ffi.refusal(platform, kernel, F32, F32, problem, precision) for problem in vjp)
    ]


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
    assert "auto" in kernels and (platform == "cpu" or set(kernels) & set(TENSOR_CORE_KERNELS))
    for kernel in kernels:
        mm = lambda a, b: jax_tiled.matmul(a, b, precision=precision, kernel=kernel)
        close(jax.jit(mm)(a, b), a, b)
        ga, gb = jax.jit(jax.grad(weighted_sum(mm, w), (0, 1)))(a, b)
        assert ga.shape == a.shape and gb.shape == b.shape
        close(ga, *(stacked(w, mT(full(b))) if a.ndim == 2 else (w, mT(b))))
        close(gb, *(stacked(mT(full(a)), w) if b.ndim == 2 else (mT(a), w)))
        primal, tangent = jax.jvp(mm, (a, b), (da, db))
        close(primal, a, b)
        close(
            tangent,
            np.concatenate([full(da), full(a)], axis=-1),
            np.concatenate([full(b), full(db)], axis=-2),
        )
        axes = (0, None) if a.ndim == 3 else (None, 0)
        close(jax.vmap(mm, in_axes=axes)(a, b), full(a), full(b))


@pytest.mark.skipif(not _ffi.cuda_module_built(), reason="this build has no CUDA module")
def test_which_products_copy_b_k_major_first(monkeypatch):
    """The lowering's rule, without a GPU: only auto's float32 tensor-core
    products (DEFAULT, HIGH) with both operands MN-major, on CUDA, on a Hopper
    GPU, where auto runs them on wgmma (not a small product)."""
    from jax_tiled._lowering import copies_b_k_major

    D, H = lax.Precision.DEFAULT, lax.Precision.HIGH
    weight_gradient = (1, 1, 1024, 1024, 4096, True, False)
    monkeypatch.setattr(_ffi, "cuda_compute_capability", lambda: _ffi.HOPPER)
    assert copies_b_k_major("cuda", "auto", F32, F32, D, weight_gradient)
    assert copies_b_k_major("cuda", "auto", F32, F32, H, weight_gradient)
    for case in [
        ("cuda", "auto", F32, F32, lax.Precision.HIGHEST, weight_gradient),  # SIMT: any layout
        ("cuda", "wgmma", F32, F32, D, weight_gradient),  # a forced kernel: as stored
        (
            "cuda",
            "auto",
            np.dtype(jnp.bfloat16),
            F32,
            D,
            weight_gradient,
        ),  # 16-bit wgmma: MN-major B
        ("cpu", "auto", F32, F32, D, weight_gradient),
        ("cuda", "auto", F32, F32, D, (1, 1, 128, 128, 128, True, False)),  # small: mma
        *[
            ("cuda", "auto", F32, F32, D, (*weight_gradient[:5], ta, tb))
            for ta, tb in [(False, False), (False, True), (True, True)]
        ],
    ]:
        assert not copies_b_k_major(*case), case
    monkeypatch.setattr(_ffi, "cuda_compute_capability", lambda: 80)  # mma reads every layout
    assert not copies_b_k_major("cuda", "auto", F32, F32, D, weight_gradient)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", TF32_PRECISIONS, ids=lambda p: p.name)
def test_auto_copies_b_k_major_for_the_float32_weight_gradient(on_gpu, precision):
    """On a Hopper GPU, auto takes b of a float32 a.T @ b through XLA's
    transpose before the kernel (_lowering.copies_b_k_major): the kernel then
    reads B K-major. A forced kernel ('mma', which takes every layout at every
    precision), HIGHEST and 16-bit inputs read b as stored."""
    if "wgmma" not in tensor_core_kernels():
        pytest.skip("wgmma needs a Hopper GPU")
    weight_gradient = (((0,), (0,)), ((), ()))

    def transposes(kernel="auto", dtype=F32, precision=precision, k=600):
        a, b = jax.ShapeDtypeStruct((k, 136), dtype), jax.ShapeDtypeStruct((k, 72), dtype)
        product = jax.jit(
            lambda a, b: jax_tiled.dot_general(
                a, b, weight_gradient, precision=precision, kernel=kernel
            )
        )
        return "stablehlo.transpose" in product.lower(a, b).as_text()

    assert transposes()
    # A small product: auto runs it on mma, which reads b as stored (3xTF32
    # stays on wgmma: the small-product rule was measured at DEFAULT).
    assert transposes(k=200) == (precision == lax.Precision.HIGH)
    assert not transposes(kernel="mma")
    assert not transposes(dtype=jnp.bfloat16)
    assert not transposes(precision=lax.Precision.HIGHEST)


# What explain says of 3xTF32's operands on wgmma (kernel_table.cu).
SPLIT_ON_CHIP = "split into TF32 hi and lo parts in shared memory"
SPLIT_IN_REGISTERS = "split into TF32 hi and lo parts in registers as the consumers load it"
SPLIT_AHEAD = "split into TF32 hi and lo parts ahead of the kernel"
SPLIT_IN_KERNEL = "its A (read once) split into TF32 hi and lo parts in registers"


@needs_cuda_module
def test_3xtf32_splits_on_chip_the_operands_read_once():
    """wgmma's 3xTF32 splits each operand into TF32 hi and lo parts by a pass
    ahead of the kernel, except one that the kernel reads only once and that
    is stored K-major: A where C is one column of 128-wide tiles, B where it
    is one row, neither broadcast over batches (each batch reads it again).
    That one lands as stored, A split by the consumers as they load it into
    registers, B in shared memory (a pass ahead over a 4096 x 4096 A with 128
    columns of C took half the product's time). The
    caller's x @ w, w stored (k, n), splits in the kernel instead where the
    passes ahead would take longer than the parts save (few rows, or K deep
    beside M x N): swapped, w the kernel's A split in registers, x its B."""

    def plan_of(problem):
        kernel, reason, plan = _ffi.cuda_explain("float32", "float32", problem, 132, "high")
        assert kernel == "wgmma", (problem, reason)
        return plan

    on_chip = {
        # (batch_a, batch_b, m, n, k, transpose_a, transpose_b): (A in registers, B on chip)
        (1, 1, 4096, 128, 4096, False, False): (True, False),
        (1, 1, 4096, 128, 4096, False, True): (True, False),
        (1, 1, 4096, 128, 4096, True, True): (False, False),  # A stored (k, m)
        (1, 1, 4096, 4096, 4096, False, True): (False, False),
        (1, 1, 128, 4096, 4096, False, True): (False, True),
        (1, 1, 4096, 4096, 4096, False, False): (False, False),  # B stored (k, n)
        (1, 1, 2048, 2048, 2048, False, False): (False, False),
        (1, 1, 128, 128, 16384, False, True): (True, True),
        (8, 8, 1024, 128, 1024, False, True): (True, False),
        (1, 8, 1024, 128, 1024, False, True): (False, False),  # A broadcast over 8 batches
        (8, 1, 128, 1024, 1024, False, True): (False, False),  # B broadcast
    }
    for problem, (a, b) in on_chip.items():
        plan = plan_of(problem)
        said = {
            (True, True): ["A " + SPLIT_IN_REGISTERS, "B " + SPLIT_ON_CHIP],
            (True, False): ["A " + SPLIT_IN_REGISTERS, "B " + SPLIT_AHEAD],
            (False, True): ["B " + SPLIT_ON_CHIP, "A " + SPLIT_AHEAD],
            (False, False): ["A and B " + SPLIT_AHEAD],
        }[a, b]
        assert all(words in plan for words in said), (problem, plan)
        reason = _ffi.cuda_explain("float32", "float32", problem, 132, "high")[1]
        assert ("A through registers" in reason) == a, (problem, reason)
        assert (SPLIT_IN_REGISTERS in plan) == a and (SPLIT_ON_CHIP in plan) == b, (problem, plan)
        assert SPLIT_IN_KERNEL not in plan, (problem, plan)
    for problem in [
        (1, 1, 128, 4096, 4096, False, False),
        (1, 1, 48, 8192, 8192, False, False),
        (4, 1, 48, 1024, 1024, False, False),
        (1, 1, 64, 14336, 4096, False, False),
        (1, 1, 256, 4096, 4096, False, False),
        (1, 1, 512, 512, 8192, False, False),
    ]:
        plan = plan_of(problem)
        assert SPLIT_IN_KERNEL in plan and "C^T = B^T A^T" in plan, (problem, plan)
        reason = _ffi.cuda_explain("float32", "float32", problem, 132, "high")[1]
        assert "A through registers" in reason and "parts read from" not in reason, reason
        assert SPLIT_AHEAD not in plan and SPLIT_ON_CHIP not in plan, (problem, plan)


@pytest.mark.gpu
def test_3xtf32_split_on_chip_gives_the_bits_of_the_split_ahead(rng, on_gpu):
    """An operand split on chip (A in registers, B in shared memory) has the
    parts the pass ahead makes, so the same bits: each product here is a
    slice of a wider (taller) one whose same operand is split ahead, both
    with tiles enough to fill every SM (no K split, so every tile sums
    alike). Both on chip: against float64."""
    if "wgmma" not in tensor_core_kernels():
        pytest.skip("wgmma needs a Hopper GPU")
    long, k = 256 * 128, 200  # rows of whole tiles past any GPU's SMs; K off the slabs
    big = random_array(rng, (long, k), F32)
    once, extra = random_array(rng, (128, k), F32), random_array(rng, (100, k), F32)
    both = jnp.concatenate([once, extra])
    high = lax.Precision.HIGH

    def product(a, b, ta, tb, *splits):
        problem = (1, 1, a.shape[1] if ta else a.shape[0], b.shape[0], k, ta, tb)
        plan = _ffi.cuda_explain("float32", "float32", problem, 132, high)[2]
        assert all(split in plan for split in splits), (problem, plan)
        return np.asarray(bind_product(a[None], b[None], ta, tb, precision=high, kernel="wgmma"))[0]

    a_on_chip = product(big, once, False, True, "A " + SPLIT_IN_REGISTERS)
    a_ahead = product(big, both, False, True, "A and B " + SPLIT_AHEAD)
    np.testing.assert_array_equal(a_on_chip, a_ahead[:, :128])
    b_on_chip = product(once, big, False, True, "B " + SPLIT_ON_CHIP)
    b_ahead = product(both, big, False, True, "A and B " + SPLIT_AHEAD)
    np.testing.assert_array_equal(b_on_chip, b_ahead[:128])
    assert_matmul_close(a_on_chip, big, once.T, platform="cuda", precision=high)
    out = product(once, extra[:64], False, True, "A " + SPLIT_IN_REGISTERS, "B " + SPLIT_ON_CHIP)
    assert_matmul_close(out, once, extra[:64].T, platform="cuda", precision=high)


def test_one_tf32_pass_reads_a_from_shared_memory_where_it_is_k_major():
    """TF32 wgmma reads shared memory K-major only: A stored (m, k) lands
    rounded by its own TFLOAT32 tensor map and is read from there, as B is;
    A stored (k, m), or b stored (k, n) swapped onto A, goes through
    registers."""
    for problem, through_registers in {
        (1, 1, 4096, 4096, 4096, False, True): False,  # a @ b.T
        (1, 1, 4096, 64, 4096, False, True): False,  # 128 x 64 tiles
        (4, 4, 1000, 1000, 1000, False, True): False,
        (1, 1, 4096, 4096, 4096, False, False): True,  # a @ b: C^T, b on A
        (1, 1, 4096, 4096, 4096, True, True): True,  # a stored (k, m)
    }.items():
        kernel, reason, _ = _ffi.cuda_explain("float32", "float32", problem, 132, "default")
        assert kernel == "wgmma", (problem, reason)
        assert ("A through registers" in reason) == through_registers, (problem, reason)
        assert ("both operands from shared memory" in reason) != through_registers, reason


def test_3xtf32_outputs_64_wide_take_128_by_64_tiles():
    """Outputs 64 or fewer columns wide take 128 x 64 tiles for 3xTF32, as
    for one pass: 128-wide ones would be half padding, and so would half the
    four products' tensor work be. That is the parts' C, or the C^T of x @ w
    split in the kernel, whose columns are x's rows. 65 columns take 128 x
    128."""
    for problem, (tiles, in_kernel) in {
        (1, 1, 16384, 64, 4096, False, False): ("128 x 64 tiles", False),
        (1, 1, 16384, 40, 4096, False, True): ("128 x 64 tiles", False),
        (1, 1, 1024, 64, 8192, False, True): ("128 x 64 tiles", False),
        (1, 1, 16384, 65, 4096, False, True): ("128 x 128 tiles", False),
        (1, 1, 48, 8192, 8192, False, False): ("128 x 64 tiles", True),
        (1, 1, 64, 14336, 4096, False, False): ("128 x 64 tiles", True),
        (1, 1, 100, 8192, 8192, False, False): ("128 x 128 tiles", True),
    }.items():
        kernel, reason, plan = _ffi.cuda_explain("float32", "float32", problem, 132, "high")
        assert kernel == "wgmma", (problem, reason)
        assert plan.startswith(tiles), (problem, plan)
        assert (SPLIT_IN_KERNEL in plan) == in_kernel, (problem, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay != (True, False)], ids=str)
def test_3xtf32_parts_on_128_by_64_tiles_against_float64(rng, on_gpu, layout):
    """3xTF32's parts on 128 x 64 tiles: odd widths and K off the slabs, K
    split across clusters or not, A split ahead or on chip (a.T @ b as
    stored is refused: test_wgmma_float32_with_both_operands_mn_major). An
    odd width only where b is stored (n, k): stored (k, n), its rows must
    start on 16 bytes for the TMA, as the forced kernel says."""
    if "wgmma" not in tensor_core_kernels():
        pytest.skip("wgmma needs a Hopper GPU")
    ta, tb = layout
    high = lax.Precision.HIGH
    for m, n, k in [(5000, 17 if tb else 36, 1000), (300, 64, 200), (1000, 40, 6000)]:
        a, b, a_op, b_op = operands(rng, m, n, k, ta, tb)
        out = np.asarray(bind_product(a, b, ta, tb, precision=high, kernel="wgmma"))
        assert_matmul_close(out[0], a_op[0], b_op[0], platform="cuda", precision=high)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [3, 16, 100, 128])
def test_3xtf32_split_in_kernel_is_as_close_as_the_parts(rng, on_gpu, m):
    """x @ w with few rows, w stored (k, n), splits in the kernel (w in
    registers, x in shared memory): the split parts are the pass's, so its
    error against float64 is 3xTF32's, on odd n and K off the slabs, K split
    or not, and with x batched over a broadcast w. (The forced kernel splits
    these in the kernel whatever auto would take: the plan depends on the
    layouts and m alone, test_3xtf32_splits_on_chip_the_operands_read_once.)"""
    if "wgmma" not in tensor_core_kernels():
        pytest.skip("wgmma needs a Hopper GPU")
    high = lax.Precision.HIGH
    for batch, n, k in [(1, 300, 4100), (1, 1000, 200), (3, 136, 520)]:
        x = random_array(rng, (batch, m, k), F32)
        w = random_array(rng, (1, k, n), F32)
        out = np.asarray(bind_product(x, w, False, False, precision=high, kernel="wgmma"))
        for i in range(batch):
            assert_matmul_close(out[i], x[i], w[0], platform="cuda", precision=high)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", TF32_PRECISIONS, ids=lambda p: p.name)
def test_wgmma_float32_with_both_operands_mn_major(rng, on_gpu, precision):
    """a^T @ ct, b's cotangent, is that layout. One TF32 pass runs it on a
    forced 'wgmma' (B rewritten K-major in shared memory), so the forward
    product and both gradients run there; 3xTF32 does not: a forced 'wgmma'
    is refused for it, and 'auto' runs it on 'mma'."""
    if "wgmma" not in tensor_core_kernels():
        pytest.skip("wgmma needs a Hopper GPU")
    m, n, k = 136, 72, 600  # K too deep for a small product (auto's mma)
    a, b, a_op, b_op = operands(rng, m, n, k, True, False)
    rewrites_b = precision == lax.Precision.DEFAULT
    kernel, reason, _ = _ffi.cuda_explain(
        "float32", "float32", (1, 1, m, n, k, True, False), 132, precision
    )
    assert kernel == ("wgmma" if rewrites_b else "mma"), reason
    if not rewrites_b:
        with pytest.raises(ValueError, match="(?s)wgmma.*3xTF32.*transpose_a=True"):
            bind_product(a, b, True, False, precision=precision, kernel="wgmma")
    for forced in ("wgmma", "auto") if rewrites_b else ("auto",):
        assert_matmul_close(
            bind_product(a, b, True, False, precision=precision, kernel=forced),
            a_op,
            b_op,
            platform="cuda",
            precision=precision,
        )
    x = random_array(rng, (m, k), F32)
    w = random_array(rng, (m, n), F32)
    y = b_op[0]
    mm = lambda x, y: jax_tiled.matmul(x, y, precision=precision, kernel="wgmma")
    assert_matmul_close(
        jax.grad(weighted_sum(mm, w))(x, y), w, y.T, platform="cuda", precision=precision
    )
    if rewrites_b:
        assert_matmul_close(
            jax.grad(weighted_sum(mm, w), 1)(x, y), x.T, w, platform="cuda", precision=precision
        )
    else:
        with pytest.raises(ValueError, match="wgmma"):
            jax.grad(weighted_sum(mm, w), 1)(x, y)
