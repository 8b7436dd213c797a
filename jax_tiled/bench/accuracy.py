"""Accuracy (--accuracy): ours and jnp.matmul against a float64 product, on the same inputs.

For each dtype and precision (float32 at default, high and highest; bfloat16
and float16 at default, each into its own dtype and into float32 through
preferred_element_type), each kernel the benchmark would time (plus auto),
each input distribution and each shape, one product by the kernel and one by
`jnp.matmul` at the same dtype and preferred_element_type, on the same
inputs, at the precision docs/performance.md's accuracy targets name
(peer_precision: the row's own, except that `high`, 3xTF32, is held to
`highest`, and a preset to the same preset). Both are measured
against ref, the float64 NumPy product of those inputs as rounded to the
dtype:

- err  = ||out - ref||_F / ||ref||_F;
- bias = mean(out - ref) / mean(|ref|), the mean signed error in units of the
  mean magnitude. On positive inputs every ref is > 0, and this is the mean of
  the signed relative error (out - ref) / ref, weighted by ref; unlike that
  mean, it stays defined on normal inputs, where some ref are near zero.

Inputs: "positive", uniform in [0.5, 1.5], where every term of every sum has
one sign, so a rounding that leans one way (truncation) adds up to a bias
instead of cancelling out; "normal", standard normal.

A row gives both sides and the ratios ours / jnp of err and of |bias|, and
its flag says which of the project's accuracy targets it misses, with the
allowances tests/test_accuracy.py makes, so that the bench and the tests
flag the same products:

- ERR:  err > 1.2 jnp's err + eps / 4;
- BIAS: |bias| > 2 |jnp's bias| + eps / 4 + 3 x 1.2 jnp's err / sqrt(M N),

eps being the output dtype's and M N the output's elements (times the
batch): a quarter of eps is room for the rounding of the result itself,
which neither side avoids, and the last term room for chance, as the mean
of M N errors of rms 1.2x jnp's wanders by about 1.2 jnp's err / sqrt(M N)
(on normal inputs both biases are mostly such noise, and a ratio of two
noises is no finding). The row records both limits.
A forced kernel that refuses a product is a refused row. Flags do not change
the exit status; a kernel that fails otherwise does.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_tiled.bench.harness import (
    PEER,
    kernels_for,
    peer_precision,
    precisions_for,
    relative_distance,
    rows_for_each,
)
from jax_tiled.bench.products import product_fn, reference
from jax_tiled.bench.progress import Progress
from jax_tiled.bench.shapes import Shape, parse_shape

# The default shapes by backend: a square, a long K, an odd shape, and few
# rows over a long K (a decoding step's product, which kernels run on tiles of
# their own: 16-bit into float32 there was 2.7x jnp's error on an H100 before
# anyone measured it); on a GPU also one row and one column (matrix-vector
# products, whose sums jnp's cuBLAS adds as a tree: one row at HIGHEST was
# 2.2x its error before the row blocks). On a GPU at the sizes the targets
# name; on a CPU small, so that the view runs in seconds.
ACCURACY_SHAPES = {
    "gpu": (
        "4096^3",
        "512x8192x512",
        "1000x800x1200",
        "16x8192x8192",
        "1x8192x8192",
        "8192x8192x1",
    ),
    "cpu": ("256^3", "128x4096x128", "197x263x131", "16x4096x256"),
}
# 16-bit operands into a float32 output also over a very long K: a float32 output
# keeps the drift of a long accumulation, which a 16-bit one would round away.
WIDE_OUTPUT_SHAPES = {"gpu": ("256x65536x256",), "cpu": ("64x16384x64",)}


def _uniform_positive(key, shape, dtype):
    return jax.random.uniform(key, shape, dtype, 0.5, 1.5)


DISTRIBUTIONS = {"positive": _uniform_positive, "normal": jax.random.normal}

ERR_TARGET = 1.2  # ours' err at most this times jnp's ...
BIAS_TARGET = 2.0  # ... and ours' |bias| at most this times jnp's, with the allowances:
ROUNDING_ROOM = 0.25  # of the output dtype's epsilon
CHANCE_STEPS = 3  # of 1.2 jnp's err / sqrt(the output's elements), for the bias

DEFINITIONS = (
    "err = ||out - ref||_F / ||ref||_F; bias = mean(out - ref) / mean(|ref|); ref: float64 "
    "NumPy product of the same dtype-rounded inputs; inputs positive: uniform [0.5, 1.5], "
    f"normal: standard normal; {PEER} at the row's dtype, output dtype and precision "
    "(high's peer: highest)"
)
LEGEND = (
    f"flag: ERR where ours' err > {ERR_TARGET:g} jnp's + eps/4, BIAS where ours' |bias| > "
    f"{BIAS_TARGET:g} |jnp's| + eps/4 + {CHANCE_STEPS} x {ERR_TARGET:g} jnp's err / "
    "sqrt(M N) (eps: the output dtype's; as tests/test_accuracy.py)"
)


@dataclasses.dataclass(frozen=True)
class Accuracy:
    """One product's distance from ref (see the module docstring)."""

    err: float
    bias: float


