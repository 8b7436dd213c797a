"""float32 at HIGH's accuracy from one TF32 product of split operands: a measurement.

    python3 -P tools/split_high.py [--shapes 4096^3,512x8192x512] [--repeats 7] [--json F]

`HIGH` runs four TF32 products of split operands inside the tensor-core
kernels (hi*hi, hi*lo, lo*hi, lo*lo, each K slab summed apart). The emulation
presets instead lay each operand's parts along K (`jax_tiled._presets.Split`,
`split_operand`) and run one product of the parts on the DEFAULT (one TF32
pass) kernel, over K x the number of terms. This times, in one process, on
the shapes given: `jnp.matmul` at HIGHEST (the peer), ours at HIGH, and the
parts' product with the three terms of TF32_TF32_F32_X3 and with HIGH's four;
and gives each one's error and bias against float64 on positive and normal
inputs (`python -m jax_tiled.bench --accuracy`'s definitions). It decides
whether HIGH should run as the parts' product (cpp/cuda/NOTES.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import jax
import jax.numpy as jnp
from jax import lax

import jax_tiled
from jax_tiled import _presets
from jax_tiled.bench.accuracy import accuracy, make_inputs
from jax_tiled.bench.products import reference
from jax_tiled.bench.shapes import parse_shape
from jax_tiled.bench.timing import pipelined_samples

SHAPES = "1024^3,4096^3,8192^3,512x8192x512,256x65536x256,4096x4096x128,2048x8192x2048"
# HIGH's four terms as parts laid along K (TF32_X3 is the preset's three).
TF32_X4 = _presets.Split("tf32", 2, ((0, 0), (0, 1), (1, 0), (1, 1)), dropped=2.0**-22)


def parts_product(split: _presets.Split):
    def product(a, b):
        parts_a = _presets.split_operand(a, split, 0, -1)
        parts_b = _presets.split_operand(b, split, 1, -2)
        return jax_tiled.matmul(parts_a, parts_b, precision=split.precision)

    return product


VARIANTS = {
    "jnp HIGHEST": lambda a, b: jnp.matmul(a, b, precision=lax.Precision.HIGHEST),
    "HIGH (fused, 4 products)": lambda a, b: jax_tiled.matmul(a, b, precision="high"),
    "parts x3 (TF32_TF32_F32_X3)": parts_product(_presets.TF32_X3),
    "parts x4 (HIGH's terms)": parts_product(TF32_X4),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(
        f"{'shape':16} {'variant':28} {'ms':>8} {'x peer':>7} {'err+':>8} {'bias+':>9} {'err':>8}"
    )
    rows = []
    for name in args.shapes.split(","):
        shape = parse_shape(name)
        inputs = {d: make_inputs(shape, "float32", d, 0) for d in ("positive", "normal")}
        refs = {d: reference(shape, [pair]) for d, pair in inputs.items()}
        flops = 2.0 * shape.batch * shape.m * shape.n * shape.k
        calls = max(3, min(200, int(2e12 / flops)))
        peer_ms = None
        for variant, fn in VARIANTS.items():
            run = jax.jit(fn)
            errs = {d: accuracy(run(*inputs[d]), refs[d]) for d in inputs}
            ms = 1e3 * statistics.median(
                pipelined_samples(run, inputs["normal"], calls=calls, repeats=args.repeats)
            )
            peer_ms = peer_ms or ms
            row = dict(shape=name, variant=variant, ms=ms, ratio=peer_ms / ms)
            row.update({f"err_{d}": e.err for d, e in errs.items()})
            row.update({f"bias_{d}": e.bias for d, e in errs.items()})
            rows.append(row)
            print(
                f"{name:16} {variant:28} {ms:8.4f} {row['ratio']:7.3f} "
                f"{row['err_positive']:8.2e} {row['bias_positive']:9.2e} {row['err_normal']:8.2e}",
                flush=True,
            )
        jax.clear_caches()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
