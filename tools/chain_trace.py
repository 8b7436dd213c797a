"""Chains of small products traced: where a product's time goes, on the GPU and off it.

    python3 tools/chain_trace.py [--sizes 128 256 512] [--dtypes bfloat16 float32]
        [--forms unrolled scan] [--weights stacked separate] [--length 64]
        [--pipelined 32] [--no-trace] [--json chain_trace.json]

On the GPU machine, with the package installed. For each chain (x = tanh(x @ w)
repeated `--length` times in one jitted function, as `python -m jax_tiled.bench
--chain` times it: `lax.scan` over a stack of weights or unrolled, the weights
`w[i]` of one stack or separate arrays), ours (`jax_tiled.matmul`, auto) and
jnp's, it reports per product:

- the GPU's view: a `jax.profiler` trace of calls on the same arrays; from the
  first device's kernels of the last call (calls parted by gaps of more than
  20 us), the span (first kernel's start to last kernel's end, over the
  length), the kernels' summed time and each kernel's median duration;
- the host's view: the wall time of `--pipelined` calls dispatched back to
  back with their outputs kept alive, as the benchmark times them (each
  call's result a new buffer; median of 7 samples), the host's time to
  dispatch them, the time of one call blocked on ("serial"), and, from a
  trace of those calls, the host's events that took longest (XLA's thunks
  and command-buffer work among them), per call.

`--no-trace` leaves the traces out (the timings only: quicker, and what
compares XLA flags, set in XLA_FLAGS per process). Under the profiler XLA
runs op by op, without its command buffers, unless XLA_FLAGS has
--xla_enable_command_buffers_during_profiling=true.

A chain whose wall time is well above its span is bound outside its kernels
(cpp/cuda/NOTES.md, "K in parts summed by XLA"). Under the profiler a
`lax.scan`'s iterations were parted by gaps the untraced benchmark does not
show: read its span with care.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jax_tiled.bench.chains import chain_fn, make_chain_inputs
from jax_tiled.bench.harness import PEER, matmul_fn
from jax_tiled.bench.report import write_tool_report
from jax_tiled.bench.timing import pipelined_times
from jax_tiled.bench.trace import trace_events

GAP_NS = 20_000  # a longer gap between kernels parts two calls
HOST_EVENTS = 12  # the host's longest events reported per chain
SAMPLES = 7  # pipelined samples, and serial calls twice as many, a chain


def chain(form: str, weights: str, length: int, impl: str):
    """f(x, *ws): the benchmark's chain (`bench.chains.chain_fn`, DEFAULT) for
    stacked weights, ws one stack (L, n, n); for "separate" weights the same
    layers over `length` arrays."""
    kernel = PEER if impl == "jnp" else "auto"
    if weights == "stacked":
        return chain_fn(form, length, "default", kernel)
    if form == "scan":
        raise ValueError("a lax.scan takes its weights stacked")
    mm = matmul_fn("default", kernel)

    def unrolled(x, *ws):
        for w in ws:
            x = jnp.tanh(mm(x, w)).astype(x.dtype)
        return x

    return unrolled


def split_calls(events, gap_ns: int = GAP_NS):
    """Kernel events (sorted by start) parted where the device idled longer
    than gap_ns: one list per call."""
    calls, current, end = [], [], 0
    for event in events:
        start, duration, _ = event
        if current and start - end > gap_ns:
            calls.append(current)
            current = []
        end = max(end, start + duration) if current else start + duration
        current.append(event)
    if current:
        calls.append(current)
    return calls


def kernel_name(name: str) -> str:
    """A kernel's name without the numbered suffix XLA gives each fusion."""
    return re.sub(r"_\d+$", "", name)[:80]


def device_view(call, length: int) -> dict:
    """Per product: the call's span, the kernels' summed time, each kernel's
    median duration (kernels of fewer than `length` launches left out)."""
    start = call[0][0]
    end = max(s + d for s, d, _ in call)
    durations = collections.defaultdict(list)
    for _, duration, name in call:
        durations[kernel_name(name)].append(duration)
    return dict(
        span_us=(end - start) / 1e3 / length,
        busy_us=sum(d for _, d, _ in call) / 1e3 / length,
        kernels=len(call),
        kernel_us={
            name: statistics.median(values) / 1e3
            for name, values in durations.items()
            if len(values) >= length
        },
    )


