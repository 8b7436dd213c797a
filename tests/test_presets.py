"""`lax.DotAlgorithmPreset`s as `precision=`: the presets `jnp.matmul` takes on a
backend, with its meaning (the operands' rounding, the accumulation, the output
dtype) and at least its accuracy; the others refused at trace time, naming
the ones the backend takes. One table (`jax_tiled._presets.PRESETS`) decides.

Tests taking the `platform` fixture run on CPU here and on CUDA as `gpu`
tests (skipped without a GPU, failed under JAX_TILED_REQUIRE_GPU=1): there
they check the CUDA half of the table against jnp.matmul on the same GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import helpers
import jax_tiled
from helpers import EPS, F32, assert_runs_as, equations, random_array, x64
from jax_tiled import _presets

Preset = lax.DotAlgorithmPreset
BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(np.float16)

# Presets both backends take: those a trace may use whatever backend it runs on.
EVERYWHERE = [p for p in _presets.PRESETS["cpu"] if p in _presets.PRESETS["cuda"]]

# (batch shape, m, k, n): odd sizes, deep K, a batch broadcast against one b.
SHAPES = [((), 67, 131, 45), ((3,), 33, 257, 19), ((), 129, 1000, 65)]


def names(presets) -> list[str]:
    return [p.name for p in presets]


def jnp_takes(preset, a, b) -> bool:
    """Whether jnp.matmul computes a @ b at `preset` on a and b's device."""
    try:
        jax.block_until_ready(jnp.matmul(a, b, precision=preset))
    except Exception:  # jax's ValueError on CPU; XLA's compile error on a GPU
        return False
    return True


def operand_pair(rng, shape, dtype):
    batch, m, k, n = shape
    return random_array(rng, (*batch, m, k), dtype), random_array(rng, (k, n), dtype)


def exact(a, b) -> np.ndarray:
    return np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))


def assert_float64_rounded_once(out, a, b):
    """out is the float64 product rounded once to float32: within half a float32
    ulp of the exact product (float64's own error is far below it)."""
    ref, mag = exact(a, b), exact(np.abs(a), np.abs(b))
    assert out.dtype == F32
    err = np.abs(np.asarray(out, np.float64) - ref)
    assert np.all(err <= 2.0**-24 * np.abs(ref) + 1e-12 * mag), err.max()


def norm_error(out, ref) -> float:
    return float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref))


# ---- The table against jnp.matmul on the same backend ----


def test_cpu_table_is_what_jnp_takes_on_cpu(rng):
    """Every preset, with jnp.matmul on the CPU (this jax): the table takes
    exactly the ones jnp takes, for every input dtype."""
    for dtype in (F32, BF16, F16):
        a, b = operand_pair(rng, ((), 5, 7, 3), dtype)
        taken = [p for p in Preset if jnp_takes(p, jax.device_put(a, jax.devices("cpu")[0]), b)]
        assert taken == list(_presets.PRESETS["cpu"]), (dtype, names(taken))


@pytest.mark.gpu
def test_cuda_table_is_what_jnp_takes_on_this_gpu(rng, on_gpu):
    """The CUDA table is XLA's documented GPU support; on a GPU, jnp.matmul
    must take every preset the table takes, and refuse the ones it refuses."""
    for dtype in (F32, BF16, F16):
        a, b = operand_pair(rng, ((), 64, 64, 64), dtype)
        taken = [p for p in Preset if jnp_takes(p, a, b)]
        assert taken == list(_presets.PRESETS["cuda"]), (dtype, names(taken))