def accuracy(out, ref: np.ndarray) -> Accuracy:
    diff = np.asarray(out, np.float64) - ref
    return Accuracy(
        err=relative_distance(out, ref), bias=float(np.mean(diff) / np.mean(np.abs(ref)))
    )


@dataclasses.dataclass(frozen=True)
class Limits:
    """The most ours' err and |bias| may be against the peer's (module docstring)."""

    err: float
    bias: float


def limits(peer: Accuracy, out_dtype: str, elements: int) -> Limits:
    rounding = ROUNDING_ROOM * float(jnp.finfo(out_dtype).eps)
    chance = CHANCE_STEPS * ERR_TARGET * peer.err / math.sqrt(elements)
    return Limits(
        err=ERR_TARGET * peer.err + rounding, bias=BIAS_TARGET * abs(peer.bias) + rounding + chance
    )


def misses(ours: Accuracy, allowed: Limits) -> list[str]:
    """The targets ours misses: "err", "bias" (a nan misses both)."""
    return [
        name
        for name, value, limit in (
            ("err", ours.err, allowed.err),
            ("bias", abs(ours.bias), allowed.bias),
        )
        if not value <= limit
    ]


def _ratio(ours: float, peer: float) -> float:
    """ours / peer; 1 where both are exact, inf where only the peer is."""
    if peer == 0:
        return 1.0 if ours == 0 else math.inf
    return ours / peer


@dataclasses.dataclass
class AccuracyRow:
    """One kernel's product and the peer's on the same inputs (module docstring)."""

    shape: str
    dtype: str
    out_dtype: str
    precision: str
    inputs: str  # the distribution's name
    kernel: str
    peer_precision: str = ""  # the peer's (peer_precision)
    err: float | None = None
    peer_err: float | None = None
    err_ratio: float | None = None  # err / peer_err
    bias: float | None = None
    peer_bias: float | None = None
    bias_ratio: float | None = None  # |bias| / |peer_bias|
    err_limit: float | None = None  # the most err and |bias| may be (limits)
    bias_limit: float | None = None
    misses: list[str] | None = None  # the targets missed: "err", "bias"
    refused: bool = False  # the forced kernel refused the product
    error: str | None = None

    def record(self, ours: Accuracy, peer: Accuracy, allowed: Limits) -> None:
        self.err, self.peer_err = ours.err, peer.err
        self.err_ratio = _ratio(ours.err, peer.err)
        self.bias, self.peer_bias = ours.bias, peer.bias
        self.bias_ratio = _ratio(abs(ours.bias), abs(peer.bias))
        self.err_limit, self.bias_limit = allowed.err, allowed.bias
        self.misses = misses(ours, allowed)


def make_inputs(shape: Shape, dtype: str, distribution: str, seed: int) -> tuple:
    """(a, b) as stored for `shape`, drawn from the distribution in the dtype."""
    keys = jax.random.split(jax.random.key(seed), 2)
    draw = DISTRIBUTIONS[distribution]
    a, b = (draw(key, stored, jnp.dtype(dtype)) for key, stored in zip(keys, shape.stored_shapes))
    if not (jnp.any(a) and jnp.any(b)):  # an empty shape: no error or bias is defined
        raise ValueError(f"--accuracy: shape {shape.name} has an all-zero operand")
    return a, b


