"""The training step (--train-step): forward + VJP of a 2-layer MLP, ours against the peer.

One jitted step of a 2-layer MLP, y = relu(x @ w1) @ w2 with loss mean(y**2)
in float32, and jax.value_and_grad with respect to w1, w2 and x, timed once
with `jnp.matmul` and once per requested kernel with `jax_tiled.matmul`; the
matmul is the only difference. The step runs 6 products (2 forward, 4 in the
VJP: x's cotangent is taken as for a block inside a deeper model) of
2*tokens*width^2 FLOPs each. Inputs rotate and samples are timed as for
products (timing.py), per step. Our step's loss and gradients must match the
peer's within a tolerance for the dtype, or the row fails and the exit status
is 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_tiled.bench.harness import (PEER, VersusPeer, count_rows, matmul_fn,
                                     measure_agreeing_with_peers, measure_into)
from jax_tiled.bench.report import Progress
from jax_tiled.bench.shapes import Shape
from jax_tiled.bench.timing import Budget, choose_sets, random_sets

TRAIN_WIDTH = {"gpu": 8192, "cpu": 1024}  # docs/performance.md's; on a CPU, one of seconds

# Largest relative difference allowed between our step's loss and gradients and the
# peer's. Both sides round h, y and the cotangents to the dtype after accumulating
# in different orders, so elements can round one unit apart, and that propagates
# through the later products: a few units of the dtype's rounding (bfloat16 2^-8,
# float16 2^-11) with a margin. float32 at default precision may run as TF32
# (float16's mantissa) on either side, so it gets float16's tolerance.
AGREEMENT_TOL = {"bfloat16": 3e-2, "float16": 1e-2, "float32": 1e-4, "float64": 1e-9}


def agreement_tolerance(dtype: str, precision: str) -> float:
    if dtype == "float32" and precision == "default":
        return AGREEMENT_TOL["float16"]
    return AGREEMENT_TOL[dtype]


@dataclasses.dataclass
class StepRow(VersusPeer):
    """One training step timed with one matmul (see the module docstring)."""
    width: int
    tokens: int
    dtype: str
    precision: str
    kernel: str
    sets: int
    ms: float | None = None          # per step
    tflops: float | None = None      # FLOPs of the step's products per second
    ratio: float | None = None       # peer ms / ms
    peer_ms: float | None = None
    peer_precision: str | None = None
    loss: float | None = None
    loss_diff: float | None = None   # |loss - peer's| / |peer's|
    grad_diff: float | None = None   # worst of dw1, dw2, dx: ||g - peer's|| / ||peer's||
    tolerance: float | None = None   # the most loss_diff and grad_diff may be
    calls: int | None = None
    samples_ms: list[float] | None = None
    error: str | None = None


def mlp_loss(matmul, w1, w2, x):
    """Mean square of a 2-layer MLP's output, reduced in float32 as mixed-precision
    training does."""
    y = matmul(jax.nn.relu(matmul(x, w1)), w2)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def train_step_fn(precision: str, kernel: str):
    """step(w1, w2, x) -> (loss, (dw1, dw2, dx)), every product by matmul_fn(precision, kernel)."""
    return jax.value_and_grad(functools.partial(mlp_loss, matmul_fn(precision, kernel)),
                              argnums=(0, 1, 2))


def train_step_products(width: int, tokens: int) -> list[Shape]:
    """The products one step runs, as M x K x N of op(a) @ op(b)."""
    t, w = tokens, width
    return [Shape(t, w, w), Shape(t, w, w),  # forward: z = x @ w1, y = relu(z) @ w2
            Shape(t, w, w), Shape(w, t, w),  # layer 2's VJP: dy @ w2.T, relu(z).T @ dy
            Shape(t, w, w), Shape(w, t, w)]  # layer 1's VJP: dz @ w1.T, x.T @ dz


def train_step_flops(width: int, tokens: int) -> int:
    return sum(p.flops for p in train_step_products(width, tokens))


def make_step_inputs(width: int, tokens: int, dtype, budget: Budget, seed: int) -> list[tuple]:
    """Rotating (w1, w2, x) sets, random normal, the weights scaled by 1/sqrt(width)
    as at initialisation, so that activations stay near unit scale at any width."""
    shapes = ((width, width), (width, width), (tokens, width))
    set_bytes = sum(map(math.prod, shapes)) * jnp.dtype(dtype).itemsize
    sets = random_sets(shapes, dtype, choose_sets(set_bytes, budget), seed)
    scale = 1 / math.sqrt(width)
    return jax.block_until_ready([(w1 * scale, w2 * scale, x) for w1, w2, x in sets])


def relative_difference(ours, peer) -> float:
    """||ours - peer|| / ||peer|| in float64; inf or nan when either is not finite."""
    ours, peer = np.asarray(ours, np.float64), np.asarray(peer, np.float64)
    return float(np.linalg.norm(ours - peer) / max(np.linalg.norm(peer), np.finfo(float).tiny))


def check_agreement(row: StepRow, ours, peer) -> None:
    """Records how far our step's loss and gradients are from the peer's. Past the
    tolerance, or not finite, the row fails: it gets no ratio and the run exits 1,
    so that a wrong kernel cannot pass for a fast one."""
    (loss, grads), (peer_loss, peer_grads) = ours, peer
    row.loss_diff = relative_difference(loss, peer_loss)
    row.grad_diff = float(np.max([relative_difference(g, p) for g, p in zip(grads, peer_grads)]))
    row.tolerance = agreement_tolerance(row.dtype, row.precision)
    if not (row.loss_diff <= row.tolerance and row.grad_diff <= row.tolerance):  # nan fails too
        row.error = (f"disagrees with {PEER}: loss by {row.loss_diff:.1e}, gradients by "
                     f"{row.grad_diff:.1e} (relative; tolerance {row.tolerance:.0e})")


def measure_step(dtype: str, precision: str, kernel: str, sets, args, budget: Budget):
    """The step's row, and its (loss, grads) on the first set (None when it failed)."""
    row = StepRow(args.width, args.tokens, dtype, precision, kernel, len(sets))
    timing = measure_into(row, train_step_fn(precision, kernel), sets,
                          train_step_flops(args.width, args.tokens), args, budget,
                          keep_first=True)
    if timing is None:
        return row, None
    row.loss = float(timing.first[0])
    return row, timing.first


def run_train_step(dtype: str, precisions: list[str], kernels: list[str], args,
                   budget: Budget, progress: Progress) -> list[StepRow]:
    sets = make_step_inputs(args.width, args.tokens, jnp.dtype(dtype), budget, args.seed)
    return measure_agreeing_with_peers(
        precisions, kernels,
        lambda precision, kernel: measure_step(dtype, precision, kernel, sets, args, budget),
        check_agreement, progress, f"train step {args.width} {dtype}")


def run_train_steps(args, kernels: list[str], budget: Budget) -> list[StepRow]:
    precisions = args.precision or ["default"]
    rows = []
    with Progress(len(args.dtype) * count_rows({p: kernels for p in precisions}),
                  enabled=not args.no_progress) as progress:
        for dtype in args.dtype:
            rows += run_train_step(dtype, precisions, kernels, args, budget, progress)
            jax.clear_caches()
    return rows


def describe_train_step(width: int, tokens: int) -> str:
    products = train_step_products(width, tokens)
    return (f"training step: 2-layer MLP, width {width}, {tokens} tokens; y = relu(x @ w1) @ w2, "
            f"loss mean(y**2) in float32, value_and_grad wrt w1, w2, x: {len(products)} "
            f"products, {train_step_flops(width, tokens) / 1e12:.4g} TFLOP per step")
