"""The emulation presets' arithmetic (`jax_tiled._presets.Split`): float32
operands split into bfloat16 or TF32 parts, the products their names count
run as one product of the parts laid along K.

CUDA's table takes them (`PRESETS["cuda"]`); the CPU computes those presets
exactly, so the tests taking `emulated` run CUDA's arithmetic on the CPU too
by giving the CPU table CUDA's modes for the test (the same lowering, on the
CPU kernel's bfloat16 and float32 paths), and on CUDA as `gpu` tests."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from helpers import (
    F32,
    assert_runs_as,
    assert_same_bits_run_to_run,
    needs_cuda_module,
    random_array,
)
from jax_tiled import _ffi, _lowering, _presets

Preset = lax.DotAlgorithmPreset
EMULATIONS = [p for p, mode in _presets.PRESETS["cuda"].items() if mode.split is not None]


# (platform, preset): on the CPU every split, the CPU table given it for the
# test; on CUDA the presets its table runs so.
CASES = [pytest.param(("cpu", Preset[name]), id=f"cpu-{name}") for name in _presets.SPLITS] + [
    pytest.param(("cuda", preset), marks=pytest.mark.gpu, id=f"cuda-{preset.name}")
    for preset in EMULATIONS
]


@pytest.fixture(params=CASES)
def emulated_on(request, monkeypatch):
    """(platform, preset): an emulation preset with its own arithmetic on
    `platform`, jax's default device there."""
    platform, preset = request.param
    if platform == "cpu":
        split = _presets.SPLITS[preset.name]
        mode = _presets.Mode(lax.Precision.DEFAULT, split=split)
        monkeypatch.setitem(_presets.PRESETS["cpu"], preset, mode)
    with jax.default_device(jax.devices(platform)[0]):
        yield platform, preset


def split_of(preset) -> _presets.Split:
    return _presets.SPLITS[preset.name]


def test_bf16_x3_is_split_and_the_others_run_as_high():
    """BF16_BF16_F32_X3 as its parts; X6 and TF32_TF32_F32_X3 as HIGH, faster
    on an H100 than their parts laid along K (and more accurate), X9 too,
    faster than nine bfloat16 products."""
    assert [p.name for p in EMULATIONS] == ["BF16_BF16_F32_X3"]
    for name in ("BF16_BF16_F32_X6", "BF16_BF16_F32_X9", "TF32_TF32_F32_X3"):
        assert _presets.PRESETS["cuda"][Preset[name]].float32 == lax.Precision.HIGH


def laid_positions(split: _presets.Split, k: int) -> np.ndarray:
    """(terms, k): where entry k of each term lies along the laid K, as the
    kernels read it: chunk by chunk (`split.chunk` of K, the last shorter),
    each chunk holding every term's entries in turn."""
    positions = np.zeros((len(split.terms), k), int)
    for begin in range(0, k, split.chunk):
        length = min(split.chunk, k - begin)
        for t in range(len(split.terms)):
            first = begin * len(split.terms) + t * length
            positions[t, begin : begin + length] = np.arange(first, first + length)
    return positions


def test_the_terms_are_laid_small_first_in_chunks_of_a_slab():
    """hi x hi last in each chunk, so that the kernel adds no small product
    into a partial sum of large ones; a chunk is one 128-byte row of the
    parts' storage (the Hopper kernel's slab: 64 bfloat16, 32 TF32)."""
    for split in _presets.SPLITS.values():
        assert split.terms[-1] == (0, 0)
        assert split.chunk * split.dtype.itemsize == 128
        assert split.precision == lax.Precision.DEFAULT
    for preset in EMULATIONS:
        laid = _presets.resolve("cuda", preset, F32, F32).kernel_run().laid_terms
        assert laid == len(split_of(preset).terms)


