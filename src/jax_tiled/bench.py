"""Benchmark jax_tiled's kernels against jnp.matmul, as /work/shared/PERF.md asks.

Every kernel rung usable on the default backend (each forced by name, plus
"auto") and the peer `jnp.matmul` run in one process through one harness, on
the same random-normal inputs; each row reports its time, TFLOP/s, achieved
GB/s for skinny shapes, and its ratio to the peer (peer time / kernel time, so
> 1 means faster than jnp.matmul). The peer of a float32 row is `jnp.matmul`
at the same precision, except that `high` (3xTF32) is compared with `highest`,
as PERF.md's targets say.

Usage:

    python -m jax_tiled.bench                      # the backend's default suite
    python -m jax_tiled.bench --quick              # a short run
    python -m jax_tiled.bench --dtype bfloat16 --dtype float16 --shapes 4096^3,8192^3
    python -m jax_tiled.bench --precision highest --kernels smem,auto
    python -m jax_tiled.bench --json out.json --plot out.png
    python -m jax_tiled.bench --list-shapes
    python -m jax_tiled.bench --train-step         # PERF.md's training step, bfloat16
    python -m jax_tiled.bench --train-step --width 8192 --tokens 8192 --json step.json

Shape names are M x K x N: "4096^3", "1000x800x1200", "b32x512x64x512" (batch
32), "b8x2048^3"; a suffix "-tA" / "-tB" stores a (or b) transposed and passes
`a_t.mT` (or `b_t.mT`) to the product. Any such name works in --shapes, not
only the suite's.

Timing: each (shape, dtype) gets R distinct input pairs, generated once on the
device with jax.random (R is chosen so the pairs overflow the caches while
staying within a memory budget). One jitted function computes all R products
(a Python loop inside jit, the same for our kernels and the peer); after
warm-up, a sample is the wall time of one or more pipelined calls plus
block_until_ready, divided by the number of products; a row reports the
median of --repeats samples.

Training step (--train-step): one jitted step of a 2-layer MLP, y = relu(x @ w1)
@ w2 with loss mean(y**2) in float32, and jax.value_and_grad with respect to w1,
w2 and x, timed once with `jnp.matmul` and once per requested kernel with
`jax_tiled.matmul`; the matmul is the only difference. The step runs 6 products
(2 forward, 4 in the VJP: x's cotangent is taken as for a block inside a deeper
model) of 2*tokens*width^2 FLOPs each. Inputs rotate and samples are timed as
above, per step. Our step's loss and gradients must match the peer's within a
tolerance for the dtype, or the row fails and the exit status is 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform as host_platform
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PEER = "jnp.matmul"
DTYPES = ("float32", "bfloat16", "float16", "float64")
PRECISIONS = ("default", "high", "highest")
PEER_PRECISION = {"default": "default", "high": "highest", "highest": "highest"}  # PERF.md

GPU_SUITE = ("512^3", "1024^3", "2048^3", "4096^3", "8192^3", "1000x800x1200",
             "4096x4096x128", "128x4096x4096", "16x8192x8192", "8192x128x8192",
             "4096x14336x4096", "b32x512x64x512", "b8x2048^3",
             "4096^3-tA", "4096^3-tB", "8192^3-tA", "8192^3-tB")
GPU_QUICK = ("1024^3", "4096^3", "1000x800x1200", "4096x4096x128")
CPU_SUITE = ("512^3", "1024^3", "2048^3", "1000x800x1200", "2048x2048x128",
             "128x2048x2048", "16x2048x2048", "2048x128x2048", "b32x512x64x512",
             "1024^3-tA", "1024^3-tB")
CPU_QUICK = ("256^3", "512^3", "1024^3", "1000x800x1200")


@dataclasses.dataclass(frozen=True)
class Budget:
    """How many input pairs to rotate through, per backend."""
    max_bytes: int      # inputs of all pairs of one shape stay under this
    target_bytes: int   # ... and reach this, if max_sets allows, to overflow caches
    max_sets: int
    sample_s: float     # pipeline calls until a sample lasts about this long
    max_calls: int = 64


GPU_BUDGET = Budget(max_bytes=1 << 30, target_bytes=256 << 20, max_sets=64, sample_s=0.02)
CPU_BUDGET = Budget(max_bytes=256 << 20, target_bytes=64 << 20, max_sets=8, sample_s=0.02)

# Error spot check vs a float64 NumPy product: only for problems this small.
CHECK_MAX_MNK = 1 << 31
SKINNY = 128
# Peak memory bandwidth (GB/s) by device_kind substring, for the %-of-HBM note.
HBM_GBPS = {"H200": 4800, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
            "A100": 1555}


# ---------------------------------------------------------------------------
# Shapes

@dataclasses.dataclass(frozen=True)
class Shape:
    m: int
    k: int
    n: int
    batch: int = 1
    transpose: str = ""  # "", "tA" or "tB"

    @property
    def name(self) -> str:
        core = f"{self.m}^3" if self.m == self.k == self.n else f"{self.m}x{self.k}x{self.n}"
        prefix = f"b{self.batch}x" if self.batch > 1 else ""
        suffix = f"-{self.transpose}" if self.transpose else ""
        return prefix + core + suffix

    def _lead(self) -> tuple[int, ...]:
        return (self.batch,) if self.batch > 1 else ()

    @property
    def stored_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of a and b as generated (a transposed operand stored as its .mT)."""
        a = (self.k, self.m) if self.transpose == "tA" else (self.m, self.k)
        b = (self.n, self.k) if self.transpose == "tB" else (self.k, self.n)
        return self._lead() + a, self._lead() + b

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    @property
    def skinny(self) -> bool:
        return min(self.m, self.n, self.k) <= SKINNY

    def bytes_moved(self, itemsize: int) -> int:
        """Each input read once and the output written once."""
        return self.batch * (self.m * self.k + self.k * self.n + self.m * self.n) * itemsize

    def input_bytes(self, itemsize: int) -> int:
        return self.batch * (self.m * self.k + self.k * self.n) * itemsize