def test_what_runs_on_cuda():
    """The CUDA half of the table, resolved (no GPU needed): the casts follow
    jax's, float32 BF16_BF16_F32 operands are rounded to bfloat16 as XLA's GPU
    algorithm rounds them, and each float32 mode is at least the preset's accuracy."""
    resolve = lambda preset, dtype=F32, out=None: _presets.resolve(
        "cuda", preset, dtype, dtype if out is None else out
    )
    Run, D, H, X = _presets.Run, lax.Precision.DEFAULT, lax.Precision.HIGH, lax.Precision.HIGHEST
    assert resolve(Preset.DEFAULT) == Run(F32, F32, D)
    assert resolve(Preset.TF32_TF32_F32) == Run(F32, F32, D)
    # BF16_BF16_F32_X3: the products of the operands' parts, as its name counts.
    for dtype in (F32, BF16):  # jax casts 16-bit operands up
        run = resolve(Preset.BF16_BF16_F32_X3, dtype)
        assert run.split == _presets.BF16_X3 and run.precision == D
        assert run.kernel_run() == Run(BF16, F32, D, laid_terms=3)
        assert _presets.resolve("cuda", _presets.PartsLaid(3), BF16, F32) == run.kernel_run()
    # The splits: the largest terms kept, every (i, j) with i + j below the cut.
    for name, (part, parts, terms) in {
        "BF16_BF16_F32_X3": ("bfloat16", 2, 3),
        "BF16_BF16_F32_X6": ("bfloat16", 3, 6),
        "TF32_TF32_F32_X3": ("tf32", 2, 3),
    }.items():
        split = _presets.SPLITS[name]
        assert (split.part, split.parts, len(set(split.terms))) == (part, parts, terms)
        assert (0, 0) in split.terms and all(max(t) < parts for t in split.terms)
        assert all((j, i) in split.terms for i, j in split.terms), name
    # The others as four TF32 products (HIGH): faster on an H100 than their
    # parts, or than nine bfloat16 products.
    for preset in (Preset.BF16_BF16_F32_X6, Preset.BF16_BF16_F32_X9, Preset.TF32_TF32_F32_X3):
        assert resolve(preset) == Run(F32, F32, H)
        assert resolve(preset, BF16) == Run(F32, F32, H)
    assert resolve(Preset.F32_F32_F32) == Run(F32, F32, X)
    assert resolve(Preset.F32_F32_F32, F16) == Run(F32, F32, X)
    assert resolve(Preset.BF16_BF16_F32) == Run(BF16, F32, D)
    assert resolve(Preset.BF16_BF16_F32, F32, BF16) == Run(BF16, F32, D)
    assert resolve(Preset.BF16_BF16_F32, BF16) == Run(BF16, BF16, D)
    assert resolve(Preset.BF16_BF16_F32, F16) == Run(BF16, F32, D)
    assert resolve(Preset.F16_F16_F32, F32) == Run(F16, F32, D)
    assert resolve(Preset.F16_F16_F32, F16) == Run(F16, F16, D)
    assert resolve(Preset.F64_F64_F64) == Run(np.dtype(np.float64), np.dtype(np.float64), D)
    for preset in (Preset.F16_F16_F16, Preset.BF16_BF16_BF16, Preset.ANY_F8_ANY_F8_F32):
        with pytest.raises(ValueError, match=f"{preset.name} is not supported on cuda"):
            resolve(preset)


def test_what_runs_on_cpu():
    """jax's casts, and exact fp32 for every float32 product: XLA's CPU runtime
    keeps float32 operands whole under BF16_BF16_F32 and its X3/X6."""
    resolve = lambda preset, dtype=F32: _presets.resolve("cpu", preset, dtype, dtype)
    for preset in (
        Preset.BF16_BF16_F32,
        Preset.BF16_BF16_F32_X3,
        Preset.BF16_BF16_F32_X6,
        Preset.F32_F32_F32,
    ):
        run = resolve(preset)
        assert (run.operand_dtype, run.product_dtype) == (F32, F32), preset
    assert resolve(Preset.F16_F16_F16) == _presets.Run(F16, F16, lax.Precision.DEFAULT)
    assert resolve(Preset.BF16_BF16_F32, F16).operand_dtype == BF16
    assert resolve(Preset.F64_F64_F64).operand_dtype == np.float64


# ---- Accuracy against jnp's same preset ----

# How far above jnp's error a preset may be: 2x plus one float32 rounding
# where both compute exact fp32 and differ in the order of summation. Two
# CUDA presets are further off: BF16_BF16_F32_X6, run as HIGH (four TF32
# products) against six bfloat16 passes, and F32_F32_F32 on the SIMT kernels
# against cuBLAS (the measurements: docs/precision.md, "The tests' tolerances
# for presets").
ACCURACY_FACTOR = {("cuda", Preset.BF16_BF16_F32_X6): 4, ("cuda", Preset.F32_F32_F32): 4}


def within_accuracy(platform, preset, error, jnp_error) -> bool:
    return error <= ACCURACY_FACTOR.get((platform, preset), 2) * jnp_error + EPS[F32]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=lambda d: d.name)
