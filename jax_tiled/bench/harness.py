"""Ours against the peers in one harness: the matmuls, the rows per precision, the ratios.

Every kernel usable on the default backend (each forced by name, plus
"auto") and the peer `jnp.matmul` run on the same inputs through the same
timing. The peer of a float32 row is `jnp.matmul` at the same precision,
except that `high` (3xTF32) is compared with `highest` (PEER_PRECISION); a
row at a `lax.DotAlgorithmPreset` (named in lower case, `bf16_bf16_f32_x3`)
is compared with `jnp.matmul` at the same preset (peer_precision).
The product suite adds a second peer, PALLAS (bench/pallas.py: jax's Pallas
Mosaic-GPU Hopper kernel at its best config), timed beside `jnp.matmul`.

Rows whose result is checked (the training step, the chains) are checked
against a truth, not against the peer: on a GPU the peer's TF32 result is
itself off, and a kernel more accurate than the peer must not fail for
disagreeing with it. `judge_against_truth` is the one rule.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_tiled.bench.progress import Progress
from jax_tiled.bench.timing import Budget, Timing, time_products

PEER = "jnp.matmul"
# The product suite's second peer (bench/pallas.py); a kernel row's ratio to it is
# pallas_ratio, beside ratio (to PEER).
PALLAS = "pallas"
PEERS = (PEER, PALLAS)
DTYPES = ("float32", "bfloat16", "float16", "float64")
# The product suite's output dtypes (--out-dtype): the operands', or float32.
OUT_DTYPES = ("same", "float32")
PRECISIONS = ("default", "high", "highest")

# The peer's precision per row precision: 3xTF32 offers HIGHEST's accuracy, so it is
# compared with HIGHEST (docs/performance.md).
PEER_PRECISION = {"default": "default", "high": "highest", "highest": "highest"}
# The lax.DotAlgorithmPresets by the names rows give them (lower case); DEFAULT is
# the precision "default".
PRESETS = tuple(p.name.lower() for p in lax.DotAlgorithmPreset if p.name != "DEFAULT")


def peer_precision(precision: str) -> str:
    """The precision of a row's peer: PEER_PRECISION's, or for a preset the same
    preset, whose arithmetic each side is asked for (docs/performance.md's
    preset targets are against jnp.matmul at the same preset)."""
    return PEER_PRECISION.get(precision, precision)


def lax_precision(precision: str) -> lax.Precision | lax.DotAlgorithmPreset:
    """A row's precision name as jnp.matmul and jax_tiled.matmul take it."""
    if precision in PRESETS:
        return lax.DotAlgorithmPreset[precision.upper()]
    return lax.Precision(precision)


def matmul_fn(precision: str, kernel: str, out_dtype: str | None = None):
    """mm(a, b): jnp.matmul for PEER, else jax_tiled.matmul forcing the kernel `kernel`;
    the result in out_dtype (preferred_element_type; None: the operands' dtype)."""
    prec = lax_precision(precision)
    if kernel == PEER:

        def mm(a, b):
            return jnp.matmul(a, b, precision=prec, preferred_element_type=out_dtype)
    else:
        import jax_tiled

        def mm(a, b):
            return jax_tiled.matmul(
                a, b, precision=prec, preferred_element_type=out_dtype, kernel=kernel
            )

    return mm


def relative_distance(x, truth) -> float:
    """||x - truth|| / ||truth|| (Frobenius) in float64; inf or nan when either is not finite."""
    x, truth = np.asarray(x, np.float64), np.asarray(truth, np.float64)
    return float(np.linalg.norm(x - truth) / max(np.linalg.norm(truth), np.finfo(float).tiny))


class VersusPeer:
    """A row timed against the peers: it has a kernel, and the peers' rows are PEERS."""

    kernel: str

    @property
    def is_peer(self) -> bool:
        return self.kernel in PEERS


