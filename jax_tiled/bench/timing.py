"""The timing harness: rotating input sets and pipelined, device-side timing.

Timing: each (shape, dtype) gets R distinct input pairs, generated once on the
device with jax.random (R is chosen so the pairs overflow the caches while
staying within a memory budget). One jitted function computes all R products
(a Python loop inside jit, the same for our kernels and the peer); after
warm-up, a sample is the wall time of one or more pipelined calls plus
block_until_ready, divided by the number of products; a row reports the
median of --repeats samples.

`tools/scaling.py` times its sharded products with `pipelined_samples`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Budget:
    """How many input pairs to rotate through, per backend."""

    max_bytes: int  # inputs of all pairs of one shape stay under this
    target_bytes: int  # ... and reach this, if max_sets allows, to overflow caches
    max_sets: int
    sample_s: float  # pipeline calls until a sample lasts about this long
    max_calls: int = 64


GPU_BUDGET = Budget(max_bytes=1 << 30, target_bytes=256 << 20, max_sets=64, sample_s=0.02)
CPU_BUDGET = Budget(max_bytes=256 << 20, target_bytes=64 << 20, max_sets=8, sample_s=0.02)


def choose_sets(set_bytes: int, budget: Budget) -> int:
    """How many input sets of set_bytes each to rotate through."""
    want = math.ceil(budget.target_bytes / set_bytes)
    return max(1, min(want, budget.max_sets, budget.max_bytes // set_bytes))


def random_sets(shapes, dtype, n_sets: int, seed: int) -> list[tuple]:
    """n_sets distinct tuples of random-normal arrays of these shapes, generated on the device."""
    keys = iter(jax.random.split(jax.random.key(seed), len(shapes) * n_sets))
    sets = [tuple(jax.random.normal(next(keys), s, dtype) for s in shapes) for _ in range(n_sets)]
    return jax.block_until_ready(sets)


@dataclasses.dataclass
class Timing:
    seconds: float  # median per product
    samples: list[float]  # per-product seconds of each sample
    calls: int  # jitted calls pipelined per sample
    first: np.ndarray | None  # fn's output on the first set (NumPy leaves), when asked for


def time_products(
    fn, sets, *, repeats: int, warmup: int, budget: Budget, keep_first: bool
) -> Timing:
    """Median per-set wall time of one jitted function applying fn to every set
    of operands (a product's pair, or a training step's arrays).
    Calls are pipelined (dispatched back to back, blocked on once) until a sample
    lasts about budget.sample_s, with their outputs within budget.max_bytes."""
    run = jax.jit(lambda sets: [fn(*operands) for operands in sets])
    out = jax.block_until_ready(run(sets))  # compiles
    first = jax.tree.map(np.asarray, out[0]) if keep_first else None
    out_bytes = sum(x.nbytes for x in jax.tree.leaves(out))
    del out
    elapsed = budget.sample_s
    for _ in range(max(1, warmup)):
        elapsed = pipelined_seconds(run, (sets,), calls=1)
    calls = min(
        budget.max_calls,
        math.ceil(budget.sample_s / max(elapsed, 1e-9)),
        budget.max_bytes // max(out_bytes, 1),
    )
    calls = max(1, calls)
    samples = [
        seconds / len(sets)
        for seconds in pipelined_samples(run, (sets,), calls=calls, repeats=repeats)
    ]
    return Timing(statistics.median(samples), samples, calls, first)


def pipelined_times(run, args, *, calls: int) -> tuple[float, float]:
    """(dispatch, wall) seconds per call of `calls` calls of run(*args),
    dispatched back to back and blocked on once: the host's time to dispatch
    them, and the whole. Host dispatch overlaps the device work, and the one
    synchronisation is shared by all the calls; where dispatch is close to
    wall, the host is what bounds the calls."""
    start = time.perf_counter()
    outs = [run(*args) for _ in range(calls)]
    dispatched = time.perf_counter()
    jax.block_until_ready(outs)
    end = time.perf_counter()
    return (dispatched - start) / calls, (end - start) / calls


def pipelined_seconds(run, args, *, calls: int) -> float:
    """Wall seconds per call of pipelined_times."""
    return pipelined_times(run, args, calls=calls)[1]


def pipelined_samples(run, args, *, calls: int, repeats: int) -> list[float]:
    """`repeats` samples of pipelined_seconds(run, args, calls=calls); the
    outputs of one sample are freed before the next starts."""
    return [pipelined_seconds(run, args, calls=calls) for _ in range(repeats)]
