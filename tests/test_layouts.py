"""Transposed operands are read as stored: `a @ b.T`, `a.T @ b` and their batched
forms run the kernel with its transpose flags instead of copying the operand
first, with the same values: on CPU always, on CUDA where the kernel that runs
them reads transposes as fast as plain layouts (`_lowering.reads_as_stored`)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tiled
from helpers import F32, HIGHEST, assert_matmul_close, random_array
from jax_tiled import _ffi

BF16 = jnp.bfloat16
_FLAGS = re.compile(r"transpose_a = (true|false), transpose_b = (true|false)")


def _on_cpu(*arrays):
    """The arrays committed to the CPU, so that jit lowers and runs there on any
    host (jax.default_device alone leaves lowering to the default backend,
    which on a GPU machine is the GPU)."""
    return jax.device_put(arrays, jax.devices("cpu")[0])


def _compiled_cpu(f, *args) -> str:
    hlo = jax.jit(f).lower(*_on_cpu(*args)).compile().as_text()
    assert _ffi.TARGETS["cpu"] in hlo, hlo  # compiled for the CPU, whatever the host
    return hlo


def _flags(hlo: str) -> list[tuple[bool, bool]]:
    return [(a == "true", b == "true") for a, b in _FLAGS.findall(hlo)]


def _mm(a, b):
    return jax_tiled.matmul(a, b, precision=HIGHEST)


# (name, stored shapes, the function, op(a) and op(b) from the stored arrays,
#  the flags the kernel should get)
CASES = [
    (
        "a @ b.T",
        ((33, 70), (45, 70)),
        lambda a, b: _mm(a, b.T),
        lambda a, b: (a, b.T),
        (False, True),
    ),
    (
        "a.T @ b",
        ((70, 33), (70, 45)),
        lambda a, b: _mm(a.T, b),
        lambda a, b: (a.T, b),
        (True, False),
    ),
    (
        "a.T @ b.T",
        ((70, 33), (45, 70)),
        lambda a, b: _mm(a.T, b.T),
        lambda a, b: (a.T, b.T),
        (True, True),
    ),
    (
        "batched x @ w.mT",
        ((3, 33, 70), (3, 45, 70)),
        lambda a, b: _mm(a, b.mT),
        lambda a, b: (a, np.swapaxes(b, -1, -2)),
        (False, True),
    ),
    (
        "4-d batch a.mT @ b",
        ((2, 3, 70, 33), (2, 3, 70, 45)),
        lambda a, b: _mm(a.mT, b),
        lambda a, b: (np.swapaxes(a, -1, -2), b),
        (True, False),
    ),
    (
        "batch broadcast x @ w.T",
        ((4, 33, 70), (45, 70)),
        lambda a, b: _mm(a, b.T),
        lambda a, b: (a, b.T),
        (False, True),
    ),
    (
        "vector @ w.T",
        ((70,), (45, 70)),
        lambda a, b: _mm(a, b.T),
        lambda a, b: (a[None], b.T),
        (False, True),
    ),
]


@pytest.mark.parametrize("name,shapes,f,ops,flags", CASES, ids=[c[0] for c in CASES])
def test_transposes_become_flags_not_copies(rng, name, shapes, f, ops, flags):
    a, b = (random_array(rng, s, np.float32) for s in shapes)
    hlo = _compiled_cpu(f, a, b)
    assert _flags(hlo) == [flags], hlo
    assert not re.search(r"\b(transpose|copy)\(", hlo), hlo
    out = np.asarray(jax.jit(f)(*_on_cpu(a, b)))
    a_op, b_op = ops(a, b)
    expected_shape = np.matmul(a_op, b_op).shape
    out = out.reshape(expected_shape) if name.startswith("vector") else out
    assert_matmul_close(out, a_op, b_op, platform="cpu", precision="highest")


def test_other_permutations_are_copied(rng):
    """Only a swap of the last two axes is a layout the kernel reads."""
    a = random_array(rng, (33, 3, 70), np.float32)  # stored (m, batch, k)
    b = random_array(rng, (3, 70, 45), np.float32)

    def f(a, b):
        return _mm(jnp.transpose(a, (1, 0, 2)), b)

    assert _flags(_compiled_cpu(f, a, b)) == [(False, False)]
    out = np.asarray(jax.jit(f)(*_on_cpu(a, b)))
    assert_matmul_close(out, np.transpose(a, (1, 0, 2)), b, platform="cpu", precision="highest")


def test_a_transpose_used_elsewhere_is_still_computed(rng):
    a = random_array(rng, (33, 70), np.float32)
    b = random_array(rng, (45, 70), np.float32)

    def f(a, b):
        bt = b.T
        return _mm(a, bt), bt * 2.0

    out, twice = jax.jit(f)(*_on_cpu(a, b))
    np.testing.assert_array_equal(np.asarray(twice), b.T * 2.0)
    assert_matmul_close(np.asarray(out), a, b.T, platform="cpu", precision="highest")


def test_gradients_and_vmap_through_a_folded_transpose(rng):
    x = random_array(rng, (5, 33, 70), np.float32)
    w = random_array(rng, (45, 70), np.float32)

    def loss(x, w):
        return jnp.sum(jnp.tanh(jax.vmap(lambda xi: _mm(xi, w.T))(x)))

    def loss_ref(x, w):
        return jnp.sum(jnp.tanh(jnp.matmul(x, w.T, precision=HIGHEST)))

    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*_on_cpu(x, w))
    want = jax.jit(jax.value_and_grad(loss_ref, argnums=(0, 1)))(*_on_cpu(x, w))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-5)


def test_symbolic_shapes_keep_the_copy_and_export(rng):
    """A dynamic shape is not folded (its reshape would need the shape at run time)."""
    b = random_array(rng, (45, 70), np.float32)
    spec = jax.export.symbolic_shape("n, 70")
    exported = jax.export.export(
        jax.jit(lambda a, b: _mm(a, b.T)),
        platforms=["cpu"],
        disabled_checks=jax_tiled.export_disabled_checks(),
    )(jax.ShapeDtypeStruct(spec, np.float32), jax.ShapeDtypeStruct(b.shape, np.float32))
    a = random_array(rng, (9, 70), np.float32)
    out = np.asarray(exported.call(*_on_cpu(a, b)))
    assert_matmul_close(out, a, b.T, platform="cpu", precision="highest")


# ---- CUDA: folded where the kernel reads transposes (mma, wgmma), else copied ----

# (name, dtype, precision, kernel, stored shapes, the function of the stored
#  arrays, op(a) and op(b), the flags on a Hopper GPU, the flags on another
#  GPU, where `mma` runs the tensor-core products).
A_BT, AT_B = ((1024, 512), (768, 512)), ((512, 1024), (512, 768))  # stored, 1024 x 512 x 768
SMALL_A_BT, SMALL_AT_B = ((128, 256), (192, 256)), ((256, 128), (256, 192))  # 128 x 256 x 192
ODD_AT_B = ((512, 1023), (512, 768))  # a's rows of 1023: 2046 bytes
HIGH_AT_B = ((512, 256), (512, 128))  # 256 x 512 x 128
ROW_BT, COL_AT_B = ((1, 515), (770, 515)), ((515, 1030), (515, 1))  # odd K and N
FOLDS_A, FOLDS_B, COPIED = (True, False), (False, True), (False, False)
CUDA_CASES = [
    ("bf16 a @ b.T", BF16, None, "auto", A_BT, "a @ b.T", FOLDS_B, FOLDS_B),
    ("bf16 a.T @ b", BF16, None, "auto", AT_B, "a.T @ b", FOLDS_A, FOLDS_A),
    ("tf32 a @ b.T", F32, None, "auto", A_BT, "a @ b.T", FOLDS_B, FOLDS_B),
    # As stored, float32's a.T @ b would have b copied instead on wgmma
    # (copies_b_k_major); mma reads it as stored.
    ("tf32 a.T @ b", F32, None, "auto", AT_B, "a.T @ b", COPIED, FOLDS_A),
    # Small products run on mma either way.
    ("bf16 small a @ b.T", BF16, None, "auto", SMALL_A_BT, "a @ b.T", FOLDS_B, FOLDS_B),
    ("tf32 small a.T @ b", F32, None, "auto", SMALL_AT_B, "a.T @ b", FOLDS_A, FOLDS_A),
    # As stored, rows of 1023 bfloat16 are not the copy engine's: auto would
    # run mma, and wgmma on the copy.
    ("bf16 a.T @ b, odd rows", BF16, None, "auto", ODD_AT_B, "a.T @ b", COPIED, FOLDS_A),
    # The SIMT kernels were not measured reading transposes as fast.
    ("fp32 highest a @ b.T", F32, "highest", "auto", A_BT, "a @ b.T", COPIED, COPIED),
    # ... but for one row, or one column, warptile's row blocks read the
    # matrix once in either layout, where the copy reads and writes it first.
    ("fp32 highest one row a @ b.T", F32, "highest", "auto", ROW_BT, "a @ b.T", FOLDS_B, FOLDS_B),
    ("fp32 highest one col a.T @ b", F32, "highest", "auto", COL_AT_B, "a.T @ b", FOLDS_A, FOLDS_A),
    # Forced wgmma refuses 3xTF32's a.T @ b as stored: it gets the copy.
    ("3xtf32 a.T @ b on wgmma", F32, "high", "wgmma", HIGH_AT_B, "a.T @ b", COPIED, COPIED),
]
_OPS = {"a @ b.T": lambda a, b: (a, b.T), "a.T @ b": lambda a, b: (a.T, b)}


def _cuda_case(precision, kernel, form):
    """The case's function of the stored arrays."""

    def f(a, b):
        return jax_tiled.matmul(*_OPS[form](a, b), precision=precision, kernel=kernel)

    return f


