"""Helpers shared by the test files: inputs, products, references and tolerances,
and the kernels a test runs. Fixtures are in conftest.py."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src import core

import jax_tiled
from jax_tiled import _ffi, _presets
from jax_tiled._checks import canonical_precision

F32 = np.dtype(np.float32)
HIGHEST = lax.Precision.HIGHEST
# The kernel lists, from the extension modules' kernel tables: a kernel added
# to a table joins every test that runs its kind. Without the CUDA module the
# CUDA lists are empty (the tests that use them need a GPU or the module).
CPU_KERNELS = _ffi.kernel_names("cpu")
CUDA_TABLE = tuple(k for k in _ffi.kernel_table("cuda") if k.listed)
# For the tests that plan CUDA launches (no GPU needed) or read the CUDA table.
needs_cuda_module = pytest.mark.skipif(
    not _ffi.cuda_module_built(), reason="this build has no CUDA module"
)
TENSOR_CORE_KERNELS = tuple(k.name for k in CUDA_TABLE if k.tensor_cores)
SIMT_KERNELS = tuple(k.name for k in CUDA_TABLE if not k.tensor_cores)
LAYOUTS = list(itertools.product((False, True), repeat=2))  # (transpose_a, transpose_b)
# Any dot_general or transpose in a jaxpr: a product not run on this package's kernels.
FORBIDDEN = re.compile(r"\b(dot_general|transpose)\[")


def load_repository_module(relative_path: str):
    """A script of the repository that is no package (examples/, tools/) as a module."""
    path = Path(__file__).resolve().parent.parent / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # before it runs: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def gpu_available() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


# ---- Inputs ----


@contextlib.contextmanager
def x64():
    """float64 enabled inside the block."""
    with jax.enable_x64(True):
        yield


def random_array(rng, shape, dtype, *, integers=False):
    """Random normal (or small-integer) values, exactly representable in dtype."""
    if integers:
        x = rng.integers(-8, 9, size=shape).astype(np.float64)
    else:
        x = rng.standard_normal(shape)
    x = np.asarray(x, dtype=dtype)
    if x.size and not integers:
        assert np.any(x != 0)
    return x


def operands(rng, m, n, k, ta, tb, dtype=F32, batch_a=1, batch_b=1, integers=False):
    """Stored a and b of a canonical problem, and op(a), op(b) for the reference."""
    a = random_array(rng, (batch_a, k, m) if ta else (batch_a, m, k), dtype, integers=integers)
    b = random_array(rng, (batch_b, n, k) if tb else (batch_b, k, n), dtype, integers=integers)
    return a, b, np.swapaxes(a, 1, 2) if ta else a, np.swapaxes(b, 1, 2) if tb else b


# ---- Products ----


def bind_product(
    a, b, ta=False, tb=False, *, precision=lax.Precision.DEFAULT, kernel="auto", out_dtype=None
):
    """The primitive itself on canonical operands (out_dtype: default a's dtype)."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    return jax_tiled.tiled_matmul_p.bind(
        a,
        b,
        transpose_a=ta,
        transpose_b=tb,
        out_dtype=np.dtype(a.dtype if out_dtype is None else out_dtype),
        precision=lax.Precision(precision),
        kernel=kernel,
    )


def tiled(a, b, kernel="auto"):
    """jax_tiled.matmul at HIGHEST (true fp32 on every kernel), to compare with `reference`."""
    return jax_tiled.matmul(a, b, precision=HIGHEST, kernel=kernel)


