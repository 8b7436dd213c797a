"""What the benchmark prints and writes: tables, geometric means, device facts, JSON.

It reads the row types of the modules that measure (products, train_step,
chains, accuracy, ladder) for annotations only; they import nothing of it."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform as host_platform
import sys
from typing import TYPE_CHECKING

import jax

from jax_tiled.bench.harness import PEER_PRECISION, peer_precision

if TYPE_CHECKING:
    from jax_tiled.bench.accuracy import AccuracyRow
    from jax_tiled.bench.chains import ChainRow
    from jax_tiled.bench.ladder import LadderRow
    from jax_tiled.bench.products import Row
    from jax_tiled.bench.train_step import StepRow

# Peak memory bandwidth (GB/s) by device_kind substring, for the %-of-HBM note.
HBM_GBPS = {"H200": 4800, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039, "A100": 1555}


def geomeans(rows: list[Row]) -> list[dict]:
    """Per (dtype, precision, kernel): the geometric mean and minimum of the ratios to
    jnp.matmul, and under "pallas" those to the Pallas peer where a row has one. The
    dtype is the row's label: products into float32 are their own group."""
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for row in rows:
        if not row.is_peer:
            groups.setdefault((row.dtype_label, row.precision, row.kernel), []).append(row)
    summary = []
    for (dtype, precision, kernel), group in groups.items():
        r = [row.ratio for row in group if row.ratio]
        vs_pallas = [row.pallas_ratio for row in group if row.pallas_ratio]
        summary.append(
            {
                "dtype": dtype,
                "precision": precision,
                "kernel": kernel,
                "n": len(r),
                "failed": sum(row.error is not None for row in group),
                "geomean": _geomean(r),
                "min": min(r) if r else None,
                "below_0.8": sum(x < 0.8 for x in r),
                "pallas": {
                    "n": len(vs_pallas),
                    "geomean": _geomean(vs_pallas),
                    "min": min(vs_pallas),
                }
                if vs_pallas
                else None,
            }
        )
    return summary


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio_cell(row, ratio: float | None) -> str:
    """A time ratio to a peer: on the peer's own row, "peer" (what the kernels'
    ratios are to)."""
    return "peer" if row.is_peer else _fmt(ratio, ".3f")


def _gbps_cells(row: Row, hbm: float | None) -> tuple[str, str]:
    """GB/s and its share of the device's HBM bandwidth: two cells, as the header has
    two columns (the share once shared the GB/s cell, on GPUs only, and a whitespace
    split of the line found more cells than columns)."""
    if row.gbps is None:
        return "-", "-"
    gbps = f"{row.gbps:.0f}" if row.gbps >= 100 else f"{row.gbps:.2f}"
    return gbps, _fmt(hbm and 100 * row.gbps / hbm, ".0f")


def format_table(rows: list[Row], hbm: float | None, pallas: bool = False) -> str:
    """The product rows; with `pallas`, the ratio to the Pallas peer ("x pallas") and
    the Pallas rows' fastest config ("config") as two more columns."""
    head = (
        "shape",
        "dtype",
        "precision",
        "kernel",
        "sets",
        "ms",
        "TFLOP/s",
        "GB/s",
        "%HBM",
        "x peer",
        *(("x pallas",) if pallas else ()),
        "rel.err",
        *(("config",) if pallas else ()),
    )
    return _text_table(head, rows, lambda row: _row_cells(row, hbm, pallas), left=4)


def _check_cells(head: tuple[str, ...], cells: tuple[str, ...]) -> None:
    """A row's cells fill the header's columns one for one, and none is empty or holds
    whitespace, so that splitting a line on whitespace gives each column where the
    header has it (tests and scripts read the tables so)."""
    if len(cells) != len(head):
        raise ValueError(
            f"table row has {len(cells)} cells against {len(head)} columns {head}: {cells}"
        )
    bad = [c for c in cells if not c or any(ch.isspace() for ch in c)]
    if bad:
        raise ValueError(f"table cells must be non-empty words: {bad} in {cells}")