_SHAPE_RE = re.compile(r"^(?:b(\d+)x)?(?:(\d+)\^3|(\d+)x(\d+)x(\d+))(?:-(tA|tB))?$", re.I)


def parse_shape(text: str) -> Shape:
    match = _SHAPE_RE.match(text.strip())
    if not match:
        raise ValueError(f"bad shape {text!r}: use e.g. 4096^3, 1000x800x1200, "
                         "b32x512x64x512, 8192^3-tA")
    batch, cube, m, k, n, transpose = match.groups()
    m, k, n = (int(cube),) * 3 if cube else (int(m), int(k), int(n))
    transpose = {"ta": "tA", "tb": "tB"}.get((transpose or "").lower(), "")
    return Shape(m, k, n, int(batch or 1), transpose)


# ---------------------------------------------------------------------------
# Products and timing

def matmul_fn(precision: str, kernel: str):
    """mm(a, b): jnp.matmul for PEER, else jax_tiled.matmul forcing the rung `kernel`."""
    prec = lax.Precision(precision)
    if kernel == PEER:
        def mm(a, b):
            return jnp.matmul(a, b, precision=prec)
    else:
        import jax_tiled

        def mm(a, b):
            return jax_tiled.matmul(a, b, precision=prec, kernel=kernel)
    return mm


def product_fn(shape: Shape, precision: str, kernel: str):
    """fn(a, b) for one product on the stored operands; `kernel` is PEER or a rung."""
    mm = matmul_fn(precision, kernel)
    if shape.transpose == "tA":
        return lambda a_t, b: mm(a_t.mT, b)
    if shape.transpose == "tB":
        return lambda a, b_t: mm(a, b_t.mT)
    return mm


def choose_sets(set_bytes: int, budget: Budget) -> int:
    """How many input sets of set_bytes each to rotate through."""
    want = math.ceil(budget.target_bytes / set_bytes)
    return max(1, min(want, budget.max_sets, budget.max_bytes // set_bytes))


def random_sets(shapes, dtype, n_sets: int, seed: int) -> list[tuple]:
    """n_sets distinct tuples of random-normal arrays of these shapes, generated on the device."""
    keys = iter(jax.random.split(jax.random.key(seed), len(shapes) * n_sets))
    sets = [tuple(jax.random.normal(next(keys), s, dtype) for s in shapes) for _ in range(n_sets)]
    return jax.block_until_ready(sets)


def make_inputs(shape: Shape, dtype, n_sets: int, seed: int):
    """n_sets distinct random-normal (a, b) pairs, generated on the device."""
    return random_sets(shape.stored_shapes, dtype, n_sets, seed)


@dataclasses.dataclass
class Timing:
    seconds: float           # median per product
    samples: list[float]     # per-product seconds of each sample
    calls: int               # jitted calls pipelined per sample
    first: np.ndarray | None  # fn's output on the first set (NumPy leaves), when asked for


def time_products(fn, sets, *, repeats: int, warmup: int, budget: Budget,
                  keep_first: bool) -> Timing:
    """Median per-set wall time of one jitted function applying fn to every set
    of operands (a product's pair, or a training step's arrays).
    Calls are pipelined (dispatched back to back, blocked on once) until a sample
    lasts about budget.sample_s, with their outputs within budget.max_bytes."""
    run = jax.jit(lambda sets: [fn(*operands) for operands in sets])
    out = jax.block_until_ready(run(sets))  # compiles
    first = jax.tree.map(np.asarray, out[0]) if keep_first else None
    out_bytes = sum(x.nbytes for x in jax.tree.leaves(out))
    del out
    elapsed = budget.sample_s
    for _ in range(max(1, warmup)):
        start = time.perf_counter()
        jax.block_until_ready(run(sets))
        elapsed = time.perf_counter() - start
    calls = min(budget.max_calls, math.ceil(budget.sample_s / max(elapsed, 1e-9)),
                budget.max_bytes // max(out_bytes, 1))
    calls = max(1, calls)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [run(sets) for _ in range(calls)]
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - start) / (calls * len(sets)))
        del outs
    return Timing(statistics.median(samples), samples, calls, first)


def reference(shape: Shape, sets) -> np.ndarray:
    """The first pair's product in float64 NumPy."""
    a, b = (np.asarray(x).astype(np.float64) for x in sets[0])
    a = a.swapaxes(-1, -2) if shape.transpose == "tA" else a
    b = b.swapaxes(-1, -2) if shape.transpose == "tB" else b
    return np.matmul(a, b)


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    out = out.astype(np.float64)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), np.finfo(float).tiny))


