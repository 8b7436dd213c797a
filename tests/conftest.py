"""Shared fixtures: the platforms under test, GPU gating, references and tolerances.

Every test that takes the `platform` fixture runs once per platform: on "cpu"
always, and on "cuda" as a test marked `gpu`. Without a GPU those skip, unless
JAX_TILED_REQUIRE_GPU=1, which turns the skip into a failure so that a GPU run
cannot pass by skipping.
"""

from __future__ import annotations

import contextlib
import os
import zlib

# Four CPU devices for tests/test_sharding.py; XLA reads this when jax starts.
os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=4"]))

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from jax_tiled import _ffi
from jax_tiled._matmul import _canonicalize, canonical_precision

REQUIRE_GPU = os.environ.get("JAX_TILED_REQUIRE_GPU") == "1"


def gpu_available() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


@pytest.fixture(autouse=True)
def _gpu_gate(request):
    if request.node.get_closest_marker("gpu") and not gpu_available():
        if REQUIRE_GPU:
            pytest.fail("JAX_TILED_REQUIRE_GPU=1 but jax sees no CUDA device")
        pytest.skip("needs a CUDA GPU")


PLATFORMS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=PLATFORMS)
def platform(request):
    """Runs the test with jax's default device on this platform."""
    with jax.default_device(jax.devices(request.param)[0]):
        yield request.param


def kernels_on(platform: str, dtype=np.float32, out_dtype=None, problem=None,
               precision=None) -> list[str]:
    """"auto" and every rung that computes dtype -> out_dtype (default: the same)
    on the platform at `precision` (as matmul takes it; None: the default, which
    honours jax.default_matmul_precision): on CUDA the tensor-core rungs take
    float32 at DEFAULT and HIGH but not HIGHEST. Forcing a rung on other dtypes
    is tested in test_errors. With `problem` = (batch_a, batch_b, m, n, k,
    transpose_a, transpose_b), only the rungs that run that layout: the Hopper
    rung needs rows its copy engine can read, and test_tensor_cores covers it
    on such shapes."""
    names = jax_tiled.kernels("gpu" if platform == "cuda" else platform, dtype, out_dtype,
                              precision)
    assert names, f"no kernels usable on {platform}"
    if problem is not None:
        out_dtype = dtype if out_dtype is None else out_dtype
        precision = canonical_precision(precision)
        names = [name for name in names
                 if not _ffi.refusal(platform, name, dtype, out_dtype, problem, precision)]
    return ["auto", *names]


def matmul_problem(a, b) -> tuple:
    """The canonical problem (batch_a, batch_b, m, n, k, False, False) that
    jax_tiled.matmul(a, b) binds, for kernels_on's `problem`."""
    a3, b3 = jax.eval_shape(lambda a, b: _canonicalize(a, b, None, None, "auto")[:2], a, b)
    return (a3.shape[0], b3.shape[0], a3.shape[1], b3.shape[2], a3.shape[2], False, False)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name so failures reproduce."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


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


EPS = {np.dtype(jnp.float16): 2.0**-11, np.dtype(jnp.bfloat16): 2.0**-8,
       np.dtype(np.float32): 2.0**-24, np.dtype(np.float64): 2.0**-53}


def tensor_core_float32(platform, dtype, precision) -> bool:
    """Whether a float32 product at `precision` may run on tensor cores: on
    CUDA at DEFAULT (TF32) and HIGH (3xTF32)."""
    return (platform == "cuda" and np.dtype(dtype) == np.float32
            and canonical_precision(precision) != lax.Precision.HIGHEST)


def input_rounding(platform, dtype, precision) -> float:
    """Relative rounding of each operand before the products, by precision
    (None, a lax.Precision or any name matmul takes; None honours
    jax.default_matmul_precision)."""
    if tensor_core_float32(platform, dtype, precision):
        if canonical_precision(precision) == lax.Precision.DEFAULT:
            return 2.0**-11  # TF32 keeps 10 mantissa bits, rounded to nearest
        return 2.0**-21  # 3xTF32: the dropped lo*lo term and the rounding of lo
    return 0.0


def accumulation_rounding(platform, in_dtype, out_dtype, precision=None) -> float:
    """Relative rounding of each addition into the accumulator."""
    if np.float64 in (np.dtype(in_dtype), np.dtype(out_dtype)):
        return EPS[np.dtype(np.float64)]
    if platform == "cuda" and (np.dtype(in_dtype).itemsize == 2
                               or tensor_core_float32(platform, in_dtype, precision)):
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
    assert not bad.any(), (
        f"{bad.sum()} of {bad.size} elements off; worst at {np.unravel_index(np.argmax(err - tol), err.shape)}: "
        f"err {err.max():.3g}, tol there {tol.flat[np.argmax(err - tol)]:.3g}")
