"""Multi-GPU scaling of jax_tiled.matmul under jit with sharded operands.

    NCCL_NVLS_ENABLE=0 python tools/scaling.py [--size 8192] [--dtype float32]
        [--precision highest] [--chunks 1 2 4] [--spare-sms 0 32] [--gather-spare-sms 0 16]
        [--gather-barrier on off] [--k-ring sums operands] [--k-sums accumulation output]
        [--gather-ring blocks collectives]
        [--no-overlap] [--devices 2] [--inputs positive] [--accuracy]
        [--pgle 3] [--schedule] [--profile]
        [--compiler-option xla_gpu_enable_analytical_latency_estimator=true]
        [--json scaling.json]

Times each layout below on 1 device and on `--devices` (default: every device
of the machine), for jax_tiled.matmul and for jnp.matmul under the same
shardings, and prints per layout the milliseconds, each one's efficiency
t(1) / (N * t(N)) against its own one-device time, jnp's time over ours, and
the all-gathers each compiled program holds (ours against jnp's: a sharded
product should gather no operand that jnp does not; `gather_ring="collectives"`
gathers jnp's operand in pieces, an all-gather each). `--accuracy` adds each
product's error and bias against the float64 product of the same inputs,
ours beside jnp's on the same sharding (the benchmark's `--accuracy`
measures and flags: ERR, BIAS), on `--inputs` (`normal`, the default, or
`positive`: uniform in [0.5, 1.5], where a biased sum shows). The one-device time is
the same unsharded product for every layout of a problem, timed once per
implementation: the size^3 product, or for the batch-sharded layout a batch
of 8 products of (size/2)^3 (the same FLOPs). `--chunks` times jax_tiled once
per value of `jax_tiled.overlap.settings(chunks=...)` (the K-sharded rings'
pieces; the others ignore it), each once per value of `--spare-sms` (the
SMs a K ring's products leave to its transfers) and of `--gather-spare-sms`
(the same for the all-gather ring; `auto` the library's choice), of
`--gather-barrier` (`on` or `off`: the all-gather ring's optimization
barrier), of `--k-ring` (how a K split sums: `sums`, `operands`,
`collectives`, or `auto`, the library's choice by the devices), of
`--k-sums` (the type the sums travel in: `accumulation` or `output`) and
of `--gather-ring` (how the all-gather pattern gathers: `blocks` or
`collectives`, whose pieces `--chunks` sets too);
`--no-overlap` adds a row with the overlap turned off. `--compiler-option
NAME=VALUE` compiles every program, ours and jnp's, with that XLA option.
Every product is checked against jnp.matmul's on the same sharding and
against ours on one device before it is timed. `--json` writes the rows,
the device, the arguments and the compiler options.

`--pgle RUNS` times every program, ours and jnp's, as profile-guided
latency estimation compiles it: RUNS calls of the program traced with
jax.profiler, their profile read (jax.experimental.profiler's
get_profiled_instructions_proto), the program compiled again with it
(compiler option `fdo_profile`), so that the scheduler knows each kernel's
measured time. XLA's own estimate knows cuBLAS's products, not a custom
call's; with it the all-gather ring's transfer was scheduled to end before
the first product that it should run beside (docs/sharding.md). The rows
give each profile's size (empty on CPU devices). `--schedule` prints under
each of our rows the order of the timed program's entry computation: its
collectives (an async pair as -start and -done), custom calls (our
kernels), fusions and dynamic-update-slices, where the scheduler's choices
show. `--profile` traces 3 calls of each of our timed programs and of jnp's
(`jax.profiler`, after the timing) and prints under each row the first
GPU's kernels that took longest, microseconds a call (ours, then jnp's):
which transfers ran (NCCL's kernels or `MemcpyP2P`, the copy engines) and
how long each product took beside them.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.profiler import get_profiled_instructions_proto
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_tiled
from jax_tiled.bench import accuracy
from jax_tiled.bench.report import write_tool_report
from jax_tiled.bench.timing import pipelined_samples
from jax_tiled.bench.trace import time_by_kernel, trace_events

# name: a's spec, b's spec, the result's spec (jit's out_shardings). Specs of
# three axes are the batched problem's (BATCH products of half the size).
LAYOUTS = {
    "M-sharded": (P("x", None), P(None, None), P("x", None)),
    "N-sharded": (P(None, None), P(None, "x"), P(None, "x")),
    "batch-sharded": (P("x", None, None), P("x", None, None), P("x", None, None)),
    "K-sharded, replicated": (P(None, "x"), P("x", None), P(None, None)),
    "K-sharded, reduce-scatter": (P(None, "x"), P("x", None), P("x", None)),
    "all-gather (a by M, b by N)": (P("x", None), P(None, "x"), P(None, "x")),
}
DEFAULTS = jax_tiled.overlap.Settings()  # the library's, which the tool's defaults time
BATCH = 8  # divides 2, 4 and 8 devices; 8 products of (n/2)^3 are n^3's FLOPs
# A collective in a compiled program's HLO: the op, or the start of its async pair.
COLLECTIVE = re.compile(
    r"\b(all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(?:-start)?\("
)


def collectives(compiled_text: str) -> dict[str, int]:
    """How many of each collective a compiled program holds."""
    counts: dict[str, int] = {}
    for match in COLLECTIVE.finditer(compiled_text):
        counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return counts


# An instruction of a compiled program's text: its opcode, after the result's
# shape (a tuple's in parentheses), before its operands.
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?\S+ = (?:\(.*?\)|\S+) ([a-z][a-z0-9-]*)\(")
# What --schedule shows of the entry computation (not its parameters, tuples,
# bitcasts, copies and the like).
SCHEDULED = re.compile(
    r"(all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(-start|-done)?"
    r"|custom-call|fusion|dynamic-update-slice|call|while"
)


def schedule(compiled_text: str) -> list[str]:
    """The opcodes of the entry computation's collectives, custom calls,
    fusions, calls and dynamic-update-slices, in the order XLA scheduled them."""
    entry = compiled_text[compiled_text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    ops = (match.group(1) for match in map(INSTRUCTION.match, entry.splitlines()) if match)
    return [op for op in ops if SCHEDULED.fullmatch(op)]


def profile_guided(lowered, compiled, a, b, runs: int, options: dict):
    """`lowered` compiled again, with `options`, and the profile of `runs` calls
    of `compiled` (profile-guided latency estimation), and the profile's size in
    bytes."""
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(runs):
            jax.block_until_ready(compiled(a, b))
        jax.profiler.stop_trace()
        run_dirs = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "")))
        profile = get_profiled_instructions_proto(run_dirs[-1])
    return lowered.compile(compiler_options={**options, "fdo_profile": profile}), len(profile)


def compiler_option(text: str) -> tuple[str, bool | int | str]:
    """NAME=VALUE of --compiler-option, the value typed as XLA's flags are."""
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    try:
        return name, int(value)
    except ValueError:
        return name, value


