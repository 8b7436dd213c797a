"""Nsight Compute of products, ours against jnp's kernels: what bounds each.

    python3 tools/ncu_products.py --shapes 1024x32768x1024,512x8192x512 \
        [--dtype bfloat16] [--precision default] [--kernel auto] [--json ncu.json]
        [--pallas 128x128x64.s4.wgN.gN8.cM] [--timeout 300]
        [--section WarpStateStats --section SchedulerStats] [--stalls] [--source 30]
        [--metric lts__t_sectors_srcunit_tex_op_read.sum] [--no-peer]

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
read). `--source N` profiles each product once more for ncu's warp samples
per SASS instruction (SourceCounters, its source page) and prints, per
kernel launched, the samples' stall reasons and the N instructions where
most samples fell, in program order: which wait, of which warps (the
producer's, the consumers'), a kernel's time is made of. `--no-peer`
leaves jnp's kernels out. Each product takes about a minute under ncu
(jnp's autotuning runs outside the profiled range but inside the process),
with `--stalls` about two at 4096^3 (H200, 2026-11-29: a 90 s --timeout
cut every one). Each runs in a process group of its own, killed whole past
`--timeout` or when this script is stopped, and the next starts once none
of the group's processes is left: a profiled product outliving its ncu held
the GPU, and the next product then failed to start (2026-11-26, and again
2026-11-29 right after a kill: CUDA_ERROR_OUT_OF_MEMORY). The JSON's device
is nvidia-smi's name for it: this script never opens the GPU itself.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from jax_tiled.bench import pallas
from jax_tiled.bench.ladder import ncu_records, probe_command

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
# sum, so that a reason not listed here shows as the difference ("selected"
# is the issuing warp's own cycle). On Hopper the waits on mbarriers show as
# long_scoreboard, wgmma's wait for its group (WARPGROUP.DEPBAR) as barrier.
STALL_REASONS = (
    "long_scoreboard", "barrier", "wait", "math_pipe_throttle", "mio_throttle",
    "short_scoreboard", "not_selected", "selected", "no_instruction", "branch_resolving",
    "sleeping", "lg_throttle", "tex_throttle", "membar", "drain", "imc_miss", "misc",
    "dispatch_stall",
)  # fmt: skip
STALL_SHOWN = 5  # the largest reasons a launch's row names


def stall_metric(reason: str) -> str:
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


PEER = "jnp.matmul"
PALLAS_CONFIGS = [config.name for config in pallas.CONFIGS]


# Only inside the probe's profiled range, the clocks and caches left as they are.
PROFILED_AS_RUN = (
    "--profile-from-start",
    "off",
    "--clock-control",
    "none",
    "--cache-control",
    "none",
)


def ncu_flags(extra_sections=(), extra_metrics=()) -> list[str]:
    """What ncu is asked: CSV in base units, as the product runs
    (PROFILED_AS_RUN), the sections and metrics."""
    flags = ["--csv", "--print-units", "base", *PROFILED_AS_RUN]
    for section in (*SECTIONS, *extra_sections):
        flags += ["--section", section]
    return flags + ["--metrics", ",".join((*METRICS, *extra_metrics))]


# --source: the warp samples per SASS instruction, on ncu's source page.
SOURCE_FLAGS = ("--section", "SourceCounters", "--page", "source", "--print-source", "sass")


def source_flags() -> list[str]:
    """What ncu is asked for --source: the source page as CSV, as the product
    runs (PROFILED_AS_RUN)."""
    return ["--csv", *PROFILED_AS_RUN, *SOURCE_FLAGS]


def ncu_command(ncu: str, flags: list[str], kernel: str, shape: str, dtype: str, precision: str):
    """One product under ncu, in a fresh process."""
    return [ncu, *flags, *probe_command(kernel, shape, dtype, precision)]


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
            wait_for_group_end(process.pid)
            return None, out, err
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    return process.returncode, out, err


def group_running(group: int) -> bool:
    """Whether a process of process group `group` is still running (not a
    zombie): /proc/PID/stat's third field is the state, its fifth the group."""
    for stat in os.listdir("/proc"):
        if not stat.isdigit():
            continue
        try:
            with open(f"/proc/{stat}/stat") as f:
                fields = f.read().rsplit(") ", 1)[-1].split()
        except OSError:
            continue  # ended meanwhile
        if fields[0] != "Z" and int(fields[2]) == group:
            return True
    return False


