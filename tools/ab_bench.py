"""Two builds of jax_tiled timed in alternated processes: a change's speed.

    mkdir -p ab_before && git archive BEFORE | tar -x -C ab_before   # here, before the call
    python3 tools/ab_bench.py ab_before [--rounds 3] [--timeout 240] [--out DIR] \
        -- --dtype bfloat16 --shapes 4096^3,8192^3              # on the GPU machine

Builds the sources in the first argument (the build before the change) into a
directory of its own and the working tree into the environment, both at once,
then runs `python -m jax_tiled.bench ARGS --kernels auto --no-progress --json`
`--rounds` times for each build, alternating (after, before, after, before,
...), and prints per row our milliseconds round by round as after / before,
and jnp's: one process's clock or neighbours move both builds' rows, and a
change of a few percent shows only against that spread (cpp/cuda/NOTES.md
measured up to 8% between processes). A round whose process fails or passes
`--timeout` seconds is reported and left out; `--chain` and `--train-step`
runs take about 100 s a process. `--no-build` reuses both builds (they
are built as CMAKE_ARGS says: -DCMAKE_CUDA_ARCHITECTURES=90a for Hopper only).
The JSON of each process lands in --out (default $OUT, else ./ab_out);
`--summarize` (no build before needed) prints the summary of the JSONs there
(of a call cut short).

Neither build need run on the device machine: the first argument may be a
wheel of the build before (tools/prebuild_hopper.sh SOURCES OUT, here), which
pip installs in seconds, and `--after-installed` takes the environment's
jax_tiled as the build after (device_check.sh with PREBUILT installed it):
    PREBUILT=prebuilt STEPS=none tools/device_check.sh && \
    python3 tools/ab_bench.py prebuilt_before/jax_tiled-*.whl --after-installed -- ...
with carry=["prebuilt", "prebuilt_before"].
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from compare_baseline import dtype_label  # noqa: E402  (a sibling script, not a package)

BUILDS = ("after", "before")


def build(source: Path, target: Path | None, log: Path) -> int:
    """pip-installs `source` (into `target`, or the environment), its log in `log`."""
    command = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps"]
    command += ["--target", str(target), "--upgrade"] if target else []
    with open(log, "w") as out:
        return subprocess.run([*command, str(source)], stdout=out, stderr=out).returncode


def run_bench(args: list[str], before: Path | None, json_path: Path, timeout: float) -> str:
    """One benchmark process of one build ('' if it wrote its JSON, else why not)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if before:
        env["PYTHONPATH"] = str(before)
    json_path.unlink(missing_ok=True)  # a file from an earlier call is not this run's
    command = [sys.executable, "-P", "-m", "jax_tiled.bench", *args]
    command += ["--kernels", "auto", "--no-progress", "--json", str(json_path)]
    try:
        done = subprocess.run(
            command,
            env=env,
            cwd=tempfile.gettempdir(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return f"cut at {timeout:.0f} s"
    if done.returncode or not json_path.is_file():
        return f"exit {done.returncode}: {(done.stderr or done.stdout)[-300:]}"
    return ""


def row_label(row: dict) -> str:
    """What a row measures: a product's shape, a chain's form and size, or a
    training step's width and tokens; then its dtypes and precision."""
    dtype = dtype_label(row)
    if "form" in row:
        head = f"{row['form']} {row['size']}"
    elif "width" in row:
        head = f"step width {row['width']} tokens {row['tokens']}"
    else:
        head = row["shape"]
    return f"{head} {dtype} {row.get('precision', '')}".strip()


def times(run: dict) -> dict:
    """{(row label, kernel): time} of one bench JSON: a chain's us a product,
    else the row's ms."""
    found = {}
    for row in run.get("rows", []):
        value = row.get("us_per_product", row.get("ms"))
        if value is not None and row.get("kernel"):
            found[(row_label(row), row["kernel"])] = value
    return found


def summarize(runs: dict) -> list[str]:
    """Lines: per row, each round's ours after / before, then jnp's. `runs` maps
    (build, round) to a bench JSON's contents; a missing one shows as '-'."""
    rounds = sorted({r for _, r in runs})
    per = {key: times(run) for key, run in runs.items()}
    # Our rows once each, in the order the runs list them (not the peers').
    rows = list(
        dict.fromkeys(
            label for found in per.values() for label, kernel in found if kernel == "auto"
        )
    )

    def at(build, r, label, kernel):
        value = per.get((build, r), {}).get((label, kernel))
        return "-" if value is None else f"{value:.4g}"

    head = ["row", *(f"round {r}: after / before" for r in rounds), "jnp (after / before)"]
    lines = [" | ".join(head)]
    for label in rows:
        ours = [
            f"{at('after', r, label, 'auto')} / {at('before', r, label, 'auto')}" for r in rounds
        ]
        peer = ", ".join(
            f"{at('after', r, label, 'jnp.matmul')} / {at('before', r, label, 'jnp.matmul')}"
            for r in rounds
        )
        lines.append(" | ".join([label, *ours, peer]))
    return lines


def load_runs(out: Path) -> dict:
    """{(build, round): bench JSON} of the processes whose JSON is in `out`."""
    runs = {}
    for path in sorted(out.glob("ab_*_*.json")):
        name, _, r = path.stem.removeprefix("ab_").rpartition("_")
        if name in BUILDS and r.isdigit():
            with open(path) as f:
                runs[(name, int(r))] = json.load(f)
    return runs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "before",
        type=Path,
        nargs="?",
        help="the sources of the build before the change, or its wheel (not with --summarize)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds a benchmark process")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "ab_out")))
    p.add_argument("--no-build", action="store_true", help="reuse both builds")
    p.add_argument(
        "--after-installed",
        action="store_true",
        help="the environment's jax_tiled is the build after (a prebuilt wheel installed)",
    )
    p.add_argument(
        "--summarize",
        action="store_true",
        help="only print the summary of the JSONs already in --out (a run cut short)",
    )
    args = p.parse_args(own)
    if args.summarize:
        runs = load_runs(args.out)
        print("\n".join(summarize(runs)) if runs else f"no ab_*_*.json in {args.out}")
        return 0 if runs else 1
    if args.before is None:
        p.error("the build before (its sources or wheel) is needed, but with --summarize")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if not (args.before / "pyproject.toml").is_file() and not (
        args.before.suffix == ".whl" and args.before.is_file()
    ):
        p.error(f"{args.before} is neither a wheel nor sources with a pyproject.toml")
    # pip reads a bare relative name ("ab_before") as a package to download.
    args.before = args.before.resolve()
    args.out = args.out.resolve()  # the benchmark runs elsewhere (off the source tree)
    args.out.mkdir(parents=True, exist_ok=True)
    before_target = Path(tempfile.gettempdir()) / "jax_tiled_ab_before"
    if not args.no_build:
        with ThreadPoolExecutor(2) as pool:
            builds = {"before": (args.before, before_target)}
            if not args.after_installed:
                builds["after"] = (ROOT, None)
            done = {
                name: pool.submit(build, source, target, args.out / f"build_{name}.log")
                for name, (source, target) in builds.items()
            }
            failed = [name for name, future in done.items() if future.result()]
        if failed:
            print(f"build failed: {', '.join(failed)} (logs in {args.out})", file=sys.stderr)
            return 1
    runs = {}
    for r in range(1, args.rounds + 1):
        for name in BUILDS:
            path = args.out / f"ab_{name}_{r}.json"
            why = run_bench(
                bench_args, before_target if name == "before" else None, path, args.timeout
            )
            print(f"round {r}, {name}: {why or 'ok'}", flush=True)
            if not why:
                with open(path) as f:
                    runs[(name, r)] = json.load(f)
    print("\n".join(summarize(runs)))
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
