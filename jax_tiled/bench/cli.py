"""The command line: `python -m jax_tiled.bench` (see the package docstring)."""

from __future__ import annotations

import argparse
import sys

import jax

import jax_tiled.bench as package
from jax_tiled.bench import ladder, pallas
from jax_tiled.bench.accuracy import (
    ACCURACY_SHAPES,
    DEFINITIONS,
    LEGEND,
    WIDE_OUTPUT_SHAPES,
    run_accuracy,
)
from jax_tiled.bench.chains import (
    CHAIN_DTYPES,
    CHAIN_LENGTH,
    CHAIN_SIZES,
    describe_chains,
    run_chains,
)
from jax_tiled.bench.harness import (
    AGREEMENT_TEXT,
    DTYPES,
    OUT_DTYPES,
    PRECISIONS,
    PRESETS,
    TRUTH_TEXT,
    lax_precision,
)
from jax_tiled.bench.plot import pyplot, write_ladder_plot, write_plot
from jax_tiled.bench.products import peers_of, run_all
from jax_tiled.bench.report import (
    device_info,
    device_label,
    format_accuracy_table,
    format_chain_table,
    format_geomeans,
    format_ladder_markdown,
    format_step_table,
    format_table,
    geomeans,
    hbm_gbps,
    heading,
    json_rows,
    write_json,
)
from jax_tiled.bench.shapes import (
    CPU_QUICK,
    CPU_SUITE,
    GPU_QUICK,
    GPU_SUITE,
    USER_SHAPES,
    Shape,
    parse_shape,
)
from jax_tiled.bench.timing import CPU_BUDGET, GPU_BUDGET, Budget
from jax_tiled.bench.train_step import (
    MODELS,
    TRAIN_SIZE,
    describe_train_step,
    run_train_steps,
    step_flops,
    step_of,
)