@pytest.mark.parametrize("name", _presets.SPLITS)
@pytest.mark.parametrize("distribution", ["normal", "positive", "wide"])
def test_the_laid_parts_multiply_to_the_kept_terms(rng, name, distribution):
    """In float64, the laid-out parts' product is the product of the operands
    within `dropped`, and not exactly it (terms are left out). Operand parts
    are `split.dtype` values, laid chunk by chunk (K = 150: whole chunks and a
    shorter last one). Every split, also those the CUDA table runs as HIGH."""
    split = _presets.SPLITS[name]
    m, k, n = 7, 150, 5
    draw = {
        "normal": lambda s: rng.standard_normal(s),
        "positive": lambda s: rng.uniform(0.5, 1.5, s),
        "wide": lambda s: rng.standard_normal(s) * 2.0 ** rng.integers(-60, 60, s),
    }[distribution]
    a, b = draw((m, k)).astype(np.float32), draw((k, n)).astype(np.float32)
    laid_a = _presets.split_operand(jnp.asarray(a), split, 0, -1)
    laid_b = _presets.split_operand(jnp.asarray(b), split, 1, -2)
    assert laid_a.shape == (m, k * len(split.terms)) and laid_a.dtype == split.dtype
    assert laid_b.shape == (k * len(split.terms), n) and laid_b.dtype == split.dtype
    parts = np.asarray(laid_a, np.float64) @ np.asarray(laid_b, np.float64)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    mag = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    assert np.all(np.abs(parts - exact) <= split.dropped * mag)
    assert np.any(parts != exact)
    # Term by term where the kernels read it: each is the product of the
    # parts it names; hi x hi's are the operands rounded once to the part's type.
    where = laid_positions(split, k)
    a_of = lambda t: np.asarray(laid_a, np.float64)[:, where[t]]
    b_of = lambda t: np.asarray(laid_b, np.float64)[where[t], :]
    hi_hi = split.terms.index((0, 0))
    bits = 8 if split.part == "bfloat16" else 11
    assert np.all(np.abs(a_of(hi_hi) - a) <= 2.0**-bits * np.abs(a))
    assert np.all(np.abs(b_of(hi_hi) - b) <= 2.0**-bits * np.abs(b))
    for t, (i, j) in enumerate(split.terms):
        same_a = [u for u, term in enumerate(split.terms) if term[0] == i]
        same_b = [u for u, term in enumerate(split.terms) if term[1] == j]
        assert all(np.array_equal(a_of(u), a_of(t)) for u in same_a)
        assert all(np.array_equal(b_of(u), b_of(t)) for u in same_b)
        if i > 0:
            assert np.all(np.abs(a_of(t)) <= 2.0 ** -(bits * i - 1) * np.abs(a))
        if j > 0:
            assert np.all(np.abs(b_of(t)) <= 2.0 ** -(bits * j - 1) * np.abs(b))


def emulated_product(a, b, preset, layout):
    """a @ b at the preset, with a and b stored as `layout` says ("tA": a
    stored (k, m), "tB": b stored (n, k)), through dot_general."""
    dims = {"": ((1,), (0,)), "tA": ((0,), (0,)), "tB": ((1,), (1,))}[layout]
    return jax_tiled.dot_general(a, b, (dims, ((), ())), precision=preset)


@pytest.mark.parametrize("layout", ["", "tA", "tB"])
@pytest.mark.parametrize("mkn", [(67, 131, 45), (1, 300, 1), (64, 257, 64)], ids=str)
def test_every_layout_against_float64(emulated_on, rng, layout, mkn):
    platform, emulated = emulated_on
    m, k, n = mkn
    a, b = random_array(rng, (m, k), F32), random_array(rng, (k, n), F32)
    stored_a = a.T if layout == "tA" else a
    stored_b = b.T if layout == "tB" else b
    out = jax.jit(emulated_product, static_argnums=(2, 3))(stored_a, stored_b, emulated, layout)
    assert_runs_as(platform, out, a, b, emulated, F32)


def test_batch_zero_k_and_16_bit_operands(emulated_on, rng):
    """A batch against one b; an empty K gives zeros; bfloat16 operands are
    cast up to float32 first (as jax does) and the result cast back."""
    platform, emulated = emulated_on
    a, b = random_array(rng, (3, 33, 96), F32), random_array(rng, (96, 19), F32)
    assert_runs_as(platform, jax_tiled.matmul(a, b, precision=emulated), a, b, emulated, F32)
    empty = jax_tiled.matmul(jnp.ones((5, 0), F32), jnp.ones((0, 7), F32), precision=emulated)
    assert empty.shape == (5, 7) and not np.any(np.asarray(empty))
    a16, b16 = (x.astype(jnp.bfloat16) for x in (a[0], b))
    out = jax_tiled.matmul(a16, b16, precision=emulated)
    assert out.dtype == jnp.bfloat16
    assert_runs_as(platform, out, a16, b16, emulated, np.dtype(jnp.bfloat16))


def test_grad_jvp_vmap(emulated_on, rng):
    """Every product of the transformations computes the same arithmetic: each
    against its float64 product, through the preset's bound."""
    platform, emulated = emulated_on
    a, b = random_array(rng, (4, 29, 70), F32), random_array(rng, (70, 23), F32)
    ct = random_array(rng, (4, 29, 23), F32)
    mm = lambda a, b: jax_tiled.matmul(a, b, precision=emulated)
    _, vjp = jax.vjp(mm, a, b)
    ga, gb = vjp(ct)
    assert_runs_as(platform, ga, ct, np.swapaxes(b, -1, -2), emulated, F32)
    ct_flat, a_flat = ct.reshape(-1, 23), a.reshape(-1, 70)
    assert_runs_as(platform, gb, a_flat.T, ct_flat, emulated, F32)
    da = random_array(rng, a.shape, F32)
    _, tangent = jax.jvp(mm, (a, b), (da, jnp.zeros_like(b)))
    assert_runs_as(platform, tangent.reshape(-1, 23), da.reshape(-1, 70), b, emulated, F32)
    out = jax.vmap(mm, in_axes=(0, None))(a, b)
    assert_runs_as(platform, out.reshape(-1, 23), a_flat, b, emulated, F32)