def _instead_of_numbers(row) -> str | None:
    """What a row without numbers shows after its first cells: ERROR and its error,
    or n/a and why it does not apply (a Pallas row it cannot compute)."""
    if row.error:
        return f"ERROR {row.error.splitlines()[0][:100]}"
    not_applicable = getattr(row, "not_applicable", None)
    return not_applicable and f"n/a {not_applicable[:120]}"


def _text_table(head: tuple[str, ...], rows: list, cells_of, left: int) -> str:
    """Aligned columns, the first `left` (what a row measures) flush left. A failed
    row shows those and the next cell, then its error in place of the numbers; a
    row that does not apply, why."""
    cells = {}
    for row in rows:
        row_cells = tuple(cells_of(row))
        if _instead_of_numbers(row):  # its numbers are none: prose after them
            row_cells = row_cells[: left + 1] + ("",) * (len(head) - left - 1)
        else:
            _check_cells(head, row_cells)
        cells[id(row)] = row_cells
    widths = [max(len(c[i]) for c in (head, *cells.values())) for i in range(len(head))]

    def line(values):
        return "  ".join(
            v.ljust(w) if i < left else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths))
        ).rstrip()

    out = [line(head), line(["-" * w for w in widths])]
    for row in rows:
        instead = _instead_of_numbers(row)
        if instead:
            out.append(f"{line(cells[id(row)][: left + 1])}  {instead}")
        else:
            out.append(line(cells[id(row)]))
    return "\n".join(out)


def _row_cells(row: Row, hbm: float | None, pallas: bool) -> tuple[str, ...]:
    lead = (row.shape, row.dtype_label, row.precision, row.kernel, str(row.sets))
    return lead + (
        _fmt(row.ms, ".4f"),
        _fmt(row.tflops, ".3f"),
        *_gbps_cells(row, hbm),
        _ratio_cell(row, row.ratio),
        *((_ratio_cell(row, row.pallas_ratio),) if pallas else ()),
        _fmt(row.rel_error, ".1e"),
        *((row.config or "-",) if pallas else ()),
    )


def _err_heads(names: tuple[str, ...]) -> tuple[str, ...]:
    """The columns of a checked row's distances to the truth: ours and the peer's per
    quantity, then the tolerance (harness.judge_against_truth)."""
    return (*(head for name in names for head in (f"{name}.err", f"jnp.{name}.err")), "tol")


def _err_cells(row, names: tuple[str, ...]) -> tuple[str, ...]:
    return (
        *(_fmt(errs and errs[name], ".1e") for name in names for errs in (row.err, row.peer_err)),
        _fmt(row.tolerance, ".0e"),
    )


CHAIN_ERRS = ("x",)


def format_chain_table(rows: list[ChainRow]) -> str:
    head = (
        "form",
        "size",
        "dtype",
        "precision",
        "kernel",
        "sets",
        "us/product",
        "TFLOP/s",
        "x peer",
        *_err_heads(CHAIN_ERRS),
    )
    return _text_table(head, rows, _chain_cells, left=5)


def _chain_cells(row: ChainRow) -> tuple[str, ...]:
    lead = (row.form, str(row.size), row.dtype, row.precision, row.kernel, str(row.sets))
    return lead + (
        _fmt(row.us_per_product, ".2f"),
        _fmt(row.tflops, ".3f"),
        _ratio_cell(row, row.ratio),
        *_err_cells(row, CHAIN_ERRS),
    )


STEP_ERRS = ("loss", "grad")


def format_step_table(rows: list[StepRow]) -> str:
    head = (
        "dtype",
        "precision",
        "kernel",
        "sets",
        "ms/step",
        "TFLOP/s",
        "x peer",
        "loss",
        *_err_heads(STEP_ERRS),
    )
    return _text_table(head, rows, _step_cells, left=3)


