"""The training step (--train-step): forward + VJP of a small model, ours against the peer.

One jitted training step, jax.value_and_grad of a loss with respect to every
weight and the input x (x's cotangent is taken as for a block inside a
deeper model), timed once with `jnp.matmul` and once per requested kernel
with `jax_tiled.matmul`; the matmul is the only difference. Two models
(--model):

- `mlp`: a 2-layer MLP, y = relu(x @ w1) @ w2, loss mean(y**2) in float32:
  6 products of 2*tokens*width^2 FLOPs each (2 forward, 4 in the VJP);
- `attention`: a transformer block on `sequences` sequences of `tokens`
  tokens: heads of 64 features, q/k/v/output projections, softmax attention
  (softmax in float32), a residual, then a 2-layer MLP of the same width with
  a residual, loss mean(y**2) in float32: 8 products forward (four of them
  batched over sequences and heads), 16 in the VJP.

Inputs rotate and samples are timed as for products (timing.py), per step.
Each step's loss and gradients on the first set are compared with the truth,
the same step by the peer at precision highest in float32 (harness.py); ours
must be within the dtype's tolerance of it or no further off than about the
peer is (harness.judge_against_truth), or the row fails and the exit status is 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

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
from jax_tiled.bench.shapes import Shape
from jax_tiled.bench.timing import Budget, choose_sets, random_sets

# (model, backend) -> (width, tokens per sequence, sequences); tokens None: the
# width. The MLP's are docs/performance.md's (on a CPU, a step of seconds); the
# attention block is the small model of the small-models target (8 sequences
# of 512 tokens, width 512).
TRAIN_SIZE = {
    ("mlp", "gpu"): (8192, None, 1),
    ("mlp", "cpu"): (1024, None, 1),
    ("attention", "gpu"): (512, 512, 8),
    ("attention", "cpu"): (256, 256, 4),
}


@dataclasses.dataclass
class StepRow(VersusPeer):
    """One training step timed with one matmul (see the module docstring)."""

    width: int
    tokens: int
    dtype: str
    precision: str
    kernel: str
    sets: int
    ms: float | None = None  # per step
    tflops: float | None = None  # FLOPs of the step's products per second
    ratio: float | None = None  # peer ms / ms
    peer_ms: float | None = None
    peer_precision: str | None = None
    loss: float | None = None
    # Relative distances to the truth (step_errs): {"loss": ..., "grad": ...}
    err: dict[str, float] | None = None
    peer_err: dict[str, float] | None = None  # the peer's, on a kernel's row
    tolerance: float | None = None  # see harness.judge_against_truth
    calls: int | None = None
    samples_ms: list[float] | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class StepSize:
    width: int
    tokens: int  # per sequence
    sequences: int = 1  # the attention block's batch; the MLP's rows are tokens * sequences


@dataclasses.dataclass(frozen=True)
class StepModel:
    """What a training step computes. loss(matmul, *arrays) is a float32 scalar;
    arrays(size) gives each array's shape and the scale of its normal values
    (weights 1/sqrt(fan-in), as at initialisation, so activations stay near unit
    scale at any width); products(size) lists every product of the step, forward
    and VJP, as M x K x N (batched where the product is)."""

    loss: Callable
    arrays: Callable[[StepSize], list[tuple[tuple[int, ...], float]]]
    products: Callable[[StepSize], list[Shape]]
    text: Callable[[StepSize], str]


def _mean_square(y):
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def mlp_loss(matmul, w1, w2, x):
    """Mean square of a 2-layer MLP's output, reduced in float32 as mixed-precision
    training does."""
    return _mean_square(matmul(jax.nn.relu(matmul(x, w1)), w2))


def _mlp_products(size: StepSize) -> list[Shape]:
    t, w = size.tokens * size.sequences, size.width
    return [
        Shape(t, w, w),
        Shape(t, w, w),  # forward: z = x @ w1, y = relu(z) @ w2
        Shape(t, w, w),
        Shape(w, t, w),  # layer 2's VJP: dy @ w2.T, relu(z).T @ dy
        Shape(t, w, w),
        Shape(w, t, w),
    ]  # layer 1's VJP: dz @ w1.T, x.T @ dz


MLP = StepModel(
    loss=mlp_loss,
    arrays=lambda s: (
        [((s.width, s.width), 1 / math.sqrt(s.width))] * 2
        + [((s.tokens * s.sequences, s.width), 1.0)]
    ),
    products=_mlp_products,
    text=lambda s: (
        f"2-layer MLP, width {s.width}, {s.tokens * s.sequences} tokens; "
        "y = relu(x @ w1) @ w2, loss mean(y**2) in float32, value_and_grad wrt "
        "w1, w2, x"
    ),
)

HEAD_FEATURES = 64


def _heads(width: int) -> int:
    return max(1, width // HEAD_FEATURES)


def attention_loss(matmul, wq, wk, wv, wo, w1, w2, x):
    """Mean square of a transformer block's output (see the module docstring)."""
    sequences, tokens, width = x.shape
    heads = _heads(width)

    def split_heads(y):  # (S, T, W) -> (S, H, T, W / H)
        return y.reshape(sequences, tokens, heads, width // heads).transpose(0, 2, 1, 3)

    q, k, v = (split_heads(matmul(x, w)) for w in (wq, wk, wv))
    scores = matmul(q, k.mT).astype(jnp.float32) / math.sqrt(width // heads)
    p = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    o = matmul(p, v).transpose(0, 2, 1, 3).reshape(sequences, tokens, width)
    y = matmul(o, wo) + x
    return _mean_square(matmul(jax.nn.relu(matmul(y, w1)), w2) + y)


def _attention_products(size: StepSize) -> list[Shape]:
    rows, w, t = size.tokens * size.sequences, size.width, size.tokens
    heads = _heads(w)
    d, bh = w // heads, size.sequences * heads
    projection = Shape(rows, w, w)  # x @ wq, wk, wv; o @ wo; the MLP's two
    forward = [projection] * 6 + [
        Shape(t, d, t, bh),  # q @ k.T
        Shape(t, t, d, bh),
    ]  # p @ v
    # The VJP of a @ b runs g @ b.T (M x N x K) and a.T @ g (K x M x N).
    vjp = [Shape(p.m, p.n, p.k, p.batch) for p in forward] + [
        Shape(p.k, p.m, p.n, p.batch) for p in forward
    ]
    return forward + vjp


ATTENTION = StepModel(
    loss=attention_loss,
    arrays=lambda s: (
        [((s.width, s.width), 1 / math.sqrt(s.width))] * 6
        + [((s.sequences, s.tokens, s.width), 1.0)]
    ),
    products=_attention_products,
    text=lambda s: (
        f"transformer block, width {s.width} ({_heads(s.width)} heads of "
        f"{s.width // _heads(s.width)}), {s.sequences} sequences of {s.tokens} "
        "tokens; attention and a 2-layer MLP with residuals, loss mean(y**2) in "
        "float32, value_and_grad wrt the 6 weights and x"
    ),
)

MODELS = {"mlp": MLP, "attention": ATTENTION}


def train_step_fn(precision: str, kernel: str, model: StepModel = MLP):
    """step(*arrays) -> (loss, grads of every array), every product by
    matmul_fn(precision, kernel)."""
    n_arrays = len(model.arrays(StepSize(HEAD_FEATURES, 1)))
    return jax.value_and_grad(
        functools.partial(model.loss, matmul_fn(precision, kernel)), argnums=tuple(range(n_arrays))
    )


def train_step_products(width: int, tokens: int) -> list[Shape]:
    """The products one MLP step runs, as M x K x N of op(a) @ op(b)."""
    return MLP.products(StepSize(width, tokens))


def step_flops(model: StepModel, size: StepSize) -> int:
    return sum(p.flops for p in model.products(size))


def make_step_inputs(
    model: StepModel, size: StepSize, dtype, budget: Budget, seed: int
) -> list[tuple]:
    """Rotating sets of the model's arrays, random normal at their scales."""
    shapes, scales = zip(*model.arrays(size))
    set_bytes = sum(map(math.prod, shapes)) * jnp.dtype(dtype).itemsize
    sets = random_sets(shapes, dtype, choose_sets(set_bytes, budget), seed)
    return jax.block_until_ready(
        [tuple((a * scale).astype(dtype) for a, scale in zip(arrays, scales)) for arrays in sets]
    )


def step_errs(result, truth) -> dict[str, float]:
    """How far a step's (loss, grads) is from the truth's: the loss's relative
    distance, and the worst of the gradients' (so that a wrong VJP fails the row
    even when the loss agrees)."""
    (loss, grads), (true_loss, true_grads) = result, truth
    return {
        "loss": relative_distance(loss, true_loss),
        "grad": max(relative_distance(g, t) for g, t in zip(grads, true_grads)),
    }


def step_of(args) -> tuple[StepModel, StepSize]:
    """The model and size the command line asks for."""
    return MODELS[args.model], StepSize(args.width, args.tokens, args.sequences)


def measure_step(dtype: str, precision: str, kernel: str, sets, args, budget: Budget):
    """The step's row, and its (loss, grads) on the first set (None when it failed)."""
    model, size = step_of(args)
    row = StepRow(args.width, args.tokens, dtype, precision, kernel, len(sets))
    timing = measure_into(
        row,
        train_step_fn(precision, kernel, model),
        sets,
        step_flops(model, size),
        args,
        budget,
        keep_first=True,
    )
    if timing is None:
        return row, None
    row.loss = float(timing.first[0])
    return row, timing.first


def run_train_step(
    dtype: str, precisions: list[str], kernels: list[str], args, budget: Budget, progress: Progress
) -> list[StepRow]:
    model, size = step_of(args)
    sets = make_step_inputs(model, size, jnp.dtype(dtype), budget, args.seed)
    truth = truth_of(lambda precision, kernel: train_step_fn(precision, kernel, model), sets[0])
    return measure_agreeing_with_peers(
        precisions,
        kernels,
        lambda precision, kernel: measure_step(dtype, precision, kernel, sets, args, budget),
        step_errs,
        truth,
        progress,
        f"train step {args.model} {args.width} {dtype}",
    )


def run_train_steps(args, kernels: list[str], budget: Budget) -> list[StepRow]:
    precisions = args.precision or ["default"]
    return rows_for_each(
        args.dtype,
        len(args.dtype) * count_rows({p: kernels for p in precisions}),
        args,
        lambda dtype, progress: run_train_step(dtype, precisions, kernels, args, budget, progress),
    )


def describe_train_step(model: StepModel, size: StepSize) -> str:
    products = model.products(size)
    return (
        f"training step: {model.text(size)}: {len(products)} products, "
        f"{step_flops(model, size) / 1e12:.4g} TFLOP per step"
    )
