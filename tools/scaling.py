"""Multi-GPU scaling of jax_tiled.matmul under jit with sharded operands.

    NCCL_NVLS_ENABLE=0 python tools/scaling.py [--size 8192] [--dtype float32]
        [--precision highest] [--chunks 1 2 4] [--no-overlap] [--devices 2]

Times each layout below on 1 device and on `--devices` (default: every device
of the machine), for jax_tiled.matmul and for jnp.matmul under the same
shardings, and prints per layout the milliseconds, each one's efficiency
t(1) / (N * t(N)) against its own one-device time, and jnp's time over ours.
The one-device time is the same unsharded product for every layout, timed
once per implementation. `--chunks` times jax_tiled once per value of
`jax_tiled.overlap.settings(chunks=...)` (the K-sharded rings' pieces; the
others ignore it); `--no-overlap` adds a row with the overlap turned off.
Every product is checked against jnp.matmul's before it is timed.
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

import jax_tiled
from jax_tiled.bench.timing import pipelined_samples

# name: a's spec, b's spec, the result's spec (jit's out_shardings).
LAYOUTS = {
    "M-sharded": (P("x", None), P(None, None), P("x", None)),
    "N-sharded": (P(None, None), P(None, "x"), P(None, "x")),
    "K-sharded, replicated": (P(None, "x"), P("x", None), P(None, None)),
    "K-sharded, reduce-scatter": (P(None, "x"), P("x", None), P("x", None)),
    "all-gather (a by M, b by N)": (P("x", None), P(None, "x"), P(None, "x")),
}


def median_seconds(fn, a, b, repeats: int, calls: int = 10) -> float:
    """Median over samples of `calls` pipelined calls, per call: host dispatch
    and the final synchronisation stay out of the per-product time."""
    jax.block_until_ready(fn(a, b))
    return statistics.median(pipelined_samples(fn, (a, b), calls=calls, repeats=repeats))


def check(out, expected, dtype) -> None:
    """Refuses to time a product that disagrees with jnp.matmul's."""
    out, expected = np.asarray(out, np.float32), np.asarray(expected, np.float32)
    err = np.abs(out - expected).max() / max(np.abs(expected).max(), 1e-30)
    if err > (3e-2 if np.dtype(dtype).itemsize == 2 else 1e-3):
        raise SystemExit(f"jax_tiled disagrees with jnp.matmul: relative error {err:.2e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--precision", default="highest")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[None],
        help="jax_tiled.overlap chunks to time (default: its automatic choice)",
    )
    parser.add_argument(
        "--no-overlap", action="store_true", help="also time jax_tiled with the overlap turned off"
    )
    parser.add_argument(
        "--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS), metavar="LAYOUT"
    )
    args = parser.parse_args(argv)
    devices = jax.devices()
    count = args.devices or len(devices)
    if not 2 <= count <= len(devices):
        parser.error(f"--devices must be 2 to {len(devices)}, got {count}")
    n = args.size
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (n, n), args.dtype)
    b = jax.random.normal(key_b, (n, n), args.dtype)
    print(
        f"# {devices[0].device_kind} x{count}, jax {jax.__version__}, {n}^3 {args.dtype}, "
        f"precision {args.precision}; efficiency = t(1) / ({count} * t({count}))"
    )

    variants = [(f"chunks={c if c is not None else 'auto'}", dict(chunks=c)) for c in args.chunks]
    if args.no_overlap:
        variants.append(("no overlap", dict(enabled=False)))

    def timed(matmul, mesh, specs, settings):
        a_spec, b_spec, out_spec = specs
        a_s = jax.device_put(a, NamedSharding(mesh, a_spec))
        b_s = jax.device_put(b, NamedSharding(mesh, b_spec))
        with jax_tiled.overlap.settings(**settings):
            fn = jax.jit(
                lambda x, y: matmul(x, y, precision=args.precision),
                out_shardings=NamedSharding(mesh, out_spec),
            )
            out = fn(a_s, b_s)
            return median_seconds(fn, a_s, b_s, args.repeats), out

    one = Mesh(np.array(devices[:1]), ("x",))
    plain = (P(), P(), P())
    t1_ours, expected = timed(jax_tiled.matmul, one, plain, {})
    t1_jnp, _ = timed(jnp.matmul, one, plain, {})
    check(expected, jnp.matmul(a, b, precision=args.precision), args.dtype)
    print(f"1 device: jax_tiled {t1_ours * 1e3:.3f} ms, jnp {t1_jnp * 1e3:.3f} ms")

    mesh = Mesh(np.array(devices[:count]), ("x",))
    header = (
        f"{'layout':28} {'jax_tiled':12} {'ours ms':>8} {'jnp ms':>8} {'ours eff':>8} "
        f"{'jnp eff':>8} {'jnp/ours':>8}"
    )
    print(header)
    print("-" * len(header))
    for layout in args.layouts:
        specs = LAYOUTS[layout]
        t_jnp, reference = timed(jnp.matmul, mesh, specs, {})
        for label, settings in variants:
            t, out = timed(jax_tiled.matmul, mesh, specs, settings)
            check(out, reference, args.dtype)
            print(
                f"{layout:28} {label:12} {t * 1e3:8.3f} {t_jnp * 1e3:8.3f} "
                f"{t1_ours / (count * t):8.1%} {t1_jnp / (count * t_jnp):8.1%} "
                f"{t_jnp / t:7.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