def _expected_flags(hopper_flags, other_flags):
    """The flags the case gets on this machine's GPU (planned as a Hopper one
    where there is none)."""
    return hopper_flags if _ffi.cuda_compute_capability() == _ffi.HOPPER else other_flags


@pytest.mark.skipif(not _ffi.cuda_module_built(), reason="this build has no CUDA module")
@pytest.mark.parametrize(
    "name,dtype,precision,kernel,shapes,form,hopper_flags,other_flags",
    CUDA_CASES,
    ids=[c[0] for c in CUDA_CASES],
)
def test_the_cuda_lowering_decides_on_any_host(
    name, dtype, precision, kernel, shapes, form, hopper_flags, other_flags
):
    """The same decisions, lowered for CUDA without running: the planners need
    no GPU (without one they plan for an H100)."""
    f = _cuda_case(precision, kernel, form)
    specs = [jax.ShapeDtypeStruct(shape, dtype) for shape in shapes]
    lowered = jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert _flags(lowered) == [_expected_flags(hopper_flags, other_flags)], lowered


# Products with nothing to compute, as stored (m, k) and (n, k) for a @ b.T,
# K long enough for auto to plan wgmma: the lowering asks the planners whether
# to fold the transpose, and they were asked about products the handler runs
# no kernel for, dividing by their count of tiles (the process died of
# SIGFPE). Now no kernel is planned: an empty output, or a zero fill for K 0.
EMPTY_PRODUCTS = [
    ((0, 2048), (520, 2048)),
    ((777, 2048), (0, 2048)),
    ((777, 0), (520, 0)),
]