def test_each_preset_runs_as_jnp_with_at_least_its_accuracy(platform, rng, shape, dtype):
    """Every preset the backend takes: jnp's output dtype, the preset's meaning
    (assert_runs_as), and an error against float64 within ACCURACY_FACTOR of
    jnp's same preset."""
    a, b = operand_pair(rng, shape, dtype)
    ref = exact(a, b)
    off = []
    for preset in _presets.PRESETS[platform]:
        out = jax_tiled.matmul(a, b, precision=preset)
        want = jnp.matmul(a, b, precision=preset)
        assert out.dtype == want.dtype == dtype and out.shape == want.shape, preset
        assert_runs_as(platform, out, a, b, preset, dtype)
        error, jnp_error = norm_error(out, ref), norm_error(want, ref)
        assert error > 0
        if not within_accuracy(platform, preset, error, jnp_error):
            off.append(f"{preset.name}: {error:.2e} vs jnp's {jnp_error:.2e}")
    assert not off, "\n".join(off)


@pytest.mark.parametrize("out_dtype", [F32, BF16, F16], ids=lambda d: d.name)
def test_preferred_element_type_with_presets(platform, rng, out_dtype):
    """16-bit operands into another output dtype, and float32 into 16 bits."""
    for dtype in (F32, BF16, F16):
        a, b = operand_pair(rng, ((), 45, 300, 37), dtype)
        for preset in _presets.PRESETS[platform]:
            out = jax_tiled.matmul(a, b, precision=preset, preferred_element_type=out_dtype)
            want = jnp.matmul(a, b, precision=preset, preferred_element_type=out_dtype)
            assert out.dtype == want.dtype == out_dtype, (preset, dtype)
            assert_runs_as(platform, out, a, b, preset, out_dtype)


def test_f64_preset_computes_in_float64_for_float32_operands(platform, rng):
    """F64_F64_F64 on float32 operands, without jax_enable_x64: computed in
    float64 (as jnp's), so the result is float64's rounded once to float32,
    below any float32 accumulation's error."""
    a, b = operand_pair(rng, ((), 70, 2000, 50), F32)
    ref = exact(a, b)
    out = jax_tiled.matmul(a, b, precision="F64_F64_F64")
    assert_float64_rounded_once(out, a, b)
    assert norm_error(jax_tiled.matmul(a, b, precision="F32_F32_F32"), ref) > 2 * norm_error(
        out, ref
    )


def test_float64_operands(platform, rng):
    with x64():
        a, b = operand_pair(rng, ((), 33, 129, 17), np.float64)
        for preset in _presets.PRESETS[platform]:
            out = jax_tiled.matmul(a, b, precision=preset)
            want = jnp.matmul(a, b, precision=preset)
            assert out.dtype == want.dtype == np.float64, preset
            assert_runs_as(platform, out, a, b, preset, np.float64)
            assert within_accuracy(
                platform, preset, norm_error(out, exact(a, b)), norm_error(want, exact(a, b))
            ), preset


@pytest.mark.gpu
def test_bf16_preset_rounds_float32_operands_on_a_gpu(rng, on_gpu):
    """BF16_BF16_F32 on float32 operands: XLA's GPU algorithm rounds them to
    bfloat16; so does jax_tiled (the error is bfloat16's class, not fp32's)."""
    a, b = operand_pair(rng, ((), 256, 512, 128), F32)
    out = jax_tiled.matmul(a, b, precision="BF16_BF16_F32")
    assert 1e-4 < norm_error(out, exact(a, b)) < 1e-2
    assert_runs_as("cuda", out, a, b, Preset.BF16_BF16_F32, F32)


# ---- Gradients carry the preset, as jnp.matmul's do ----


def preset_of_products(jaxpr, name="tiled_matmul") -> list:
    return [e.params["precision"] for e in equations(jaxpr, name)]


@pytest.mark.parametrize("preset", EVERYWHERE, ids=str)
def test_gradients_carry_the_preset(preset):
    """The VJP's products are at the preset, as jnp.matmul's dot_generals are."""
    a, b, w = jnp.ones((2, 5, 6)), jnp.ones((6, 4)), jnp.ones((2, 5, 4)) / 3
    for mm, name in ((jax_tiled.matmul, "tiled_matmul"), (jnp.matmul, "dot_general")):
        loss = lambda a, b: jnp.sum(mm(a, b, precision=preset) * w)
        jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(a, b)
        assert preset_of_products(jaxpr, name) == [preset] * 3, (name, jaxpr)


