"""Nsight Compute of products, ours against jnp's kernels: what bounds each.

    python3 tools/ncu_products.py --shapes 1024x32768x1024,512x8192x512 \
        [--dtype bfloat16] [--precision default] [--kernel auto] [--json ncu.json]
        [--pallas 128x128x64.s4.wgN.gN8.cM] [--timeout 300]
        [--section WarpStateStats --section SchedulerStats] [--stalls]
        [--metric lts__t_sectors_srcunit_tex_op_read.sum]

On the GPU machine, with the package installed. Each product runs once to
compile and warm up, then once under ncu (the ladder's probe, `python -m
jax_tiled.bench.ladder --probe`, between cuProfilerStart and cuProfilerStop),
for `--kernel`, for jnp.matmul after XLA's autotuning and for each `--pallas`
config of the benchmark's Pallas sweep (`jax_tiled.bench.pallas`), with the
clocks left as they are and the caches not flushed (`--cache-control none`:
L2 holds what a benchmark's repeated calls leave there). Printed per kernel launched: its
time, blocks (cluster size), SM, L2 and DRAM throughput in % of peak, and
the bytes read through L2 and from DRAM. ncu's SpeedOfLight, LaunchStats and
Occupancy sections are read (Occupancy's "Max Active Clusters" says how many
clusters of a kernel's size the GPU holds at once), and any `--section` named
besides (WarpStateStats: where the warps stall) and any `--metric`;
`--stalls` reads each stall reason's warps per issued instruction too (the
parts of WarpStateStats's cycles per issued instruction, which its tables,
not read here, break down) and prints them per launch; the JSON
keeps every metric of every launch (the tables some sections print are not
read). Each product takes about a minute under ncu (jnp's
autotuning runs outside the profiled range but inside the process). Each
runs in a process group of its own, killed whole past `--timeout` or when
this script is stopped: a profiled product outliving its ncu held the GPU,
and the next product then failed to start (2026-11-26).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys

from jax_tiled.bench import pallas
from jax_tiled.bench.ladder import ncu_records

SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy")
METRICS = (
    "dram__bytes_read.sum",
    "lts__t_sectors_op_read.sum",
    "lts__t_sectors_op_write.sum",
    "lts__t_sector_hit_rate.pct",
)
SECTOR_BYTES = 32
# Why warps wait (--stalls): each reason's average count of warps stalled on
# it per issued instruction; together they make ncu's "Warp Cycles Per
# Issued Instruction" (WarpStateStats), which the table prints beside their
# sum, so that a reason not listed here shows as the difference.
STALL_REASONS = (
    "long_scoreboard", "barrier", "wait", "math_pipe_throttle", "mio_throttle",
    "short_scoreboard", "not_selected", "lg_throttle", "membar", "drain", "imc_miss",
    "dispatch_stall",
)  # fmt: skip
STALL_SHOWN = 5  # the largest reasons a launch's row names


def stall_metric(reason: str) -> str:
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


PEER = "jnp.matmul"
PALLAS_CONFIGS = [config.name for config in pallas.CONFIGS]


def ncu_flags(extra_sections=(), extra_metrics=()) -> list[str]:
    """What ncu is asked: CSV in base units, only inside the probe's profiled
    range, the clocks and caches left as they are, the sections and metrics."""
    flags = ["--csv", "--print-units", "base", "--profile-from-start", "off"]
    flags += ["--clock-control", "none", "--cache-control", "none"]
    for section in (*SECTIONS, *extra_sections):
        flags += ["--section", section]
    return flags + ["--metrics", ",".join((*METRICS, *extra_metrics))]


def ncu_command(
    ncu: str, kernel: str, shape: str, dtype: str, precision: str, sections=(), metrics=()
) -> list[str]:
    """One product under ncu, in a fresh process."""
    return [
        ncu,
        *ncu_flags(sections, metrics),
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


def run_in_own_group(command: list[str], env: dict, timeout: float):
    """(exit status, stdout, stderr) of `command`, run in a process group of its
    own; past `timeout` seconds, or where this process is stopped, the whole
    group is killed (ncu and the product it profiles, which would otherwise
    hold the GPU and make the next product fail to start) and the status is
    None."""
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    ) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            return None, out, err
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    return process.returncode, out, err


def number(text: str):
    """A metric's value as a float where it is one ("2,109,952" too), else the text."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def parse_launches(text: str) -> list[dict]:
    """ncu's --csv output as one dict per kernel launch, in launch order: its
    name and every metric by ncu's name for it (ValueError where there is no
    table: ladder.ncu_records)."""
    launches: dict[str, dict] = {}
    for record in ncu_records(text):
        if record.get("Kernel Name") is None:
            continue  # a row of another table (a section's tables print their own)
        launch = launches.setdefault(record["ID"], {"kernel": record["Kernel Name"]})
        if record.get("Metric Name"):
            launch[record["Metric Name"]] = number(record["Metric Value"])
    return list(launches.values())


def short_name(kernel: str) -> str:
    """A kernel's name without its arguments and, but for our kernels'
    configuration, its template arguments."""
    name = re.match(r"(?:void )?([\w:]+)", kernel)
    config = re.search(r"WgmmaConfig<[^>]*>", kernel)
    base = name.group(1) if name else kernel
    return f"{base}<{config.group(0)}>" if config else base


def scaled(value, scale: float):
    """value x scale where ncu gave a number, else None."""
    return value * scale if isinstance(value, float) else None


