"""Bad input fails early and says what is wrong: trace-time TypeError/ValueError
from the API and the primitive, an ffi::Error (not an abort) from the handlers."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from helpers import gpu_available, handler_call

A = jnp.ones((3, 4), jnp.float32)
B = jnp.ones((4, 5), jnp.float32)


def test_contracting_mismatch_names_both_sizes():
    with pytest.raises((TypeError, ValueError), match=r"a\(3, 4\) has 4.*b\(5, 6\) has 5"):
        jax.jit(jax_tiled.matmul)(A, jnp.ones((5, 6)))


def test_contracting_mismatch_vector():
    with pytest.raises((TypeError, ValueError), match=r"has 4.*has 3"):
        jax_tiled.matmul(A, jnp.ones((3,)))


def test_rank0_operands():
    with pytest.raises(ValueError, match=r"at least 1 dimension.*\(\)"):
        jax_tiled.matmul(jnp.float32(2.0), B)
    with pytest.raises(ValueError, match="at least 1 dimension"):
        jax_tiled.matmul(A, 3.0)


@pytest.mark.parametrize("bad", [jnp.complex64, jnp.float8_e4m3fn], ids=lambda d: np.dtype(d).name)
def test_uncomputed_dtypes(bad):
    x = jnp.ones((3, 4), bad)
    with pytest.raises(TypeError, match=np.dtype(bad).name):
        jax_tiled.matmul(x, B)
    with pytest.raises(TypeError, match=np.dtype(bad).name):
        jax_tiled.matmul(A, jnp.ones((4, 5), bad))


@pytest.mark.parametrize(
    "dtype", [jnp.int32, jnp.int8, jnp.bool_, jnp.uint8], ids=lambda d: np.dtype(d).name
)
def test_integer_only_products_are_refused(dtype):
    """Integer operands mixed with floats promote (tests/test_promotion.py);
    integers alone are refused, naming both dtypes."""
    x, y = jnp.ones((3, 4), dtype), jnp.ones((4, 5), jnp.int16)
    with pytest.raises(TypeError, match=rf"integer-only.*{np.dtype(dtype).name}.*int16"):
        jax_tiled.matmul(x, y)
    with pytest.raises(TypeError, match="integer-only"):
        jax_tiled.matmul(x, jnp.ones((4, 5), dtype))


def test_bad_preferred_element_type():
    with pytest.raises(TypeError, match="int32"):
        jax_tiled.matmul(A, B, preferred_element_type=jnp.int32)


def test_batch_dims_that_do_not_broadcast():
    with pytest.raises(ValueError, match=r"\(2, 3, 4\).*\(5, 4, 6\)"):
        jax_tiled.matmul(jnp.ones((2, 3, 4)), jnp.ones((5, 4, 6)))


def test_unknown_kernel_lists_valid_ones():
    with pytest.raises(ValueError, match=r"'nope'.*'auto'.*'blocked'"):
        jax_tiled.matmul(A, B, kernel="nope")


DOT = (((1,), (0,)), ((), ()))
CALLS = {
    "jax_tiled.matmul": lambda a, b, **kw: jax_tiled.matmul(a, b, **kw),
    "jax_tiled.dot_general": lambda a, b, **kw: jax_tiled.dot_general(a, b, DOT, **kw),
    "jax_tiled.explain": lambda a, b, **kw: jax_tiled.explain(a, b, **kw),
}


@pytest.mark.parametrize("api", CALLS)
def test_messages_name_the_function_called(api):
    call = CALLS[api]
    with pytest.raises(ValueError, match=rf"^{re.escape(api)}: unknown kernel 'nope'"):
        call(A, B, kernel="nope")
    with pytest.raises(ValueError, match=rf"^{re.escape(api)}: unsupported precision 'fast'"):
        call(A, B, precision="fast")
    with pytest.raises(ValueError, match=rf"^{re.escape(api)}: a precision pair needs 2"):
        call(A, B, precision=("high", "high", "high"))


def test_kernels_names_itself_for_a_bad_precision():
    with pytest.raises(ValueError, match=r"^jax_tiled\.kernels: unsupported precision 'fast'"):
        jax_tiled.kernels("cpu", jnp.float32, precision="fast")


def test_a_cuda_kernel_on_an_install_without_the_cuda_module(monkeypatch):
    """On an install without the CUDA module a CUDA kernel's name is "not
    built", not "unknown" (the CPU module knows the ladder's names)."""
    names = jax_tiled._ffi.cuda_ladder_names()
    assert "wgmma" in names and "mma" in names
    built = {"cpu": jax_tiled._ffi.kernel_names("cpu"), "cuda": ()}
    monkeypatch.setattr(jax_tiled._ffi, "kernel_names", built.__getitem__)
    for api, call in CALLS.items():
        for kernel in names:
            with pytest.raises(
                ValueError,
                match=rf"^{re.escape(api)}: kernel '{kernel}' is a CUDA kernel, not built in "
                r"this install \(no CUDA module.*valid on cpu: \['auto', 'blocked'\]",
            ):
                call(A, B, kernel=kernel)
        with pytest.raises(ValueError, match=rf"^{re.escape(api)}: unknown kernel 'nope'"):
            call(A, B, kernel="nope")