def out_dtypes(dtype: str) -> tuple[str, ...]:
    """The output dtypes measured for the operands' dtype: 16-bit operands also
    into float32, as mixed-precision training asks through preferred_element_type."""
    return (dtype, "float32") if jnp.dtype(dtype).itemsize == 2 else (dtype,)


@dataclasses.dataclass(frozen=True)
class Products:
    """The products measured on one input pair: the peer's and each kernel's."""

    out_dtype: str
    precision: str
    kernels: tuple[str, ...]


def shapes_for(args, suite: str, dtype: str, out_dtype: str) -> list[Shape]:
    """--shapes, else the suite's, with a long K where 16-bit operands go into float32."""
    if args.shapes:
        return args.shapes
    wide = WIDE_OUTPUT_SHAPES[suite] if out_dtype != dtype else ()
    return [parse_shape(name) for name in (*ACCURACY_SHAPES[suite], *wide)]


def plan(args, kernels: list[str], suite: str) -> list[tuple[Shape, str, list[Products]]]:
    """(shape, dtype, the products on it) in run order. One input pair per shape, dtype
    and distribution serves all of those, so its float64 reference is computed once."""
    requested = args.kernels is not None
    work = []
    for dtype in args.dtype:
        by_shape: dict[Shape, list[Products]] = {}
        for out in out_dtypes(dtype):
            for precision in precisions_for(dtype, args.precision):
                product = Products(
                    out, precision, tuple(kernels_for(dtype, precision, kernels, requested, out))
                )
                for shape in shapes_for(args, suite, dtype, out):
                    by_shape.setdefault(shape, []).append(product)
        work += [(shape, dtype, products) for shape, products in by_shape.items()]
    return work


def _evaluate(shape: Shape, precision: str, kernel: str, out_dtype: str, a, b) -> np.ndarray:
    return np.asarray(jax.jit(product_fn(shape, precision, kernel, out_dtype))(a, b))


def measure_products(
    shape: Shape,
    dtype: str,
    distribution: str,
    products: list[Products],
    seed: int,
    progress: Progress,
) -> list[AccuracyRow]:
    """Rows for one input pair: per product the peer's once, then each kernel's."""
    a, b = make_inputs(shape, dtype, distribution, seed)
    ref = reference(shape, [(a, b)])
    rows = []
    for p in products:
        peer_prec = peer_precision(p.precision)
        peer = accuracy(_evaluate(shape, peer_prec, PEER, p.out_dtype, a, b), ref)
        allowed = limits(peer, p.out_dtype, ref.size)
        for kernel in p.kernels:
            progress.describe(
                f"{shape.name} {dtype}->{p.out_dtype} {p.precision} {distribution} {kernel}"
            )
            row = AccuracyRow(
                shape.name, dtype, p.out_dtype, p.precision, distribution, kernel, peer_prec
            )
            try:
                row.record(
                    accuracy(_evaluate(shape, p.precision, kernel, p.out_dtype, a, b), ref),
                    peer,
                    allowed,
                )
            except ValueError as exc:  # a forced kernel refuses the product when traced
                row.refused, row.error = True, f"refused: {exc}"
            except Exception as exc:  # noqa: BLE001 - a failing kernel is a row, not a crash
                row.error = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            progress.step()
    return rows


def run_accuracy(args, kernels: list[str], suite: str) -> list[AccuracyRow]:
    work = plan(args, kernels, suite)

    def every_distribution(shape_work, progress) -> list[AccuracyRow]:
        shape, dtype, products = shape_work
        return [
            row
            for distribution in DISTRIBUTIONS
            for row in measure_products(shape, dtype, distribution, products, args.seed, progress)
        ]

    total = len(DISTRIBUTIONS) * sum(len(p.kernels) for _, _, ps in work for p in ps)
    return rows_for_each(work, total, args, every_distribution)