# ---------------------------------------------------------------------------
# Rows

class VersusPeer:
    """A row timed against the peer: it has a kernel, and the peer's rows are PEER."""
    kernel: str

    @property
    def is_peer(self) -> bool:
        return self.kernel == PEER


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


def measure_into(row, fn, sets, flops: int, args, budget: Budget, *,
                 keep_first: bool) -> Timing | None:
    """Times fn over the sets into row (ms, TFLOP/s for `flops` per set, samples);
    returns the timing, or None with row.error set when fn fails."""
    try:
        timing = time_products(fn, sets, repeats=args.repeats, warmup=args.warmup,
                               budget=budget, keep_first=keep_first)
    except Exception as exc:  # noqa: BLE001 - an unsupported rung is a row, not a crash
        row.error = f"{type(exc).__name__}: {exc}"
        return None
    row.ms = timing.seconds * 1e3
    row.samples_ms = [s * 1e3 for s in timing.samples]
    row.calls = timing.calls
    row.tflops = flops / timing.seconds / 1e12
    return timing


def measure_row(shape: Shape, dtype: str, precision: str, kernel: str, sets, ref,
                args, budget: Budget) -> Row:
    row = Row(shape.name, shape.batch, shape.m, shape.k, shape.n, shape.transpose, dtype,
              precision, kernel, len(sets))
    timing = measure_into(row, product_fn(shape, precision, kernel), sets, shape.flops, args,
                          budget, keep_first=ref is not None)
    if timing is None:
        return row
    if shape.skinny:
        row.gbps = shape.bytes_moved(np.dtype(dtype).itemsize) / timing.seconds / 1e9
    if ref is not None:
        row.rel_error = relative_error(timing.first, ref)
    return row


def attach_ratio(row, peer) -> None:
    if peer is None:
        return
    row.peer_precision = peer.precision
    row.peer_ms = peer.ms
    if row.ms and peer.ms and row.error is None:  # a wrong result's speed is no ratio
        row.ratio = peer.ms / row.ms


# ---------------------------------------------------------------------------
# Progress