def _split(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m jax_tiled.bench",
        description=package.__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dtype",
        action="append",
        metavar="DT",
        help=f"dtype(s), repeatable or comma-separated: {', '.join(DTYPES)} "
        "(default float32; --train-step: bfloat16; --accuracy: float32, "
        "bfloat16, float16)",
    )
    p.add_argument(
        "--out-dtype",
        action="append",
        metavar="OUT",
        help="the products' output dtype(s), repeatable or comma-separated: "
        "same (the operands', the default) or float32 (preferred_element_type: "
        "16-bit operands into float32, as mixed-precision training asks; a "
        "second row per 16-bit product; the product suite only)",
    )
    p.add_argument(
        "--precision",
        action="append",
        metavar="P",
        help="precision(s): default, high, highest (default: all three for "
        "float32, default otherwise), or a lax.DotAlgorithmPreset by name, "
        "e.g. bf16_bf16_f32_x3, whose peer is jnp.matmul at the same preset "
        "(the product suite and --accuracy)",
    )
    p.add_argument(
        "--kernels",
        action="append",
        metavar="K",
        help="subset of kernels (names from jax_tiled.kernels(), or auto; "
        "--train-step: default auto)",
    )
    p.add_argument(
        "--shapes",
        action="append",
        metavar="S",
        help="shapes by name, e.g. 4096^3, 1000x800x1200, b32x512x64x512, 8192^3-tA",
    )
    p.add_argument(
        "--pallas",
        action=argparse.BooleanOptionalAction,
        help="time the Pallas Mosaic-GPU Hopper kernel that jax ships "
        f"({pallas.MODULE}) as a second peer, the fastest of {len(pallas.CONFIGS)} "
        "configs per row, timed again after the sweep: a 'pallas' row beside "
        "jnp.matmul's and an 'x pallas' column (default: on where it runs, an sm_90 "
        "GPU whose jax has the module; --pallas shows the column elsewhere too, each "
        "row marked n/a with the reason; --no-pallas leaves it out)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short run: a few small and medium shapes, fewer repeats",
    )
    p.add_argument(
        "--cpu-suite",
        action="store_true",
        help="the small CPU suite even on a GPU backend (default on CPU)",
    )
    p.add_argument(
        "--user-shapes",
        action="store_true",
        help="the shapes users' products take, by class (odd sizes, skinny, K-heavy, "
        "M <= 64, batched; --list-shapes prints them), instead of the suite",
    )
    p.add_argument(
        "--repeats",
        type=int,
        help="samples per row, median taken (default 10; --quick 5; at least 5)",
    )
    p.add_argument("--warmup", type=int, default=2, help="warm-up calls after compiling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the error spot check against float64 NumPy on small shapes",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    p.add_argument("--list-shapes", action="store_true", help="print the suites and exit")
    p.add_argument(
        "--train-step",
        action="store_true",
        help="time the training step (forward + VJP of a 2-layer MLP) with "
        "jnp.matmul and with each kernel, instead of single products "
        "(default dtype bfloat16, precision default)",
    )
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        help="--train-step: the model (default mlp; attention: a transformer block)",
    )
    p.add_argument(
        "--width",
        type=int,
        metavar="W",
        help="--train-step: the model's width (default: mlp "
        f"{TRAIN_SIZE['mlp', 'gpu'][0]}, {TRAIN_SIZE['mlp', 'cpu'][0]} on CPU; "
        f"attention {TRAIN_SIZE['attention', 'gpu'][0]})",
    )
    p.add_argument(
        "--tokens",
        "--batch-rows",
        type=int,
        metavar="T",
        help="--train-step: tokens per sequence; the MLP's rows of x (default: "
        f"the width; attention {TRAIN_SIZE['attention', 'gpu'][1]})",
    )
    p.add_argument(
        "--sequences",
        type=int,
        metavar="S",
        help="--train-step --model attention: sequences in the batch (default "
        f"{TRAIN_SIZE['attention', 'gpu'][2]})",
    )
    p.add_argument(
        "--chain",
        action="store_true",
        help="time chains of small dependent products, x = tanh(x @ w[i]), in "
        "lax.scan and unrolled, per product, instead of single products "
        "(default dtypes bfloat16 and float32, precision default)",
    )
    p.add_argument(
        "--sizes",
        action="append",
        metavar="N",
        help=f"--chain: the products' size(s), N x N x N (default "
        f"{','.join(map(str, CHAIN_SIZES['gpu']))}; "
        f"{','.join(map(str, CHAIN_SIZES['cpu']))} on CPU)",
    )
    p.add_argument(
        "--chain-length",
        type=int,
        default=CHAIN_LENGTH,
        metavar="L",
        help=f"--chain: products per chain (default {CHAIN_LENGTH})",
    )
    p.add_argument(
        "--accuracy",
        action="store_true",
        help="instead of timing, measure each kernel's and jnp.matmul's error "
        "against a float64 NumPy product of the same inputs, per dtype, "
        "precision, output dtype (16-bit also into float32), input "
        "distribution and shape: err = ||out - ref||_F / ||ref||_F, bias = "
        "mean(out - ref) / mean(|ref|), on positive (uniform [0.5, 1.5]) and "
        "normal inputs; flags rows whose err is more than 1.2x jnp's or whose "
        "|bias| is more than 2x jnp's (with tests/test_accuracy.py's room for "
        "the output's rounding and for chance). Default shapes: "
        f"{', '.join(ACCURACY_SHAPES['gpu'] + WIDE_OUTPUT_SHAPES['gpu'])}"
        " (the last for 16-bit into float32 only); on CPU or with --cpu-suite "
        f"{', '.join(ACCURACY_SHAPES['cpu'] + WIDE_OUTPUT_SHAPES['cpu'])}",
    )
    p.add_argument(
        "--ladder",
        action="store_true",
        help="the ladder report (a CUDA GPU only): every rung of the kernel ladder in "
        "order, from the naive kernel to the Hopper one, and jnp.matmul, on one shape "
        f"(--shapes, default {ladder.DEFAULT_SHAPE}) per dtype (default "
        f"{', '.join(ladder.DEFAULT_DTYPES)}); float32 at HIGHEST on the SIMT rungs and "
        "DEFAULT (TF32) on the tensor-core rungs unless --precision names one; "
        "TFLOP/s, the speedup over the rung before and over the naive one, the "
        "ratio to jnp.matmul, and global bytes read per output by the tiling, as "
        "a markdown table (--ladder-md), --json and --plot",
    )
    p.add_argument(
        "--ladder-md",
        metavar="PATH",
        help="--ladder: write the markdown table to PATH too",
    )
    p.add_argument(
        "--ncu",
        action="store_true",
        help="--ladder: also measure each rung's L2 and DRAM bytes read per output "
        "with Nsight Compute (ncu on PATH; one product per rung in a subprocess)",
    )
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    modes = _given(
        ("--train-step", args.train_step),
        ("--chain", args.chain),
        ("--accuracy", args.accuracy),
        ("--ladder", args.ladder),
    )
    if len(modes) > 1:
        p.error(f"{' and '.join(modes)} are separate runs")
    mode = modes[0] if modes else None
    if mode in ("--train-step", "--chain") and (
        args.shapes or args.cpu_suite or args.user_shapes or args.plot or args.list_shapes
    ):
        p.error(
            f"{mode} times its own products: --shapes, --cpu-suite, --user-shapes, --plot "
            "and --list-shapes do not apply"
        )
    suites = _given(
        ("--shapes", args.shapes),
        ("--quick", args.quick),
        ("--cpu-suite", args.cpu_suite),
        ("--user-shapes", args.user_shapes),
    )
    if args.user_shapes and len(suites) > 1:
        p.error(f"{' and '.join(suites)} each choose the shapes: give one")
    if args.user_shapes and mode in ("--accuracy", "--ladder"):
        p.error(f"--user-shapes goes with the product suite, not {mode}")
    if mode and args.pallas is not None:
        p.error(f"--pallas and --no-pallas go with the product suite, not {mode}")
    if mode == "--accuracy" and (args.quick or args.plot or args.list_shapes):
        p.error("--accuracy times nothing: --quick, --plot and --list-shapes do not apply")
    if mode == "--ladder" and (args.quick or args.cpu_suite or args.list_shapes):
        p.error("--ladder times one shape: --quick, --cpu-suite and --list-shapes do not apply")
    if mode != "--ladder" and (args.ladder_md or args.ncu):
        p.error("--ladder-md and --ncu go with --ladder")
    if not args.train_step and (args.width or args.tokens or args.model or args.sequences):
        p.error("--model, --width, --tokens and --sequences go with --train-step")
    args.model = args.model or "mlp"
    if args.sequences is not None and args.model != "attention":
        p.error("--sequences goes with --model attention")
    if any(v is not None and v < 1 for v in (args.width, args.tokens, args.sequences)):
        p.error("--width, --tokens and --sequences must be positive")
    if not args.chain and (args.sizes or args.chain_length != CHAIN_LENGTH):
        p.error("--sizes and --chain-length go with --chain")
    try:
        args.sizes = [int(v) for v in _split(args.sizes)] if args.sizes else None
    except ValueError:
        p.error(f"--sizes takes whole numbers, got {args.sizes}")
    if args.chain_length < 1 or any(v < 1 for v in args.sizes or []):
        p.error("--sizes and --chain-length must be positive")
    default_dtypes = {
        "--train-step": ["bfloat16"],
        "--chain": list(CHAIN_DTYPES),
        "--accuracy": ["float32", "bfloat16", "float16"],
        "--ladder": list(ladder.DEFAULT_DTYPES),
    }.get(mode, ["float32"])
    args.dtype = _split(args.dtype) or default_dtypes
    if mode and args.out_dtype:
        p.error(
            f"--out-dtype goes with the product suite, not {mode}"
            + (" (which measures 16-bit products into float32 too)" if mode == "--accuracy" else "")
        )
    args.out_dtype = _split(args.out_dtype) or ["same"]
    args.precision = [v.lower() for v in _split(args.precision) or []] or None
    args.kernels = _split(args.kernels)
    args.shapes = _split(args.shapes)
    for value, allowed, what in (
        (args.dtype, DTYPES, "dtype"),
        (args.out_dtype, OUT_DTYPES, "output dtype"),
        (args.precision or [], (*PRECISIONS, *PRESETS), "precision"),
    ):
        bad = [v for v in value if v not in allowed]
        if bad:
            p.error(f"unknown {what} {bad}; choose from {list(allowed)}")
    presets = [v for v in args.precision or [] if v in PRESETS]
    if presets and mode in ("--train-step", "--chain", "--ladder"):
        p.error(f"presets ({', '.join(presets)}) go with the product suite and --accuracy")
    if args.repeats is None:
        args.repeats = 5 if args.quick else 10
    if args.repeats < 5:
        p.error("--repeats must be at least 5 (the protocol: median of at least 5 samples)")
    try:
        args.shapes = [parse_shape(s) for s in args.shapes] if args.shapes else None
    except ValueError as exc:
        p.error(str(exc))
    if mode == "--ladder" and len(args.shapes or []) > 1:
        p.error(
            f"--ladder times one shape, got {len(args.shapes)}: "
            f"{', '.join(s.name for s in args.shapes)}"
        )
    if mode == "--ladder":
        if len(args.precision or []) > 1:
            p.error(f"--ladder runs every rung at one precision, got {args.precision}")
        args.precision = args.precision[0] if args.precision else None
    return p, args