def measure_into(
    row, fn, sets, flops: int, args, budget: Budget, *, keep_first: bool
) -> Timing | None:
    """Times fn over the sets into row (ms, TFLOP/s for `flops` per set, samples);
    returns the timing, or None with row.error set when fn fails."""
    try:
        timing = time_products(
            fn, sets, repeats=args.repeats, warmup=args.warmup, budget=budget, keep_first=keep_first
        )
    except Exception as exc:  # noqa: BLE001 - an unsupported kernel is a row, not a crash
        row.error = f"{type(exc).__name__}: {exc}"
        return None
    row.ms = timing.seconds * 1e3
    row.samples_ms = [s * 1e3 for s in timing.samples]
    row.calls = timing.calls
    row.tflops = flops / timing.seconds / 1e12
    return timing


def rows_for_each(work: list, total_rows: int, args, rows_of) -> list:
    """The rows of rows_of(item, progress) for each item of `work` in turn, under
    one progress bar of `total_rows` (none with --no-progress). jax's caches are
    cleared after each item: its compiled functions do not run again, and a
    suite's worth of them would otherwise be held to the end."""
    rows = []
    with Progress(total_rows, enabled=not args.no_progress) as progress:
        for item in work:
            rows += rows_of(item, progress)
            jax.clear_caches()
    return rows


def attach_ratio(row, peer) -> None:
    """row's time against a peer row's: ratio (peer_ms, peer_precision) for PEER,
    pallas_ratio (pallas_ms) for PALLAS."""
    if peer is None:
        return
    # a wrong result's speed is no ratio
    ratio = peer.ms / row.ms if row.ms and peer.ms and row.error is None else None
    if peer.kernel == PALLAS:
        row.pallas_ms, row.pallas_ratio = peer.ms, ratio
        return
    row.peer_precision = peer.precision
    row.peer_ms = peer.ms
    if ratio is not None:
        row.ratio = ratio


def precisions_for(dtype: str, requested: list[str] | None) -> list[str]:
    if requested:
        return requested
    return list(PRECISIONS) if dtype == "float32" else ["default"]


def count_rows(kernels: dict[str, list[str]], peers: tuple[str, ...] = (PEER,)) -> int:
    """Rows that measure_against_peers(kernels, ..., peers) makes."""
    peer_rows = len(peers) * len({peer_precision(p) for p in kernels})
    return peer_rows + sum(map(len, kernels.values()))


def measure_against_peers(
    kernels: dict[str, list[str]], measure, peers: tuple[str, ...] = (PEER,)
) -> list:
    """Rows of measure(precision, kernel) for each precision's kernels: each peer
    (PEER first, then PALLAS where asked) once per peer precision, before the
    kernels compared with them, and each kernel row with its ratios to them."""
    rows, peer_rows = [], {}
    for precision, precision_kernels in kernels.items():
        peer_prec = peer_precision(precision)
        if peer_prec not in peer_rows:
            peer_rows[peer_prec] = [measure(peer_prec, peer) for peer in peers]
            rows += peer_rows[peer_prec]
        for kernel in precision_kernels:
            row = measure(precision, kernel)
            for peer in peer_rows[peer_prec]:
                attach_ratio(row, peer)
            rows.append(row)
    return rows


# The truth a checked row is measured against: the same computation by the peer at
# HIGHEST, on the operands widened to float32 (float64 stays float64): true fp32
# on a GPU too, where the peer at DEFAULT runs TF32.
TRUTH_PRECISION = "highest"
TRUTH_TEXT = (
    f"err: relative distance to the truth, the same computation by {PEER} at "
    f"precision {TRUTH_PRECISION} in float32 (float64 for float64)"
)