def _step_cells(row: StepRow) -> tuple[str, ...]:
    lead = (row.dtype, row.precision, row.kernel, str(row.sets))
    return lead + (
        _fmt(row.ms, ".4f"),
        _fmt(row.tflops, ".3f"),
        _ratio_cell(row, row.ratio),
        _fmt(row.loss, ".5g"),
        *_err_cells(row, STEP_ERRS),
    )


def format_accuracy_table(rows: list[AccuracyRow]) -> str:
    head = (
        "shape",
        "dtype",
        "out",
        "precision",
        "inputs",
        "kernel",
        "err",
        "jnp.err",
        "err/jnp",
        "bias",
        "jnp.bias",
        "|bias|/jnp",
        "flag",
    )
    return _text_table(head, rows, _accuracy_cells, left=6)


def _accuracy_cells(row: AccuracyRow) -> tuple[str, ...]:
    flag = "ok" if not row.misses else "+".join(m.upper() for m in row.misses)
    return (
        row.shape,
        row.dtype,
        row.out_dtype,
        row.precision,
        row.inputs,
        row.kernel,
        _fmt(row.err, ".2e"),
        _fmt(row.peer_err, ".2e"),
        _fmt(row.err_ratio, ".2f"),
        _fmt(row.bias, "+.1e"),
        _fmt(row.peer_bias, "+.1e"),
        _fmt(row.bias_ratio, ".2f"),
        flag,
    )


def format_geomeans(summary: list[dict]) -> str:
    out = ["geometric mean of ratios (peer time / kernel time):"]
    # a preset's name is wider than a precision's, "bfloat16->float32" than a dtype's
    precision_width = max([8, *(len(g["precision"]) for g in summary)])
    dtype_width = max([9, *(len(g["dtype"]) for g in summary)])
    for g in summary:
        vs_pallas = g.get("pallas")
        out.append(
            f"  {g['dtype']:<{dtype_width}} {g['precision']:<{precision_width}} {g['kernel']:<12} "
            f"{_fmt(g['geomean'], '.3f'):>6}x  over {g['n']} shapes, "
            f"min {_fmt(g['min'], '.3f')}x, {g['below_0.8']} below 0.8x"
            + (f", {g['failed']} failed" if g["failed"] else "")
            + (
                f"; vs pallas {vs_pallas['geomean']:.3f}x over {vs_pallas['n']} shapes, "
                f"min {vs_pallas['min']:.3f}x"
                if vs_pallas
                else ""
            )
        )
    return "\n".join(out)