@pytest.mark.skipif(not _ffi.cuda_module_built(), reason="this build has no CUDA module")
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("shapes", EMPTY_PRODUCTS, ids=str)
def test_products_with_nothing_to_compute_lower_for_cuda(shapes, dtype):
    a_spec, b_spec = (jax.ShapeDtypeStruct(shape, dtype) for shape in shapes)
    for form in ("a @ b.T", "a.T @ b"):
        specs = (a_spec, b_spec)
        if form == "a.T @ b":  # stored (k, m) and (k, n)
            specs = tuple(jax.ShapeDtypeStruct(s.shape[::-1], dtype) for s in specs)
        lowered = jax.jit(_cuda_case(None, "auto", form)).trace(*specs)
        assert "custom_call @tiled_matmul" in lowered.lower(lowering_platforms=("cuda",)).as_text()
    explained = jax_tiled.explain(
        a_spec, jax.ShapeDtypeStruct(b_spec.shape[::-1], dtype), backend="gpu"
    )
    k = a_spec.shape[-1]
    assert explained.kernel == "none" and explained.plan == "", explained
    assert ("zeros" if k == 0 and 0 not in explained.problem[2:4] else "empty") in (
        explained.reason
    ), explained


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name,dtype,precision,kernel,shapes,form,hopper_flags,other_flags",
    CUDA_CASES,
    ids=[c[0] for c in CUDA_CASES],
)
def test_cuda_reads_transposes_where_the_kernel_does(
    on_gpu, rng, name, dtype, precision, kernel, shapes, form, hopper_flags, other_flags
):
    a, b = (jnp.asarray(random_array(rng, s, np.float32), dtype) for s in shapes)
    f = _cuda_case(precision, kernel, form)
    hlo = jax.jit(f).lower(a, b).compile().as_text()
    expected = _expected_flags(hopper_flags, other_flags)
    assert _flags(hlo) == [expected], hlo
    if expected != COPIED:  # folded: no transpose left
        assert not re.search(r"\btranspose\(", hlo), hlo
    a_op, b_op = _OPS[form](np.asarray(a), np.asarray(b))
    out = np.asarray(jax.jit(f)(a, b))
    assert_matmul_close(out, a_op, b_op, platform="cuda", precision=precision)


