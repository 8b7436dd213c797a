"""The ladder report (--ladder): every rung of the CUDA kernel ladder on one shape,
from the naive kernel to the Hopper one, against jnp.matmul.

The rungs are the listed kernels of the CUDA module's table in its order, each
with its rung number (its file's, cpp/cuda/kernels/<rung>_<technique>.cu;
`smem` and `smem16` share rung 1). Each is timed through the product suite's
harness (timing.py: the same rotating random-normal input sets, pipelined
calls, the median of --repeats samples) on one shape per dtype, at the precision
it was built for: float32 at HIGHEST (true fp32) on the SIMT rungs and at
DEFAULT (one TF32 pass) on the tensor-core ones, so that one float32 section
runs the whole ladder; other dtypes at DEFAULT (16-bit inputs: precision changes
nothing). --precision puts every rung at one precision instead. A rung that
refuses the product (pipelined takes float32 inputs only, the tensor-core
rungs no float64) is a row that says why. `jnp.matmul` is the peer, at each
precision the section uses (PEER_PRECISION: HIGH is compared with HIGHEST).

Per rung: TFLOP/s, its speedup over the rung before (the previous timed row of
the section) and over the naive rung, its ratio to jnp.matmul, and the
global-memory bytes each output element costs by its tiling
(`bytes_per_output`); with --ncu, the L2 and DRAM bytes read per output that
Nsight Compute measures, one product per rung in a subprocess (`probe_main`,
this module's hidden entry point). The command line's mode (cli.ladder_main)
prints the rows as a markdown table (report.format_ladder_markdown; also
--ladder-md) and writes them to --json and a PNG (plot.write_ladder_plot;
--plot).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import io
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_tiled.bench import pallas
from jax_tiled.bench.harness import (
    PEER,
    VersusPeer,
    attach_ratio,
    measure_into,
    peer_precision,
    rows_for_each,
)
from jax_tiled.bench.products import make_inputs, product_fn
from jax_tiled.bench.progress import Progress
from jax_tiled.bench.shapes import Shape, parse_shape
from jax_tiled.bench.timing import Budget, choose_sets

DEFAULT_SHAPE = "4096^3"
DEFAULT_DTYPES = ("float32", "bfloat16")

BYTES_TEXT = (
    "bytes/output: the global-memory bytes one output element costs by the rung's "
    "tiling, caches aside: a block computing a block_m x block_n tile reads block_m "
    "rows of A and block_n columns of B, K elements each, so K * (1/block_n + "
    "1/(cluster_m * block_m)) elements per output (a cluster of cluster_m blocks "
    "shares each B tile); the naive rung's 1 x 1 tile reads 2 K"
)
PRECISION_TEXT = (
    "precision: float32 at HIGHEST (true fp32) on the SIMT rungs and DEFAULT (one "
    "TF32 pass) on the tensor-core rungs, the arithmetic each was built for; 16-bit "
    "inputs at DEFAULT; jnp.matmul at each precision a section uses"
)


def bytes_per_output(
    k: int, itemsize: int, block_m: int, block_n: int, cluster_m: int = 1
) -> float:
    """Global-memory bytes read per output element by a kernel's tiling, caches
    aside (BYTES_TEXT). A block_m x block_n output tile reads block_m x K of
    op(A) and K x block_n of op(B): per output, K / block_n elements of A and
    K / block_m of B. A cluster of cluster_m blocks stacked along M that
    multicasts each B tile to all of them (wgmma's TMA multicast) reads B once
    for cluster_m * block_m rows. Splitting K (split_k) or computing C^T
    changes neither count. The naive kernel (1 x 1) reads 2 K per output."""
    return k * itemsize * (1 / block_n + 1 / (cluster_m * block_m))


@dataclasses.dataclass
class LadderRow(VersusPeer):
    shape: str
    dtype: str
    precision: str
    kernel: str
    rung: int | None  # None: the peer
    sets: int = 0
    skipped: str | None = None  # why the rung does not run this product (its refusal)
    plan: str | None = None  # its launch plan, as explain says it
    block_m: int | None = None
    block_n: int | None = None
    cluster_m: int | None = None
    bytes_per_output: float | None = None  # by the tiling (bytes_per_output)
    ms: float | None = None
    tflops: float | None = None
    samples_ms: list[float] | None = None
    calls: int | None = None
    error: str | None = None
    peer_ms: float | None = None
    peer_precision: str | None = None
    ratio: float | None = None  # peer time / ours
    step: float | None = None  # TFLOP/s over the previous timed rung's
    vs_naive: float | None = None  # TFLOP/s over rung 0's
    l2_bytes_per_output: float | None = None  # ncu: L2 read sectors x 32 / outputs
    dram_bytes_per_output: float | None = None  # ncu: DRAM bytes read / outputs
    ncu_error: str | None = None


def kernel_precision(kernel, dtype: str, requested: str | None) -> str:
    """The precision a rung runs at (PRECISION_TEXT): `requested` (--precision) if
    given; float32 at HIGHEST where the kernel gives true fp32, else DEFAULT."""
    if requested:
        return requested
    return "highest" if dtype == "float32" and kernel.true_fp32 else "default"


def problem_of(shape: Shape, kernel: str, dtype: str, precision: str) -> tuple:
    """The canonical problem a rung sees (_ffi.ANY_PROBLEM's fields): a
    transposed operand as stored where the lowering reads it so for this
    kernel (`_lowering.reads_as_stored`), else after XLA's transpose, plain."""
    plain = (shape.batch, shape.batch, shape.m, shape.n, shape.k, False, False)
    if not shape.transpose:
        return plain
    from jax_tiled import _lowering, _presets

    stored = (*plain[:5], shape.transpose == "tA", shape.transpose == "tB")
    run = _presets.resolve("cuda", precision, dtype, dtype)
    return stored if _lowering.reads_as_stored("cuda", kernel, run, stored, plain) else plain


def cuda_refusal(kernel: str, dtype: str, problem: tuple, precision: str) -> str:
    from jax_tiled import _ffi

    return _ffi.refusal("cuda", kernel, dtype, dtype, problem, precision)


def cuda_plan(kernel: str, dtype: str, problem: tuple, precision: str):
    """The plan the handler runs (a _ffi.CudaPlan, or None)."""
    from jax_tiled import _ffi

    return _ffi.cuda_plan(kernel, dtype, dtype, problem, precision)


def run_ladder(
    args,
    rungs: list,
    budget: Budget,
    *,
    refusal_of=None,
    plan_of=None,
) -> list[LadderRow]:
    """The rows of every section (one per dtype of args.dtype), on args.shapes[0]:
    each rung of `rungs` (kernel facts, _ffi.KernelFacts, in ladder order) timed,
    or skipped with its refusal (refusal_of; default cuda_refusal), with its
    plan's bytes per output (plan_of; default cuda_plan), then jnp.matmul at
    each precision the section used; ratios and speedups attached."""
    (shape,) = args.shapes
    refusal_of, plan_of = refusal_of or cuda_refusal, plan_of or cuda_plan
    work = [
        (dtype, [(k, kernel_precision(k, dtype, args.precision)) for k in rungs])
        for dtype in args.dtype
    ]
    total = sum(len(section) + len({peer_precision(p) for _, p in section}) for _, section in work)
    return rows_for_each(
        work,
        total,
        args,
        lambda dtype_section, progress: _run_section(
            args, shape, *dtype_section, budget, progress, refusal_of, plan_of
        ),
    )


def _run_section(
    args, shape: Shape, dtype: str, section, budget: Budget, progress, refusal_of, plan_of
) -> list[LadderRow]:
    itemsize = np.dtype(jnp.dtype(dtype)).itemsize
    sets = make_inputs(
        shape, jnp.dtype(dtype), choose_sets(shape.input_bytes(itemsize), budget), args.seed
    )

    def measure(kernel: str, rung: int | None, precision: str) -> LadderRow:
        progress.describe(f"ladder {shape.name} {dtype} {precision} {kernel}")
        row = LadderRow(shape.name, dtype, precision, kernel, rung, len(sets))
        if rung is not None:
            problem = problem_of(shape, kernel, dtype, precision)
            row.skipped = refusal_of(kernel, dtype, problem, precision) or None
        if row.skipped is None:
            fn = product_fn(shape, precision, kernel)
            measure_into(row, fn, sets, shape.flops, args, budget, keep_first=False)
        progress.step()
        return row

    ours = []
    for kernel, precision in section:
        row = measure(kernel.name, kernel.rung, precision)
        problem = problem_of(shape, kernel.name, dtype, precision)
        plan = None if row.skipped else plan_of(kernel.name, dtype, problem, precision)
        if plan is not None:
            row.plan, row.block_m, row.block_n = plan.text, plan.block_m, plan.block_n
            row.cluster_m = plan.cluster_m
            row.bytes_per_output = bytes_per_output(
                shape.k, itemsize, plan.block_m, plan.block_n, plan.cluster_m
            )
        ours.append(row)
    peers = {
        precision: measure(PEER, None, precision)
        for precision in dict.fromkeys(peer_precision(row.precision) for row in ours)
    }
    for row in ours:
        attach_ratio(row, peers[peer_precision(row.precision)])
    attach_speedups(ours)
    return ours + list(peers.values())


def attach_speedups(rows: list[LadderRow]) -> None:
    """One section's rungs, in ladder order: each timed row's TFLOP/s over the
    previous timed row's (step) and over rung 0's (vs_naive), where timed."""
    timed = [row for row in rows if row.tflops and row.error is None]
    base = next((row for row in timed if row.rung == 0), None)
    for before, row in zip([None, *timed], timed):
        row.step = None if before is None else row.tflops / before.tflops
        row.vs_naive = None if base is None else row.tflops / base.tflops


# ---- Measured bytes: Nsight Compute ----

# L2 read sectors (32 bytes each) and DRAM bytes read, summed over a product's kernels.
NCU_METRICS = ("lts__t_sectors_op_read.sum", "dram__bytes_read.sum")
SECTOR_BYTES = 32
# ncu's units, as --print-units base prints them (and the scaled ones, should a
# version ignore the flag).
_UNIT_SCALE = {
    "": 1,
    "sector": 1,
    "byte": 1,
    "Kbyte": 1e3,
    "Mbyte": 1e6,
    "Gbyte": 1e9,
    "Tbyte": 1e12,
    "Ksector": 1e3,
    "Msector": 1e6,
    "Gsector": 1e9,
}


@dataclasses.dataclass(frozen=True)
class NcuReading:
    """What Nsight Compute measured over the kernels of one profiled product."""

    kernels: tuple[str, ...]  # each profiled launch's kernel name
    l2_read_bytes: float  # lts__t_sectors_op_read.sum x SECTOR_BYTES
    dram_read_bytes: float  # dram__bytes_read.sum


def ncu_records(text: str) -> list[dict]:
    """The rows of `ncu --csv` output (one per launch and metric), by column.
    Lines before the CSV's header (ncu's ==PROF== log, the program's output)
    are skipped. ValueError, with ncu's own lines, when there is no table."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        said = [line for line in lines if line.startswith("==")][-5:]
        raise ValueError("no ncu table in the output" + (": " + " ".join(said) if said else ""))
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def parse_ncu_csv(text: str) -> NcuReading:
    """The metrics of `ncu --csv --metrics NCU_METRICS` (values may carry
    thousands separators), summed over the launches. ValueError, with ncu's
    own lines, when there is no table or a metric is missing."""
    totals = dict.fromkeys(NCU_METRICS, 0.0)
    seen = {metric: 0 for metric in NCU_METRICS}
    kernels = {}
    for record in ncu_records(text):
        metric = record.get("Metric Name")
        if metric not in totals:
            continue
        unit = record.get("Metric Unit", "")
        if unit not in _UNIT_SCALE:
            raise ValueError(f"ncu metric {metric} in an unknown unit {unit!r}")
        value = record["Metric Value"].replace(",", "")
        totals[metric] += float(value) * _UNIT_SCALE[unit]
        seen[metric] += 1
        kernels[record["ID"]] = record.get("Kernel Name", "")
    missing = [metric for metric, count in seen.items() if not count]
    if missing:
        raise ValueError(f"ncu reported no {', '.join(missing)}")
    return NcuReading(
        kernels=tuple(kernels.values()),
        l2_read_bytes=totals["lts__t_sectors_op_read.sum"] * SECTOR_BYTES,
        dram_read_bytes=totals["dram__bytes_read.sum"],
    )


def probe_command(kernel: str, shape: str, dtype: str, precision: str) -> list[str]:
    """The command that runs one product alone in a fresh process (probe_main),
    for a profiler to run it under."""
    return [
        sys.executable,
        "-P",
        "-m",
        "jax_tiled.bench.ladder",
        "--probe",
        kernel,
        shape,
        dtype,
        precision,
    ]


def ncu_command(ncu: str, row: LadderRow) -> list[str]:
    """Profiles one product of `row` in a fresh process (probe_command), only
    between its cuProfilerStart and cuProfilerStop (--profile-from-start off),
    with the GPU's clocks left as they are."""
    return [
        ncu,
        "--metrics",
        ",".join(NCU_METRICS),
        "--csv",
        "--print-units",
        "base",
        "--profile-from-start",
        "off",
        "--clock-control",
        "none",
        *probe_command(row.kernel, row.shape, row.dtype, row.precision),
    ]


def measure_bytes(rows: list[LadderRow], shape: Shape, progress_enabled: bool) -> str:
    """With ncu on PATH, each timed row's L2 and DRAM bytes read per output; the
    note the report prints about it."""
    ncu = shutil.which("ncu")
    if ncu is None:
        return "Measured bytes: ncu (Nsight Compute) was not found on PATH, so none"
    outputs = shape.batch * shape.m * shape.n
    timed = [row for row in rows if not row.skipped and row.error is None]
    with Progress(len(timed), enabled=progress_enabled) as progress:
        for row in timed:
            progress.describe(f"ncu {row.dtype} {row.precision} {row.kernel}")
            try:
                reading = _profile(ncu, row)
            except (ValueError, OSError, subprocess.SubprocessError) as exc:
                row.ncu_error = str(exc)
            else:
                row.l2_bytes_per_output = reading.l2_read_bytes / outputs
                row.dram_bytes_per_output = reading.dram_read_bytes / outputs
            progress.step()
    return (
        "Measured bytes: Nsight Compute, one product per rung after a warm-up call, "
        f"{' and '.join(NCU_METRICS)} summed over its kernels, per output element "
        f"(L2: sectors x {SECTOR_BYTES} bytes; ncu flushes the caches before each "
        "kernel, so DRAM counts cold reads)"
    )


def _profile(ncu: str, row: LadderRow) -> NcuReading:
    # The C locale: parse_ncu_csv reads "2,109,952" as ncu prints numbers there.
    env = {**os.environ, "LC_ALL": "C"}
    done = subprocess.run(
        ncu_command(ncu, row), capture_output=True, text=True, timeout=900, env=env
    )
    try:
        return parse_ncu_csv(done.stdout)
    except ValueError as exc:
        tail = " ".join(done.stderr.split()[-40:])
        raise ValueError(f"{exc} (exit status {done.returncode}; {tail})") from None


@contextlib.contextmanager
def profiled():
    """cuProfilerStart and cuProfilerStop around the block, on device 0's primary
    context (XLA's), through the driver library: under `ncu --profile-from-start
    off` only the kernels launched inside are profiled, not the inputs' set-up
    or XLA's autotuning while compiling."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")

    def check(status: int, what: str) -> None:
        if status:
            raise RuntimeError(f"{what} failed with CUresult {status}")

    device, context = ctypes.c_int(), ctypes.c_void_p()
    check(cuda.cuInit(0), "cuInit")
    check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
    try:
        check(cuda.cuProfilerStart(), "cuProfilerStart")
        try:
            yield
        finally:
            cuda.cuProfilerStop()
    finally:
        cuda.cuCtxPopCurrent_v2(ctypes.byref(context))
        cuda.cuDevicePrimaryCtxRelease_v2(device)


def probe_main(argv=None) -> int:
    """The hidden entry point ncu runs (ncu_command): one product of a rung,
    once to compile and warm up, then once under the profiler."""
    p = argparse.ArgumentParser(prog="python -m jax_tiled.bench.ladder")
    p.add_argument(
        "--probe",
        required=True,
        metavar="KERNEL",
        help="a kernel name, jnp.matmul, or pallas:CONFIG (a config of the Pallas sweep)",
    )
    p.add_argument("shape")
    p.add_argument("dtype")
    p.add_argument("precision")
    args = p.parse_args(argv)
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    shape = parse_shape(args.shape)
    if args.probe.startswith(pallas.PROBE_PREFIX):
        try:
            config = pallas.probed_config(args.probe, shape, args.dtype, args.precision)
        except ValueError as exc:
            p.error(str(exc))
        fn = pallas.matmul_fn(config)
    else:
        fn = jax.jit(product_fn(shape, args.precision, args.probe))
    rng = np.random.default_rng(0)
    # On the host and copied: no kernel of the inputs' own runs on the device.
    a, b = (
        jnp.asarray(rng.standard_normal(s).astype(jnp.dtype(args.dtype)))
        for s in shape.stored_shapes
    )
    jax.block_until_ready(fn(a, b))  # compiles (XLA may autotune jnp.matmul here)
    with profiled():
        jax.block_until_ready(fn(a, b))
    return 0


# ---- The rungs the command line asks for ----


def ladder_rungs(parser, requested: list[str] | None) -> list:
    """The listed kernels of the CUDA table in ladder order (_ffi.KernelFacts), or
    those of them --kernels names."""
    from jax_tiled import _ffi

    rungs = [k for k in _ffi.kernel_table("cuda") if k.listed]
    if requested is None:
        return rungs
    names = [k.name for k in rungs]
    bad = [k for k in requested if k not in names]
    if bad:
        parser.error(f"--ladder: kernel(s) {bad} are not rungs of the ladder; valid: {names}")
    return [k for k in rungs if k.name in requested]


if __name__ == "__main__":
    sys.exit(probe_main())
