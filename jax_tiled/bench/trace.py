"""Kernel events from a `jax.profiler` trace, for the tools that read where a
program's time goes on the GPU (tools/chain_trace.py, tools/scaling.py)."""

from __future__ import annotations

import collections
import glob
import tempfile

import jax


def trace_events(fn, args, calls: int, gpu: int = 0):
    """The xplane of `calls` calls of fn(*args) under jax.profiler, as
    (device events, host events): (start_ns, duration_ns, name) sorted, the
    device's from the "Stream" lines of GPU `gpu`, the host's from every line
    of the host planes. No device events where there is no GPU."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{trace_dir}/plugins/profile/*/*.xplane.pb")
        profile = jax.profiler.ProfileData.from_file(path)
        device, host = [], []
        for plane in profile.planes:
            on_gpu = plane.name.startswith(f"/device:GPU:{gpu}")
            if not on_gpu and not plane.name.startswith("/host:"):
                continue
            for line in plane.lines:
                if on_gpu and not line.name.startswith("Stream"):
                    continue
                into = device if on_gpu else host
                into.extend((e.start_ns, e.duration_ns, e.name) for e in line.events)
    return sorted(device), sorted(host)


def time_by_kernel(events, top: int, width: int = 60) -> dict[str, float]:
    """Microseconds a kernel name (its first `width` characters) took in
    `events` (trace_events' device events), the `top` longest, longest first."""
    totals = collections.Counter()
    for _, duration_ns, name in events:
        totals[name[:width]] += duration_ns / 1e3
    return dict(totals.most_common(top))
