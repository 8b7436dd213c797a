"""The product suite: one row per shape, dtype, precision and kernel, against the peers
(jnp.matmul; with --pallas, also the Pallas kernel at its best config: bench/pallas.py)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jax_tiled.bench import pallas
from jax_tiled.bench.harness import (
    PALLAS,
    PEER,
    VersusPeer,
    count_rows,
    kernels_for,
    matmul_fn,
    measure_against_peers,
    measure_into,
    precisions_for,
    rows_for_each,
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
    out_dtype: str | None = None  # the products' dtype where not the operands' (--out-dtype)
    ms: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    ratio: float | None = None
    peer_ms: float | None = None
    peer_precision: str | None = None
    pallas_ms: float | None = None  # the PALLAS peer's time, and ours against it
    pallas_ratio: float | None = None
    rel_error: float | None = None
    calls: int | None = None
    samples_ms: list[float] | None = None
    error: str | None = None
    not_applicable: str | None = None  # a PALLAS row it cannot compute: why
    config: str | None = None  # a PALLAS row: the fastest config's name
    sweep: list[pallas.SweepEntry] | None = None  # a PALLAS row: each config's timing

    @property
    def dtype_label(self) -> str:
        """The operands' dtype, and the products' where they differ (bfloat16->float32)."""
        return f"{self.dtype}->{self.out_dtype}" if self.out_dtype else self.dtype


def measure_row(
    shape: Shape,
    dtype: str,
    precision: str,
    kernel: str,
    sets,
    ref,
    args,
    budget: Budget,
    describe=lambda text: None,
    out_dtype: str | None = None,
) -> Row:
    """One row: PEER, PALLAS (its sweep; describe(config) as each starts) or a kernel,
    into out_dtype (None: the operands' dtype)."""
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
        out_dtype,
    )
    if kernel == PALLAS:
        timing = pallas.sweep_into(
            row, shape, sets, args, budget, describe, keep_first=ref is not None
        )
    else:
        timing = measure_into(
            row,
            product_fn(shape, precision, kernel, out_dtype),
            sets,
            shape.flops,
            args,
            budget,
            keep_first=ref is not None,
        )
    if timing is None:
        return row
    if shape.skinny:
        itemsize = np.dtype(dtype).itemsize
        out_itemsize = np.dtype(out_dtype or dtype).itemsize
        row.gbps = shape.bytes_moved(itemsize, out_itemsize) / timing.seconds / 1e9
    if ref is not None:
        row.rel_error = relative_error(timing.first, ref)
    return row


def out_dtypes(args, dtype: str) -> list[str | None]:
    """The output dtypes --out-dtype asks of the dtype's products (None: the
    operands'); float32 only where it is not the operands' dtype already."""
    outs = [None if out in ("same", dtype) else out for out in args.out_dtype]
    return list(dict.fromkeys(outs))


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

    rows = []
    for out_dtype in out_dtypes(args, dtype):

        def measure(precision, kernel, out_dtype=out_dtype):
            label = (
                f"{shape.name} {dtype}{'->' + out_dtype if out_dtype else ''} {precision} {kernel}"
            )
            progress.describe(label)
            describe = lambda config: progress.describe(f"{label} {config}")
            row = measure_row(
                shape, dtype, precision, kernel, sets, ref, args, budget, describe, out_dtype
            )
            progress.step()
            return row

        rows += measure_against_peers(kernels, measure, peers_of(args))
    return rows


def peers_of(args) -> tuple[str, ...]:
    """The peers each row is timed against: PEER, and PALLAS with --pallas."""
    return (PEER, PALLAS) if args.pallas else (PEER,)


def run_all(args, kernels: list[str], budget: Budget) -> list[Row]:
    requested = args.kernels is not None
    work = [
        (shape, dtype, {p: kernels_for(dtype, p, kernels, requested) for p in precisions})
        for shape, dtype, precisions in plan(args)
    ]
    return rows_for_each(
        work,
        sum(count_rows(ks, peers_of(args)) * len(out_dtypes(args, dtype)) for _, dtype, ks in work),
        args,
        lambda shape_work, progress: run_shape(*shape_work, args, budget, progress),
    )
