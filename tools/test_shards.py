"""The GPU suite's test files in shards of about equal time, and its slowest tests.

    python3 tools/test_shards.py 1/2            # shard 1 of 2: its test files, one a line
    python3 tools/test_shards.py --write T.tsv ...  # both tables anew from runs' test_times.tsv
    python3 tools/test_shards.py --unfinished T.tsv COLLECTED  # what a cut run did not finish

tools/device_check.sh runs the suite in shards (TEST_SHARD=i/n), a device
call each, each call at most 10 minutes. The files are dealt by their time on
a GPU (tests/gpu_test_seconds.tsv: each file's test seconds summed over its
tests, as tests/conftest.py logs them under JAX_TILED_TEST_TIMES), the
heaviest first, each to the shard with the fewest seconds so far; a file the
table does not name counts as the table's median. Every file lands in exactly
one shard, and the same one on every call. Dealing every n-th file put 1150
tests in the first of two shards and 450 in the second (2026-11-26).

Within a shard, pytest-xdist hands out tests in the order they are collected,
so a slow test collected late starts late: on four H100s (2026-11-26) three
shards ended in about 245 s and the fourth was cut at 420 s with one test
still running, nvcc's ptxas check of the wgmma unit for float, which had
started late. tests/gpu_slow_tests.tsv names the tests that took
SLOW_SECONDS or more, the slowest first; with JAX_TILED_SLOW_FIRST=1
(tools/device_check.sh sets it) tests/conftest.py collects them in the
order slow_first() gives. Collected simply slowest first, they ran one after
another on one worker: xdist's load scheduler hands each worker a run of
consecutive tests at the start (a quarter of its share), so the first
worker took the five slowest, and on four H100s (2026-11-28) a shard whose
tests summed to 167 s a worker was cut at 380 s with two of them not
started. tools/device_check.sh runs pytest with --maxschedchunk 1, under
which each worker gets XDIST_FIRST_CHUNK tests at the start and one at a
time after; slow_first() puts one of the slowest tests at the head of
each worker's first chunk.

A run cut short by its time limit (TEST_TIMEOUT) leaves tests unfinished;
--unfinished prints them, the tests of COLLECTED (`pytest --collect-only -q`
output) that no line of the run's test_times.tsv names, one id a line:
tools/device_check.sh writes them to tests<suffix>_unfinished.ids, and
TEST_IDS=that file (carried into the tree) runs just those on a later call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "tests" / "gpu_test_seconds.tsv"
SLOW_TABLE = ROOT / "tests" / "gpu_slow_tests.tsv"
SLOW_SECONDS = 20.0
# Tests pytest-xdist's load scheduler sends each worker at the start under
# --maxschedchunk 1 (xdist 3.8: max(min(a quarter of its share, 1), 2)).
XDIST_FIRST_CHUNK = 2


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


def seconds_per_test(times: list[Path]) -> dict[str, float]:
    """Each test's seconds in test_times.tsv files (the longest where a test
    ran in more than one)."""
    seconds: dict[str, float] = {}
    for path in times:
        for line in path.read_text().splitlines():
            value, _, nodeid = line.split("\t")
            seconds[nodeid] = max(seconds.get(nodeid, 0.0), float(value))
    return seconds


def read_slow_tests(path: Path) -> list[str]:
    """The test ids of a slow-test table, slowest first ('#' lines are notes)."""
    lines = path.read_text().splitlines() if path.is_file() else []
    return [line.split("\t")[1] for line in lines if line.strip() and not line.startswith("#")]


def slow_first(ids: list[str], slow: list[str], workers: int) -> list[str]:
    """`ids` (collection order) reordered for `workers` pytest-xdist workers
    under --maxschedchunk 1: the head of each worker's first chunk one of the
    `workers` slowest of `slow` (slowest first) that `ids` holds, the rest of
    that chunk other tests; then the other slow tests, slowest first; then the
    rest, in collection order."""
    rank = {test: i for i, test in enumerate(slow)}
    slow_here = sorted((t for t in ids if t in rank), key=rank.__getitem__)
    rest = [t for t in ids if t not in rank]
    fillers = XDIST_FIRST_CHUNK - 1
    order = []
    for i, test in enumerate(slow_here[:workers]):
        order += [test] + rest[i * fillers : (i + 1) * fillers]
    used = min(len(slow_here), workers) * fillers
    return order + slow_here[workers:] + rest[used:]


def unfinished(times: list[Path], collected: list[str]) -> list[str]:
    """The test ids among `collected` lines (pytest --collect-only -q) that
    no test_times.tsv line names, in collection order."""
    ended = set()
    for path in times:
        for line in path.read_text().splitlines():
            ended.add(line.split("\t", 2)[2])
    ids = [line.rstrip("\n") for line in collected if "::" in line]
    return [test for test in ids if test not in ended]


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
    p.add_argument(
        "--unfinished",
        nargs=2,
        type=Path,
        metavar=("TIMES", "COLLECTED"),
        help="the collected tests a run's test_times.tsv does not name",
    )
    args = p.parse_args(argv)
    if args.unfinished:
        times, collected = args.unfinished
        tests = unfinished([times] if times.is_file() else [], collected.read_text().splitlines())
        if tests:
            print("\n".join(tests))
        return 0
    if args.write:
        total = file_seconds(args.write)
        lines = ["# test file\tseconds on a GPU (tools/test_shards.py --write)"]
        lines += [f"{name}\t{total[name]:.0f}" for name in sorted(total)]
        TABLE.write_text("\n".join(lines) + "\n")
        each = seconds_per_test(args.write)
        slow = sorted((t for t in each if each[t] >= SLOW_SECONDS), key=lambda t: (-each[t], t))
        lines = ["# seconds on a GPU\ttest, the slowest first (tools/test_shards.py --write)"]
        lines += [f"{each[t]:.0f}\t{t}" for t in slow]
        SLOW_TABLE.write_text("\n".join(lines) + "\n")
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