def median_seconds(fn, a, b, repeats: int, calls: int = 10) -> float:
    """Median over samples of `calls` pipelined calls, per call: host dispatch
    and the final synchronisation stay out of the per-product time."""
    jax.block_until_ready(fn(a, b))
    return statistics.median(pipelined_samples(fn, (a, b), calls=calls, repeats=repeats))


def check(out, expected, dtype) -> None:
    """Refuses to time a product that disagrees with `expected` (jnp.matmul's,
    or ours on one device)."""
    out, expected = np.asarray(out, np.float32), np.asarray(expected, np.float32)
    err = np.abs(out - expected).max() / max(np.abs(expected).max(), 1e-30)
    if err > (3e-2 if np.dtype(dtype).itemsize == 2 else 1e-3):
        raise SystemExit(f"jax_tiled disagrees: relative error {err:.2e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--precision", default="highest")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[None],
        help="jax_tiled.overlap chunks to time (default: its automatic choice)",
    )
    parser.add_argument(
        "--spare-sms",
        type=lambda text: None if text == "auto" else int(text),
        nargs="+",
        default=[None],
        help="jax_tiled.overlap spare_sms to time, each with each --chunks (default: auto, "
        f"the library's choice: {jax_tiled.overlap.SPARE_SMS}, or none for a ring whose "
        "transfers run on the copy engines)",
    )
    parser.add_argument(
        "--gather-spare-sms",
        type=lambda text: None if text == "auto" else int(text),
        nargs="+",
        default=[None],
        help="jax_tiled.overlap gather_spare_sms to time, each with each --chunks and "
        "--spare-sms (default: auto, the library's choice)",
    )
    parser.add_argument(
        "--gather-barrier",
        nargs="+",
        default=["on"],
        choices=("on", "off"),
        help="jax_tiled.overlap gather_barrier to time, each with each other setting (default: on)",
    )
    # The overlap's named settings; k_ring's None (the library's choice) is "auto".
    for name, values in (
        ("k_ring", (None, *jax_tiled.overlap.K_RINGS)),
        ("gather_ring", jax_tiled.overlap.GATHER_RINGS),
        ("k_sums", jax_tiled.overlap.K_SUMS),
    ):
        parser.add_argument(
            "--" + name.replace("_", "-"),
            nargs="+",
            default=[getattr(DEFAULTS, name)],
            type=lambda text: None if text == "auto" else text,
            choices=values,
            metavar="{" + ",".join(value or "auto" for value in values) + "}",
            help=f"jax_tiled.overlap {name} to time, each with each other setting "
            f"(default: {getattr(DEFAULTS, name) or 'auto'})",
        )
    parser.add_argument(
        "--compiler-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        type=compiler_option,
        help="an XLA option every program, ours and jnp's, is compiled with "
        "(repeatable; true/false and integers are typed)",
    )
    parser.add_argument(
        "--no-overlap", action="store_true", help="also time jax_tiled with the overlap turned off"
    )
    parser.add_argument(
        "--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS), metavar="LAYOUT"
    )
    parser.add_argument(
        "--pgle",
        type=int,
        default=0,
        metavar="RUNS",
        help="compile with the profile of RUNS calls (profile-guided latency estimation; "
        "default 0: off)",
    )
    parser.add_argument(
        "--schedule",
        action="store_true",
        help="print the order of each of our programs' collectives, kernels and fusions",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="trace 3 calls of each timed program, ours and jnp's, and print the first GPU's "
        "longest kernels a call",
    )
    parser.add_argument(
        "--inputs",
        default="normal",
        choices=tuple(accuracy.DISTRIBUTIONS),
        help="the operands' distribution (default normal; positive: uniform in [0.5, 1.5])",
    )
    parser.add_argument(
        "--accuracy",
        action="store_true",
        help="also each product's error and bias against float64, ours beside jnp's",
    )
    parser.add_argument("--json", metavar="PATH", help="write the rows here")
    args = parser.parse_args(argv)
    if args.pgle < 0:
        parser.error(f"--pgle must be at least 0, got {args.pgle}")
    devices = jax.devices()
    count = args.devices or len(devices)
    if not 2 <= count <= len(devices):
        parser.error(f"--devices must be 2 to {len(devices)}, got {count}")
    n = args.size
    if n % 2:
        parser.error(f"--size must be even (the batched problem is {BATCH} of size/2), got {n}")
    key_a, key_b = jax.random.split(jax.random.key(0))
    draw = accuracy.DISTRIBUTIONS[args.inputs]
    problems = {
        2: (draw(key_a, (n, n), args.dtype), draw(key_b, (n, n), args.dtype)),
        3: (
            draw(key_a, (BATCH, n // 2, n // 2), args.dtype),
            draw(key_b, (BATCH, n // 2, n // 2), args.dtype),
        ),
    }
    copy_engines = jax_tiled.overlap.permutes_by_copy_engines()
    print(
        f"# {devices[0].device_kind} x{count}, jax {jax.__version__}, {n}^3 {args.dtype}, "
        f"precision {args.precision}, {args.inputs} inputs; efficiency = t(1) / ({count} * "
        f"t({count})); batch-sharded: {BATCH} x {n // 2}^3; the rings' transfers by "
        + ("the copy engines" if copy_engines else "NCCL's send/receive")
        + " (XLA_FLAGS' --xla_gpu_collective_permute_mode)"
    )
    if args.accuracy:
        print(f"# {accuracy.DEFINITIONS}\n# {accuracy.LEGEND}")

    options = dict(args.compiler_option)
    if options:
        print(f"# compiled with {options}")
    variants = [
        (f"chunks={c if c is not None else 'auto'} spare={spare if spare is not None else 'auto'}"
         + (f" gather={gather if gather is not None else 'auto'}"
            if args.gather_spare_sms != [None] else "")
         + (f" barrier={barrier}" if args.gather_barrier != ["on"] else "")
         + (f" {ring or 'auto'}" if args.k_ring != [DEFAULTS.k_ring] else "")
         + (f" sums={sums}" if args.k_sums != [DEFAULTS.k_sums] else "")
         + (f" gather_ring={by}" if args.gather_ring != [DEFAULTS.gather_ring] else ""),
         dict(chunks=c, spare_sms=spare, gather_spare_sms=gather, k_ring=ring,
              gather_barrier=barrier == "on", k_sums=sums, gather_ring=by))
        for c in args.chunks
        for spare in args.spare_sms
        for gather in args.gather_spare_sms
        for barrier in args.gather_barrier
        for ring in args.k_ring
        for sums in args.k_sums
        for by in args.gather_ring
    ]  # fmt: skip
    if args.no_overlap:
        variants.append(("no overlap", dict(enabled=False)))

    def profiled(compiled, a, b, calls: int = 3) -> dict[str, float]:
        """The first GPU's longest kernels in `calls` traced calls, us a call."""
        device, _ = trace_events(compiled, (a, b), calls)
        return {name: us / calls for name, us in time_by_kernel(device, top=6).items()}

    def timed(matmul, mesh, specs, settings, profile: bool = False):
        """Seconds per product, the result, the timed program's text and
        profile size (bytes; 0 without --pgle), and where `profile` its longest
        kernels (`profiled`)."""
        a_spec, b_spec, out_spec = specs
        a, b = problems[len(a_spec)]
        a_s = jax.device_put(a, NamedSharding(mesh, a_spec))
        b_s = jax.device_put(b, NamedSharding(mesh, b_spec))
        with jax_tiled.overlap.settings(**settings):
            jitted = jax.jit(
                lambda x, y: matmul(x, y, precision=args.precision),
                out_shardings=NamedSharding(mesh, out_spec),
            )
            lowered = jitted.lower(a_s, b_s)
            compiled, profile_bytes = lowered.compile(compiler_options=options), 0
            if args.pgle:
                compiled, profile_bytes = profile_guided(
                    lowered, compiled, a_s, b_s, args.pgle, options
                )
            out = compiled(a_s, b_s)
            seconds = median_seconds(compiled, a_s, b_s, args.repeats)
            kernels = profiled(compiled, a_s, b_s) if profile else {}
            return seconds, out, compiled.as_text(), profile_bytes, kernels

    # rank -> the float64 product of the inputs (--accuracy), each computed
    # before any program is timed: the host's BLAS threads then run beside
    # no timed program (XLA's peer-access copies meet in a rendezvous of
    # host threads every call).
    ranks = sorted({len(LAYOUTS[layout][0]) for layout in args.layouts})  # the problems timed
    float64 = {
        rank: np.matmul(*(np.asarray(x, np.float64) for x in problems[rank]))
        for rank in ranks
        if args.accuracy
    }

    def against_float64(out, rank):
        """out's error and bias against the float64 product of problem `rank`;
        None without --accuracy."""
        if not args.accuracy:
            return None
        return accuracy.accuracy(out, float64[rank])

    def measured(out, peer, rank) -> dict:
        """Ours' and the peer's (`peer`: against_float64 of its result) error
        and bias, and the targets ours misses (the benchmark's --accuracy
        limits); {} without --accuracy."""
        if peer is None:
            return {}
        ours = against_float64(out, rank)
        allowed = accuracy.limits(peer, str(out.dtype), float64[rank].size)
        return dict(
            err=ours.err, jnp_err=peer.err, bias=ours.bias, jnp_bias=peer.bias,
            misses=accuracy.misses(ours, allowed),
        )  # fmt: skip

    def accuracy_text(errors: dict) -> str:
        if not errors:
            return ""
        flags = " ".join(name.upper() for name in errors["misses"])
        return (
            f"  err {errors['err']:.2e} (jnp {errors['jnp_err']:.2e}) bias {errors['bias']:+.2e} "
            f"(jnp {errors['jnp_bias']:+.2e})" + (f"  {flags}" if flags else "")
        )

    one = Mesh(np.array(devices[:1]), ("x",))
    single = {}  # rank -> (ours, jnp) one-device seconds
    single_out = {}  # rank -> our one-device result
    for rank in ranks:
        plain = (P(*[None] * rank),) * 3
        t1_ours, expected, *_ = timed(jax_tiled.matmul, one, plain, {})
        t1_jnp, peer_out, *_ = timed(jnp.matmul, one, plain, {})
        check(expected, peer_out, args.dtype)
        single[rank] = (t1_ours, t1_jnp)
        single_out[rank] = expected
        what = f"{n}^3" if rank == 2 else f"{BATCH} x {n // 2}^3"
        print(
            f"1 device, {what}: jax_tiled {t1_ours * 1e3:.3f} ms, jnp {t1_jnp * 1e3:.3f} ms"
            + accuracy_text(measured(expected, against_float64(peer_out, rank), rank))
        )

    mesh = Mesh(np.array(devices[:count]), ("x",))
    width = max(20, *(len(label) for label, _ in variants))  # the variants' column
    header = (
        f"{'layout':28} {'jax_tiled':{width}} {'ours ms':>8} {'jnp ms':>8} {'ours eff':>8} "
        f"{'jnp eff':>8} {'jnp/ours':>8} {'gathers':>8}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for layout in args.layouts:
        specs = LAYOUTS[layout]
        t1_ours, t1_jnp = single[len(specs[0])]
        t_jnp, reference, jnp_text, jnp_profile, jnp_kernels = timed(
            jnp.matmul, mesh, specs, {}, profile=args.profile
        )
        jnp_ops = collectives(jnp_text)
        jnp_error = against_float64(reference, len(specs[0]))  # once for every variant
        for label, settings in variants:
            t, out, text, profile, kernels = timed(
                jax_tiled.matmul, mesh, specs, settings, profile=args.profile
            )
            ops = collectives(text)
            check(out, reference, args.dtype)  # jnp's on the same sharding
            check(out, single_out[len(specs[0])], args.dtype)  # ours on one device
            gathers, jnp_gathers = ops.get("all-gather", 0), jnp_ops.get("all-gather", 0)
            errors = measured(out, jnp_error, len(specs[0]))
            print(
                f"{layout:28} {label:{width}} {t * 1e3:8.3f} {t_jnp * 1e3:8.3f} "
                f"{t1_ours / (count * t):8.1%} {t1_jnp / (count * t_jnp):8.1%} "
                f"{t_jnp / t:7.2f}x {f'{gathers}/{jnp_gathers}':>8}"
                + ("  GATHERS WHERE JNP DOES NOT" if gathers and not jnp_gathers else "")
                + accuracy_text(errors)
            )
            if args.schedule:
                print(f"  schedule: {' '.join(schedule(text))}")
            for who, longest in (("ours", kernels), ("jnp", jnp_kernels)) if args.profile else ():
                listed = ", ".join(f"{name} {us:.0f}" for name, us in longest.items())
                print(f"  {who}: longest kernels (us a call, GPU 0): {listed or 'none traced'}")
            rows.append(
                dict(
                    layout=layout,
                    variant=label,
                    ours_ms=t * 1e3,
                    jnp_ms=t_jnp * 1e3,
                    ours_one_device_ms=t1_ours * 1e3,
                    jnp_one_device_ms=t1_jnp * 1e3,
                    ours_efficiency=t1_ours / (count * t),
                    jnp_efficiency=t1_jnp / (count * t_jnp),
                    ratio=t_jnp / t,
                    collectives=ops,
                    jnp_collectives=jnp_ops,
                    schedule=schedule(text),
                    pgle_profile_bytes=profile,
                    jnp_pgle_profile_bytes=jnp_profile,
                    kernels_us=kernels,
                    jnp_kernels_us=jnp_kernels,
                    **errors,
                )
            )
    if args.json:
        write_tool_report(
            args.json, argv, devices=count, size=n, batch=BATCH, dtype=args.dtype,
            precision=args.precision, inputs=args.inputs, pgle_profiling_runs=args.pgle,
            compiler_options=options, permutes_by_copy_engines=copy_engines, rows=rows,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