# The tolerance: how far from the truth a result may be whatever the peer's distance.
# A 16-bit step rounds its intermediates (h, y, the cotangents) to the dtype, where
# the truth keeps them in float32, and that propagates through the later products: a
# few units of the dtype's rounding (bfloat16 2^-8, float16 2^-11) with a margin.
# float32 at default precision may run as TF32 (float16's mantissa), so it gets
# float16's tolerance.
AGREEMENT_TOL = {"bfloat16": 3e-2, "float16": 1e-2, "float32": 1e-4, "float64": 1e-9}
# Past the tolerance, a result may still be this many times as far from the truth as
# the peer's: a peer that is itself off (TF32) widens what ours may be off by, and a
# kernel that is closer than the peer always passes.
PEER_ERR_FACTOR = 2.0
AGREEMENT_TEXT = (
    f"a kernel's row fails when an err exceeds max(tol, {PEER_ERR_FACTOR:g}x the "
    f"err of {PEER} at its peer precision)"
)


def agreement_tolerance(dtype: str, precision: str) -> float:
    if dtype == "float32" and precision == "default":
        return AGREEMENT_TOL["float16"]
    return AGREEMENT_TOL[dtype]


def truth_of(fn_of, operands):
    """The truth for a computation fn_of(precision, kernel) -> fn: fn_of(TRUTH_PRECISION,
    PEER) on the operands widened to float32 (float64 stays float64), as NumPy."""
    widened = [x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in operands]
    return jax.tree.map(np.asarray, jax.jit(fn_of(TRUTH_PRECISION, PEER))(*widened))


def judge_against_truth(
    row, errs: dict[str, float], peer_errs: dict[str, float] | None, tolerance: float
) -> None:
    """Records a row's distances to the truth (errs, by quantity), its peer's
    (peer_errs; None for the peer's own row, or when the peer failed) and the
    tolerance; a kernel's row fails, with no ratio and exit status 1, when a
    distance exceeds max(tolerance, PEER_ERR_FACTOR x the peer's), or is not finite."""
    row.err, row.peer_err, row.tolerance = errs, peer_errs, tolerance
    if row.is_peer:
        return
    allowed = {
        name: tolerance
        if peer_errs is None or not math.isfinite(peer_errs[name])
        else max(tolerance, PEER_ERR_FACTOR * peer_errs[name])
        for name in errs
    }
    over = [name for name, err in errs.items() if not err <= allowed[name]]  # nan fails too
    if over:
        row.error = "disagrees with the truth: " + "; ".join(
            f"{name} off by {errs[name]:.1e}"
            + ("" if peer_errs is None else f" ({PEER}: {peer_errs[name]:.1e})")
            + f", allowed {allowed[name]:.1e}"
            for name in over
        )


def measure_agreeing_with_peers(
    precisions: list[str], kernels: list[str], measure, errs_of, truth, progress, label: str
) -> list:
    """measure_against_peers for rows whose result is checked: measure(precision,
    kernel) returns (row, result or None), errs_of(result, truth) the result's
    relative distance to the truth per quantity, and judge_against_truth decides
    each row with its peer's distances."""
    peer_errs = {}

    def one(precision, kernel):
        progress.describe(f"{label} {precision} {kernel}")
        row, result = measure(precision, kernel)
        if result is not None:
            errs = errs_of(result, truth)
            if row.is_peer:
                peer_errs[precision] = errs
            peer = None if row.is_peer else peer_errs.get(peer_precision(precision))
            judge_against_truth(row, errs, peer, agreement_tolerance(row.dtype, row.precision))
        progress.step()
        return row

    return measure_against_peers({p: kernels for p in precisions}, one)


def kernels_for(
    dtype: str, precision: str, kernels: list[str], requested: bool, out_dtype: str | None = None
) -> list[str]:
    """The kernels to time on `dtype` at `precision` (into out_dtype; None: dtype):
    without --kernels, only the kernels that compute it (the others would be error
    rows: the tensor-core kernels take float32 at default and high, not highest);
    named ones are timed as asked."""
    if requested:
        return kernels
    import jax_tiled

    takes = set(
        jax_tiled.kernels(None, jnp.dtype(dtype), out_dtype, precision=lax_precision(precision))
    )
    return [k for k in kernels if k == "auto" or k in takes]
