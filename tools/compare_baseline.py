"""Compare a benchmark run with a committed baseline, row by row, against the peer.

    python tools/compare_baseline.py docs/perf/h100-2026-11-23-baseline-tf32-bf16.json run.json

Both files are `python -m jax_tiled.bench --json` output. A row is matched by
shape, dtype, output dtype, precision and kernel; what is compared is the ratio against the
peer measured in the same run (peer time / kernel time), since the peer's own
time moves between processes and machines. Every matched row that lost more
than --threshold (default 3%) is printed as a regression and the exit status
is 1; rows only in one file are listed. A different device is an error: the
ratios of two cards say nothing about a change.

    python tools/compare_baseline.py docs/perf run.json

A directory in place of the baseline takes the newest of its *baseline*.json
files (by the date of their run) measured on the run's device, and says
which; none for that device is an error.

    python tools/compare_baseline.py docs/perf --args-for "NVIDIA H200"

prints the benchmark arguments of that device's baseline (less its --json
and --plot), shell-quoted, for a run that measures the same rows
(tools/device_check.sh uses them where it is given none).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def dtype_label(row: dict) -> str:
    """A row's dtype, "bfloat16->float32" for a product into another dtype."""
    out = row.get("out_dtype")
    return f"{row['dtype']}->{out}" if out else row["dtype"]


def rows_by_key(run: dict) -> dict:
    """The run's kernel rows (not the peer's) with a ratio, by (shape, dtype, precision,
    kernel); the dtype is "bfloat16->float32" for products into another dtype
    (--out-dtype; runs before it have no out_dtype)."""
    return {
        (r["shape"], dtype_label(r), r["precision"], r["kernel"]): r
        for r in run["rows"]
        if r.get("ratio") is not None
    }


def compare(baseline: dict, run: dict, threshold: float) -> tuple[list[str], bool]:
    """Report lines, and whether any row regressed by more than `threshold`."""
    old, new = rows_by_key(baseline), rows_by_key(run)
    lines, regressed = [], False
    dtype_width = max([9, *(len(key[1]) for key in old.keys() | new.keys())])
    lines.append(
        f"{'shape':<14} {'dtype':<{dtype_width}} {'precision':<9} {'kernel':<8} "
        f"{'base':>6} {'now':>6} {'change':>7}"
    )
    for key in sorted(old.keys() & new.keys()):
        before, after = old[key]["ratio"], new[key]["ratio"]
        change = after / before - 1.0
        flag = ""
        if change < -threshold:
            flag, regressed = "  REGRESSION", True
        shape, dtype, precision, kernel = key
        lines.append(
            f"{shape:<14} {dtype:<{dtype_width}} {precision:<9} {kernel:<8} "
            f"{before:>6.3f} {after:>6.3f} {100 * change:>+6.1f}%{flag}"
        )
    for label, keys in (
        ("only in the baseline", old.keys() - new.keys()),
        ("new", new.keys() - old.keys()),
    ):
        for key in sorted(keys):
            lines.append(f"{' '.join(key)}: {label}")
    return lines, regressed


def newest_baseline(directory: Path, device: str | None) -> Path | None:
    """The newest *baseline*.json in `directory`, by its run's date, measured on `device`."""
    found = []
    for path in directory.glob("*baseline*.json"):
        with open(path) as f:
            run = json.load(f)
        if run.get("device") == device:
            found.append((run.get("date", ""), path.name, path))
    return max(found)[2] if found else None


def bench_args(baseline: dict) -> list[str]:
    """The baseline run's own benchmark arguments, less where it wrote its files."""
    args, argv = [], iter(baseline.get("argv", []))
    for arg in argv:
        if arg in ("--json", "--plot"):
            next(argv, None)
        else:
            args.append(arg)
    return args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("baseline")
    p.add_argument("run", nargs="?")
    p.add_argument(
        "--threshold", type=float, default=0.03, help="largest loss not flagged (0.03: 3%%)"
    )
    p.add_argument("--args-for", metavar="DEVICE", help="print the baseline's bench arguments")
    args = p.parse_args(argv)
    if (args.run is None) == (args.args_for is None):
        p.error("give a run to compare, or --args-for DEVICE")
    run = {"device": args.args_for}
    if args.run:
        with open(args.run) as f:
            run = json.load(f)
    if Path(args.baseline).is_dir():
        picked = newest_baseline(Path(args.baseline), run.get("device"))
        if picked is None:
            print(f"no baseline of {run.get('device')!r} in {args.baseline}", file=sys.stderr)
            return 2
        if args.args_for is None:
            print(f"baseline: {picked}")
        args.baseline = str(picked)
    with open(args.baseline) as f:
        baseline = json.load(f)
    if args.args_for is not None:
        print(shlex.join(bench_args(baseline)))
        return 0
    if baseline.get("device") != run.get("device"):
        print(
            f"different devices: {baseline.get('device')!r} and {run.get('device')!r}",
            file=sys.stderr,
        )
        return 2
    lines, regressed = compare(baseline, run, args.threshold)
    print(f"ratio against the peer, {args.run} vs {args.baseline} ({run.get('device')})")
    print("\n".join(lines))
    return 1 if regressed else 0


if __name__ == "__main__":
    sys.exit(main())
