"""Multi-GPU scaling of jax_tiled.matmul under jit with sharded operands.

    python tools/scaling.py [--size 8192] [--dtype float32]

For 1 GPU and for all GPUs of the machine, times an M-sharded product (a split
by rows, b replicated) and a K-sharded one (a split by columns, b by rows: a
local product, then an all-reduce), and prints t1 / (N * tN) as efficiency.
jnp.matmul under the same shardings runs alongside for reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_tiled
from jax_tiled.bench.timing import pipelined_samples

LAYOUTS = {"M-sharded": (P("x", None), P(None, None)), "K-sharded": (P(None, "x"), P("x", None))}


def median_seconds(fn, a, b, repeats: int, calls: int = 10) -> float:
    """Median over samples of `calls` pipelined calls, per call: host dispatch
    and the final synchronisation stay out of the per-product time."""
    jax.block_until_ready(fn(a, b))
    return statistics.median(pipelined_samples(fn, (a, b), calls=calls, repeats=repeats))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--precision", default="highest")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    devices = jax.devices()
    n = args.size
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (n, n), args.dtype)
    b = jax.random.normal(key_b, (n, n), args.dtype)
    print(f"# {devices[0].device_kind} x{len(devices)}, jax {jax.__version__}, {n}^3 {args.dtype}, "
          f"precision {args.precision}")
    print(f"{'layout':10} {'impl':10} {'GPUs':>4} {'ms':>9} {'TFLOP/s':>8} {'efficiency':>10}")
    for layout, (a_spec, b_spec) in LAYOUTS.items():
        for name, matmul in (("jax_tiled", jax_tiled.matmul), ("jnp", jnp.matmul)):
            t1 = None
            for count in sorted({1, 2, len(devices)} & set(range(1, len(devices) + 1))):
                mesh = Mesh(np.array(devices[:count]), ("x",))
                a_s = jax.device_put(a, NamedSharding(mesh, a_spec))
                b_s = jax.device_put(b, NamedSharding(mesh, b_spec))
                fn = jax.jit(lambda x, y: matmul(x, y, precision=args.precision))
                t = median_seconds(fn, a_s, b_s, args.repeats)
                t1 = t if count == 1 else t1
                eff = t1 / (count * t)
                print(f"{layout:10} {name:10} {count:>4} {t * 1e3:9.3f} {2 * n**3 / t / 1e12:8.2f} "
                      f"{eff:10.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