def summary(launch: dict) -> dict:
    """The columns printed for one launch (ncu's base units: ns, bytes, sectors)."""
    return {
        "kernel": short_name(launch["kernel"]),
        "us": scaled(launch.get("Duration"), 1e-3),
        "blocks": launch.get("Grid Size"),
        "cluster": launch.get("Cluster Size"),
        "sm_pct": launch.get("Compute (SM) Throughput"),
        "l2_pct": launch.get("L2 Cache Throughput"),
        "dram_pct": launch.get("DRAM Throughput"),
        "l2_read_mb": scaled(launch.get("lts__t_sectors_op_read.sum"), SECTOR_BYTES / 1e6),
        "dram_read_mb": scaled(launch.get("dram__bytes_read.sum"), 1e-6),
    }


def stall_table(rows: list[dict]) -> str:
    """A markdown table of why each launch's warps wait (--stalls): the
    cycles a warp takes per issued instruction (ncu's, where WarpStateStats
    was read), the listed reasons' sum, and the largest reasons."""
    lines = [
        "| product | implementation | kernel | cycles an issue | listed | largest stalls |",
        "|" + "---|" * 6,
    ]
    for row in rows:
        for launch in row["launches"]:
            stalls = {r: launch.get(stall_metric(r)) for r in STALL_REASONS}
            stalls = {r: v for r, v in stalls.items() if isinstance(v, float)}
            largest = sorted(stalls.items(), key=lambda item: -item[1])[:STALL_SHOWN]
            total = launch.get("Warp Cycles Per Issued Instruction")
            cells = [
                row["product"],
                row["implementation"],
                short_name(launch["kernel"]),
                f"{total:.2f}" if isinstance(total, float) else "",
                f"{sum(stalls.values()):.2f}" if stalls else "",
                ", ".join(f"{reason} {value:.2f}" for reason, value in largest),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """A markdown table, a row a launch."""
    fields = ("us", "blocks", "cluster", "sm_pct", "l2_pct", "dram_pct", "l2_read_mb")
    fields += ("dram_read_mb",)
    head = "| product | implementation | kernel | µs | blocks | cluster | SM % | L2 % | DRAM % "
    head += "| L2 read MB | DRAM read MB |"
    lines = [head, "|" + "---|" * 11]

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.0f}" if value >= 100 or value.is_integer() else f"{value:.3g}"
        return "" if value is None else str(value)

    for row in rows:
        for launch in row["launches"]:
            s = summary(launch)
            cells = [row["product"], row["implementation"], s["kernel"]]
            lines.append("| " + " | ".join(cells + [cell(s[f]) for f in fields]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/ncu_products.py", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", required=True, help="MxKxN, comma-separated")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--precision", default="default")
    p.add_argument("--kernel", default="auto", help="ours: a kernel name (default auto)")
    p.add_argument(
        "--pallas",
        action="append",
        default=[],
        metavar="CONFIG",
        help="also the Pallas Mosaic-GPU kernel at this config of the benchmark's "
        "sweep (jax_tiled.bench.pallas.CONFIGS by name, e.g. 128x128x64.s4.wgN.gN8.cM; "
        "repeatable)",
    )
    p.add_argument("--json", metavar="PATH", help="write every launch's metrics here")
    p.add_argument(
        "--section",
        action="append",
        default=[],
        metavar="NAME",
        help="an ncu section read besides the default ones (repeatable)",
    )
    p.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="NAME",
        help="an ncu metric read besides the default ones (repeatable)",
    )
    p.add_argument(
        "--stalls",
        action="store_true",
        help="also read why warps wait (ncu's stall reasons: warps stalled per issued "
        "instruction, by reason) and print them per launch in a second table",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="per product under ncu (default 300; about a minute each, 8192^3 more): "
        "past it the product and ncu are killed and the next one starts",
    )
    args = p.parse_args(argv)
    if args.timeout <= 0:
        p.error(f"--timeout must be positive, got {args.timeout}")
    # Stopped from outside (timeout(1), a device call's limit): the product under
    # ncu goes too (run_in_own_group), not left holding the GPU.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    unknown = [name for name in args.pallas if name not in PALLAS_CONFIGS]
    if unknown:
        configs = ", ".join(PALLAS_CONFIGS)
        p.error(f"--pallas {', '.join(unknown)}: the sweep's configs are {configs}")
    ncu = shutil.which("ncu")
    if ncu is None:
        p.error("ncu (Nsight Compute) is not on PATH")
    metrics = [*args.metric, *(map(stall_metric, STALL_REASONS) if args.stalls else ())]
    rows, failed = [], 0
    # The C locale: ncu prints numbers without thousands separators there.
    env = {**os.environ, "LC_ALL": "C"}
    for shape in args.shapes.split(","):
        implementations = [("ours", args.kernel), ("jnp", PEER)]
        implementations += [("pallas", pallas.PROBE_PREFIX + name) for name in args.pallas]
        for implementation, kernel in implementations:
            command = ncu_command(
                ncu, kernel, shape, args.dtype, args.precision, args.section, metrics
            )
            print(f"ncu: {shape} {args.dtype} {kernel}", file=sys.stderr, flush=True)
            status, out, err = run_in_own_group(command, env, args.timeout)
            if status is None:
                print(f"{shape} {kernel}: cut at {args.timeout:g} s (--timeout), killed")
                failed += 1
                continue
            try:
                launches = parse_launches(out)
            except ValueError as exc:
                tail = " ".join(err.split()[-40:])
                print(f"{shape} {kernel}: {exc} (exit status {status}; {tail})")
                failed += 1
                continue
            rows.append(
                {"product": shape, "implementation": implementation, "kernel_asked": kernel,
                 "launches": launches}
            )  # fmt: skip
    print(table(rows))
    if args.stalls:
        print()
        print(stall_table(rows))
    if args.json:
        import jax

        device = jax.devices()[0]
        record = {
            "device": device.device_kind,
            "jax_version": jax.__version__,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "argv": sys.argv[1:] if argv is None else argv,
            "ncu_flags": ncu_flags(args.section, metrics),
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
