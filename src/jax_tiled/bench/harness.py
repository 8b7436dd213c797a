"""Ours against the peer in one harness: the matmuls, the rows per precision, the ratios.

Every kernel usable on the default backend (each forced by name, plus
"auto") and the peer `jnp.matmul` run on the same inputs through the same
timing. The peer of a float32 row is `jnp.matmul` at the same precision,
except that `high` (3xTF32) is compared with `highest` (PEER_PRECISION).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_tiled.bench.timing import Budget, Timing, time_products

PEER = "jnp.matmul"
DTYPES = ("float32", "bfloat16", "float16", "float64")
PRECISIONS = ("default", "high", "highest")

# The peer's precision per row precision: 3xTF32 offers HIGHEST's accuracy, so it is
# compared with HIGHEST (docs/performance.md).
PEER_PRECISION = {"default": "default", "high": "highest", "highest": "highest"}


def matmul_fn(precision: str, kernel: str):
    """mm(a, b): jnp.matmul for PEER, else jax_tiled.matmul forcing the kernel `kernel`."""
    prec = lax.Precision(precision)
    if kernel == PEER:
        def mm(a, b):
            return jnp.matmul(a, b, precision=prec)
    else:
        import jax_tiled

        def mm(a, b):
            return jax_tiled.matmul(a, b, precision=prec, kernel=kernel)
    return mm


class VersusPeer:
    """A row timed against the peer: it has a kernel, and the peer's rows are PEER."""
    kernel: str

    @property
    def is_peer(self) -> bool:
        return self.kernel == PEER


def measure_into(row, fn, sets, flops: int, args, budget: Budget, *,
                 keep_first: bool) -> Timing | None:
    """Times fn over the sets into row (ms, TFLOP/s for `flops` per set, samples);
    returns the timing, or None with row.error set when fn fails."""
    try:
        timing = time_products(fn, sets, repeats=args.repeats, warmup=args.warmup,
                               budget=budget, keep_first=keep_first)
    except Exception as exc:  # noqa: BLE001 - an unsupported kernel is a row, not a crash
        row.error = f"{type(exc).__name__}: {exc}"
        return None
    row.ms = timing.seconds * 1e3
    row.samples_ms = [s * 1e3 for s in timing.samples]
    row.calls = timing.calls
    row.tflops = flops / timing.seconds / 1e12
    return timing


def attach_ratio(row, peer) -> None:
    if peer is None:
        return
    row.peer_precision = peer.precision
    row.peer_ms = peer.ms
    if row.ms and peer.ms and row.error is None:  # a wrong result's speed is no ratio
        row.ratio = peer.ms / row.ms


def precisions_for(dtype: str, requested: list[str] | None) -> list[str]:
    if requested:
        return requested
    return list(PRECISIONS) if dtype == "float32" else ["default"]


def count_rows(kernels: dict[str, list[str]]) -> int:
    """Rows that measure_against_peers(kernels, ...) makes."""
    return len({PEER_PRECISION[p] for p in kernels}) + sum(map(len, kernels.values()))


def measure_against_peers(kernels: dict[str, list[str]], measure) -> list:
    """Rows of measure(precision, kernel) for each precision's kernels: the peer
    once per peer precision, before the kernels it is compared with, and each
    kernel row with its ratio to it."""
    rows, peers = [], {}
    for precision, precision_kernels in kernels.items():
        peer_prec = PEER_PRECISION[precision]
        if peer_prec not in peers:
            peers[peer_prec] = measure(peer_prec, PEER)
            rows.append(peers[peer_prec])
        for kernel in precision_kernels:
            row = measure(precision, kernel)
            attach_ratio(row, peers[peer_prec])
            rows.append(row)
    return rows


def measure_agreeing_with_peers(precisions: list[str], kernels: list[str], measure, check,
                                progress, label: str) -> list:
    """measure_against_peers for rows whose result must agree with the peer's:
    measure(precision, kernel) returns (row, result or None), and check(row,
    result, peer's result) records how far apart they are, failing the row
    past its tolerance."""
    peer_results = {}

    def one(precision, kernel):
        progress.describe(f"{label} {precision} {kernel}")
        row, result = measure(precision, kernel)
        peer = peer_results.get(PEER_PRECISION[precision])
        if row.is_peer:
            peer_results[precision] = result
        elif result is not None and peer is not None:
            check(row, result, peer)
        progress.step()
        return row

    return measure_against_peers({p: kernels for p in precisions}, one)


def kernels_for(dtype: str, precision: str, kernels: list[str], requested: bool) -> list[str]:
    """The kernels to time on `dtype` at `precision`: without --kernels, only the
    kernels that compute it (the others would be error rows: the tensor-core kernels
    take float32 at default and high, not highest); named ones are timed as asked."""
    if requested:
        return kernels
    import jax_tiled

    takes = set(jax_tiled.kernels(None, jnp.dtype(dtype), precision=precision))
    return [k for k in kernels if k == "auto" or k in takes]
