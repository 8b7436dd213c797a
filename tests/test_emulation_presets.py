"""The emulation presets' arithmetic (`jax_tiled._presets.Split`): float32
operands split into bfloat16 or TF32 parts, the products their names count
run as one product of the parts laid along K.

CUDA's table takes them (`PRESETS["cuda"]`); the CPU computes those presets
exactly, so the tests taking `emulated` run CUDA's arithmetic on the CPU too
by giving the CPU table CUDA's modes for the test (the same lowering, on the
CPU kernel's bfloat16 and float32 paths), and on CUDA as `gpu` tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_tiled
from helpers import F32, assert_runs_as, random_array
from jax_tiled import _presets

Preset = lax.DotAlgorithmPreset
EMULATIONS = [p for p, mode in _presets.PRESETS["cuda"].items() if mode.split is not None]


@pytest.fixture(params=EMULATIONS, ids=str)
def emulated(request, platform, monkeypatch):
    """An emulation preset, with CUDA's arithmetic on `platform`."""
    preset = request.param
    if platform == "cpu":
        monkeypatch.setitem(_presets.PRESETS["cpu"], preset, _presets.PRESETS["cuda"][preset])
    return preset


def split_of(preset) -> _presets.Split:
    return _presets.PRESETS["cuda"][preset].split


def test_the_emulation_presets_are_split_but_x9():
    """BF16_BF16_F32_X3/X6 and TF32_TF32_F32_X3; X9 runs as HIGH, faster than
    nine bfloat16 products and more accurate."""
    assert {p.name for p in EMULATIONS} == {
        "BF16_BF16_F32_X3",
        "BF16_BF16_F32_X6",
        "TF32_TF32_F32_X3",
    }
    assert _presets.PRESETS["cuda"][Preset.BF16_BF16_F32_X9].float32 == lax.Precision.HIGH


@pytest.mark.parametrize("preset", EMULATIONS, ids=str)
@pytest.mark.parametrize("distribution", ["normal", "positive", "wide"])
def test_the_laid_parts_multiply_to_the_kept_terms(rng, preset, distribution):
    """In float64, the laid-out parts' product is the product of the operands
    within `dropped`, and not exactly it (terms are left out). Operand parts
    are `split.dtype` values."""
    split = split_of(preset)
    m, k, n = 7, 50, 5
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
    # The first of each term's K entries: the hi parts, whose sum is the
    # operand rounded once to the part's type.
    hi = np.asarray(laid_a, np.float64)[:, :: len(split.terms)]
    assert np.all(np.abs(hi - a) <= 2.0 ** -(8 if split.part == "bfloat16" else 11) * np.abs(a))


def emulated_product(a, b, preset, layout):
    """a @ b at the preset, with a and b stored as `layout` says ("tA": a
    stored (k, m), "tB": b stored (n, k)), through dot_general."""
    dims = {"": ((1,), (0,)), "tA": ((0,), (0,)), "tB": ((1,), (1,))}[layout]
    return jax_tiled.dot_general(a, b, (dims, ((), ())), precision=preset)


@pytest.mark.parametrize("layout", ["", "tA", "tB"])
@pytest.mark.parametrize("mkn", [(67, 131, 45), (1, 300, 1), (64, 257, 64)], ids=str)
def test_every_layout_against_float64(platform, emulated, rng, layout, mkn):
    m, k, n = mkn
    a, b = random_array(rng, (m, k), F32), random_array(rng, (k, n), F32)
    stored_a = a.T if layout == "tA" else a
    stored_b = b.T if layout == "tB" else b
    out = jax.jit(emulated_product, static_argnums=(2, 3))(stored_a, stored_b, emulated, layout)
    assert_runs_as(platform, out, a, b, emulated, F32)


def test_batch_zero_k_and_16_bit_operands(platform, emulated, rng):
    """A batch against one b; an empty K gives zeros; bfloat16 operands are
    cast up to float32 first (as jax does) and the result cast back."""
    a, b = random_array(rng, (3, 33, 96), F32), random_array(rng, (96, 19), F32)
    assert_runs_as(platform, jax_tiled.matmul(a, b, precision=emulated), a, b, emulated, F32)
    empty = jax_tiled.matmul(jnp.ones((5, 0), F32), jnp.ones((0, 7), F32), precision=emulated)
    assert empty.shape == (5, 7) and not np.any(np.asarray(empty))
    a16, b16 = (x.astype(jnp.bfloat16) for x in (a[0], b))
    out = jax_tiled.matmul(a16, b16, precision=emulated)
    assert out.dtype == jnp.bfloat16
    assert_runs_as(platform, out, a16, b16, emulated, np.dtype(jnp.bfloat16))


def test_grad_jvp_vmap(platform, emulated, rng):
    """Every product of the transformations computes the same arithmetic: each
    against its float64 product, through the preset's bound."""
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


def test_special_values_as_true_arithmetic(platform, emulated):
    """inf, NaN and values at float32's limit: NaN, +inf and -inf where exact
    arithmetic gives them (inf * 0 is NaN, inf * a part that is 0 is not),
    finite values where it is finite; the values at the limit, whose parts
    would round past it, stay finite."""
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