# ---- CUDA: rows that are not whole 16-byte lines, padded to whole lines ----

# (name, dtype, precision, kernel, (m, k, n), padded (m, k, n) or None): a
# stored (m, k), b (k, n). Padded where auto would run mma only because the
# rows are not 16-byte lines, and wgmma once they are; at HIGHEST, where it
# would run warptile's kernel for every product, and its float32 mainloop
# once they are, if the product does enough work a byte the padding writes.
PADDING_CASES = [
    ("bf16 odd k and n", BF16, None, "auto", (777, 1999, 513), (777, 2000, 520)),
    ("tf32 odd n", F32, None, "auto", (3000, 1000, 2999), (3000, 1000, 3000)),
    ("3xtf32 odd k", F32, "high", "auto", (1024, 1023, 1024), (1024, 1024, 1024)),
    ("bf16 aligned", BF16, None, "auto", (1024, 1024, 1024), None),
    # Small: mma either way (a small product, K short).
    ("bf16 small odd", BF16, None, "auto", (197, 263, 131), None),
    ("fp32 highest odd n", F32, "highest", "auto", (3000, 1000, 2999), (3000, 1000, 3000)),
    ("fp32 highest odd k and n", F32, "highest", "auto", (1001, 4097, 1003), (1001, 4100, 1004)),
    # Too little work a byte the padding writes for the SIMT kernels.
    ("fp32 highest odd, small", F32, "highest", "auto", (777, 1999, 513), None),
    ("fp32 highest odd, few rows", F32, "highest", "auto", (16, 8193, 8191), None),
    # One column: warptile's row blocks read the matrix once as given (a
    # column padded to whole lines would send it to wgmma's tiles).
    ("bf16 one column", BF16, None, "auto", (8192, 8192, 1), None),
    ("fp32 highest one column", F32, "highest", "auto", (8192, 8192, 1), None),
    # A forced kernel runs the product as given.
    ("bf16 odd on mma", BF16, None, "mma", (777, 1999, 513), None),
    ("fp32 highest odd on warptile", F32, "highest", "warptile", (3000, 1000, 2999), None),
]


def _padding_case(precision, kernel):
    def f(a, b):
        return jax_tiled.matmul(a, b, precision=precision, kernel=kernel)

    return f


def _call_operand_shapes(lowered: str) -> list[list[tuple[int, ...]]]:
    """The operand shapes of each tiled_matmul custom call in `lowered`."""
    calls = [line for line in lowered.splitlines() if "custom_call @tiled_matmul" in line]
    operand_types = [re.search(r":\s*\((.*)\)\s*->", line).group(1) for line in calls]
    return [
        [tuple(int(d) for d in t.split("x")[:-1]) for t in re.findall(r"tensor<([^>]+)>", types)]
        for types in operand_types
    ]


@pytest.mark.skipif(not _ffi.cuda_module_built(), reason="this build has no CUDA module")
@pytest.mark.parametrize(
    "name,dtype,precision,kernel,shape,padded", PADDING_CASES, ids=[c[0] for c in PADDING_CASES]
)
def test_rows_are_padded_to_whole_lines_where_auto_then_loads_them(
    name, dtype, precision, kernel, shape, padded
):
    """Lowered for CUDA without running (the planners need no GPU): the
    custom call reads the padded operands and the result is sliced back, or
    nothing is padded. explain() says so, and which kernel and plan run:
    wgmma, or warptile's float32 mainloop at HIGHEST."""
    m, k, n = shape
    specs = [jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype)]
    f = _padding_case(precision, kernel)
    lowered = jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    explained = jax_tiled.explain(*specs, precision=precision, kernel=kernel, backend="gpu")
    hopper = _ffi.cuda_compute_capability() == _ffi.HOPPER
    if padded is None or not hopper:
        assert "stablehlo.pad" not in lowered, lowered
        assert _call_operand_shapes(lowered) == [[(1, m, k), (1, k, n)]], lowered
        assert "padded" not in explained.reason, explained
        return
    pm, pk, pn = padded
    assert _call_operand_shapes(lowered) == [[(1, pm, pk), (1, pk, pn)]], lowered
    if (pm, pn) != (m, n):  # a padded K changes no shape of the result
        assert "stablehlo.slice" in lowered and f"-> tensor<1x{m}x{n}x" in lowered, lowered
    assert explained.kernel == ("warptile" if precision == "highest" else "wgmma"), explained
    runs = _ffi.cuda_plan(
        explained.kernel, dtype, dtype, (1, 1, pm, pn, pk, False, False), precision or "default"
    )
    assert runs.reads_whole_lines, runs
    assert f"{m}x{k}x{n} as {pm}x{pk}x{pn}" in explained.reason, explained