@pytest.mark.parametrize(
    "bad", [None, "a string", object(), [1.0, None]], ids=["None", "str", "object", "list"]
)
def test_operands_that_are_not_arrays(bad):
    kind = type(np.asarray(bad) if isinstance(bad, list) else bad).__name__
    for api in ("jax_tiled.matmul", "jax_tiled.dot_general"):
        call = CALLS[api]
        first, second = ("a", "b") if api == "jax_tiled.matmul" else ("lhs", "rhs")
        with pytest.raises(
            TypeError, match=rf"^{re.escape(api)}: {second} must be an array.*{kind}"
        ):
            call(A, bad)
        with pytest.raises(
            TypeError, match=rf"^{re.escape(api)}: {first} must be an array.*{kind}"
        ):
            call(bad, B)


@pytest.mark.skipif(gpu_available(), reason="needs a machine without the CUDA kernels")
def test_kernel_unavailable_on_platform():
    cuda_only = [
        k for k in jax_tiled._ffi.kernel_names("cuda") if k not in jax_tiled.kernels("cpu")
    ]
    if not cuda_only:
        pytest.skip("this build has no CUDA module")
    with pytest.raises(ValueError, match="not available on cpu"):
        jax.jit(lambda a, b: jax_tiled.matmul(a, b, kernel=cuda_only[0]))(A, B)


@pytest.mark.parametrize("bad", ["fast", "HIGHEST", 3, ("default",)], ids=str)
def test_bad_precision(bad):
    with pytest.raises(ValueError, match="precision"):
        jax_tiled.matmul(A, B, precision=bad)


@pytest.mark.parametrize("bad", ["fast", "HIGHEST", 3, ("default",)], ids=str)
def test_kernels_rejects_a_bad_precision(bad):
    with pytest.raises(ValueError, match="precision"):
        jax_tiled.kernels("cpu", jnp.float32, precision=bad)


def test_primitive_checks_its_operands():
    bind = lambda a, b, **kw: jax_tiled.tiled_matmul_p.bind(
        a,
        b,
        **{
            "transpose_a": False,
            "transpose_b": False,
            "out_dtype": np.dtype(np.float32),
            "precision": lax.Precision.DEFAULT,
            "kernel": "auto",
            **kw,
        },
    )
    with pytest.raises(TypeError, match="rank 3"):
        bind(A, B)
    with pytest.raises(TypeError, match="K=4.*K=5"):
        bind(A[None], jnp.ones((1, 5, 5)))
    with pytest.raises(TypeError, match="batches 2 and 3"):
        bind(jnp.ones((2, 3, 4)), jnp.ones((3, 4, 5)))
    with pytest.raises(TypeError, match="differ: float32 and bfloat16"):
        bind(A[None], B[None].astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="int32"):
        bind(A[None], B[None], out_dtype=np.dtype(np.int32))


@pytest.mark.gpu
def test_forced_kernel_refuses_dtypes_it_cannot_compute():
    a = jnp.ones((8, 8), jnp.bfloat16)
    with jax.default_device(jax.devices("cuda")[0]):
        with pytest.raises(TypeError, match="'pipelined'.*got bfloat16 -> bfloat16"):
            jax_tiled.matmul(a, a, kernel="pipelined")
        # The handler refuses too, for callers that bypass the primitive.
        with pytest.raises(Exception, match="'pipelined'.*got bfloat16 -> bfloat16"):
            jax.block_until_ready(
                handler_call(
                    "cuda",
                    a[None],
                    a[None],
                    (1, 8, 8),
                    jnp.bfloat16,
                    kernel="pipelined",
                    precision=2,
                )
            )


@pytest.mark.gpu
def test_cuda_handler_refuses_negative_spare_sms():
    a = jnp.ones((1, 8, 8), jnp.float32)
    with jax.default_device(jax.devices("cuda")[0]):
        with pytest.raises(Exception, match="spare_sms must be at least 0, got -1"):
            jax.block_until_ready(handler_call("cuda", a, a, (1, 8, 8), jnp.float32, spare_sms=-1))


@pytest.mark.gpu
def test_cuda_handler_refuses_laid_terms_below_one():
    a = jnp.ones((1, 8, 8), jnp.float32)
    with jax.default_device(jax.devices("cuda")[0]):
        with pytest.raises(Exception, match="laid_terms must be at least 1, got 0"):
            jax.block_until_ready(handler_call("cuda", a, a, (1, 8, 8), jnp.float32, laid_terms=0))