def _given(*flags: tuple[str, object]) -> list[str]:
    """The names of the (name, value) flags that were given."""
    return [name for name, value in flags if value]


def default_shapes(args, on_cpu: bool) -> list[Shape]:
    if args.user_shapes:
        return [parse_shape(name) for names in USER_SHAPES.values() for name in names]
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
        for title, names in (
            ("GPU suite", GPU_SUITE),
            ("GPU --quick", GPU_QUICK),
            ("CPU suite", CPU_SUITE),
            ("CPU --quick", CPU_QUICK),
            *((f"--user-shapes, {kind}", names) for kind, names in USER_SHAPES.items()),
        ):
            print(f"{title}: {' '.join(names)}")
        return 0
    if args.plot:
        pyplot()  # fail before the run, not after it
    if "float64" in args.dtype:
        jax.config.update("jax_enable_x64", True)
    import jax_tiled

    on_cpu = jax.default_backend() == "cpu"
    budget = CPU_BUDGET if on_cpu else GPU_BUDGET
    for precision in args.precision or []:
        try:  # a preset this backend refuses, named before the run, with those it takes
            jax_tiled.kernels(None, "float32", precision=lax_precision(precision))
        except ValueError as exc:
            parser.error(str(exc))
    info = device_info()
    if args.train_step:
        return train_step_main(parser, args, on_cpu, budget, info)
    if args.chain:
        return chain_main(parser, args, on_cpu, budget, info)
    if args.accuracy:
        return accuracy_main(parser, args, on_cpu, info)
    if args.ladder:
        return ladder_main(parser, args, on_cpu, budget, info)
    kernels = select_kernels(parser, args.kernels, jax_tiled.kernels())
    args.shapes = args.shapes or default_shapes(args, on_cpu)
    args.pallas_unavailable = pallas.unavailable()
    if args.pallas is None:
        args.pallas = args.pallas_unavailable is None
    _announce(
        info,
        f"kernels {kernels}; peers {list(peers_of(args))}; {len(args.shapes)} shapes x "
        f"{args.dtype}; median of {args.repeats}",
    )
    if args.pallas_unavailable:
        shown = "marked n/a" if args.pallas else "left out (--pallas shows it, marked n/a)"
        print(
            f"bench: the Pallas peer's column is {shown}: {args.pallas_unavailable}",
            file=sys.stderr,
        )

    rows = run_all(args, kernels, budget)
    summary = geomeans(rows)
    print(heading(info))
    print(format_table(rows, hbm_gbps(info["device"]), pallas=args.pallas))
    if any(r.precision == "high" for r in rows):
        print(
            "(precision high: ratio against jnp.matmul at precision highest, as "
            "docs/performance.md says)"
        )
    if any(r.precision in PRESETS for r in rows):
        print("(a preset's ratio: against jnp.matmul at the same preset)")
    print()
    print(format_geomeans(summary))
    if args.json:
        write_json(args.json, info, args, rows, geomeans=summary, pallas=pallas.json_section(args))
    if args.plot:
        write_plot(args.plot, info, rows)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if any(r.error is None for r in rows) else 1