@pytest.mark.parametrize(
    "preset_name", ["F32_F32_F32", "BF16_BF16_F32", "F64_F64_F64", "BF16_BF16_F32_X6"]
)
def test_gradient_values_match_jnp(platform, rng, preset_name):
    """Both cotangents, float32 and bfloat16 operands: within 2x jnp's error
    against the float64 products w @ b^T and a^T @ w, plus float32 output rounding."""
    preset = Preset[preset_name]
    for dtype in (F32, BF16):
        a, b = operand_pair(rng, ((), 37, 129, 23), dtype)
        w = random_array(rng, (37, 23), dtype)
        grads = {}
        for name, mm in (("tiled", jax_tiled.matmul), ("jnp", jnp.matmul)):
            loss = lambda a, b: jnp.sum(mm(a, b, precision=preset).astype(F32) * w)
            grads[name] = jax.jit(jax.grad(loss, (0, 1)))(a, b)
        for i, ref in enumerate((exact(w, np.asarray(b).T), exact(np.asarray(a).T, w))):
            ours, theirs = grads["tiled"][i], grads["jnp"][i]
            assert ours.dtype == theirs.dtype == dtype
            floor = EPS[np.dtype(dtype)]
            assert norm_error(ours, ref) <= 2 * norm_error(theirs, ref) + floor, (dtype, i)


# ---- Every entry point, under every transformation ----


@pytest.mark.parametrize("preset", EVERYWHERE, ids=str)
def test_jit_vmap_jvp_keep_the_preset(preset):
    a, b = jnp.ones((3, 5, 6)), jnp.ones((6, 4))
    mm = lambda a, b: jax_tiled.matmul(a, b, precision=preset)
    for jaxpr in (
        jax.make_jaxpr(jax.jit(mm))(a, b),
        jax.make_jaxpr(jax.vmap(mm, in_axes=(0, None)))(a, b),
        jax.make_jaxpr(lambda a, b: jax.jvp(mm, (a, b), (a, b)))(a, b),
        jax.make_jaxpr(
            jax.jit(jax.vmap(jax.grad(lambda a, b: jnp.sum(mm(a, b)), 1), in_axes=(0, None)))
        )(a, b),
    ):
        products = preset_of_products(jaxpr)
        assert products and all(p == preset for p in products), jaxpr


def test_presets_by_name_and_by_default_matmul_precision(rng):
    a, b = operand_pair(rng, ((), 9, 17, 5), F32)
    by_name = jax.make_jaxpr(lambda a, b: jax_tiled.matmul(a, b, precision="F64_F64_F64"))(a, b)
    assert preset_of_products(by_name) == [Preset.F64_F64_F64]
    with jax.default_matmul_precision("F64_F64_F64"):
        routed = jax.make_jaxpr(jax_tiled.matmul)(a, b)
        assert jax_tiled.explain(a, b, backend="cpu").precision == "F64_F64_F64"
        assert_float64_rounded_once(jax_tiled.matmul(a, b), a, b)
    assert preset_of_products(routed) == [Preset.F64_F64_F64]


def test_dot_general_einsum_and_tiled_take_presets(platform, rng):
    """The same presets through dot_general (a transposed operand), einsum and
    a routed jnp.matmul: the preset reaches the product, and the values are the run's."""
    a = random_array(rng, (4, 37, 65), F32)  # (batch, k, m): contracted first
    b = random_array(rng, (4, 37, 23), F32)
    dims = (((1,), (1,)), ((0,), (0,)))
    a_op = np.swapaxes(a, 1, 2)
    for preset in _presets.PRESETS[platform]:
        outs = {
            "dot_general": jax_tiled.dot_general(a, b, dims, precision=preset),
            "einsum": jax_tiled.einsum("bkm,bkn->bmn", a, b, precision=preset),
            "tiled": jax.jit(
                jax_tiled.tiled(lambda a, b: jnp.matmul(jnp.swapaxes(a, 1, 2), b, precision=preset))
            )(a, b),
        }
        want = lax.dot_general(a, b, dims, precision=preset)
        for name, out in outs.items():
            assert out.dtype == want.dtype and out.shape == want.shape, (name, preset)
            assert_runs_as(platform, out, a_op, b, preset, F32)
        routed = jax.make_jaxpr(
            jax_tiled.tiled(lambda a, b: jnp.einsum("bkm,bkn->bmn", a, b, precision=preset))
        )(a, b)
        assert preset_of_products(routed) == [preset]
        assert not list(equations(routed, "dot_general"))