def test_special_values_as_true_arithmetic(emulated_on):
    """inf, NaN and values at float32's limit: NaN, +inf and -inf where exact
    arithmetic gives them (inf * 0 is NaN, inf * a part that is 0 is not),
    finite values where it is finite; the values at the limit, whose parts
    would round past it, stay finite."""
    platform, emulated = emulated_on
    big = np.finfo(np.float32).max
    a = np.array([[np.inf], [1.0], [big], [np.nan], [-np.inf], [2.0], [1e-3], [-big]], F32)
    b = np.array([[1.0, 0.0, np.inf, 2.0, 1.5, -np.inf, 0.5, -1.0]], F32)
    out = np.asarray(jax_tiled.matmul(a, b, precision=emulated))
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0; float32's overflow
        want32 = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
    assert np.array_equal(np.isnan(out), np.isnan(want32))
    assert np.array_equal(out[np.isinf(want32)], want32[np.isinf(want32)])
    finite = np.isfinite(want32)
    assert np.all(np.isfinite(out[finite]))
    assert np.allclose(out[finite], want32[finite], rtol=split_of(emulated).dropped * 4, atol=0)


SMS = 132  # an H100's, as explain assumes them without a GPU


def wgmma_plan(split: _presets.Split, m, n, k, laid_terms):
    problem = (1, 1, m, n, k * len(split.terms), False, False)
    return _ffi.cuda_plan(
        "wgmma", split.dtype, F32, problem, multiprocessors=SMS, laid_terms=laid_terms
    )


@needs_cuda_module
@pytest.mark.parametrize("preset", EMULATIONS, ids=str)
def test_laid_parts_run_on_tiles_with_blocked_sums(preset):
    """The parts' product is summed in partial sums of one chunk group (the
    terms' slabs of one chunk), also where a product of one part each takes
    wgmma's 128 x 256 tiles: those have no room for a second set of
    accumulators and would keep one running sum over K x terms."""
    split, terms = split_of(preset), len(split_of(preset).terms)
    for m, n, k in [(4096, 4096, 4096), (2048, 2048, 2048), (512, 512, 8192), (1024, 1024, 1024)]:
        laid = wgmma_plan(split, m, n, k, terms)
        assert laid.block_n <= 128, (m, n, k, laid)
        assert f"partial sums of {terms} slabs" in laid.text, laid
    # The same product of one part each runs on the wide tiles.
    assert wgmma_plan(split, 4096, 4096, 4096, 1).block_n == 256


