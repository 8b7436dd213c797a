"""The second peer: the Pallas Mosaic-GPU Hopper kernel that jax ships, at its best config.

`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu` computes a (M, K) @ (K, N)
product of bfloat16 or float16 operands, row-major both, into their dtype, on
an sm_90 GPU. It runs where it imports: on any other device, or where jax lacks
the module, the benchmark leaves its column out, or (--pallas) marks each row
unavailable with the reason. A row it cannot compute (float32, a transposed or
batched operand, no config dividing the shape) names why instead of failing.

Each applicable row times every config of CONFIGS that divides its shape,
through the harness's timing on the row's own input sets, then times the
fastest once more and reports that: its time, its TFLOP/s, the config, and
the whole sweep in the JSON (the fastest of several timings is a lucky draw
of the card's clock: sweep_into).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import jax

from jax_tiled.bench.harness import measure_into
from jax_tiled.bench.shapes import Shape
from jax_tiled.bench.timing import Budget

MODULE = "jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu"
DTYPES = ("bfloat16", "float16")
PRECISION = "default"  # its one arithmetic: 16-bit products accumulated in float32
COMPUTE_CAPABILITY = "9.0"
# Shared memory a block may use on sm_90 (227 KiB): what a config's buffers must fit.
SMEM_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True)
class Config:
    """The module's TuningConfig fields that the sweep varies (the others keep its
    defaults: epilogue tiles of 64 x 64). Two consumer warpgroups each compute a
    tile_m x tile_n tile, side by side along wg_dimension; a cluster of two blocks
    along cluster_dimension shares its operand tile by multicast; the persistent
    grid walks the tiles in bands of grid_tile_width along grid_minor_dim."""

    tile_m: int
    tile_n: int
    tile_k: int
    max_concurrent_steps: int
    wg_dimension: str = "N"  # "M" or "N"
    grid_minor_dim: str = "N"  # "M" or "N"
    grid_tile_width: int = 1
    cluster_dimension: str | None = None  # None, "M" or "N"

    @property
    def name(self) -> str:
        """tile_m x tile_n x tile_k, .s steps, .wg, .g order and width, .c cluster."""
        name = (
            f"{self.tile_m}x{self.tile_n}x{self.tile_k}.s{self.max_concurrent_steps}"
            f".wg{self.wg_dimension}.g{self.grid_minor_dim}{self.grid_tile_width}"
        )
        return name + (f".c{self.cluster_dimension}" if self.cluster_dimension else "")

    @property
    def block_tile(self) -> tuple[int, int]:
        """(M, N) of one block's output tile: both warpgroups' tiles."""
        return (
            self.tile_m * (2 if self.wg_dimension == "M" else 1),
            self.tile_n * (2 if self.wg_dimension == "N" else 1),
        )

    @property
    def cluster_tile(self) -> tuple[int, int]:
        """(M, N) of one cluster's output tile: what M and N must be multiples of."""
        m, n = self.block_tile
        return (
            m * (2 if self.cluster_dimension == "M" else 1),
            n * (2 if self.cluster_dimension == "N" else 1),
        )

    def smem_bytes(self, itemsize: int) -> int:
        """The pipeline's operand buffers and the two warpgroups' epilogue buffers."""
        m, n = self.block_tile
        epilogue_slots = min(2, self.tile_m * self.tile_n // (64 * 64))
        return itemsize * (
            (m + n) * self.tile_k * self.max_concurrent_steps + 2 * epilogue_slots * 64 * 64
        )

    def misfit(self, m: int, k: int, n: int) -> str | None:
        """Why this config cannot compute an M x K x N product, or None."""
        tile_m, tile_n = self.cluster_tile
        bad = [
            f"{dim}={size} is no multiple of {tile}"
            for dim, size, tile in (("M", m, tile_m), ("N", n, tile_n), ("K", k, self.tile_k))
            if size % tile
        ]
        return ", ".join(bad) or None


# The sweep: a 128 x 256 block tile (the module's largest that fits with 4 stages)
# walked in bands along N or M, or twice as wide; 256 x 128; a cluster of two; and a
# 128 x 128 tile for shapes that 256 does not divide.
CONFIGS = (
    Config(128, 128, 64, 4, "N", "N", 8),
    Config(128, 128, 64, 4, "N", "M", 8),
    Config(128, 128, 64, 4, "N", "N", 16),
    Config(128, 128, 64, 4, "M", "N", 8),
    Config(128, 128, 64, 4, "N", "N", 8, cluster_dimension="M"),
    Config(128, 64, 64, 4, "N", "N", 4),
)


def unavailable(device=None) -> str | None:
    """Why the kernel cannot run on `device` (default: jax's first device): not an
    sm_90 GPU, or this jax lacks the module or the API used here; None if it can."""
    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform not in ("gpu", "cuda") or capability is None:
        return f"needs an sm_90 GPU; the device is {device.platform}"
    if capability != COMPUTE_CAPABILITY:
        return (
            f"needs compute capability {COMPUTE_CAPABILITY} (sm_90a); "
            f"{device.device_kind} has {capability}"
        )
    try:
        module = importlib.import_module(MODULE)
    except Exception as exc:  # noqa: BLE001 - any failure to import is a reason, not a crash
        return f"{MODULE} does not import: {type(exc).__name__}: {exc}"
    missing = [
        name for name in ("matmul", "TuningConfig", "MatmulDimension") if not hasattr(module, name)
    ]
    if missing:
        return f"{MODULE} of jax {jax.__version__} lacks {', '.join(missing)}"
    return None


def not_applicable(
    shape: Shape, dtype: str, precision: str, out_dtype: str | None = None
) -> str | None:
    """Why no config computes this row's product (into out_dtype; None: the
    operands' dtype), or None."""
    if out_dtype is not None:
        return "writes the operands' dtype only"
    if dtype not in DTYPES:
        return f"takes {' and '.join(DTYPES)}, not {dtype}"
    if precision != PRECISION:
        return f"one arithmetic (16-bit products, float32 sums): compared at {PRECISION} only"
    if shape.batch > 1:
        return "2-D products only, not batched"
    if shape.transpose:
        operand = "a" if shape.transpose == "tA" else "b"
        return f"reads {operand} row-major only, not transposed"
    if all(config.misfit(shape.m, shape.k, shape.n) for config in CONFIGS):
        smallest = min(CONFIGS, key=lambda c: c.cluster_tile[0] * c.cluster_tile[1])
        return (
            f"no config divides it (smallest, {smallest.name}: "
            f"{smallest.misfit(shape.m, shape.k, shape.n)})"
        )
    return None


PROBE_PREFIX = "pallas:"


def probed_config(probe: str, shape: Shape, dtype: str, precision: str) -> Config:
    """The config that `--probe pallas:NAME` names, for one product (ncu's probe:
    tools/ncu_products.py --pallas NAME); ValueError naming the configs where
    NAME is none of them, or why the config cannot compute the product."""
    name = probe.removeprefix(PROBE_PREFIX)
    config = next((c for c in CONFIGS if c.name == name), None)
    if config is None:
        raise ValueError(
            f"no Pallas config {name!r}; the sweep's: {', '.join(c.name for c in CONFIGS)}"
        )
    why = not_applicable(shape, dtype, precision) or config.misfit(shape.m, shape.k, shape.n)
    if why:
        raise ValueError(f"Pallas config {name} cannot compute {shape.name}: {why}")
    return config


def tuning_config(module, config: Config):
    """The module's TuningConfig for `config`."""
    dims = module.MatmulDimension
    return module.TuningConfig(
        tile_m=config.tile_m,
        tile_n=config.tile_n,
        tile_k=config.tile_k,
        max_concurrent_steps=config.max_concurrent_steps,
        wg_dimension=dims[config.wg_dimension],
        grid_minor_dim=dims[config.grid_minor_dim],
        grid_tile_width=config.grid_tile_width,
        cluster_dimension=None
        if config.cluster_dimension is None
        else dims[config.cluster_dimension],
    )


def matmul_fn(config: Config):
    """mm(a, b): the module's product with `config`, jitted, so that the harness's
    function of many input sets lowers the kernel once. The module's matmul(a, b, c,
    config) adds c to the product (None here); older ones take (a, b, config)."""
    module = importlib.import_module(MODULE)
    tuning = tuning_config(module, config)
    extra = {"c": None} if "c" in inspect.signature(module.matmul).parameters else {}
    return jax.jit(lambda a, b: module.matmul(a, b, config=tuning, **extra))


@dataclasses.dataclass
class SweepEntry:
    """One config's timing on a row (the harness's measure_into fills it)."""

    config: str
    ms: float | None = None
    tflops: float | None = None
    calls: int | None = None
    samples_ms: list[float] | None = None
    error: str | None = None
    not_applicable: str | None = None


def sweep_into(row, shape: Shape, sets, args, budget: Budget, describe, *, keep_first: bool):
    """Times each config that divides the row's shape, on the row's sets through the
    harness's timing, into row.sweep; the fastest is timed once more, and that
    timing fills the row (ms, TFLOP/s, calls, samples; config) and is returned.
    The fastest of many timings is the one that drew the fastest moment of the
    card (an H100's clock swings 1.56-1.98 GHz between one 0.1 s sample and the
    next), so its own time would favour the peer that has most configs. None,
    with row.not_applicable set (the column is unavailable, or no config computes
    the row) or row.error (every config failed), when nothing ran. describe(text)
    names each config as it starts."""
    if args.pallas_unavailable:
        row.not_applicable = f"unavailable: {args.pallas_unavailable}"
        return None
    row.not_applicable = not_applicable(shape, row.dtype, row.precision, row.out_dtype)
    if row.not_applicable:
        return None
    row.sweep, best = [], None
    for config in CONFIGS:
        entry = SweepEntry(config.name, not_applicable=config.misfit(shape.m, shape.k, shape.n))
        row.sweep.append(entry)
        if entry.not_applicable:
            continue
        describe(config.name)
        try:
            fn = matmul_fn(config)
        except Exception as exc:  # noqa: BLE001 - a config this jax refuses is an entry
            entry.error = f"{type(exc).__name__}: {exc}"
            continue
        timing = measure_into(entry, fn, sets, shape.flops, args, budget, keep_first=False)
        if timing is not None and (best is None or timing.seconds < best[1].seconds):
            best = entry, timing, fn
    if best is None:
        failed = next(entry for entry in row.sweep if entry.error)
        row.error = f"every config failed; {failed.config}: {failed.error}"
        return None
    entry, _, fn = best
    row.config = entry.config
    describe(f"{entry.config}, the fastest, again")
    return measure_into(row, fn, sets, shape.flops, args, budget, keep_first=keep_first)


def json_section(args) -> dict:
    """The JSON's "pallas" section: whether the column ran, why not, the sweep."""
    return {
        "module": MODULE,
        "enabled": args.pallas,
        "unavailable": args.pallas_unavailable,
        "dtypes": list(DTYPES),
        "precision": PRECISION,
        "configs": [{"name": c.name, **dataclasses.asdict(c)} for c in CONFIGS],
    }
