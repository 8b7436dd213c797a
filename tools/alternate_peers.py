"""Ours, jnp.matmul and (optionally) one Pallas config timed in alternated
rounds of one process, with the GPU's SM clock and power sampled meanwhile.

    python3 tools/alternate_peers.py --shape 8192x8192x8192 [--dtype bfloat16]
        [--pallas 128x128x64.s4.wgN.gN8.cM] [--rounds 6] [--json rounds.json]

A benchmark row is one timing of each implementation, taken one after the
other: at bfloat16 8192³ an H100's SM clock swings between 1.56 and 1.98 GHz
from one 0.1 s sample to the next, by what ran just before, so a few percent
between two rows can be the order they ran in. Here each round times every
implementation once (the harness's timing: pipelined calls, median of
--repeats samples), the order rotated round by round, and the medians over
rounds are compared. Where `nvidia-smi` runs, it samples the SM clock, power
and temperature every 50 ms; each timing gets their means over its timed
samples, after its compile (few at the default --repeats: 0.1 s at 8192³;
the power it reads lags, an average over about a second). Prints a line per
timing, then each one's median and mean SM clock over the rounds; `--json`
writes every window and the samples.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

import jax_tiled
from jax_tiled.bench import pallas, timing
from jax_tiled.bench.report import write_tool_report
from jax_tiled.bench.shapes import parse_shape

SMI_QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu"


def smi_samples(path: str) -> list[dict]:
    """nvidia-smi's CSV lines as dicts of (UTC) time, MHz, W and °C."""
    samples = []
    for line in open(path):
        fields = [f.strip() for f in line.split(",")]
        try:
            stamp = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f")
            samples.append(
                dict(
                    time=stamp.replace(tzinfo=datetime.UTC).timestamp(),
                    sm_mhz=float(fields[1]),
                    watts=float(fields[2]),
                    celsius=float(fields[3]),
                )
            )
        except (ValueError, IndexError):  # a header, or a field it could not read
            continue
    return samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", required=True, help="e.g. 8192x8192x8192 or 4096^3")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--pallas", metavar="CONFIG", help="a config of the bench's sweep")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    shape = parse_shape(args.shape)
    fns = {"ours": jax_tiled.matmul, "jnp": jnp.matmul}
    if args.pallas:
        if why := pallas.unavailable():
            parser.error(f"--pallas: the Pallas kernel is unavailable here: {why}")
        try:
            config = pallas.probed_config(args.pallas, shape, args.dtype, pallas.PRECISION)
        except ValueError as exc:
            parser.error(str(exc))
        fns["pallas"] = pallas.matmul_fn(config)
    device = jax.devices()[0]
    budget = timing.GPU_BUDGET if device.platform == "gpu" else timing.CPU_BUDGET
    sets = timing.random_sets(shape.stored_shapes, jnp.dtype(args.dtype), 1, 0)
    print(f"# {device.device_kind}, jax {jax.__version__}, {shape.name} {args.dtype}")

    smi_log = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False)
    smi = None
    if device.platform == "gpu" and shutil.which("nvidia-smi"):
        smi = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits"]
            + ["-lms", "50", "-i", str(device.id)],
            stdout=smi_log,
        )
    windows, names = [], list(fns)
    try:
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start = time.time()
                timed = timing.time_products(
                    fns[name], sets, repeats=args.repeats, warmup=2, budget=budget,
                    keep_first=False,
                )  # fmt: skip
                end = time.time()
                # The samples are the window's last seconds (its compile comes first).
                timed_s = sum(timed.samples) * len(sets) * timed.calls
                windows.append(
                    dict(round=r, impl=name, start=start, timed_start=end - timed_s, end=end,
                         ms=timed.seconds * 1e3, calls=timed.calls)
                )  # fmt: skip
                tflops = shape.flops / timed.seconds / 1e12
                print(f"round {r} {name:7} {timed.seconds * 1e3:.4f} ms {tflops:7.1f} TFLOP/s")
    finally:
        if smi is not None:
            smi.terminate()
            smi.wait()
        smi_log.close()
    samples = smi_samples(smi_log.name)
    for window in windows:
        inside = [s for s in samples if window["timed_start"] <= s["time"] <= window["end"]]
        for key in ("sm_mhz", "watts"):
            window[key] = statistics.mean(s[key] for s in inside) if inside else None
    medians = {}
    for name in names:
        ms = [w["ms"] for w in windows if w["impl"] == name]
        medians[name] = statistics.median(ms)
        clocks = [w["sm_mhz"] for w in windows if w["impl"] == name and w["sm_mhz"]]
        clock = f", SM clock {statistics.mean(clocks):.0f} MHz" if clocks else ""
        print(f"{name:7} median {medians[name]:.4f} ms over {len(ms)} rounds{clock}: "
              + " ".join(f"{m:.4f}" for m in ms))  # fmt: skip
    for name in names[1:]:
        print(f"{name} / ours: {medians[name] / medians['ours']:.3f}x")
    if args.json:
        write_tool_report(
            args.json, argv, shape=shape.name, dtype=args.dtype, medians_ms=medians,
            windows=windows, smi_samples=samples,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