def test_tiled_grad_of_a_preset_product(rng):
    """tiled routes the VJP's dot_generals too, each at the preset."""
    a, b = operand_pair(rng, ((), 11, 13, 7), F32)
    loss = lambda a, b: jnp.sum(jnp.sin(jnp.matmul(a, b, precision="F32_F32_F32")))
    routed = jax.make_jaxpr(jax_tiled.tiled(jax.grad(loss, (0, 1))))(a, b)
    assert preset_of_products(routed) == [Preset.F32_F32_F32] * 3
    ga, gb = jax_tiled.tiled(jax.grad(loss, (0, 1)))(a, b)
    want_a, want_b = jax.grad(loss, (0, 1))(a, b)
    helpers.assert_trees_close((ga, gb), (want_a, want_b), rtol=1e-5)


# ---- explain and kernels ----


def test_explain_says_what_runs(rng):
    a, b = jax.ShapeDtypeStruct((67, 131), F16), jax.ShapeDtypeStruct((131, 45), F16)
    found = jax_tiled.explain(a, b, precision="BF16_BF16_F32", backend="cpu")
    assert (found.precision, found.kernel) == ("BF16_BF16_F32", "blocked")
    assert found.runs_as == (
        "operands cast to bfloat16, bfloat16 product into float32, cast to float16"
    ), found
    assert str(found).startswith(
        "cpu: 1 x (67 x 131) @ (131 x 45), float16 -> float16, precision BF16_BF16_F32 (runs as "
        "operands cast to bfloat16, bfloat16 product into float32, cast to float16): blocked"
    )
    f32 = jax.ShapeDtypeStruct((67, 131), F32), jax.ShapeDtypeStruct((131, 45), F32)
    found = jax_tiled.explain(*f32, precision=Preset.F32_F32_F32, backend="cpu")
    assert found.runs_as == "float32 product into float32 at HIGHEST", found


@pytest.mark.gpu
def test_explain_and_kernels_on_a_gpu(on_gpu):
    """On CUDA BF16_BF16_F32_X3 runs as one product of its operands' parts on
    tensor cores, the other emulation presets on tensor cores at HIGH,
    F32_F32_F32 on a SIMT kernel, BF16_BF16_F32 on bfloat16 tensor cores."""
    a, b = jax.ShapeDtypeStruct((1000, 800), F32), jax.ShapeDtypeStruct((800, 1200), F32)
    found = jax_tiled.explain(a, b, precision="BF16_BF16_F32_X3")
    assert found.runs_as.startswith("operands split into 2 bfloat16 parts, 3 products"), found
    assert found.kernel in helpers.TENSOR_CORE_KERNELS, found
    for preset in ("BF16_BF16_F32_X6", "BF16_BF16_F32_X9", "TF32_TF32_F32_X3"):
        found = jax_tiled.explain(a, b, precision=preset)
        assert found.runs_as.endswith("at HIGH"), found
        assert found.kernel in helpers.TENSOR_CORE_KERNELS, found
    found = jax_tiled.explain(a, b, precision="F32_F32_F32")
    assert found.kernel in helpers.SIMT_KERNELS, found
    found = jax_tiled.explain(a, b, precision="BF16_BF16_F32")
    assert found.runs_as.startswith("operands cast to bfloat16"), found
    assert found.kernel in helpers.TENSOR_CORE_KERNELS, found
    assert set(jax_tiled.kernels("gpu", F32, precision="F32_F32_F32")).isdisjoint(
        helpers.TENSOR_CORE_KERNELS
    )
    assert set(helpers.tensor_cores_of_this_gpu()) <= set(
        jax_tiled.kernels("gpu", F32, precision="BF16_BF16_F32_X6")
    )


def test_kernels_take_presets():
    cpu = list(helpers.CPU_KERNELS)
    assert jax_tiled.kernels("cpu", F32, precision="F64_F64_F64") == cpu
    assert jax_tiled.kernels("cpu", BF16, F32, precision=Preset.F16_F16_F16) == cpu
    with pytest.raises(ValueError, match="TF32_TF32_F32 is not supported on cpu"):
        jax_tiled.kernels("cpu", F32, precision="TF32_TF32_F32")


# ---- Refusals ----

REFUSED_ON_CPU = [p for p in Preset if p not in _presets.PRESETS["cpu"]]


