"""The GPU suite's test files in shards of about equal time.

    python3 tools/test_shards.py 1/2            # shard 1 of 2: its test files, one a line
    python3 tools/test_shards.py --write T.tsv ...  # the table anew from runs' test_times.tsv

tools/device_check.sh runs the suite in shards (TEST_SHARD=i/n), a device
call each, each call at most 10 minutes. The files are dealt by their time on
a GPU (tests/gpu_test_seconds.tsv: each file's test seconds summed over its
tests, as tests/conftest.py logs them under JAX_TILED_TEST_TIMES), the
heaviest first, each to the shard with the fewest seconds so far; a file the
table does not name counts as the table's median. Every file lands in exactly
one shard, and the same one on every call. Dealing every n-th file put 1150
tests in the first of two shards and 450 in the second (2026-11-26).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "tests" / "gpu_test_seconds.tsv"


def read_table(path: Path) -> dict[str, float]:
    """{test file name: seconds} of a table --write wrote ('#' lines are notes)."""
    seconds = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, value = line.split("\t")
            seconds[name] = float(value)
    return seconds


def file_seconds(times: list[Path]) -> Counter:
    """Each test file's seconds summed over the tests in test_times.tsv files
    ("seconds<TAB>outcome<TAB>nodeid" lines)."""
    total = Counter()
    for path in times:
        for line in path.read_text().splitlines():
            seconds, _, nodeid = line.split("\t")
            total[Path(nodeid.split("::")[0]).name] += float(seconds)
    return total


def shards(files: list[str], seconds: dict[str, float], count: int) -> list[list[str]]:
    """`files` dealt into `count` shards by their seconds, heaviest first."""
    default = statistics.median(seconds.values()) if seconds else 1.0
    weight = {f: seconds.get(f, default) for f in files}
    loads = [0.0] * count
    dealt: list[list[str]] = [[] for _ in range(count)]
    for f in sorted(files, key=lambda f: (-weight[f], f)):
        lightest = loads.index(min(loads))
        dealt[lightest].append(f)
        loads[lightest] += weight[f]
    return [sorted(shard) for shard in dealt]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shard", nargs="?", help="I/N: shard I (from 1) of N")
    p.add_argument("--write", nargs="+", type=Path, metavar="TIMES", help="test_times.tsv files")
    args = p.parse_args(argv)
    if args.write:
        total = file_seconds(args.write)
        lines = ["# test file\tseconds on a GPU (tools/test_shards.py --write)"]
        lines += [f"{name}\t{total[name]:.0f}" for name in sorted(total)]
        TABLE.write_text("\n".join(lines) + "\n")
        return 0
    try:
        index, count = (int(x) for x in (args.shard or "").split("/"))
    except ValueError:
        p.error("give the shard as I/N, e.g. 1/2")
    if not 1 <= index <= count:
        p.error(f"shard {index} of {count}: I runs from 1 to N")
    files = sorted(f.name for f in (ROOT / "tests").glob("test_*.py"))
    seconds = read_table(TABLE) if TABLE.is_file() else {}
    print("\n".join(f"tests/{f}" for f in shards(files, seconds, count)[index - 1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