@pytest.mark.skipif(not _ffi.cuda_module_built(), reason="this build has no CUDA module")
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_the_gradients_products_are_padded_too(dtype):
    """The VJP's two products (dC @ B^T and A^T @ dC, their operands read as
    stored) of an odd-sized product: every call's stored rows are whole
    16-byte lines, so none falls back to mma; lowered for CUDA on any host."""
    if _ffi.cuda_compute_capability() != _ffi.HOPPER:
        pytest.skip("the padding is for the Hopper kernel's copy engine")
    m, k, n = 777, 1999, 513
    specs = [jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype)]

    def loss(a, b):
        return jnp.sum(jax_tiled.matmul(a, b).astype(jnp.float32) ** 2)

    lowered = (
        jax.jit(jax.grad(loss, argnums=(0, 1)))
        .trace(*specs)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    calls = _call_operand_shapes(lowered)
    assert len(calls) == 3, lowered
    line = 16 // np.dtype(dtype).itemsize
    for operands in calls:
        assert all(shape[-1] % line == 0 for shape in operands), calls


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name,dtype,precision,kernel,shape,padded",
    [c for c in PADDING_CASES if c[-1] is not None],
    ids=[c[0] for c in PADDING_CASES if c[-1] is not None],
)
def test_padded_products_are_the_products(
    on_gpu, rng, name, dtype, precision, kernel, shape, padded
):
    """On the GPU: the padded product against float64, the last real row and
    column carrying inf and NaN (padding must neither drop them nor make new
    ones), under jit, grad and vmap."""
    m, k, n = shape
    a = random_array(rng, (m, k), np.float32)
    b = random_array(rng, (k, n), np.float32)
    a[m - 1, k - 1], b[k - 1, n - 1] = np.inf, np.nan
    a, b = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
    f = jax.jit(_padding_case(precision, kernel))
    out = np.asarray(f(a, b), np.float64)
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
    finite = slice(0, m - 1), slice(0, n - 1)
    assert_matmul_close(
        np.asarray(f(a[: m - 1], b[:, : n - 1])),
        a[: m - 1],
        b[:, : n - 1],
        platform="cuda",
        precision=precision,
    )
    assert np.isfinite(out[finite]).all()
    # Gradients (the transposed products, padded where they need it) and a
    # batch of two (vmap) against jnp's on finite inputs.
    # Zeros where the specials were (nan_to_num would put float32's largest
    # there, whose products overflow to inf again).
    a_fin, b_fin = (jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x)) for x in (a, b))

    def loss(fn):
        return lambda x, y: jnp.sum(fn(x, y).astype(jnp.float32) ** 2) / (m * n)

    ours = jax.grad(loss(_padding_case(precision, kernel)), argnums=(0, 1))(a_fin, b_fin)
    theirs = jax.grad(loss(lambda x, y: jnp.matmul(x, y, precision=precision)), argnums=(0, 1))(
        a_fin, b_fin
    )
    for mine, peer in zip(ours, theirs):
        assert np.isfinite(np.asarray(mine, np.float32)).all()
        np.testing.assert_allclose(
            np.asarray(mine, np.float64), np.asarray(peer, np.float64), rtol=0.05, atol=1e-3
        )
    stacked = jax.vmap(_padding_case(precision, kernel))(
        jnp.stack([a_fin, a_fin]), jnp.stack([b_fin, b_fin])
    )
    assert_matmul_close(np.asarray(stacked[1]), a_fin, b_fin, platform="cuda", precision=precision)
