"""What the sharded products' transfers cost alone: a ppermute around the ring
of the machine's devices, one way, half each way, and in four pieces, and
one psum_scatter (NCCL's reduce-scatter) of a square result, each timed as
pipelined calls (median of --repeats), bfloat16.

    NCCL_NVLS_ENABLE=0 python3 tools/transfer_rates.py [--devices 4] [--mb 33.5 67]
        [--size 8192] [--json rates.json]

The K rings send their sums by ppermute (NCCL's send/receive kernel), the
`k_ring="collectives"` path by reduce-scatter or all-reduce (NCCL's collective
kernels): on four H100s the first moved about half the bytes a second of the
second (docs/sharding.md, "Four H100s: the transfers").
"""

from __future__ import annotations

import argparse
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_tiled.bench.report import write_tool_report
from jax_tiled.bench.timing import pipelined_samples

MIB = 2**20


def ring_bodies(rows: int, forward, backward) -> dict:
    """Per-device functions of a (rows, n) block that send it around the ring
    of mesh axis "x": whole one way, half each way, in four pieces one way."""
    ring = lambda x, pairs: jax.lax.ppermute(x, "x", pairs)
    half, cuts = rows // 2, [rows * i // 4 for i in range(5)]
    return {
        "one way": lambda v: ring(v, forward),
        "half each way": lambda v: jnp.concatenate(
            [ring(v[:half], forward), ring(v[half:], backward)]
        ),
        "four pieces one way": lambda v: jnp.concatenate(
            [ring(v[lo:hi], forward) for lo, hi in zip(cuts, cuts[1:])]
        ),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--mb", type=float, nargs="+", default=[33.5, 67.0], metavar="MB")
    parser.add_argument(
        "--size", type=int, default=8192, help="the rows' length, and the psum_scatter's square"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    devices = jax.devices()
    count = args.devices or len(devices)
    if not 2 <= count <= len(devices):
        parser.error(f"--devices must be 2 to {len(devices)}, got {count}")
    if any(mb <= 0 for mb in args.mb):
        parser.error(f"--mb must be positive, got {args.mb}")
    mesh = Mesh(np.array(devices[:count]), ("x",))
    forward = [(j, (j + 1) % count) for j in range(count)]
    backward = [(j, (j - 1) % count) for j in range(count)]
    n = args.size

    def seconds(body, x) -> float:
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x", None), out_specs=P("x", None)))
        jax.block_until_ready(f(x))
        return statistics.median(pipelined_samples(f, (x,), calls=args.calls, repeats=args.repeats))

    print(f"# {devices[0].device_kind} x{count}, jax {jax.__version__}, bfloat16 rows of {n}")
    rows_out = []
    for mb in args.mb:
        rows = max(4, int(mb * MIB / (n * 2)))
        moved = rows * n * 2  # bytes a device sends
        x = jax.device_put(
            jnp.ones((count * rows, n), jnp.bfloat16), NamedSharding(mesh, P("x", None))
        )
        timed = {
            how: seconds(body, x) for how, body in ring_bodies(rows, forward, backward).items()
        }
        for how, t in timed.items():
            print(f"ppermute {moved / MIB:6.1f} MiB a device, {how:20} {t * 1e6:8.1f} us "
                  f"{moved / t / 1e9:6.1f} GB/s")  # fmt: skip
            rows_out.append(dict(op="ppermute", how=how, bytes=moved, us=t * 1e6))
    square = jax.device_put(
        jnp.ones((count * n, n), jnp.bfloat16), NamedSharding(mesh, P("x", None))
    )
    t = seconds(lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True), square)
    sent = (count - 1) * n * n * 2 // count  # what a ring reduce-scatter sends a device
    print(f"psum_scatter of a {n}x{n} bfloat16 a device {t * 1e6:8.1f} us "
          f"({sent / MIB:.1f} MiB sent a device by a ring: {sent / t / 1e9:.1f} GB/s)")  # fmt: skip
    rows_out.append(dict(op="psum_scatter", how="tiled", bytes=sent, us=t * 1e6))
    if args.json:
        write_tool_report(args.json, argv, devices=count, rows=rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