class Progress:
    """tqdm when installed, else a one-line counter on stderr."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, unit="row", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def describe(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_description_str(text)
        else:
            sys.stderr.write(f"\r[{self.done:>3}/{self.total}] {text:<60.60}")
            sys.stderr.flush()

    def step(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            sys.stderr.write(f"\r[{self.done:>3}/{self.total}] done{' ' * 56}\n")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# ---------------------------------------------------------------------------
# The run

def precisions_for(dtype: str, requested: list[str] | None) -> list[str]:
    if requested:
        return requested
    return list(PRECISIONS) if dtype == "float32" else ["default"]


def plan(args) -> list[tuple[Shape, str, list[str]]]:
    """(shape, dtype, precisions) in run order."""
    return [(shape, dtype, precisions_for(dtype, args.precision))
            for shape in args.shapes for dtype in args.dtype]


def count_rows(kernels: dict[str, list[str]]) -> int:
    """Rows that measure_against_peers(kernels, ...) makes."""
    return len({PEER_PRECISION[p] for p in kernels}) + sum(map(len, kernels.values()))


def measure_against_peers(kernels: dict[str, list[str]], measure) -> list:
    """Rows of measure(precision, kernel) for each precision's kernels: the peer
    once per peer precision, before the kernels it is compared with, and each
    kernel row with its ratio to it."""
    rows, peers = [], {}
    for precision, precision_kernels in kernels.items():
        peer_prec = PEER_PRECISION[precision]
        if peer_prec not in peers:
            peers[peer_prec] = measure(peer_prec, PEER)
            rows.append(peers[peer_prec])
        for kernel in precision_kernels:
            row = measure(precision, kernel)
            attach_ratio(row, peers[peer_prec])
            rows.append(row)
    return rows


def run_shape(shape: Shape, dtype: str, kernels: dict[str, list[str]], args, budget: Budget,
              progress: Progress) -> list[Row]:
    """Rows for one shape and dtype; `kernels` maps each precision to its rungs."""
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


def kernels_for(dtype: str, precision: str, kernels: list[str], requested: bool) -> list[str]:
    """The kernels to time on `dtype` at `precision`: without --kernels, only the
    rungs that compute it (the others would be error rows: the tensor-core rungs
    take float32 at default and high, not highest); named ones are timed as asked."""
    if requested:
        return kernels
    import jax_tiled

    takes = set(jax_tiled.kernels(None, jnp.dtype(dtype), precision=precision))
    return [k for k in kernels if k == "auto" or k in takes]


def run_all(args, kernels: list[str], budget: Budget) -> list[Row]:
    requested = args.kernels is not None
    work = [(shape, dtype, {p: kernels_for(dtype, p, kernels, requested) for p in precisions})
            for shape, dtype, precisions in plan(args)]
    rows = []
    with Progress(sum(count_rows(ks) for _, _, ks in work),
                  enabled=not args.no_progress) as progress:
        for shape, dtype, precision_kernels in work:
            rows += run_shape(shape, dtype, precision_kernels, args, budget, progress)
            jax.clear_caches()
    return rows


# ---------------------------------------------------------------------------
# Training step

TRAIN_WIDTH = {"gpu": 8192, "cpu": 1024}  # PERF.md's width; on a CPU, one that takes seconds

# Largest relative difference allowed between our step's loss and gradients and the
# peer's. Both sides round h, y and the cotangents to the dtype after accumulating
# in different orders, so elements can round one unit apart, and that propagates
# through the later products: a few units of the dtype's rounding (bfloat16 2^-8,
# float16 2^-11) with a margin. float32 at default precision may run as TF32
# (float16's mantissa) on either side, so it gets float16's tolerance.
AGREEMENT_TOL = {"bfloat16": 3e-2, "float16": 1e-2, "float32": 1e-4, "float64": 1e-9}


def agreement_tolerance(dtype: str, precision: str) -> float:
    if dtype == "float32" and precision == "default":
        return AGREEMENT_TOL["float16"]
    return AGREEMENT_TOL[dtype]


@dataclasses.dataclass
class StepRow(VersusPeer):
    """One training step timed with one matmul (see the module docstring)."""
    width: int
    tokens: int
    dtype: str
    precision: str
    kernel: str
    sets: int
    ms: float | None = None          # per step
    tflops: float | None = None      # FLOPs of the step's products per second
    ratio: float | None = None       # peer ms / ms
    peer_ms: float | None = None
    peer_precision: str | None = None
    loss: float | None = None
    loss_diff: float | None = None   # |loss - peer's| / |peer's|
    grad_diff: float | None = None   # worst of dw1, dw2, dx: ||g - peer's|| / ||peer's||
    tolerance: float | None = None   # the most loss_diff and grad_diff may be
    calls: int | None = None
    samples_ms: list[float] | None = None
    error: str | None = None


def mlp_loss(matmul, w1, w2, x):
    """Mean square of a 2-layer MLP's output, reduced in float32 as mixed-precision
    training does."""
    y = matmul(jax.nn.relu(matmul(x, w1)), w2)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def train_step_fn(precision: str, kernel: str):
    """step(w1, w2, x) -> (loss, (dw1, dw2, dx)), every product by matmul_fn(precision, kernel)."""
    return jax.value_and_grad(functools.partial(mlp_loss, matmul_fn(precision, kernel)),
                              argnums=(0, 1, 2))


def train_step_products(width: int, tokens: int) -> list[Shape]:
    """The products one step runs, as M x K x N of op(a) @ op(b)."""
    t, w = tokens, width
    return [Shape(t, w, w), Shape(t, w, w),  # forward: z = x @ w1, y = relu(z) @ w2
            Shape(t, w, w), Shape(w, t, w),  # layer 2's VJP: dy @ w2.T, relu(z).T @ dy
            Shape(t, w, w), Shape(w, t, w)]  # layer 1's VJP: dz @ w1.T, x.T @ dz


def train_step_flops(width: int, tokens: int) -> int:
    return sum(p.flops for p in train_step_products(width, tokens))


def make_step_inputs(width: int, tokens: int, dtype, budget: Budget, seed: int) -> list[tuple]:
    """Rotating (w1, w2, x) sets, random normal, the weights scaled by 1/sqrt(width)
    as at initialisation, so that activations stay near unit scale at any width."""
    shapes = ((width, width), (width, width), (tokens, width))
    set_bytes = sum(map(math.prod, shapes)) * jnp.dtype(dtype).itemsize
    sets = random_sets(shapes, dtype, choose_sets(set_bytes, budget), seed)
    scale = 1 / math.sqrt(width)
    return jax.block_until_ready([(w1 * scale, w2 * scale, x) for w1, w2, x in sets])


def relative_difference(ours, peer) -> float:
    """||ours - peer|| / ||peer|| in float64; inf or nan when either is not finite."""
    ours, peer = np.asarray(ours, np.float64), np.asarray(peer, np.float64)
    return float(np.linalg.norm(ours - peer) / max(np.linalg.norm(peer), np.finfo(float).tiny))


def check_agreement(row: StepRow, ours, peer) -> None:
    """Records how far our step's loss and gradients are from the peer's. Past the
    tolerance, or not finite, the row fails: it gets no ratio and the run exits 1,
    so that a wrong kernel cannot pass for a fast one."""
    (loss, grads), (peer_loss, peer_grads) = ours, peer
    row.loss_diff = relative_difference(loss, peer_loss)
    row.grad_diff = float(np.max([relative_difference(g, p) for g, p in zip(grads, peer_grads)]))
    row.tolerance = agreement_tolerance(row.dtype, row.precision)
    if not (row.loss_diff <= row.tolerance and row.grad_diff <= row.tolerance):  # nan fails too
        row.error = (f"disagrees with {PEER}: loss by {row.loss_diff:.1e}, gradients by "
                     f"{row.grad_diff:.1e} (relative; tolerance {row.tolerance:.0e})")


def measure_step(dtype: str, precision: str, kernel: str, sets, args, budget: Budget):
    """The step's row, and its (loss, grads) on the first set (None when it failed)."""
    row = StepRow(args.width, args.tokens, dtype, precision, kernel, len(sets))
    timing = measure_into(row, train_step_fn(precision, kernel), sets,
                          train_step_flops(args.width, args.tokens), args, budget,
                          keep_first=True)
    if timing is None:
        return row, None
    row.loss = float(timing.first[0])
    return row, timing.first