def refusal_pattern(preset, platform) -> str:
    return (
        f"precision {preset.name} is not supported on {platform}.*presets accepted on "
        f"{platform}: {', '.join(names(_presets.PRESETS[platform]))}"
    )


@pytest.mark.parametrize("preset", REFUSED_ON_CPU, ids=str)
def test_presets_cpu_refuses_raise_at_trace_time(preset):
    """jnp.matmul refuses them on CPU; every entry point refuses them while
    tracing (make_jaxpr lowers nothing), naming the preset and the accepted ones."""
    a, b = jnp.ones((4, 6)), jnp.ones((6, 3))
    pattern = refusal_pattern(preset, "cpu")
    with jax.default_device(jax.devices("cpu")[0]):
        entries = {
            "matmul": lambda a, b: jax_tiled.matmul(a, b, precision=preset),
            "dot_general": lambda a, b: jax_tiled.dot_general(
                a, b, (((1,), (0,)), ((), ())), precision=preset
            ),
            "einsum": lambda a, b: jax_tiled.einsum("ik,kj->ij", a, b, precision=preset),
            "tiled": jax_tiled.tiled(lambda a, b: jnp.matmul(a, b, precision=preset)),
        }
        for entry in entries.values():
            with pytest.raises(ValueError, match=pattern):
                jax.make_jaxpr(entry)(a, b)
        with pytest.raises(ValueError, match=pattern):
            jax_tiled.explain(a, b, precision=preset, backend="cpu")
        with pytest.raises(ValueError, match=pattern):
            jax_tiled.kernels("cpu", F32, precision=preset)


@pytest.mark.parametrize(
    "preset", [p for p in Preset if p not in _presets.PRESETS["cuda"]], ids=str
)
def test_presets_cuda_refuses_are_refused_for_cuda(preset):
    """explain for CUDA (no GPU needed) refuses what XLA's GPU refuses."""
    a, b = jax.ShapeDtypeStruct((64, 64), F32), jax.ShapeDtypeStruct((64, 64), F32)
    with pytest.raises(ValueError, match=refusal_pattern(preset, "cuda")):
        jax_tiled.explain(a, b, precision=preset, backend="cuda")


def test_the_lowering_refuses_for_the_platform_it_lowers_for():
    """A product traced elsewhere (the primitive bound directly) is still
    refused when lowered for the CPU."""
    a = jnp.ones((1, 4, 4))
    f = lambda a: jax_tiled.tiled_matmul_p.bind(
        a,
        a,
        transpose_a=False,
        transpose_b=False,
        out_dtype=F32,
        precision=Preset.TF32_TF32_F32,
        kernel="auto",
    )
    with pytest.raises(ValueError, match=refusal_pattern(Preset.TF32_TF32_F32, "cpu")):
        jax.jit(f).trace(a).lower(lowering_platforms=("cpu",))


@pytest.mark.parametrize(
    "bad",
    [
        lax.DotAlgorithm(np.float32, np.float32, np.float32),
        ("F32_F32_F32", "default"),
        (Preset.F32_F32_F32, Preset.F32_F32_F32),
        "f32_f32_f32",
    ],
    ids=str,
)
def test_other_algorithm_forms_are_refused(bad):
    a = jnp.ones((4, 4))
    with pytest.raises(ValueError, match="unsupported precision"):
        jax_tiled.matmul(a, a, precision=bad)


def test_presets_on_operands_sharded_over_k(rng):
    """K split over 4 CPU devices, so each device's partial products are summed:
    a bfloat16 preset as on one device, and F64_F64_F64 on float32 operands,
    which traces float64 with jax_enable_x64 off, still float64's result."""
    devices = jax.devices("cpu")[:4]
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    spec = jax.sharding.NamedSharding
    P = jax.sharding.PartitionSpec
    a, b = operand_pair(rng, ((), 24, 64, 20), F32)
    a_s = jax.device_put(a, spec(mesh, P(None, "x")))
    b_s = jax.device_put(b, spec(mesh, P("x", None)))
    with jax.default_device(devices[0]):
        for preset in (Preset.BF16_BF16_F32, Preset.F64_F64_F64):
            out = jax.jit(lambda a, b: jax_tiled.matmul(a, b, precision=preset))(a_s, b_s)
            if preset == Preset.F64_F64_F64:
                assert_float64_rounded_once(out, a, b)
            else:
                assert_runs_as("cpu", out, a, b, preset, F32)