def wait_for_group_end(group: int, seconds: float = 60.0) -> None:
    """Until no process of a killed group runs (its GPU memory then freed),
    at most `seconds`: the killed product's python, a grandchild, outlives
    ncu by a moment, and the next product started then could not open the GPU."""
    deadline = time.monotonic() + seconds
    while group_running(group) and time.monotonic() < deadline:
        time.sleep(0.2)


def gpu_name() -> str:
    """The profiled GPU's name by nvidia-smi (the first of CUDA_VISIBLE_DEVICES
    where that names one by index), "unknown" where it cannot tell."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    command = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    command += ["-i", visible] if visible.isdigit() else []
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    names = done.stdout.strip().splitlines()
    return names[0].strip() if done.returncode == 0 and names else "unknown"


def parse_source(text: str) -> list[dict]:
    """ncu's source page (--csv) as one dict per profiled kernel: its name and
    per SASS instruction, in program order, the instruction, how often it
    ran, its warp samples and their stall reasons (ValueError where there is
    no such page)."""
    kernels: list[dict] = []
    header: list[str] | None = None
    for cells in csv.reader(line for line in text.splitlines() if line.startswith('"')):
        if cells[0] == "Kernel Name":
            kernels.append({"kernel": cells[1], "instructions": []})
            header = None
        elif cells[0] == "Address":
            header = cells
        elif header is not None and kernels:
            record = dict(zip(header, cells))
            stalls = {
                name.removeprefix("stall_"): int(value)
                for name, value in record.items()
                if name.startswith("stall_") and "Not Issued" not in name and value.isdigit()
                and int(value)
            }  # fmt: skip
            kernels[-1]["instructions"].append({
                "sass": record.get("Source", "").strip(),
                "executed": int(number(record.get("Instructions Executed", "0")) or 0),
                "samples": int(number(record.get("# Samples", "0")) or 0),
                "stalls": stalls,
            })  # fmt: skip
    if not any(kernel["instructions"] for kernel in kernels):
        raise ValueError("no ncu source page")
    return kernels


def source_summary(kernel: dict, shown: int) -> dict:
    """One kernel's samples: their count, each stall reason's share of them,
    and the `shown` instructions with the most, in program order (their
    index among the kernel's instructions kept)."""
    instructions = kernel["instructions"]
    samples = sum(i["samples"] for i in instructions)
    by_reason: dict[str, int] = {}
    for instruction in instructions:
        for reason, count in instruction["stalls"].items():
            by_reason[reason] = by_reason.get(reason, 0) + count
    order = sorted(range(len(instructions)), key=lambda k: -instructions[k]["samples"])
    top = sorted(k for k in order[:shown] if instructions[k]["samples"])
    return {
        "kernel": kernel["kernel"],
        "samples": samples,
        "stall_shares": {
            reason: count / samples
            for reason, count in sorted(by_reason.items(), key=lambda item: -item[1])
        },
        "top": [{"index": k, **instructions[k]} for k in top],
    }


def source_report(product: str, implementation: str, summaries: list[dict]) -> str:
    """Markdown: per kernel, its samples' stall shares, then a table of its
    instructions with the most samples."""
    lines = []
    for s in summaries:
        shares = ", ".join(
            f"{r} {100 * v:.1f}%" for r, v in s["stall_shares"].items() if v >= 0.005
        )
        lines += [
            f"{product} {implementation} {short_name(s['kernel'])}: {s['samples']} samples; "
            f"stalls {shares}",
            "",
            "| # | instruction | samples % | executed | largest stalls |",
            "|" + "---|" * 5,
        ]
        for i in s["top"]:
            share = 100 * i["samples"] / s["samples"] if s["samples"] else 0.0
            stalls = sorted(i["stalls"].items(), key=lambda item: -item[1])[:3]
            named = ", ".join(f"{reason} {count}" for reason, count in stalls)
            sass = i["sass"].replace("|", "\\|")
            lines.append(f"| {i['index']} | `{sass}` | {share:.1f} | {i['executed']} | {named} |")
        lines.append("")
    return "\n".join(lines)


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
    for what in ("section", "metric"):
        p.add_argument(
            f"--{what}",
            action="append",
            default=[],
            metavar="NAME",
            help=f"an ncu {what} read besides the default ones (repeatable)",
        )
    p.add_argument(
        "--stalls",
        action="store_true",
        help="also read why warps wait (ncu's stall reasons: warps stalled per issued "
        "instruction, by reason) and print them per launch in a second table",
    )
    p.add_argument(
        "--source",
        type=int,
        default=0,
        metavar="N",
        help="also profile each product for ncu's warp samples per SASS instruction "
        "and print, per kernel, their stall reasons and the N instructions with the most",
    )
    p.add_argument("--no-peer", action="store_true", help="leave jnp's kernels out")
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
    if args.source < 0:
        p.error(f"--source must be a count of instructions, got {args.source}")
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
    flags = ncu_flags(args.section, metrics)
    reports = []

    def profiled(asked: list[str], kernel: str, shape: str, parse):
        """`parse` of one product's output under ncu with the flags `asked`, or
        None (said why) where it failed."""
        command = ncu_command(ncu, asked, kernel, shape, args.dtype, args.precision)
        status, out, err = run_in_own_group(command, env, args.timeout)
        if status is None:
            print(f"{shape} {kernel}: cut at {args.timeout:g} s (--timeout), killed")
            return None
        try:
            return parse(out)
        except ValueError as exc:
            tail = " ".join(err.split()[-40:])
            print(f"{shape} {kernel}: {exc} (exit status {status}; {tail})")
            return None

    # Stopped part way (--timeout of the call around it, SIGTERM): the tables
    # and the JSON still hold every product done, so a cut run is not lost.
    stopped = True
    try:
        for shape in args.shapes.split(","):
            implementations = [("ours", args.kernel)] + ([] if args.no_peer else [("jnp", PEER)])
            implementations += [("pallas", pallas.PROBE_PREFIX + name) for name in args.pallas]
            for implementation, kernel in implementations:
                print(f"ncu: {shape} {args.dtype} {kernel}", file=sys.stderr, flush=True)
                launches = profiled(flags, kernel, shape, parse_launches)
                if launches is None:
                    failed += 1
                    continue
                row = {"product": shape, "implementation": implementation, "kernel_asked": kernel,
                       "launches": launches}  # fmt: skip
                if args.source:
                    print(
                        f"ncu --source: {shape} {args.dtype} {kernel}", file=sys.stderr, flush=True
                    )
                    kernels = profiled(source_flags(), kernel, shape, parse_source)
                    if kernels is None:
                        failed += 1
                    else:
                        row["source"] = [source_summary(k, args.source) for k in kernels]
                        reports.append(source_report(shape, implementation, row["source"]))
                rows.append(row)
        stopped = False
    finally:
        if stopped:
            print(f"stopped: the products done so far ({len(rows)} of them)", flush=True)
        print(table(rows))
        if args.stalls:
            print()
            print(stall_table(rows))
        for report in reports:
            print()
            print(report)
        if args.json:
            record = {
                "device": gpu_name(),
                "jax_version": importlib.metadata.version("jax"),
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "argv": sys.argv[1:] if argv is None else argv,
                "ncu_flags": flags,
                **({"source_flags": source_flags()} if args.source else {}),
                **({"stopped": True} if stopped else {}),
                "rows": rows,
            }
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