def train_step_main(parser, args, on_cpu: bool, budget: Budget, info: dict) -> int:
    """--train-step: exit status 1 when any step failed or was off from the truth
    (harness.judge_against_truth)."""
    import jax_tiled

    kernels = select_kernels(parser, args.kernels or ["auto"], jax_tiled.kernels())
    width, tokens, sequences = TRAIN_SIZE[args.model, "cpu" if on_cpu else "gpu"]
    args.width = args.width or width
    args.tokens = args.tokens or tokens or args.width
    args.sequences = args.sequences or sequences
    model, size = step_of(args)
    _announce(
        info,
        f"kernels {kernels}; training step of the {args.model} at width {args.width}, "
        f"{args.sequences} x {args.tokens} tokens x {args.dtype}; median of {args.repeats}",
    )

    rows = run_train_steps(args, kernels, budget)
    return _report_against_truth(
        args,
        info,
        rows,
        description=describe_train_step(model, size),
        table=format_step_table(rows),
        what="training step",
        json_key="train_step",
        json_fields={
            "model_name": args.model,
            "width": args.width,
            "tokens": args.tokens,
            "sequences": args.sequences,
            "flops_per_step": step_flops(model, size),
        },
    )


def _announce(info: dict, what: str) -> None:
    """The run's first line, on stderr: the device, jax's version, then `what` runs."""
    print(f"bench: {device_label(info)}; jax {info['jax_version']}; {what}", file=sys.stderr)


