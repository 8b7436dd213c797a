"""`lax.DotAlgorithmPreset`s: which ones each backend takes, and what runs for them.

`jnp.matmul(..., precision=preset)` casts the operands to the preset's input
type, accumulates in its accumulation type and casts the result to the output
dtype (jax's `get_algorithm_compute_types`, from the preset's public
`supported_lhs_types` and `supported_output_types`); XLA then runs the dot with
the preset's algorithm where the backend has it, and refuses the rest. jax_tiled
does the same casts and runs the cast product on one of its kernel precision
modes. `PRESETS` below is the one place that says, per backend, which presets
are taken and which mode computes each; `matmul`, `dot_general`, `tiled`,
`explain`, `kernels` and the lowering all read it through `resolve`.

A preset stays in the primitive's `precision` param (the lowering resolves it
for the platform it lowers for), so the products of `grad`, `jvp` and `vmap`
carry the preset, as the `dot_general`s of `jnp.matmul`'s VJP do.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Preset = lax.DotAlgorithmPreset
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
BF16 = np.dtype(jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class PartsLaid:
    """The kernel precision of a product of parts laid along K (`Split`,
    `split_operand`), the primitive's `precision` param inside an emulation
    preset's lowering: DEFAULT's arithmetic, told that each chunk group holds
    `terms` products of parts (the FFI attribute `laid_terms`), so that the
    kernel keeps it on tiles that sum one chunk group a partial sum."""

    terms: int


@dataclasses.dataclass(frozen=True)
class Split:
    """A float32 product computed from narrower parts of its operands, as XLA's
    emulation presets define it: each operand x = p0 + p1 (+ p2), p0 = x rounded
    to `part`, each next part the rest rounded so; of the products of parts,
    those in `terms` ((i, j): a's part i times b's part j) are kept.

    They run as one product of `part` operands over K x len(terms): each
    operand's parts are laid along K chunk by chunk (`split_operand`), so one
    kernel call sums them all, with no pass to add partial products; the
    kernel sums each chunk group (every term's chunk) into a fresh partial
    sum (`PartsLaid`: bfloat16 parts on wgmma), which keeps its truncating
    tensor-core sums as short as those of XLA's separate products, or
    shorter. `terms` is the order they are laid in each chunk: the small
    products first, hi x hi last (cpp/cuda/NOTES.md, "The emulation presets
    laid chunk by chunk"). Special values: a non-finite x keeps p0 and has
    zero lower parts, and p0 enters only the (0, 0) term as it is; in the
    other terms a non-finite p0 counts as zero, so inf * (a part that is 0)
    cannot make a NaN where the exact product is infinite (XLA's emulations
    add the products of lower parts apart and drop their NaNs instead). The
    parts are computed in float32's bits, so bfloat16 parts are exact in
    bfloat16 and TF32 ones pass the TF32 kernel's rounding unchanged.

    part: "bfloat16", or "tf32" (float32 storage of TF32 values: the TF32
      kernel rounds operands to TF32, which leaves p0 exact).
    dropped: a bound on |a b - (the kept terms)| / |a b| for one pair of
      operands (the parts' own rounding and the terms left out)."""

    part: str
    parts: int
    terms: tuple[tuple[int, int], ...]
    dropped: float

    @property
    def dtype(self) -> np.dtype:
        """The parts' storage dtype, the operands of the kernel's product."""
        return BF16 if self.part == "bfloat16" else F32

    @property
    def chunk(self) -> int:
        """K per chunk: one slab of the Hopper kernel, a 128-byte row of the
        parts' storage (cpp/cuda/blocks/hopper.cuh, kSwizzleElements), so that
        each of its slabs holds one term's chunk."""
        return 128 // self.dtype.itemsize

    @property
    def precision(self) -> lax.Precision:
        """The kernel precision the parts' product runs at: DEFAULT (for
        float32 storage, one TF32 pass)."""
        return lax.Precision.DEFAULT

    def describe(self) -> str:
        names = ("hi", "mid", "lo") if self.parts == 3 else ("hi", "lo")
        terms = ", ".join(f"{names[i]}*{names[j]}" for i, j in self.terms)
        return (
            f"operands split into {self.parts} {self.part} parts, {len(self.terms)} "
            f"products of parts ({terms}) summed as one {self.part} product over "
            f"K x {len(self.terms)}"
        )


# Each part is the rest of x rounded to nearest (|x - p0| <= 2^-8 |x| for
# bfloat16's 8 significant bits, 2^-11 for TF32's 11), except past the
# largest part (|x| above 3.39e38 for bfloat16): there p0 is the largest part
# and the lower parts are truncated toward zero, so that no partial sum of
# the parts passes float32's limit (rounded to nearest, p0 + p1 could). To
# nearest, the split is Triton's and XLA's; truncating every lower part
# instead doubles X3's error on normal inputs (tools/tensor_core_sums.py).
# `dropped` from those: what the parts leave of x and the terms left out
# (lo*lo for X3; mid*lo, lo*mid, lo*lo for X6).
BF16_X3 = Split("bfloat16", 2, ((0, 1), (1, 0), (0, 0)), dropped=2.0**-13)
# Not in the CUDA table (PRESETS: slower than HIGH there); tools/split_high.py
# and the tests of the split read them.
BF16_X6 = Split("bfloat16", 3, ((1, 1), (0, 2), (2, 0), (0, 1), (1, 0), (0, 0)), 2.0**-20)
TF32_X3 = Split("tf32", 2, ((0, 1), (1, 0), (0, 0)), dropped=2.0**-19)
SPLITS = {"BF16_BF16_F32_X3": BF16_X3, "BF16_BF16_F32_X6": BF16_X6, "TF32_TF32_F32_X3": TF32_X3}

# Per part type: the bits it keeps of a float32, and the largest finite part's bits.
_PART_MASK = {"bfloat16": 0xFFFF0000, "tf32": 0xFFFFE000}
_PART_MAX = {"bfloat16": 0x7F7F0000, "tf32": 0x7F7FE000}


def _round_part(x, part: str, toward_zero):
    """x (float32) rounded to a `part` value, as float32: to nearest even, or
    toward zero where `toward_zero` (a mask); a finite x that would round past
    the largest part gets the largest part instead of inf."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    dropped = ~_PART_MASK[part] & 0xFFFFFFFF
    lowest_kept = (bits >> dropped.bit_length()) & 1
    nearest = bits + jnp.uint32(dropped >> 1) + lowest_kept  # ties to even
    bits = jnp.where(toward_zero, bits, nearest) & jnp.uint32(_PART_MASK[part])
    rounded = jnp.where(jnp.isfinite(x), lax.bitcast_convert_type(bits, F32), x)
    return jnp.where(jnp.isinf(rounded) & jnp.isfinite(x), jnp.sign(x) * _largest(part), rounded)


def _largest(part: str) -> np.float32:
    return np.array(_PART_MAX[part], np.uint32).view(np.float32)


def part_taken(term: tuple[int, int], side: int) -> int:
    """What the product of parts `term` takes from operand `side` (0 for a,
    1 for b): 0 its hi part as it is (the hi x hi term: a non-finite x
    stays), 1 hi with a non-finite x as zero (the other terms), 1 + i its
    part i >= 1 (zero for a non-finite x). The CUDA split's part codes
    (cpp/cuda/blocks/split_parts.cuh, SplitPart) are these."""
    i = term[side]
    if i > 0:
        return 1 + i
    return 0 if term == (0, 0) else 1


def split_operand(x, split: Split, side: int, k_axis: int):
    """x (float32) as its parts laid along K: axis `k_axis` of length K becomes
    K x len(split.terms), in `split.dtype`. Chunk by chunk (`split.chunk` of
    K; the last one may be shorter): the part that each term in turn takes
    from this operand (`side` 0 for a, 1 for b) over the chunk."""
    past_largest = jnp.abs(x) > _largest(split.part)
    parts, rest = [_round_part(x, split.part, False)], x
    for _ in range(split.parts - 1):
        rest = rest - parts[-1]
        parts.append(_round_part(rest, split.part, past_largest))
    finite = jnp.isfinite(x)
    # Each part in its storage dtype as soon as it is made (exact there): the
    # layout below then moves the narrow values. Indexed by part_taken's codes.
    choices = [
        parts[0].astype(split.dtype),
        jnp.where(finite, parts[0], 0).astype(split.dtype),
        *(jnp.where(finite, p, 0).astype(split.dtype) for p in parts[1:]),
    ]
    k_axis %= x.ndim
    k, chunk = x.shape[k_axis], split.chunk
    if k == 0:
        return jnp.zeros(x.shape, split.dtype)
    taken = [choices[part_taken(t, side)] for t in split.terms]
    lead, trail = x.shape[:k_axis], x.shape[k_axis + 1 :]

    def laid(begin, end):
        """The terms' parts over K's [begin, end), whole chunks or one shorter
        one, as (..., chunks, terms, chunk, ...) flat along K: each part
        reshaped and the terms concatenated, with no transpose, which XLA
        fuses into one pass an operand (the transposing layout this replaced
        took 28% longer on an H100: cpp/cuda/NOTES.md, "BF16_BF16_F32_X3: chunk
        groups, not the wide tiles")."""
        length = end - begin
        width = min(chunk, length)
        grouped = [
            lax.slice_in_dim(part, begin, end, axis=k_axis).reshape(
                *lead, length // width, 1, width, *trail
            )
            for part in taken
        ]
        out = jnp.concatenate(grouped, axis=k_axis + 1)
        return out.reshape(*lead, length * len(taken), *trail)

    whole = k - k % chunk
    pieces = [laid(begin, end) for begin, end in ((0, whole), (whole, k)) if end > begin]
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=k_axis)


@dataclasses.dataclass(frozen=True)
class Mode:
    """How a backend computes a preset's product once its operands are cast.

    float32: the kernel precision of a product whose (cast) operands are float32.
    round_float32_to: a narrower type float32 operands are rounded to first,
      where the backend's algorithm rounds them inside the dot (XLA's GPU
      BF16_BF16_F32 reads float32 storage as bfloat16).
    split: the emulation presets' arithmetic (`Split`), for float32 operands."""

    float32: lax.Precision
    round_float32_to: np.dtype | None = None
    split: Split | None = None  # float32 operands computed from their parts
    why: str = ""


_D, _H, _X = lax.Precision.DEFAULT, lax.Precision.HIGH, lax.Precision.HIGHEST

_FASTER_AS_HIGH = "four TF32 products (HIGH): faster on an H100 than the preset's own parts"

# Backend -> the presets jnp.matmul takes there -> what jax_tiled runs for them.
# CPU: jax's own list (XLA's CPU runtime ignores the algorithm; jax refuses the
# presets it cannot honour), and the CPU kernel is exact fp32 at every mode.
# CUDA: XLA's GPU support (xla/service/algorithm_util.cc,
# IsSupportedDotAlgorithmOnGpu, for sm_80+; F16_F16_F16 and BF16_BF16_BF16 are
# not among them, the ANY_F8 presets take float8 operands only, which jax_tiled
# does not compute). BF16_BF16_F32_X3 computes its own arithmetic, the three
# products of bfloat16 parts (`Split`); the other emulation presets run as
# HIGH, where they were measured slower as parts.
PRESETS: dict[str, dict[Preset, Mode]] = {
    "cpu": {
        Preset.DEFAULT: Mode(_D),
        Preset.F16_F16_F16: Mode(_X),
        Preset.BF16_BF16_F32: Mode(_X, why="XLA's CPU runtime keeps float32 operands whole"),
        Preset.BF16_BF16_F32_X3: Mode(_X),
        Preset.BF16_BF16_F32_X6: Mode(_X),
        Preset.F32_F32_F32: Mode(_X),
        Preset.F64_F64_F64: Mode(_X),
    },
    "cuda": {
        Preset.DEFAULT: Mode(_D),
        Preset.F16_F16_F32: Mode(_X),
        Preset.BF16_BF16_F32: Mode(_X, round_float32_to=BF16),
        Preset.BF16_BF16_F32_X3: Mode(_D, split=BF16_X3),
        # Their parts laid along K (BF16_X6, TF32_X3) ran slower than HIGH on an
        # H100, which is also the more accurate (cpp/cuda/NOTES.md, "The
        # emulation presets laid chunk by chunk"); nine bfloat16 products
        # were slower than HIGHEST itself.
        Preset.BF16_BF16_F32_X6: Mode(_H, why=_FASTER_AS_HIGH),
        Preset.BF16_BF16_F32_X9: Mode(_H, why=_FASTER_AS_HIGH),
        Preset.TF32_TF32_F32: Mode(_D),
        Preset.TF32_TF32_F32_X3: Mode(_H, why=_FASTER_AS_HIGH),
        Preset.F32_F32_F32: Mode(_X),
        Preset.F64_F64_F64: Mode(_X),
    },
}


@dataclasses.dataclass(frozen=True)
class Run:
    """What the kernel computes for a product: operands cast to operand_dtype,
    the product into product_dtype at kernel precision `precision` (or, with
    `split`, the product of their parts: `kernel_run`), then the result cast to
    the product's output dtype."""

    operand_dtype: np.dtype
    product_dtype: np.dtype
    precision: lax.Precision
    split: Split | None = None
    # > 1: the operands are parts laid along K, this many products of parts a
    # chunk group (`PartsLaid`); the kernel's FFI attribute `laid_terms`.
    laid_terms: int = 1

    def kernel_run(self) -> Run:
        """The product the kernel itself runs: for a split, that of the parts."""
        if self.split is None:
            return self
        terms = len(self.split.terms)
        return Run(self.split.dtype, self.product_dtype, self.split.precision, laid_terms=terms)

    def kernel_problem(self, problem: tuple) -> tuple:
        """A (batch_a, batch_b, m, n, k, transpose_a, transpose_b) problem as the
        kernel runs it: for a split, over K x the number of terms."""
        if self.split is None:
            return problem
        batch_a, batch_b, m, n, k, transpose_a, transpose_b = problem
        return (batch_a, batch_b, m, n, k * len(self.split.terms), transpose_a, transpose_b)

    def describe(self, dtype, out_dtype) -> str:
        """The casts and the mode, in words (explain's `runs_as`)."""
        parts = []
        if self.operand_dtype != np.dtype(dtype):
            parts.append(f"operands cast to {self.operand_dtype.name}")
        if self.split is not None:
            mode = f"{self.split.describe()} into {self.product_dtype.name}"
        else:
            mode = f"{self.operand_dtype.name} product into {self.product_dtype.name}"
            if self.operand_dtype == F32:
                mode += f" at {self.precision.name}"
        parts.append(mode)
        if self.product_dtype != np.dtype(out_dtype):
            parts.append(f"cast to {np.dtype(out_dtype).name}")
        return ", ".join(parts)


def is_preset(precision) -> bool:
    return isinstance(precision, Preset)


def accepted(platform: str) -> list[str]:
    return [p.name for p in PRESETS.get(platform, {})]


def check(platform: str, preset: Preset, api: str = "jax_tiled") -> Mode:
    """The backend's mode for `preset`, or a ValueError naming what it takes."""
    modes = PRESETS.get(platform)
    if modes is None:
        raise ValueError(f"{api}: no kernels for backend {platform!r}")
    if preset not in modes:
        hint = (
            " (ANY_F8 presets take float8 operands, which jax_tiled does not compute)"
            if preset.name.startswith("ANY_F8")
            else ""
        )
        raise ValueError(
            f"{api}: precision {preset.name} is not supported on {platform}, as jnp.matmul "
            f"refuses it there{hint}; presets accepted on {platform}: "
            f"{', '.join(accepted(platform))}; or a lax.Precision"
        )
    return modes[preset]


def _jax_compute_types(preset: Preset, dtype, out_dtype) -> tuple[np.dtype, np.dtype]:
    """jax's casts for a preset: the operands' type and the accumulation
    (the dot's own result) type, as jax's dot_general lowering chooses them."""

    def pick(current, allowed):
        if allowed is None or current in map(np.dtype, allowed):
            return current
        return np.dtype(allowed[0])

    operand = pick(np.dtype(dtype), preset.supported_lhs_types)
    product = pick(np.dtype(out_dtype), preset.supported_output_types(operand, operand))
    return operand, product


def resolve(platform: str, precision, dtype, out_dtype, api: str = "jax_tiled") -> Run:
    """What runs for a dtype -> out_dtype product at `precision` (a lax.Precision,
    a preset, or `PartsLaid`) on `platform`; a preset the platform refuses
    raises ValueError."""
    dtype, out_dtype = np.dtype(dtype), np.dtype(out_dtype)
    if isinstance(precision, PartsLaid):
        return Run(dtype, out_dtype, lax.Precision.DEFAULT, laid_terms=precision.terms)
    if not is_preset(precision):
        return Run(dtype, out_dtype, lax.Precision(precision))
    mode = check(platform, precision, api)
    operand, product = _jax_compute_types(precision, dtype, out_dtype)
    if operand == F32 and mode.round_float32_to is not None:
        operand = mode.round_float32_to
    # Only float32 products have modes; others are computed the same at every one.
    if operand != F32:
        return Run(operand, product, lax.Precision.DEFAULT)
    return Run(operand, product, mode.float32, mode.split)


def trace_platform() -> str:
    """The platform a product traced now will most likely run on: jax's default
    device's (`jax.default_device`), else the default backend's. The lowering
    checks again for the platform it actually lowers for."""
    device = jax.config.jax_default_device
    if isinstance(device, str):
        platform = device
    elif device is not None:
        platform = device.platform
    else:
        platform = jax.default_backend()
    return {"gpu": "cuda"}.get(platform, platform)


def needs_x64(run: Run) -> bool:
    """Whether the product computes in float64 while jax_enable_x64 is off (as
    jax's own F64_F64_F64 lowering does for float32 operands): tracing it then
    needs float64 switched on."""
    return F64 in (run.operand_dtype, run.product_dtype) and not jax.config.jax_enable_x64


@contextlib.contextmanager
def wide_types(run: Run):
    """float64 available while tracing a product that needs_x64."""
    if needs_x64(run):
        with jax.enable_x64(True):
            yield
    else:
        yield