def host_view(events, calls: int, most: int = HOST_EVENTS) -> dict:
    """The host events that took longest in total, in us per call; not the
    Python tracer's frames (named "$file:line function"), the profiler's own
    among them."""
    totals = collections.Counter()
    for _, duration, name in events:
        if not name.startswith("$"):
            totals[name[:100]] += duration
    return {name: total / 1e3 / calls for name, total in totals.most_common(most)}


def timings(fn, args, length: int, pipelined: int) -> dict:
    """Microseconds a product: wall and dispatch of `pipelined` calls as the
    benchmark times them (calls dispatched back to back, outputs kept;
    bench.timing.pipelined_times), and one call blocked on."""
    jax.block_until_ready([fn(*args) for _ in range(pipelined)])
    dispatch, wall = zip(*(pipelined_times(fn, args, calls=pipelined) for _ in range(SAMPLES)))
    serial = []
    for _ in range(2 * SAMPLES):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        serial.append(time.perf_counter() - start)
    per_product = 1e6 / length
    return dict(
        wall_us=statistics.median(wall) * per_product,
        dispatch_us=statistics.median(dispatch) * per_product,
        serial_us=statistics.median(serial) * per_product,
    )


def measure(form, weights, size, dtype, length, pipelined, impl, trace=True) -> dict:
    ((x, ws),) = make_chain_inputs(size, length, jnp.dtype(dtype), seed=0)
    args = (x, ws) if weights == "stacked" else (x, *[ws[i] + 0 for i in range(length)])
    fn = jax.jit(chain(form, weights, length, impl))
    row = dict(device=None, host_us_per_call=None)
    if trace:
        device, _ = trace_events(fn, args, calls=5)
        # No GPU (CPU devices): the host's view only.
        row["device"] = device_view(split_calls(device)[-1], length) if device else None
    row.update(timings(fn, args, length, pipelined))
    if trace:
        _, host = trace_events(fn, args, calls=pipelined)
        row["host_us_per_call"] = host_view(host, pipelined)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools/chain_trace.py", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--forms", nargs="+", choices=("unrolled", "scan"), default=["unrolled"])
    p.add_argument(
        "--weights", nargs="+", choices=("stacked", "separate"), default=["stacked", "separate"]
    )
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--pipelined", type=int, default=32, help="calls a wall-time sample holds")
    p.add_argument("--no-trace", action="store_true", help="the timings only, no profiler traces")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    rows = []
    for dtype in args.dtypes:
        for size in args.sizes:
            for form in args.forms:
                for weights in args.weights:
                    if form == "scan" and weights != "stacked":
                        continue
                    for impl in ("jnp", "ours"):
                        row = dict(form=form, weights=weights, size=size, dtype=dtype, impl=impl)
                        row.update(
                            measure(
                                form,
                                weights,
                                size,
                                dtype,
                                args.length,
                                args.pipelined,
                                impl,
                                trace=not args.no_trace,
                            )
                        )
                        rows.append(row)
                        d = row["device"]
                        on_gpu = (
                            f"span {d['span_us']:6.2f} busy {d['busy_us']:6.2f} "
                            f"({d['kernels']} kernels) "
                            if d
                            else ""
                        )
                        print(
                            f"{form:8} {weights:8} {size:4} {dtype:8} {impl:4} {on_gpu}"
                            f"wall {row['wall_us']:6.2f} dispatch {row['dispatch_us']:6.2f} "
                            f"serial {row['serial_us']:6.2f} us/product",
                            flush=True,
                        )
                        for name, us in list((row["host_us_per_call"] or {}).items())[:5]:
                            print(f"      host {us:8.1f} us/call  {name}")
    if args.json:
        write_tool_report(args.json, argv, length=args.length, pipelined=args.pipelined, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