def _report_against_truth(
    args,
    info: dict,
    rows,
    *,
    description: str,
    table: str,
    what: str,
    json_key: str,
    json_fields: dict,
) -> int:
    """The report of rows checked against the truth (chains, training steps):
    the table under its description and the rule it was judged by; with --json
    the rows and, under `json_key`, `json_fields` then the description and the
    rule. The exit status: 1 when any row failed (_report_failures, naming `what`)."""
    agreement = f"{TRUTH_TEXT}; {AGREEMENT_TEXT}"
    print(heading(info))
    print(description)
    print(agreement)
    print(table)
    if args.json:
        section = {**json_fields, "model": description, "agreement": agreement}
        write_json(args.json, info, args, rows, **{json_key: section})
    return _report_failures(rows, what)


def _report_failures(rows, what: str) -> int:
    failed = [row for row in rows if row.error]
    for row in failed:
        print(
            f"bench: {what} FAILED with {row.kernel} ({row.dtype}, {row.precision}): {row.error}",
            file=sys.stderr,
        )
    return 1 if failed else 0


def chain_main(parser, args, on_cpu: bool, budget: Budget, info: dict) -> int:
    """--chain: exit status 1 when any chain failed or was off from the truth
    (harness.judge_against_truth)."""
    import jax_tiled

    kernels = select_kernels(parser, args.kernels or ["auto"], jax_tiled.kernels())
    args.sizes = args.sizes or list(CHAIN_SIZES["cpu" if on_cpu else "gpu"])
    _announce(
        info,
        f"kernels {kernels}; chains of {args.chain_length} products, sizes {args.sizes} x "
        f"{args.dtype}; median of {args.repeats}",
    )

    rows = run_chains(args, kernels, budget)
    return _report_against_truth(
        args,
        info,
        rows,
        description=describe_chains(args.chain_length),
        table=format_chain_table(rows),
        what="chain",
        json_key="chains",
        json_fields={"length": args.chain_length, "sizes": args.sizes},
    )


