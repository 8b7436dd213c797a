"""Chains of small products (--chain): what a small model pays per call.

A small model's layers are products of a few hundred rows and columns, run
one after another, and most JAX models run their layers inside `lax.scan`.
There the figure is the time of one call (host work, launch, the product's
latency), not peak FLOP/s. One jitted function runs `length` dependent
products, x = tanh(x @ w[i]) with x and every w[i] size x size, either as a
`lax.scan` over the stacked weights or unrolled in Python, once with
`jnp.matmul` and once per requested kernel with `jax_tiled.matmul`. A row
reports the time per product, timed as products are (timing.py) but on one
input set: a chain already reads `length` distinct weights, as a model's
step does, and timing.py compiles every set's chain into one function (64
sets of 64 unrolled products took minutes to compile on a GPU). Each
chain's final x is compared with the truth, the same chain by the peer at
precision highest in float32, as the training step's are
(harness.judge_against_truth): past the rule, the row fails and the exit
status is 1.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_tiled.bench.harness import (
    VersusPeer,
    count_rows,
    matmul_fn,
    measure_agreeing_with_peers,
    measure_into,
    relative_distance,
    rows_for_each,
    truth_of,
)
from jax_tiled.bench.progress import Progress
from jax_tiled.bench.timing import Budget, random_sets

FORMS = ("scan", "unrolled")
CHAIN_SIZES = {"gpu": (128, 256, 512), "cpu": (128, 256)}
CHAIN_LENGTH = 64
CHAIN_DTYPES = ("bfloat16", "float32")
# Weights are normal / sqrt(size) times this gain: tanh then settles x at a
# spread of order one (a gain of 1 or less would shrink it towards zero layer
# by layer), and a layer's Jacobian stays below one, so rounding differences
# between two kernels do not grow along the chain.
WEIGHT_GAIN = 1.5


@dataclasses.dataclass
class ChainRow(VersusPeer):
    """One chain timed with one matmul (see the module docstring)."""

    form: str
    size: int
    length: int
    dtype: str
    precision: str
    kernel: str
    sets: int
    ms: float | None = None  # per chain
    us_per_product: float | None = None
    tflops: float | None = None
    ratio: float | None = None  # peer time / our time
    peer_ms: float | None = None
    peer_precision: str | None = None
    # Relative distances to the truth of the final x (chain_errs): {"x": ...}
    err: dict[str, float] | None = None
    peer_err: dict[str, float] | None = None  # the peer's, on a kernel's row
    tolerance: float | None = None  # see harness.judge_against_truth
    calls: int | None = None
    samples_ms: list[float] | None = None
    error: str | None = None


def chain_fn(form: str, length: int, precision: str, kernel: str):
    """chain(x, ws) -> x after `length` layers x = tanh(x @ ws[i])."""
    mm = matmul_fn(precision, kernel)

    def layer(x, w):
        return jnp.tanh(mm(x, w)).astype(x.dtype)

    if form == "scan":

        def chain(x, ws):
            return lax.scan(lambda x, w: (layer(x, w), None), x, ws)[0]
    elif form == "unrolled":

        def chain(x, ws):
            for i in range(length):
                x = layer(x, ws[i])
            return x
    else:
        raise ValueError(f"unknown chain form {form!r}; choose from {FORMS}")
    return chain


def chain_flops(size: int, length: int) -> int:
    return 2 * length * size**3


def make_chain_inputs(size: int, length: int, dtype, seed: int) -> list[tuple]:
    """One input set (see the module docstring): x, and the stacked weights."""
    sets = random_sets(((size, size), (length, size, size)), dtype, 1, seed)
    scale = WEIGHT_GAIN / math.sqrt(size)
    return jax.block_until_ready([(x, (ws * scale).astype(dtype)) for x, ws in sets])


def measure_chain(
    form: str, size: int, dtype: str, precision: str, kernel: str, sets, args, budget: Budget
):
    """The chain's row, and its final x on the first set (None when it failed)."""
    row = ChainRow(form, size, args.chain_length, dtype, precision, kernel, len(sets))
    timing = measure_into(
        row,
        chain_fn(form, args.chain_length, precision, kernel),
        sets,
        chain_flops(size, args.chain_length),
        args,
        budget,
        keep_first=True,
    )
    if timing is None:
        return row, None
    row.us_per_product = row.ms * 1e3 / args.chain_length
    return row, timing.first


def chain_errs(x, truth) -> dict[str, float]:
    """How far a chain's final x is from the truth's."""
    return {"x": relative_distance(x, truth)}


def run_chain(
    form: str,
    size: int,
    dtype: str,
    precisions: list[str],
    kernels: list[str],
    args,
    budget: Budget,
    progress: Progress,
) -> list[ChainRow]:
    sets = make_chain_inputs(size, args.chain_length, jnp.dtype(dtype), args.seed)
    truth = truth_of(
        lambda precision, kernel: chain_fn(form, args.chain_length, precision, kernel), sets[0]
    )
    return measure_agreeing_with_peers(
        precisions,
        kernels,
        lambda precision, kernel: measure_chain(
            form, size, dtype, precision, kernel, sets, args, budget
        ),
        chain_errs,
        truth,
        progress,
        f"chain {form} {size} {dtype}",
    )


def run_chains(args, kernels: list[str], budget: Budget) -> list[ChainRow]:
    precisions = args.precision or ["default"]
    work = [(form, size, dtype) for dtype in args.dtype for size in args.sizes for form in FORMS]
    return rows_for_each(
        work,
        len(work) * count_rows({p: kernels for p in precisions}),
        args,
        lambda chain, progress: run_chain(*chain, precisions, kernels, args, budget, progress),
    )


def describe_chains(length: int) -> str:
    return (
        f"chains: {length} dependent products x = tanh(x @ w[i]) in one jitted function, "
        "x and w[i] size x size; time per product"
    )
