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
class Mode:
    """How a backend computes a preset's product once its operands are cast.

    float32: the kernel precision of a product whose (cast) operands are float32.
    round_float32_to: a narrower type float32 operands are rounded to first,
      where the backend's algorithm rounds them inside the dot (XLA's GPU
      BF16_BF16_F32 reads float32 storage as bfloat16)."""

    float32: lax.Precision
    round_float32_to: np.dtype | None = None
    why: str = ""


_D, _H, _X = lax.Precision.DEFAULT, lax.Precision.HIGH, lax.Precision.HIGHEST

# Backend -> the presets jnp.matmul takes there -> what jax_tiled runs for them.
# CPU: jax's own list (XLA's CPU runtime ignores the algorithm; jax refuses the
# presets it cannot honour), and the CPU kernel is exact fp32 at every mode.
# CUDA: XLA's GPU support (xla/service/algorithm_util.cc,
# IsSupportedDotAlgorithmOnGpu, for sm_80+; F16_F16_F16 and BF16_BF16_BF16 are
# not among them, the ANY_F8 presets take float8 operands only, which jax_tiled
# does not compute). The emulation presets run as 3xTF32 (HIGH), which is more
# accurate than XLA's bf16 emulations on square products but not over a long K
# with few output tiles (docs/precision.md has the measurements); fused
# emulation kernels with each preset's own arithmetic are later work.
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
        Preset.BF16_BF16_F32_X3: Mode(_H, why="3xTF32, more accurate than 3 bf16 products"),
        Preset.BF16_BF16_F32_X6: Mode(_H, why="3xTF32, more accurate than 6 bf16 products"),
        Preset.BF16_BF16_F32_X9: Mode(_H, why="3xTF32, more accurate than 9 bf16 products"),
        Preset.TF32_TF32_F32: Mode(_D),
        Preset.TF32_TF32_F32_X3: Mode(_H),
        Preset.F32_F32_F32: Mode(_X),
        Preset.F64_F64_F64: Mode(_X),
    },
}


@dataclasses.dataclass(frozen=True)
class Run:
    """What the kernel computes for a product: operands cast to operand_dtype,
    the product into product_dtype at kernel precision `precision`, then the
    result cast to the product's output dtype."""

    operand_dtype: np.dtype
    product_dtype: np.dtype
    precision: lax.Precision

    def describe(self, dtype, out_dtype) -> str:
        """The casts and the mode, in words (explain's `runs_as`)."""
        parts = []
        if self.operand_dtype != np.dtype(dtype):
            parts.append(f"operands cast to {self.operand_dtype.name}")
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
    """What runs for a dtype -> out_dtype product at `precision` (a lax.Precision
    or a preset) on `platform`; a preset the platform refuses raises ValueError."""
    dtype, out_dtype = np.dtype(dtype), np.dtype(out_dtype)
    if not is_preset(precision):
        return Run(dtype, out_dtype, lax.Precision(precision))
    mode = check(platform, precision, api)
    operand, product = _jax_compute_types(precision, dtype, out_dtype)
    if operand == F32 and mode.round_float32_to is not None:
        operand = mode.round_float32_to
    # Only float32 products have modes; others are computed the same at every one.
    return Run(operand, product, mode.float32 if operand == F32 else lax.Precision.DEFAULT)


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