def reference(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


def loss_of(matmul):
    # Nonlinear, so that second derivatives are not trivially zero.
    return lambda a, b: jnp.sum(jnp.sin(matmul(a, b)))


def matmul_problem(a, b) -> tuple:
    """The canonical problem (batch_a, batch_b, m, n, k, transpose_a,
    transpose_b) that jax_tiled.matmul(a, b) binds, for kernels_on's `problem`."""
    return jax_tiled.explain(a, b, backend="cpu").problem


# ---- The kernels a test runs ----


def kernels_on(
    platform: str, dtype=np.float32, out_dtype=None, problem=None, precision=None
) -> list[str]:
    """ "auto" and every kernel that computes dtype -> out_dtype (default: the
    same) on the platform at `precision` (as matmul takes it; None: the default,
    which honours jax.default_matmul_precision): on CUDA the tensor-core kernels
    take float32 at DEFAULT and HIGH but not HIGHEST. Forcing a kernel on other
    dtypes is tested in test_errors. With `problem` = (batch_a, batch_b, m, n, k,
    transpose_a, transpose_b), only the kernels that run that layout: the Hopper
    kernel needs rows its copy engine can read, and test_tensor_cores covers it
    on such shapes."""
    names = jax_tiled.kernels(
        "gpu" if platform == "cuda" else platform, dtype, out_dtype, precision
    )
    assert names, f"no kernels usable on {platform}"
    if problem is not None:
        out_dtype = dtype if out_dtype is None else out_dtype
        precision = canonical_precision(precision)
        names = [
            name
            for name in names
            if not _ffi.refusal(platform, name, dtype, out_dtype, problem, precision)
        ]
    return ["auto", *names]


def admits(kernel: _ffi.KernelFacts, capability: int) -> bool:
    """Whether, by its table's facts, a kernel runs on a GPU of this compute
    capability (major * 10 + minor)."""
    return capability >= kernel.min_capability and (not kernel.hopper_only or capability == 90)


def tensor_cores_of_this_gpu() -> tuple[str, ...]:
    """The tensor-core kernels the table admits on this GPU's compute capability
    (a Hopper GPU's where none is visible)."""
    capability = _ffi.cuda_compute_capability()
    return tuple(k.name for k in CUDA_TABLE if k.tensor_cores and admits(k, capability))


def tensor_core_kernels(
    dtype=F32, out_dtype=None, *, problem=None, precision=lax.Precision.DEFAULT
) -> list[str]:
    """The tensor-core kernels listed on this GPU for dtype -> out_dtype (default:
    the same) at `precision` that take `problem`'s layout (default: any)."""
    out_dtype = dtype if out_dtype is None else out_dtype
    listed = jax_tiled.kernels("gpu", dtype, out_dtype, precision)
    names = [k for k in TENSOR_CORE_KERNELS if k in listed]
    if np.dtype(dtype).itemsize == 2 or lax.Precision(precision) != HIGHEST:
        # Every tensor-core kernel this GPU admits takes them (sm_80+ has one).
        assert names and set(tensor_cores_of_this_gpu()) <= set(names), listed
    if problem is not None:
        names = [
            k for k in names if not _ffi.refusal("cuda", k, dtype, out_dtype, problem, precision)
        ]
    return names


def tensor_kernels_on(platform, problem, precision, dtype=F32) -> list[str]:
    """'auto' and the kernels whose arithmetic depends on the precision: on CUDA
    the tensor-core kernels that take the problem, on CPU the one CPU kernel."""
    if platform == "cpu":
        return ["auto", *CPU_KERNELS]
    return ["auto", *tensor_core_kernels(dtype, problem=problem, precision=precision)]


# ---- References and tolerances ----

EPS = {
    np.dtype(jnp.float16): 2.0**-11,
    np.dtype(jnp.bfloat16): 2.0**-8,
    np.dtype(np.float32): 2.0**-24,
    np.dtype(np.float64): 2.0**-53,
}


def tensor_core_float32(platform, dtype, precision) -> bool:
    """Whether a float32 product at `precision` may run on tensor cores: on
    CUDA at DEFAULT (TF32) and HIGH (3xTF32)."""
    return (
        platform == "cuda"
        and np.dtype(dtype) == np.float32
        and canonical_precision(precision) != lax.Precision.HIGHEST
    )


def input_rounding(platform, dtype, precision) -> float:
    """Relative rounding of each operand before the products, by precision
    (None, a lax.Precision or any name matmul takes; None honours
    jax.default_matmul_precision)."""
    if tensor_core_float32(platform, dtype, precision):
        if canonical_precision(precision) == lax.Precision.DEFAULT:
            return 2.0**-11  # TF32 keeps 10 mantissa bits, rounded to nearest
        # 3xTF32: hi is x truncated, so |lo| < 2^-10 |x|: the dropped lo*lo
        # term and the rounding of lo.
        return 2.0**-20
    return 0.0


def accumulation_rounding(platform, in_dtype, out_dtype, precision=None) -> float:
    """Relative rounding of each addition into the accumulator."""
    if np.float64 in (np.dtype(in_dtype), np.dtype(out_dtype)):
        return EPS[np.dtype(np.float64)]
    if platform == "cuda" and (
        np.dtype(in_dtype).itemsize == 2 or tensor_core_float32(platform, in_dtype, precision)
    ):
        # Tensor cores add products into float32 in groups, aligned to the
        # largest and truncated rather than rounded: allow 4 ulps per addition.
        return 4 * EPS[np.dtype(np.float32)]
    return EPS[np.dtype(np.float32)]


def assert_matmul_close(out, a, b, *, platform="cpu", precision=None, out_dtype=None):
    """Checks every element of `out` against a float64 product of a and b.

    Elementwise bound: K accumulation roundings of the accumulator type plus the
    operand rounding of the precision mode, relative to |a| @ |b|, plus one
    rounding of the output type relative to |ref|.
    """
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ref = np.matmul(a64, b64)
    mag = np.matmul(np.abs(a64), np.abs(b64))
    out = np.asarray(out)
    in_dtype = jnp.promote_types(a.dtype, b.dtype)
    out_dtype = np.dtype(out_dtype or in_dtype)
    assert out.dtype == out_dtype, (out.dtype, out_dtype)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    k = a.shape[-1]
    acc_eps = accumulation_rounding(platform, in_dtype, out_dtype, precision)
    bound = (k + 2) * acc_eps + 2 * input_rounding(platform, in_dtype, precision)
    tol = bound * mag + EPS[out_dtype] * np.abs(ref) + 1e-30
    err = np.abs(out.astype(np.float64) - ref)
    assert np.all(np.isfinite(out)), "non-finite output"
    bad = err > tol
    worst = np.argmax(err - tol)
    assert not bad.any(), (
        f"{bad.sum()} of {bad.size} elements off; worst at {np.unravel_index(worst, err.shape)}: "
        f"err {err.max():.3g}, tol there {tol.flat[worst]:.3g}"
    )


def kernel_products(kernel: str) -> list[tuple[str, str]]:
    """Every (dtype, out_dtype) pair a CUDA kernel takes, from the kernel table."""
    facts = next((k for k in CUDA_TABLE if k.name == kernel), None)
    return [] if facts is None else [(i, o) for i in facts.inputs for o in facts.outputs]


def assert_every_layout_and_type(rng, kernel, m, n, k, batch_a=1, batch_b=1):
    """The kernel's product at HIGHEST in every layout and (dtype, out_dtype)
    pair it takes, against float64; beyond 2**22 elements of b float32 only
    (the other types' float64 references take long)."""
    for dtype, out_dtype in kernel_products(kernel):
        if k * n > 2**22 and (dtype, out_dtype) != ("float32", "float32"):
            continue
        with jax.enable_x64(True):
            for ta, tb in LAYOUTS:
                a, b, a_op, b_op = operands(rng, m, n, k, ta, tb, np.dtype(dtype), batch_a, batch_b)
                out = bind_product(
                    a, b, ta, tb, precision=HIGHEST, kernel=kernel, out_dtype=out_dtype
                )
                assert_matmul_close(
                    out, a_op, b_op, platform="cuda", precision=HIGHEST, out_dtype=out_dtype
                )


def highest_plan(kernel, shape, dtype=F32, out_dtype=None, multiprocessors=None):
    """The CUDA plan of `kernel` at HIGHEST for (batch, m, n, k) `shape`, both
    operands of the batch and untransposed (no GPU needed; multiprocessors
    default: the first CUDA device's, an H100's without one)."""
    batch, m, n, k = shape
    out_dtype = dtype if out_dtype is None else out_dtype
    problem = (batch, batch, m, n, k, False, False)
    return _ffi.cuda_plan(
        kernel, dtype, out_dtype, problem, HIGHEST, multiprocessors=multiprocessors
    )


def assert_special_values_across_k(
    rng, m, n, k, kernel="auto", dtype=F32, precision=HIGHEST, out_dtype=None
):
    """inf at the end of row 0's K, NaN at the start of row 1's, inf - inf
    across row 2's (so across the parts where K is cut): the product (at
    HIGHEST, or `precision`, of `dtype` operands into `out_dtype`) carries
    them as true arithmetic does, and the other rows are close to float64's."""
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    a[0, k - 1] = np.inf
    a[1, 0] = np.nan
    a[2, k - 1], a[2, 0] = np.inf, -np.inf
    with np.errstate(invalid="ignore"):
        want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    got = jax_tiled.matmul(
        a, b, precision=precision, kernel=kernel, preferred_element_type=out_dtype
    )
    got = np.asarray(got, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    infinite = np.isinf(want)
    np.testing.assert_array_equal(got[infinite], want[infinite])
    rest = got[3:].astype(np.dtype(out_dtype or dtype))
    assert_matmul_close(rest, a[3:], b, platform="cuda", precision=precision, out_dtype=out_dtype)


def assert_same_bits_run_to_run(product, a, b, runs=3):
    """`product(a, b)` run `runs` more times gives the first run's result bit
    for bit: the kernel's sums meet in a fixed order, whatever the launch."""
    first = np.asarray(product(a, b))
    for _ in range(runs):
        np.testing.assert_array_equal(np.asarray(product(a, b)), first)


def tanh_loss_of(matmul):
    """sum(tanh(a @ b)) at HIGHEST through `matmul`: a nonlinear loss whose
    gradients carry the product's error through tanh'."""
    return lambda a, b: jnp.sum(jnp.tanh(matmul(a, b, precision=HIGHEST)))


def errors_beside_jnp(a, b, precision=HIGHEST, peer_precision=None) -> dict:
    """{"ours": ..., "jnp": ...}: the relative Frobenius error against float64
    of jax_tiled.matmul's product of a and b at `precision` and of
    jnp.matmul's at `peer_precision` (the same where None)."""
    want = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
    errors = {}
    peer_precision = precision if peer_precision is None else peer_precision
    for name, product, at in (
        ("ours", jax_tiled.matmul, precision),
        ("jnp", jnp.matmul, peer_precision),
    ):
        got = np.asarray(product(a, b, precision=at), np.float64)
        errors[name] = np.linalg.norm(got - want) / np.linalg.norm(want)
    return errors


def relative_norm_error(out, a_op, b_op) -> float:
    """Relative Frobenius error of out against the float64 product op(a) @ op(b)."""
    ref = np.matmul(np.asarray(a_op, np.float64), np.asarray(b_op, np.float64))
    return float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref))


