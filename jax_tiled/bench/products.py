"""The product suite: one row per shape, dtype, precision and kernel, against the peer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_tiled.bench.harness import (
    VersusPeer,
    count_rows,
    kernels_for,
    matmul_fn,
    measure_against_peers,
    measure_into,
    precisions_for,
)
from jax_tiled.bench.progress import Progress
from jax_tiled.bench.shapes import Shape
from jax_tiled.bench.timing import Budget, choose_sets, random_sets

# Error spot check vs a float64 NumPy product: only for problems this small.
CHECK_MAX_MNK = 1 << 31


def product_fn(shape: Shape, precision: str, kernel: str, out_dtype: str | None = None):
    """fn(a, b) for one product on the stored operands, into out_dtype (None: the
    operands' dtype); `kernel` is PEER or a kernel name."""
    mm = matmul_fn(precision, kernel, out_dtype)
    if shape.transpose == "tA":
        return lambda a_t, b: mm(a_t.mT, b)
    if shape.transpose == "tB":
        return lambda a, b_t: mm(a, b_t.mT)
    return mm


def make_inputs(shape: Shape, dtype, n_sets: int, seed: int):
    """n_sets distinct random-normal (a, b) pairs, generated on the device."""
    return random_sets(shape.stored_shapes, dtype, n_sets, seed)


def reference(shape: Shape, sets) -> np.ndarray:
    """The first pair's product in float64 NumPy."""
    a, b = (np.asarray(x).astype(np.float64) for x in sets[0])
    a = a.swapaxes(-1, -2) if shape.transpose == "tA" else a
    b = b.swapaxes(-1, -2) if shape.transpose == "tB" else b
    return np.matmul(a, b)


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    out = out.astype(np.float64)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), np.finfo(float).tiny))


@dataclasses.dataclass
class Row(VersusPeer):
    shape: str
    batch: int
    m: int
    k: int
    n: int
    transpose: str
    dtype: str
    precision: str
    kernel: str
    sets: int
    ms: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    ratio: float | None = None
    peer_ms: float | None = None
    peer_precision: str | None = None
    rel_error: float | None = None
    calls: int | None = None
    samples_ms: list[float] | None = None
    error: str | None = None


def measure_row(
    shape: Shape, dtype: str, precision: str, kernel: str, sets, ref, args, budget: Budget
) -> Row:
    row = Row(
        shape.name,
        shape.batch,
        shape.m,
        shape.k,
        shape.n,
        shape.transpose,
        dtype,
        precision,
        kernel,
        len(sets),
    )
    timing = measure_into(
        row,
        product_fn(shape, precision, kernel),
        sets,
        shape.flops,
        args,
        budget,
        keep_first=ref is not None,
    )
    if timing is None:
        return row
    if shape.skinny:
        row.gbps = shape.bytes_moved(np.dtype(dtype).itemsize) / timing.seconds / 1e9
    if ref is not None:
        row.rel_error = relative_error(timing.first, ref)
    return row


def plan(args) -> list[tuple[Shape, str, list[str]]]:
    """(shape, dtype, precisions) in run order."""
    return [
        (shape, dtype, precisions_for(dtype, args.precision))
        for shape in args.shapes
        for dtype in args.dtype
    ]


def run_shape(
    shape: Shape,
    dtype: str,
    kernels: dict[str, list[str]],
    args,
    budget: Budget,
    progress: Progress,
) -> list[Row]:
    """Rows for one shape and dtype; `kernels` maps each precision to its kernels."""
    n_sets = choose_sets(shape.input_bytes(np.dtype(dtype).itemsize), budget)
    sets = make_inputs(shape, jnp.dtype(dtype), n_sets, args.seed)
    small = shape.batch * shape.m * shape.n * shape.k <= CHECK_MAX_MNK
    ref = reference(shape, sets) if args.check and small else None

    def measure(precision, kernel):
        progress.describe(f"{shape.name} {dtype} {precision} {kernel}")
        row = measure_row(shape, dtype, precision, kernel, sets, ref, args, budget)
        progress.step()
        return row

    return measure_against_peers(kernels, measure)


def run_all(args, kernels: list[str], budget: Budget) -> list[Row]:
    requested = args.kernels is not None
    work = [
        (shape, dtype, {p: kernels_for(dtype, p, kernels, requested) for p in precisions})
        for shape, dtype, precisions in plan(args)
    ]
    rows = []
    with Progress(
        sum(count_rows(ks) for _, _, ks in work), enabled=not args.no_progress
    ) as progress:
        for shape, dtype, precision_kernels in work:
            rows += run_shape(shape, dtype, precision_kernels, args, budget, progress)
            jax.clear_caches()
    return rows