def _ladder_cell(value, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _ladder_bytes(value) -> str:
    """Whole bytes where they are whole ("2,048"), else one decimal."""
    if value is None:
        return "—"
    return f"{value:,.0f}" if value == round(value) or value >= 100 else f"{value:,.1f}"


# The ladder report's table (format_ladder_markdown).
LADDER_COLUMNS = (
    "rung",
    "kernel",
    "precision",
    "TFLOP/s",
    "× previous",
    "× naive",
    "× jnp.matmul",
    "bytes/output (tiling)",
    "L2 bytes/output (ncu)",
    "DRAM bytes/output (ncu)",
)


def _markdown_row(row: LadderRow) -> str:
    if row.skipped or row.error:
        numbers = ["skipped" if row.skipped else "failed"] + ["—"] * 6
    else:
        numbers = [
            _ladder_cell(row.tflops, ".3g"),
            _ladder_cell(row.step, ".3g", "×"),
            _ladder_cell(row.vs_naive, ".3g", "×"),
            "peer" if row.is_peer else _ladder_cell(row.ratio, ".3g", "×"),
            _ladder_bytes(row.bytes_per_output),
            _ladder_bytes(row.l2_bytes_per_output),
            _ladder_bytes(row.dram_bytes_per_output),
        ]
    rung = "peer" if row.rung is None else str(row.rung)
    cells = [rung, f"`{row.kernel}`", row.precision, *numbers]
    return "| " + " | ".join(cells) + " |"


def format_ladder_markdown(rows: list[LadderRow], info: dict, args, notes: list[str]) -> str:
    """The ladder report (--ladder) as markdown: what ran and `notes` (what the
    columns mean), then one table per dtype, each followed by the rows it could
    not time or measure and why."""
    (shape,) = args.shapes
    out = [
        f"{device_label(info)}, jax {info['jax_version']}, {info['date'][:10]}; "
        f"{shape.name} (M x K x N = {shape.m} x {shape.k} x {shape.n}"
        f"{f', batch {shape.batch}' if shape.batch > 1 else ''}), median of "
        f"{args.repeats}; `python -m jax_tiled.bench {' '.join(args.argv)}`",
        "",
        " ".join(f"{note}." for note in notes),
    ]
    align = "|" + "|".join("---" if i in (1, 2) else "---:" for i in range(len(LADDER_COLUMNS)))
    for dtype in dict.fromkeys(row.dtype for row in rows):
        section = [row for row in rows if row.dtype == dtype]
        out += ["", f"**{dtype}**", "", "| " + " | ".join(LADDER_COLUMNS) + " |", align + "|"]
        out += [_markdown_row(row) for row in section]
        said = [
            f"- `{row.kernel}` ({row.precision}): "
            + (f"skipped: {row.skipped}" if row.skipped else f"failed: {row.error}")
            for row in section
            if row.skipped or row.error
        ]
        said += [
            f"- `{row.kernel}`: ncu: {row.ncu_error}"
            for row in section
            if row.ncu_error and not row.skipped
        ]
        if said:
            out += ["", *said]
    return "\n".join(out) + "\n"


def write_tool_report(path: str, argv, **fields) -> None:
    """A tool's JSON (tools/): the first device's kind, jax's version, the UTC
    time and the arguments (sys.argv's where `argv` is None), then `fields`."""
    report = dict(
        device=jax.devices()[0].device_kind,
        jax_version=jax.__version__,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        argv=sys.argv[1:] if argv is None else list(argv),
        **fields,
    )
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")


def device_info() -> dict:
    device = jax.devices()[0]
    info = {
        "device": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "jax_version": jax.__version__,
        "jaxlib_version": _jaxlib_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": host_platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import jax_tiled
        from jax_tiled import _ffi

        info["jax_tiled_version"] = jax_tiled.__version__
        # The CPU kernel's path for bfloat16 inputs (AMX, vdpbf16ps or the float32
        # fallback), as JAX_TILED_CPU_BF16 and this CPU decide it.
        info["cpu_bf16_path"] = _ffi.cpu_bf16_path()
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
        path = f", bfloat16 path {info['cpu_bf16_path']}" if info.get("cpu_bf16_path") else ""
        return f"CPU: {info['cpu']} ({info['cpu_count']} cores{path})"
    return f"{info['device']} ({info['platform']})"


def hbm_gbps(device_kind: str) -> float | None:
    for key, value in HBM_GBPS.items():
        if key in device_kind:
            return value
    return None


def json_rows(rows: list) -> list[dict]:
    return [dataclasses.asdict(r) for r in rows]


def write_json(path: str, info: dict, args, rows: list | None, **sections) -> None:
    """Writes the device facts, the command line, the timed rows (None: a run
    that times nothing, such as --accuracy, whose rows are in its section) and
    the sections to `path`, and says so on stderr."""
    doc = {**info, "argv": args.argv}
    if rows is not None:
        doc.update(
            repeats=args.repeats,
            warmup=args.warmup,
            # a preset row's peer is at the same preset
            peer_precision={
                **PEER_PRECISION,
                **{r.precision: peer_precision(r.precision) for r in rows},
            },
            rows=json_rows(rows),
        )
    doc.update(sections)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)