def assert_trees_close(x, y, rtol=2e-5):
    """Two pytrees of the same structure and shapes, leaf by leaf within rtol
    (and an absolute tolerance of rtol times the largest magnitude, at least 1)."""
    assert jax.tree.structure(x) == jax.tree.structure(y), (
        jax.tree.structure(x),
        jax.tree.structure(y),
    )
    for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        assert u.shape == v.shape
        np.testing.assert_allclose(u, v, rtol=rtol, atol=rtol * max(1.0, np.abs(v).max(initial=0)))


# ---- Jaxprs ----


def equations(jaxpr, name: str):
    """Every equation of primitive `name` in a jaxpr (open or closed) and in
    the jaxprs inside its equations, at any depth."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            yield eqn
        for sub in core.jaxprs_in_params(eqn.params):
            yield from equations(sub, name)


def count_equations(jaxpr, name: str) -> int:
    """How many equations of primitive `name` a jaxpr holds, at any depth."""
    return sum(1 for _ in equations(jaxpr, name))


def handler_call(
    platform,
    a,
    b,
    out_shape,
    out_dtype,
    *stack_indices,
    kernel="auto",
    precision=0,
    spare_sms=0,
    laid_terms=1,
    transpose_a=False,
    transpose_b=False,
):
    """The FFI handler called directly, bypassing the primitive, with every
    attribute it binds (CUDA's `spare_sms` and `laid_terms` too); a non-int
    `precision` is passed as it is, for the tests of bad attributes."""
    attributes = dict(
        transpose_a=np.bool_(transpose_a),
        transpose_b=np.bool_(transpose_b),
        precision=np.int32(precision) if isinstance(precision, int) else precision,
        kernel=kernel,
    )
    if platform == "cuda":
        attributes.update(spare_sms=np.int32(spare_sms), laid_terms=np.int32(laid_terms))
    call = jax.ffi.ffi_call(_ffi.TARGETS[platform], jax.ShapeDtypeStruct(out_shape, out_dtype))
    return call(a, b, *stack_indices, **attributes)


def assert_runs_as(platform, out, a, b, preset, out_dtype):
    """out is what the table says runs: the operands rounded to the run's type,
    their product accumulated and rounded to the product type, then to out_dtype,
    held elementwise to that computation's rounding bound."""
    run = _presets.resolve(platform, preset, a.dtype, out_dtype)
    cast = lambda x: np.asarray(x).astype(run.operand_dtype).astype(np.float64)
    a64, b64 = cast(a), cast(b)
    ref, mag = np.matmul(a64, b64), np.matmul(np.abs(a64), np.abs(b64))
    kernel = run.kernel_run()  # an emulation's: the product of parts, over K x terms
    k = a.shape[-1] * (len(run.split.terms) if run.split else 1)
    acc = accumulation_rounding(
        platform, kernel.operand_dtype, kernel.product_dtype, kernel.precision
    )
    inputs = (
        run.split.dropped
        if run.split
        else input_rounding(platform, run.operand_dtype, run.precision)
    )
    rounding = EPS[run.product_dtype] + EPS[np.dtype(out_dtype)]
    tol = ((k + 2) * acc + 2 * inputs) * mag + rounding * np.abs(ref) + 1e-30
    out = np.asarray(out, np.float64)
    assert np.all(np.isfinite(out))
    bad = np.abs(out - ref) > tol
    assert not bad.any(), (
        f"{preset.name} on {platform}, {a.dtype} -> {out_dtype}: {bad.sum()} "
        f"of {bad.size} off the run {run}"
    )
