"""Whether a change computes the same bits: hashes of every kernel's results on fixed products.

    PYTHONPATH=OLD python3 -P tools/same_bits.py --write before.json  # the build before
    python3 -P tools/same_bits.py --compare before.json               # the build after

(OLD: the earlier commit installed with `pip install --target OLD .`.)

A change that should not move a result (a refactor, an instruction sequence
replaced by an equal one) is shown to by one run of each build on the same
machine: every kernel of the backend (and `auto`), every dtype and float32
precision it takes, odd and aligned shapes, a batch, every layout, on normal,
positive and special-value inputs (inf, NaN, values at the float32 limit, a
subnormal). A product a kernel refuses is recorded as refused, so a change in
what a kernel takes shows too. --compare prints each product whose bits
differ, or that only one run has, and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_tiled

# (batch, m, k, n): odd sizes, tile edges, K past a blocked sum's partials, a
# batch, and one output tile over a K deep enough that the Hopper kernel splits
# it across clusters of blocks (a second kernel adds their parts).
SHAPES = [(1, 1, 1, 1), (1, 33, 17, 65), (1, 64, 64, 64), (1, 130, 300, 96), (1, 256, 600, 136)]
SHAPES += [(3, 40, 24, 56), (1, 8, 32768, 8)]
# Few rows and whole micro-panels of columns: the CPU kernel reads B in place
# (kBInPlacePanels); narrow outputs above read A in place.
SHAPES += [(1, 40, 300, 96)]
DTYPES = ("float32", "bfloat16", "float16")
PRECISIONS = (lax.Precision.DEFAULT, lax.Precision.HIGH, lax.Precision.HIGHEST)
INPUTS = ("normal", "positive", "special")
F32_MAX = float(np.finfo(np.float32).max)
# Specials planted in each operand: infinities, NaN, float32 values that round
# past the largest TF32 or bfloat16, and a subnormal.
SPECIALS = (np.inf, -np.inf, np.nan, 3.4025e38, -F32_MAX, 1e-40)


def operands(shape, dtype: str, transpose_a: bool, transpose_b: bool, inputs: str, seed: int):
    """(a, b) as stored (transposed where asked), of `inputs` kind."""
    batch, m, k, n = shape
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((batch, k, m) if transpose_a else (batch, m, k))
    b = rng.standard_normal((batch, n, k) if transpose_b else (batch, k, n))
    if inputs == "positive":
        a, b = np.abs(a) + 0.5, np.abs(b) + 0.5
    if inputs == "special":
        for x in (a, b):
            planted = SPECIALS[: x.size]
            x.flat[rng.choice(x.size, len(planted), replace=False)] = planted
    with np.errstate(over="ignore"):  # float16 takes the float32 limit to inf, as it should
        return jnp.asarray(a.astype(np.float32), dtype), jnp.asarray(b.astype(np.float32), dtype)


def cases(kernels: list[str], dtypes: tuple[str, ...]):
    """(kernel, dtype, precision) for each kernel and what it takes, then each shape and layout."""
    for dtype in dtypes:
        for precision in PRECISIONS if dtype == "float32" else PRECISIONS[:1]:
            takes = set(jax_tiled.kernels(None, jnp.dtype(dtype), precision=precision))
            for kernel in kernels:
                if kernel == "auto" or kernel in takes:
                    yield kernel, dtype, precision


def product(kernel: str, precision, transpose_a: bool, transpose_b: bool):
    def f(a, b):
        a = a.mT if transpose_a else a
        b = b.mT if transpose_b else b
        return jax_tiled.matmul(a, b, precision=precision, kernel=kernel)

    return jax.jit(f)


def digest(x) -> str:
    return hashlib.md5(np.asarray(x).tobytes()).hexdigest()


def hashes(kernels: list[str], dtypes: tuple[str, ...], progress=print) -> dict[str, str]:
    """{case: md5 of the result's bytes, or "refused: ..."} for every case."""
    out = {}
    for kernel, dtype, precision in cases(kernels, dtypes):
        for shape, (ta, tb) in itertools.product(
            SHAPES, itertools.product((False, True), repeat=2)
        ):
            name = f"{kernel} {dtype} {precision.name} {'x'.join(map(str, shape))} ta={ta} tb={tb}"
            fn = product(kernel, precision, ta, tb)
            for seed, inputs in enumerate(INPUTS):
                try:
                    out[f"{name} {inputs}"] = digest(
                        fn(*operands(shape, dtype, ta, tb, inputs, seed))
                    )
                except ValueError as exc:  # refused at trace time: the same for every input
                    out[f"{name} {inputs}"] = f"refused: {str(exc).splitlines()[0]}"
        progress(f"same_bits: {kernel} {dtype} {precision.name} done")
    return out


def compare(before: dict[str, str], now: dict[str, str]) -> list[str]:
    """One line per case whose result differs, or that only one run has."""
    lines = [
        f"differs: {case}"
        for case in sorted(before.keys() & now.keys())
        if before[case] != now[case]
    ]
    lines += [f"only before: {case}" for case in sorted(before.keys() - now.keys())]
    lines += [f"only now: {case}" for case in sorted(now.keys() - before.keys())]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", metavar="PATH", help="write this build's hashes")
    action.add_argument("--compare", metavar="PATH", help="compare with hashes --write wrote")
    parser.add_argument("--kernels", help="comma-separated (default: every kernel and auto)")
    parser.add_argument("--dtype", help=f"comma-separated (default: {','.join(DTYPES)})")
    args = parser.parse_args(argv)
    kernels = args.kernels.split(",") if args.kernels else [*jax_tiled.kernels(), "auto"]
    dtypes = tuple(args.dtype.split(",")) if args.dtype else DTYPES
    now = hashes(kernels, dtypes, lambda line: print(line, file=sys.stderr))
    facts = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    if args.write:
        with open(args.write, "w") as f:
            json.dump({**facts, "hashes": now}, f, indent=1)
            f.write("\n")
        print(f"same_bits: {len(now)} products written to {args.write}")
        return 0
    with open(args.compare) as f:
        before = json.load(f)
    if before["device"] != facts["device"]:
        print(f"same_bits: {args.compare} is from {before['device']}, this is {facts['device']}")
        return 2
    lines = compare(before["hashes"], now)
    print("\n".join(lines) if lines else f"same_bits: all {len(now)} products the same bits")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