def accuracy_main(parser, args, on_cpu: bool, info: dict) -> int:
    """--accuracy: the table last. Exit status 1 when a kernel failed other than by
    refusing a product it was forced on, or when no row was measured; flags (targets
    missed) leave it 0."""
    import jax_tiled

    kernels = select_kernels(parser, args.kernels, jax_tiled.kernels())
    suite = "cpu" if on_cpu or args.cpu_suite else "gpu"
    _announce(info, f"kernels {kernels}; accuracy of {args.dtype}")

    rows = run_accuracy(args, kernels, suite)
    flagged = sum(bool(row.misses) for row in rows)
    print(f"bench: {flagged} of {len(rows)} rows miss an accuracy target", file=sys.stderr)
    if args.json:
        write_json(
            args.json,
            info,
            args,
            None,
            accuracy={"definitions": DEFINITIONS, "flags": LEGEND, "rows": json_rows(rows)},
        )
    status = _report_failures([row for row in rows if not row.refused], "accuracy")
    print(heading(info))
    print(DEFINITIONS)
    print(LEGEND)
    print(format_accuracy_table(rows))
    return status if any(row.error is None for row in rows) else 1


def ladder_main(parser, args, on_cpu: bool, budget: Budget, info: dict) -> int:
    """--ladder: exit status 1 when no rung was timed or a rung failed (a refusal
    is a row, not a failure)."""
    from jax_tiled import _ffi

    if on_cpu:
        parser.error(
            "--ladder reports the CUDA kernel ladder and needs a GPU: jax's default "
            "backend is cpu (run it where jax sees a CUDA device)"
        )
    if not _ffi.cuda_module_built():
        parser.error("--ladder: this build has no CUDA module (built without nvcc)")
    rungs = ladder.ladder_rungs(parser, args.kernels)
    args.shapes = args.shapes or [parse_shape(ladder.DEFAULT_SHAPE)]
    _announce(
        info,
        f"the ladder {[k.name for k in rungs]} on {args.shapes[0].name} x {args.dtype}; "
        f"median of {args.repeats}",
    )
    rows = ladder.run_ladder(args, rungs, budget)
    if args.ncu:
        ncu_note = ladder.measure_bytes(rows, args.shapes[0], not args.no_progress)
    else:
        ncu_note = "Measured bytes: not measured (--ncu measures them with Nsight Compute)"
    text = format_ladder_markdown(
        rows, info, args, [ladder.PRECISION_TEXT, ladder.BYTES_TEXT, ncu_note]
    )
    print(heading(info))
    print(text)
    if args.ladder_md:
        with open(args.ladder_md, "w") as f:
            f.write(text)
        print(f"wrote {args.ladder_md}", file=sys.stderr)
    if args.json:
        write_json(
            args.json,
            info,
            args,
            rows,
            ladder={
                "shape": args.shapes[0].name,
                "precision": ladder.PRECISION_TEXT,
                "bytes_per_output": ladder.BYTES_TEXT,
                "ncu": ncu_note,
            },
        )
    if args.plot:
        write_ladder_plot(args.plot, info, rows)
        print(f"wrote {args.plot}", file=sys.stderr)
    failed = [row for row in rows if row.error]
    for row in failed:
        print(f"bench: {row.kernel} ({row.dtype}) FAILED: {row.error}", file=sys.stderr)
    timed = [row for row in rows if not row.is_peer and row.tflops]
    return 1 if failed or not timed else 0