def run_train_step(dtype: str, precisions: list[str], kernels: list[str], args,
                   budget: Budget, progress: Progress) -> list[StepRow]:
    sets = make_step_inputs(args.width, args.tokens, jnp.dtype(dtype), budget, args.seed)
    peer_outputs = {}  # peer precision -> the peer step's (loss, grads) on the first set

    def measure(precision, kernel):
        progress.describe(f"train step {args.width} {dtype} {precision} {kernel}")
        row, outputs = measure_step(dtype, precision, kernel, sets, args, budget)
        peer = peer_outputs.get(PEER_PRECISION[precision])
        if row.is_peer:
            peer_outputs[precision] = outputs
        elif outputs is not None and peer is not None:
            check_agreement(row, outputs, peer)
        progress.step()
        return row

    return measure_against_peers({p: kernels for p in precisions}, measure)


def run_train_steps(args, kernels: list[str], budget: Budget) -> list[StepRow]:
    precisions = args.precision or ["default"]
    rows = []
    with Progress(len(args.dtype) * count_rows({p: kernels for p in precisions}),
                  enabled=not args.no_progress) as progress:
        for dtype in args.dtype:
            rows += run_train_step(dtype, precisions, kernels, args, budget, progress)
            jax.clear_caches()
    return rows


# ---------------------------------------------------------------------------
# Reports

def geomeans(rows: list[Row]) -> list[dict]:
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for row in rows:
        if not row.is_peer:
            groups.setdefault((row.dtype, row.precision, row.kernel), []).append(row)
    summary = []
    for (dtype, precision, kernel), group in groups.items():
        r = [row.ratio for row in group if row.ratio]
        summary.append({"dtype": dtype, "precision": precision, "kernel": kernel, "n": len(r),
                        "failed": sum(row.error is not None for row in group),
                        "geomean": math.exp(sum(map(math.log, r)) / len(r)) if r else None,
                        "min": min(r) if r else None, "below_0.8": sum(x < 0.8 for x in r)})
    return summary


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _gbps_text(row: Row, hbm: float | None) -> str:
    if row.gbps is None:
        return ""
    text = f"{row.gbps:.0f}" if row.gbps >= 100 else f"{row.gbps:.2f}"
    return text + (f" ({100 * row.gbps / hbm:.0f}% HBM)" if hbm else "")