@pytest.mark.gpu
@pytest.mark.parametrize("distribution", ["positive", "normal"])
@pytest.mark.parametrize(
    "mkn", [(512, 8192, 512), (1024, 1024, 1024), (2048, 2048, 2048), (3000, 2999, 1000)], ids=str
)
@pytest.mark.parametrize("preset", EMULATIONS, ids=str)
def test_as_accurate_as_jnp_at_the_same_preset(on_gpu, rng, preset, mkn, distribution):
    """Error against float64 within 1.3x jnp's at the same preset, bias
    within 2x (plus float32's rounding of a sum this long), over a long K
    (K split on wgmma), squares (K whole; 2048^3 is one a product of one
    part each runs on the 128 x 256 tiles) and odd sizes (padded for the
    copy engine, a short last chunk); inputs in [0.5, 1.5] expose a lean
    toward zero, normal ones the cancelling sums."""
    m, k, n = mkn
    if distribution == "positive":
        a, b = rng.uniform(0.5, 1.5, (m, k)), rng.uniform(0.5, 1.5, (k, n))
    else:
        a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    a, b = a.astype(F32), b.astype(F32)
    ref = a.astype(np.float64) @ b.astype(np.float64)

    def error_and_bias(out):
        diff = np.asarray(out, np.float64) - ref
        return np.linalg.norm(diff) / np.linalg.norm(ref), np.mean(diff) / np.mean(np.abs(ref))

    ours = error_and_bias(jax.jit(lambda x, y: jax_tiled.matmul(x, y, precision=preset))(a, b))
    peer = error_and_bias(jax.jit(lambda x, y: jnp.matmul(x, y, precision=preset))(a, b))
    assert ours[0] <= 1.3 * peer[0], f"{preset.name}: error {ours[0]:.2e}, jnp's {peer[0]:.2e}"
    assert abs(ours[1]) <= 2 * abs(peer[1]) + 1e-8, (
        f"{preset.name}: bias {ours[1]:+.1e}, jnp's {peer[1]:+.1e}"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("preset", EMULATIONS, ids=str)
def test_bitwise_the_same_run_to_run(on_gpu, rng, preset):
    """K split on wgmma (512 x 8192 x 512): the parts' partial sums meet in a
    fixed order."""
    a, b = random_array(rng, (512, 8192), F32), random_array(rng, (8192, 512), F32)
    product = jax.jit(lambda x, y: jax_tiled.matmul(x, y, precision=preset))
    assert_same_bits_run_to_run(product, a, b)


def _bits_with_specials(rng, shape) -> np.ndarray:
    """float32 of `shape` from random bit patterns (every exponent, inf and NaN
    among them), a quarter exact bfloat16 ties, and the values around
    bfloat16's largest."""
    size = int(np.prod(shape))
    x = rng.integers(0, 2**32, size, dtype=np.uint64).astype(np.uint32)
    ties = rng.random(size) < 0.25
    x[ties] = (x[ties] & 0xFFFF0000) | 0x8000
    edges = np.array([0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000, 0x7F800000])
    x[: min(size, edges.size)] = edges[: min(size, edges.size)]
    x = x.view(np.float32)
    # No magnitudes whose lower part would be subnormal: XLA's GPU code
    # flushes those to zero, ours keeps them, and which the CPU does is its
    # runtime's choice.
    tiny = (np.abs(x) < 2.0**-100) & (x != 0)
    x[tiny] *= np.float32(2.0**64)
    return x.reshape(shape)


@pytest.mark.gpu
@pytest.mark.parametrize("k_minor", [True, False], ids=["K along rows", "K down columns"])
@pytest.mark.parametrize("side", [0, 1], ids=["a", "b"])
@pytest.mark.parametrize(
    "shape",
    [
        (2, 72, 200),
        (1, 130, 64),
        (1, 9, 36),
        (3, 33, 31),
        (4, 2, 16),
        (1, 64, 7),
        (1, 0, 5),
        (1, 6, 0),
    ],
    ids=str,
)
def test_the_cuda_split_lays_the_cpus_parts(on_gpu, rng, shape, side, k_minor):
    """The lowering's split on one GPU (our kernel) gives the bits XLA's split
    gives on the CPU, NaNs apart (any NaN is a NaN): whole and short chunks,
    eight, four and one columns a thread (200 and 64, 36, 31), row groups
    across batch entries (33 rows; 2, shorter than a group) and empty
    operands, both layouts."""
    split = _presets.BF16_X3
    x = _bits_with_specials(rng, shape)
    ours = np.asarray(jax.jit(lambda v: _lowering.split_on_gpu(v, split, side, k_minor))(x))
    cpu = jax.devices("cpu")[0]
    want = _presets.split_operand(jax.device_put(x, cpu), split, side, -1 if k_minor else -2)
    want = np.asarray(want)
    assert ours.shape == want.shape and ours.dtype == want.dtype
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(ours.astype(np.float32)), nan)
    assert np.array_equal(ours.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


@pytest.mark.gpu
def test_one_gpu_splits_with_our_kernel(on_gpu):
    """On one GPU the preset's lowering splits both operands with our CUDA
    split, not XLA's fusions."""
    a = jnp.ones((64, 128), F32)
    product = jax.jit(lambda x, y: jax_tiled.matmul(x, y, precision=Preset.BF16_BF16_F32_X3))
    assert product.lower(a, a.T).as_text().count("tiled_split_parts_cuda") == 2


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [1, 2], ids=lambda c: f"chunk {c}")
@pytest.mark.parametrize("shape", [(1, 5, 12), (2, 12, 6)], ids=str)
def test_the_cuda_split_lays_chunks_narrower_than_a_thread(on_gpu, rng, shape, chunk):
    """Chunks narrower than the kernel's four columns a thread (the handler
    takes any power of two): each thread's columns stay in one chunk, the
    bits equal the CPU's split of the same layout."""

    class Narrow(_presets.Split):
        pass

    Narrow.chunk = chunk  # shadows Split's property: the layout reads split.chunk
    split = Narrow(
        **{f.name: getattr(_presets.BF16_X3, f.name) for f in dataclasses.fields(_presets.Split)}
    )
    x = _bits_with_specials(rng, shape)
    cpu = jax.devices("cpu")[0]
    for k_minor in (True, False):
        ours = np.asarray(jax.jit(lambda v: _lowering.split_on_gpu(v, split, 1, k_minor))(x))
        want = np.asarray(
            _presets.split_operand(jax.device_put(x, cpu), split, 1, -1 if k_minor else -2)
        )
        nan = np.isnan(want.astype(np.float32))
        assert np.array_equal(np.isnan(ours.astype(np.float32)), nan)
        assert np.array_equal(ours.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