def _call_handler(
    a, b, out_shape, out_dtype=jnp.float32, kernel="auto", precision=0, stack_indices=()
):
    return handler_call(
        "cpu", a, b, out_shape, out_dtype, *stack_indices, kernel=kernel, precision=precision
    )


def _b_as_stack(b_shape, *stack_indices):
    """a (1, 3, 4) times b of `b_shape` (a stack where it has rank 4), with
    these index arguments."""
    return dict(
        a=jnp.ones((1, 3, 4)),
        b=jnp.ones(b_shape),
        out_shape=(1, 3, 6),
        stack_indices=stack_indices,
    )


@pytest.mark.parametrize(
    "case,pattern",
    [
        (
            dict(a=jnp.ones((1, 3, 4)), b=jnp.ones((1, 5, 6)), out_shape=(1, 3, 6)),
            "contracting dimensions differ",
        ),
        (dict(a=jnp.ones((1, 3, 4)), b=jnp.ones((1, 4, 6)), out_shape=(1, 3, 7)), "does not match"),
        (dict(a=jnp.ones((2, 3, 4)), b=jnp.ones((3, 4, 6)), out_shape=(2, 3, 6)), "must each be 1"),
        (dict(a=jnp.ones((3, 4)), b=jnp.ones((4, 6)), out_shape=(3, 6)), "rank 3"),
        # An operand of rank 4 is a stack of slices, chosen by an int32 scalar each.
        (_b_as_stack((2, 1, 4, 6)), r"the stack b\(2, 1, 4, 6\) has no index argument"),
        (
            _b_as_stack((2, 1, 4, 6), jnp.float32(0)),
            r"the index of the stack b\(2, 1, 4, 6\) must be an int32 scalar",
        ),
        (
            _b_as_stack((2, 1, 4, 6), jnp.zeros((1,), jnp.int32)),
            "must be an int32 scalar, got shape \\(1,\\)",
        ),
        (_b_as_stack((1, 4, 6), jnp.int32(0)), "1 index arguments for 0 stacked operands"),
        (_b_as_stack((0, 1, 4, 6), jnp.int32(0)), r"the stack b\(0, 1, 4, 6\) is empty"),
        (
            dict(a=jnp.ones((1, 1, 1, 3, 4)), b=jnp.ones((1, 4, 6)), out_shape=(1, 3, 6)),
            r"a must have rank 3, or 4 as a stack of slices, got a\(1, 1, 1, 3, 4\)",
        ),
        (
            dict(a=jnp.ones((1, 3, 4)), b=jnp.ones((1, 4, 6)), out_shape=(1, 3, 6), kernel="smem"),
            "unknown CPU kernel 'smem'",
        ),
        (
            dict(a=jnp.ones((1, 3, 4)), b=jnp.ones((1, 4, 6)), out_shape=(1, 3, 6), precision=7),
            "precision attribute must be 0, 1 or 2, got 7",
        ),
        # The FFI decodes the attribute into the handler's enum: an int32 and nothing else.
        (
            dict(
                a=jnp.ones((1, 3, 4)),
                b=jnp.ones((1, 4, 6)),
                out_shape=(1, 3, 6),
                precision=np.int64(1),
            ),
            "precision|scalar data type",
        ),
        (
            dict(
                a=jnp.ones((1, 3, 4), jnp.int32),
                b=jnp.ones((1, 4, 6), jnp.int32),
                out_shape=(1, 3, 6),
            ),
            "dtypes must be",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_handler_returns_ffi_errors(case, pattern):
    """Past the Python checks, the C++ handler still validates and reports, never aborts."""
    with jax.default_device(jax.devices("cpu")[0]):
        with pytest.raises(Exception, match=pattern):
            jax.block_until_ready(_call_handler(**case))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "x_shape, out_shape, terms, match",
    [
        ((1, 8, 64), (1, 8, 192), [0, 1, 5], "unknown part code 5"),
        (
            (1, 8, 64),
            (1, 8, 128),
            [2, 1, 0],
            r"\(1, 8, 64\) with 3 terms .* cannot be \(1, 8, 128\)",
        ),
        ((8, 64), (8, 192), [2, 1, 0], r"takes \(batch, rows, cols\) operands"),
    ],
    ids=["part code", "result shape", "rank"],
)
def test_cuda_split_refuses_what_it_cannot_lay(x_shape, out_shape, terms, match):
    """The CUDA split's handler answers bad attributes and shapes with an
    error naming them (an ffi::Error), never a launch."""
    x = jnp.ones(x_shape, jnp.float32)
    call = jax.ffi.ffi_call("tiled_split_parts_cuda", jax.ShapeDtypeStruct(out_shape, jnp.bfloat16))
    with jax.default_device(jax.devices("cuda")[0]):
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(
                call(x, k_minor=True, terms=np.array(terms, np.int32), chunk=np.int32(64))
            )