def format_table(rows: list[Row], hbm: float | None) -> str:
    head = ("shape", "dtype", "precision", "kernel", "sets", "ms", "TFLOP/s", "GB/s",
            "x peer", "rel.err")
    return _text_table(head, rows, lambda row: _row_cells(row, hbm), left=4)


def _text_table(head: tuple[str, ...], rows: list, cells_of, left: int) -> str:
    """Aligned columns, the first `left` (what a row measures) flush left. A failed
    row shows those and the next cell, then its error in place of the numbers."""
    cells = {id(row): cells_of(row) for row in rows}
    widths = [max(len(c[i]) for c in (head, *cells.values())) for i in range(len(head))]

    def line(values):
        return "  ".join(v.ljust(w) if i < left else v.rjust(w)
                         for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    out = [line(head), line(["-" * w for w in widths])]
    for row in rows:
        if row.error:
            message = row.error.splitlines()[0][:100]
            out.append(f"{line(cells[id(row)][:left + 1])}  ERROR {message}")
        else:
            out.append(line(cells[id(row)]))
    return "\n".join(out)


def _row_cells(row: Row, hbm: float | None) -> tuple[str, ...]:
    lead = (row.shape, row.dtype, row.precision, row.kernel, str(row.sets))
    if row.error:
        return lead + ("",) * 5
    ratio = "peer" if row.is_peer else _fmt(row.ratio, ".3f")
    return lead + (_fmt(row.ms, ".4f"), _fmt(row.tflops, ".3f"), _gbps_text(row, hbm),
                   ratio, _fmt(row.rel_error, ".1e"))


def format_step_table(rows: list[StepRow]) -> str:
    head = ("dtype", "precision", "kernel", "sets", "ms/step", "TFLOP/s", "x peer", "loss",
            "loss diff", "grad diff", "tol")
    return _text_table(head, rows, _step_cells, left=3)


def _step_cells(row: StepRow) -> tuple[str, ...]:
    lead = (row.dtype, row.precision, row.kernel, str(row.sets))
    if row.error:
        return lead + ("",) * 7
    ratio = "peer" if row.is_peer else _fmt(row.ratio, ".3f")
    return lead + (_fmt(row.ms, ".4f"), _fmt(row.tflops, ".3f"), ratio, _fmt(row.loss, ".5g"),
                   _fmt(row.loss_diff, ".1e"), _fmt(row.grad_diff, ".1e"),
                   _fmt(row.tolerance, ".0e"))


def describe_train_step(width: int, tokens: int) -> str:
    products = train_step_products(width, tokens)
    return (f"training step: 2-layer MLP, width {width}, {tokens} tokens; y = relu(x @ w1) @ w2, "
            f"loss mean(y**2) in float32, value_and_grad wrt w1, w2, x: {len(products)} "
            f"products, {train_step_flops(width, tokens) / 1e12:.4g} TFLOP per step")


def format_geomeans(summary: list[dict]) -> str:
    out = ["geometric mean of ratios (peer time / kernel time):"]
    for g in summary:
        out.append(f"  {g['dtype']:<9} {g['precision']:<8} {g['kernel']:<12} "
                   f"{_fmt(g['geomean'], '.3f'):>6}x  over {g['n']} shapes, "
                   f"min {_fmt(g['min'], '.3f')}x, {g['below_0.8']} below 0.8x"
                   + (f", {g['failed']} failed" if g["failed"] else ""))
    return "\n".join(out)


def device_info() -> dict:
    device = jax.devices()[0]
    info = {"device": device.device_kind, "platform": device.platform,
            "device_count": jax.device_count(), "jax_version": jax.__version__,
            "jaxlib_version": _jaxlib_version(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "python": host_platform.python_version(), "cpu": _cpu_model(),
            "cpu_count": os.cpu_count()}
    try:
        import jax_tiled
        info["jax_tiled_version"] = jax_tiled.__version__
    except Exception:  # noqa: BLE001
        pass
    return info


def _jaxlib_version() -> str | None:
    try:
        import jaxlib
        return jaxlib.__version__
    except Exception:  # noqa: BLE001
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return host_platform.processor() or host_platform.machine()


def heading(info: dict) -> str:
    return f"# {device_label(info)}, jax {info['jax_version']}, {info['date']}"


def device_label(info: dict) -> str:
    if info["platform"] == "cpu":
        return f"CPU: {info['cpu']} ({info['cpu_count']} cores)"
    return f"{info['device']} ({info['platform']})"


def hbm_gbps(device_kind: str) -> float | None:
    for key, value in HBM_GBPS.items():
        if key in device_kind:
            return value
    return None


def write_json(path: str, info: dict, args, rows: list, **sections) -> None:
    doc = {**info, "argv": args.argv, "repeats": args.repeats, "warmup": args.warmup,
           "peer_precision": PEER_PRECISION, "rows": [dataclasses.asdict(r) for r in rows],
           **sections}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def write_plot(path: str, info: dict, rows: list[Row]) -> None:
    """TFLOP/s per shape, one bar per kernel and peer; one panel per dtype/precision."""
    plt = pyplot()
    panels = _plot_panels([row for row in rows if row.tflops is not None])
    if not panels:
        print("bench: nothing to plot (every row failed)", file=sys.stderr)
        return
    fig, axes = plt.subplots(len(panels), 1, squeeze=False, layout="constrained",
                             figsize=(max(8, 0.9 * _max_shapes(panels) + 3), 3.8 * len(panels)))
    for ax, ((dtype, precision), prows) in zip(axes[:, 0], panels.items()):
        _plot_panel(ax, prows, precision, f"{dtype}, precision {precision}")
    fig.suptitle(f"jax_tiled vs {PEER} - {device_label(info)} - {info['date'][:16]}")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or a clear exit when it is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("python -m jax_tiled.bench: --plot needs matplotlib "
                         "(pip install matplotlib)") from None
    return plt


def _plot_panels(rows: list[Row]) -> dict[tuple[str, str], list[Row]]:
    """(dtype, precision) -> its kernel rows and the peer rows they compare with."""
    panels: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        if not row.is_peer:
            panels.setdefault((row.dtype, row.precision), []).append(row)
    for (dtype, precision), prows in panels.items():
        prows += [r for r in rows if r.is_peer and r.dtype == dtype
                  and r.precision == PEER_PRECISION[precision]]
    return panels


def _max_shapes(panels) -> int:
    return max(len({r.shape for r in rows}) for rows in panels.values())


def _plot_panel(ax, rows: list[Row], precision: str, title: str) -> None:
    shapes = list(dict.fromkeys(r.shape for r in rows))
    names = list(dict.fromkeys(r.kernel for r in rows))
    names.sort(key=lambda k: (k != PEER, k == "auto"))  # peer first, auto last
    labels = {k: k for k in names}
    for r in rows:  # peers for 'high' run at 'highest': say so in the legend
        if r.is_peer and r.precision != precision:
            labels[PEER] = f"{PEER} ({r.precision})"
    width = 0.8 / len(names)
    value = {(r.shape, r.kernel): r.tflops for r in rows}
    for i, name in enumerate(names):
        xs = [s + (i - (len(names) - 1) / 2) * width for s in range(len(shapes))]
        ys = [value.get((shape, name), 0.0) for shape in shapes]
        ax.bar(xs, ys, width, label=labels[name])
    ax.set_xticks(range(len(shapes)), shapes, rotation=30, ha="right")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", ncols=min(len(names), 4))


# ---------------------------------------------------------------------------
# Command line

def _split(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m jax_tiled.bench",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", action="append", metavar="DT",
                   help=f"dtype(s), repeatable or comma-separated: {', '.join(DTYPES)} "
                        "(default float32; --train-step: bfloat16)")
    p.add_argument("--precision", action="append", metavar="P",
                   help="precision(s): default, high, highest (default: all three for "
                        "float32, default otherwise)")
    p.add_argument("--kernels", action="append", metavar="K",
                   help="subset of kernel rungs (names from jax_tiled.kernels(), or auto; "
                        "--train-step: default auto)")
    p.add_argument("--shapes", action="append", metavar="S",
                   help="shapes by name, e.g. 4096^3, 1000x800x1200, b32x512x64x512, 8192^3-tA")
    p.add_argument("--quick", action="store_true",
                   help="a short run: a few small and medium shapes, fewer repeats")
    p.add_argument("--cpu-suite", action="store_true",
                   help="the small CPU suite even on a GPU backend (default on CPU)")
    p.add_argument("--repeats", type=int, help="samples per row, median taken (default 10; "
                                               "--quick 5; at least 5)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up calls after compiling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the error spot check against float64 NumPy on small shapes")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    p.add_argument("--list-shapes", action="store_true", help="print the suites and exit")
    p.add_argument("--train-step", action="store_true",
                   help="time PERF.md's training step (forward + VJP of a 2-layer MLP) with "
                        "jnp.matmul and with each kernel, instead of single products "
                        "(default dtype bfloat16, precision default)")
    p.add_argument("--width", type=int, metavar="W",
                   help=f"--train-step: the MLP's width (default {TRAIN_WIDTH['gpu']}; "
                        f"{TRAIN_WIDTH['cpu']} on CPU)")
    p.add_argument("--tokens", "--batch-rows", type=int, metavar="T",
                   help="--train-step: rows of x, i.e. batch x sequence (default: the width)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.train_step and (args.shapes or args.cpu_suite or args.plot or args.list_shapes):
        p.error("--train-step times the MLP step only: --shapes, --cpu-suite, --plot and "
                "--list-shapes do not apply")
    if not args.train_step and (args.width or args.tokens):
        p.error("--width and --tokens go with --train-step")
    if any(v is not None and v < 1 for v in (args.width, args.tokens)):
        p.error("--width and --tokens must be positive")
    args.dtype = _split(args.dtype) or (["bfloat16"] if args.train_step else ["float32"])
    args.precision = _split(args.precision)
    args.kernels = _split(args.kernels)
    args.shapes = _split(args.shapes)
    for value, allowed, what in ((args.dtype, DTYPES, "dtype"),
                                 (args.precision or [], PRECISIONS, "precision")):
        bad = [v for v in value if v not in allowed]
        if bad:
            p.error(f"unknown {what} {bad}; choose from {list(allowed)}")
    if args.repeats is None:
        args.repeats = 5 if args.quick else 10
    if args.repeats < 5:
        p.error("--repeats must be at least 5 (PERF.md: median of at least 5 samples)")
    try:
        args.shapes = [parse_shape(s) for s in args.shapes] if args.shapes else None
    except ValueError as exc:
        p.error(str(exc))
    return p, args


def default_shapes(args, on_cpu: bool) -> list[Shape]:
    if on_cpu or args.cpu_suite:
        names = CPU_QUICK if args.quick else CPU_SUITE
    else:
        names = GPU_QUICK if args.quick else GPU_SUITE
    return [parse_shape(name) for name in names]


def select_kernels(parser, requested: list[str] | None, available: list[str]) -> list[str]:
    valid = [*available, "auto"]
    if requested is None:
        return valid
    bad = [k for k in requested if k not in valid]
    if bad:
        parser.error(f"kernel(s) {bad} not available on {jax.default_backend()}; valid: {valid}")
    return requested


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    if args.list_shapes:
        for title, names in (("GPU suite", GPU_SUITE), ("GPU --quick", GPU_QUICK),
                             ("CPU suite", CPU_SUITE), ("CPU --quick", CPU_QUICK)):
            print(f"{title}: {' '.join(names)}")
        return 0
    if args.plot:
        pyplot()  # fail before the run, not after it
    if "float64" in args.dtype:
        jax.config.update("jax_enable_x64", True)
    import jax_tiled

    on_cpu = jax.default_backend() == "cpu"
    budget = CPU_BUDGET if on_cpu else GPU_BUDGET
    info = device_info()
    if args.train_step:
        return train_step_main(parser, args, on_cpu, budget, info)
    kernels = select_kernels(parser, args.kernels, jax_tiled.kernels())
    args.shapes = args.shapes or default_shapes(args, on_cpu)
    print(f"bench: {device_label(info)}; jax {info['jax_version']}; kernels {kernels}; "
          f"{len(args.shapes)} shapes x {args.dtype}; median of {args.repeats}",
          file=sys.stderr)

    rows = run_all(args, kernels, budget)
    summary = geomeans(rows)
    print(heading(info))
    print(format_table(rows, hbm_gbps(info["device"])))
    if any(r.precision == "high" for r in rows):
        print("(precision high: ratio against jnp.matmul at precision highest, per PERF.md)")
    print()
    print(format_geomeans(summary))
    if args.json:
        write_json(args.json, info, args, rows, geomeans=summary)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        write_plot(args.plot, info, rows)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if any(r.error is None for r in rows) else 1


def train_step_main(parser, args, on_cpu: bool, budget: Budget, info: dict) -> int:
    """--train-step: exit status 1 when any step failed or disagreed with the peer's."""
    import jax_tiled

    kernels = select_kernels(parser, args.kernels or ["auto"], jax_tiled.kernels())
    args.width = args.width or TRAIN_WIDTH["cpu" if on_cpu else "gpu"]
    args.tokens = args.tokens or args.width
    print(f"bench: {device_label(info)}; jax {info['jax_version']}; kernels {kernels}; "
          f"training step at width {args.width}, {args.tokens} tokens x {args.dtype}; "
          f"median of {args.repeats}", file=sys.stderr)

    rows = run_train_steps(args, kernels, budget)
    print(heading(info))
    print(describe_train_step(args.width, args.tokens))
    print(format_step_table(rows))
    if args.json:
        write_json(args.json, info, args, rows, train_step={
            "width": args.width, "tokens": args.tokens,
            "flops_per_step": train_step_flops(args.width, args.tokens),
            "model": describe_train_step(args.width, args.tokens)})
        print(f"wrote {args.json}", file=sys.stderr)
    failed = [row for row in rows if row.error]
    for row in failed:
        print(f"bench: training step FAILED with {row.kernel} ({row.dtype}, {row.precision}): "
              f"{row.error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
