"""A model of the CUDA kernels' sums: a summation structure's error and bias
against float64, predicted on the CPU before it is built.

    python3 tools/tensor_core_sums.py                # calibration, then the designs
    python3 tools/tensor_core_sums.py --samples 16   # a quicker, noisier look

The tensor cores are modelled as a block fused multiply-add, the model of
Fasi, Higham, Mikaitis and Pranesh ("Numerical behavior of NVIDIA tensor
cores", 2021): the products of `block` operand pairs are exact; they and the
accumulator are aligned to the largest of them and cut toward zero to
`24 + extra_bits` bits below its leading bit; the cut terms are summed
exactly and the sum is truncated to float32. One instruction of depth k (k8
for TF32, k16 for 16-bit operands) is k / block such steps in a row. `block`
and `extra_bits` per operand type are not read from a datasheet: they are
the values whose predictions come closest to rows the benchmark measured on
an H100 (CALIBRATION below; `--accuracy`, docs/perf/*accuracy*.json).

A design is a `Schedule`: how each float32 operand becomes the parts the
tensor cores read, which products of parts go into each fresh partial sum in
which order, and how many of K one partial sum holds before it is added to
the running total with a float32 round-to-nearest add. Outputs are a square
sample of the product's, K in full, inputs as the benchmark draws them.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import numpy as np

from jax_tiled.bench.accuracy import accuracy

F32 = np.float32


# ---- operands as the kernels round or split them (cpp/cuda/blocks/tf32.cuh) ----


def tf32_round(x: np.ndarray) -> np.ndarray:
    """RoundToTf32: to nearest, ties away (finite inputs)."""
    return ((x.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(F32)


def tf32_truncate(x: np.ndarray) -> np.ndarray:
    return (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(F32)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """To nearest bfloat16, ties to even (finite inputs), kept as float32."""
    bits = x.view(np.uint32)
    even = (bits >> np.uint32(16)) & np.uint32(1)
    return ((bits + np.uint32(0x7FFF) + even) & np.uint32(0xFFFF0000)).view(F32)


def split(x: np.ndarray, parts: int, first: Callable, rest: Callable) -> list[np.ndarray]:
    """x = hi + ... in `parts` parts: hi = first(x), each next part rest() of
    what is left (float32 arithmetic, exact for these splits)."""
    out = [first(x)]
    for _ in range(parts - 1):
        out.append(rest((x - sum(out[1:], out[0])).astype(F32)))
    return out


# ---- the arithmetic ----


def to_float32_toward_zero(s: np.ndarray) -> np.ndarray:
    f = s.astype(F32)
    over = np.abs(f.astype(np.float64)) > np.abs(s)
    return np.where(over, np.nextafter(f, F32(0)), f)


@dataclasses.dataclass(frozen=True)
class TensorCore:
    """One operand type's instruction: its depth and the block FMA's shape."""

    depth: int  # k per instruction: 8 for TF32, 16 for 16-bit operands
    block: int  # products per block fused multiply-add
    extra_bits: int  # kept past float32's 24 when the terms are aligned

    def mma(self, c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """c + a @ b for a (..., depth) and b (depth, ...) slices, c (rows, cols)."""
        # Exact in float64: the parts have at most 11 significant bits.
        products = a.astype(np.float64)[:, None, :] * b.T.astype(np.float64)[None, :, :]
        keep = 24 + self.extra_bits
        for j in range(0, self.depth, self.block):
            terms = np.concatenate(
                [c[..., None].astype(np.float64), products[..., j : j + self.block]], axis=-1
            )
            _, exponent = np.frexp(np.max(np.abs(terms), axis=-1, keepdims=True))
            quantum = np.ldexp(1.0, exponent - keep)
            c = to_float32_toward_zero((np.trunc(terms / quantum) * quantum).sum(-1))
        return c


def fma_float32(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The SIMT kernels' sums: one fused multiply-add per k, rounded to nearest."""
    for j in range(a.shape[1]):
        c = (c.astype(np.float64) + a[:, j, None] * b[None, j, :].astype(np.float64)).astype(F32)
    return c


# ---- designs ----


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How a kernel sums: `parts` makes an operand's parts; `order` lists, for
    one partial sum, the (part of a, part of b) products in the order they are
    accumulated, each over the partial's whole depth before the next
    (pair-major), or, with `step_major`, all pairs of one instruction step
    before the next step; `depth` is K per fresh partial sum (0: the whole of
    K in one running sum). `core` None: SIMT fused multiply-adds."""

    name: str
    parts: Callable[[np.ndarray], list[np.ndarray]]
    order: tuple[tuple[int, int], ...]
    depth: int
    core: TensorCore | None
    step_major: tuple[tuple[int, int], ...] = ()  # pairs run step-major, before `order`
    # The inputs' own dtype, as a rounding of float32 (bfloat16 inputs): the
    # reference is the float64 product of the rounded inputs, as --accuracy's.
    input_dtype: Callable[[np.ndarray], np.ndarray] | None = None
    # K split into this many equal parts, each summed on its own and the
    # parts' sums added in order (split-K: LaunchPlan::split_k).
    k_parts: int = 1
    # Partial sums added this many at a time into a group's sum, each group
    # then into the running total (blocked_sum.cuh, kPartialsPerGroup); 1:
    # each partial straight into the total.
    group: int = 1
    # b's parts (made from b.T), where they are not made as a's.
    parts_b: Callable[[np.ndarray], list[np.ndarray]] | None = None

    def run(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a_parts = self.parts(a)
        b_parts = [p.T for p in (self.parts_b or self.parts)(b.T)]
        k = a_parts[0].shape[1]  # the K the kernel sums: longer for parts laid along it
        if k % self.k_parts:
            raise ValueError(f"K = {k} does not split into {self.k_parts} equal parts")
        part = k // self.k_parts
        sums = [self._sum(a_parts, b_parts, k0, k0 + part) for k0 in range(0, k, part)]
        total = sums[0]
        for s in sums[1:]:
            total = (total + s).astype(F32)
        return total

    def _sum(self, a_parts, b_parts, begin: int, end: int) -> np.ndarray:
        """The running total over K in [begin, end), a fresh partial sum every
        `depth`, added into it `group` at a time."""
        rows, cols = a_parts[0].shape[0], b_parts[0].shape[1]
        depth = self.depth or end - begin
        total = group = None
        in_group = 0
        for k0 in range(begin, end, depth):
            partial = np.zeros((rows, cols), F32)
            step = self.core.depth if self.core else depth
            stop = min(k0 + depth, end)  # a partial never reaches past its part of K
            steps = [(s0, min(s0 + step, stop)) for s0 in range(k0, stop, step)]
            for s0, s1 in steps:
                for i, j in self.step_major:
                    partial = self._accumulate(partial, a_parts[i], b_parts[j], s0, s1)
            for i, j in self.order:
                for s0, s1 in steps:
                    partial = self._accumulate(partial, a_parts[i], b_parts[j], s0, s1)
            group = partial if group is None else (group + partial).astype(F32)
            in_group += 1
            if in_group == self.group or k0 + depth >= end:
                total = group if total is None else (total + group).astype(F32)
                group, in_group = None, 0
        return total

    def _accumulate(self, c, a, b, k0, k1):
        if self.core is None:
            return fma_float32(c, a[:, k0:k1], b[k0:k1, :])
        return self.core.mma(c, a[:, k0:k1], b[k0:k1, :])


def one_part(rounding: Callable) -> Callable:
    return lambda x: [rounding(x)]


def laid_along_k(parts: Callable, terms: tuple, side: int) -> Callable:
    """One operand (rows, K) as the parts its `terms` take (side 0: a's part
    i of each (i, j); 1: b's part j) side by side along K, (rows, K x terms):
    the layout of `jax_tiled._presets.split_operand`, read by one product on
    the DEFAULT kernels."""

    def laid(x: np.ndarray) -> list[np.ndarray]:
        split_x = parts(x)
        stacked = np.stack([split_x[term[side]] for term in terms], axis=-1)
        return [stacked.reshape(x.shape[0], -1)]

    return laid


def bf16_truncate(x: np.ndarray) -> np.ndarray:
    return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(F32)


def operands(inputs: str, rows: int, k: int, cols: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    if inputs == "positive":
        return (rng.uniform(0.5, 1.5, (rows, k)).astype(F32),
                rng.uniform(0.5, 1.5, (k, cols)).astype(F32))  # fmt: skip
    return rng.standard_normal((rows, k)).astype(F32), rng.standard_normal((k, cols)).astype(F32)


def predict(schedule: Schedule, k: int, inputs: str, samples: int, seed: int = 0):
    a, b = operands(inputs, samples, k, samples, seed)
    if schedule.input_dtype is not None:
        a, b = schedule.input_dtype(a), schedule.input_dtype(b)
    # The benchmark's measure (--accuracy), so that predictions and rows compare.
    measured = accuracy(schedule.run(a, b), a.astype(np.float64) @ b.astype(np.float64))
    return measured.err, measured.bias


# ---- what was measured, and what is asked ----

TF32_SPLIT_TRUNCATED = lambda x: split(x, 2, tf32_truncate, tf32_round)  # noqa: E731  (ours)
TF32_SPLIT_ROUNDED = lambda x: split(x, 2, tf32_round, tf32_round)  # noqa: E731
BF16_SPLIT = lambda x: split(x, 3, bf16_round, bf16_round)  # noqa: E731  (Triton's)
# jax_tiled._presets' splits (parts laid along K): hi to nearest, the rest
# truncated toward zero.
TF32_SPLIT_NEAREST_THEN_TRUNCATED = lambda x: split(x, 2, tf32_round, tf32_truncate)  # noqa: E731
BF16_SPLIT_NEAREST_THEN_TRUNCATED = lambda x: split(x, 2, bf16_round, bf16_truncate)  # noqa: E731
TERMS_X3 = ((0, 0), (0, 1), (1, 0))
HI, MID, LO = 0, 1, 2
TF32_LO = 1  # a TF32 split has two parts
# Small products first, hi x hi last (tf32.cuh; Triton's BF16DotTC).
PAIRS_3XTF32 = ((TF32_LO, HI), (HI, TF32_LO))
PAIRS_BF16 = {
    3: ((MID, HI), (HI, MID)),
    6: ((MID, MID), (LO, HI), (HI, LO), (MID, HI), (HI, MID)),
    9: ((LO, LO), (MID, LO), (LO, MID), (MID, MID), (LO, HI), (HI, LO), (MID, HI), (HI, MID)),
}


def schedules(tf32: TensorCore, bf16: TensorCore) -> dict[str, Schedule]:
    """The kernels as built (the calibration's rows) and the designs asked about."""
    one_tf32 = one_part(tf32_round)
    designs = [
        # As built: wgmma's 128 x 256 tiles (one TF32 pass and 16-bit inputs
        # at 4096^3) keep one running sum: no room for a second set.
        Schedule("TF32, one running sum (as built)", one_tf32,
                 ((0, 0),), 0, tf32),
        Schedule("bf16 inputs, one running sum (as built)", one_part(bf16_round),
                 ((0, 0),), 0, bf16, input_dtype=bf16_round),
        # As built: 3xTF32, hi truncated, each 32-k slab summed afresh, its
        # small products step by step first, then the four hi x hi steps.
        Schedule("3xTF32, 32-k slabs (as built)", TF32_SPLIT_TRUNCATED,
                 ((HI, HI),), 32, tf32, step_major=PAIRS_3XTF32),
        Schedule("SIMT fp32, 128-k partials (as built)", one_part(lambda x: x),
                 ((0, 0),), 128, None),
        # Designs: K split in 8 parts as wgmma's split-K plans do (LaunchPlan::split_k),
        # with the split as built, with lo x lo as a fourth pass, with hi rounded.
        Schedule("3xTF32, K split in 8", TF32_SPLIT_TRUNCATED,
                 ((HI, HI),), 32, tf32, step_major=PAIRS_3XTF32, k_parts=8),
        Schedule("3xTF32 + lo x lo (4 passes), K split in 8", TF32_SPLIT_TRUNCATED,
                 ((HI, HI),), 32, tf32, step_major=((TF32_LO, TF32_LO), *PAIRS_3XTF32), k_parts=8),
        Schedule("3xTF32, hi rounded, K split in 8", TF32_SPLIT_ROUNDED,
                 ((HI, HI),), 32, tf32, step_major=PAIRS_3XTF32, k_parts=8),
        # Few rows (16-bit, m <= 64) on wgmma's 128 x 64 tiles: 16x8192x8192
        # splits K in two, 64-k partials; into the total one by one (before
        # 9a244a6), or in groups of eight (as built).
        Schedule("bf16 inputs, few rows, K split in 2, 64-k partials", one_part(bf16_round),
                 ((0, 0),), 64, bf16, input_dtype=bf16_round, k_parts=2),
        Schedule("bf16 inputs, few rows, K split in 2, 64-k partials in groups of 8 (as built)",
                 one_part(bf16_round), ((0, 0),), 64, bf16, input_dtype=bf16_round, k_parts=2,
                 group=8),
        # 16-bit products split on 128 x 256 tiles (WgmmaSplitKWide): no
        # room for blocked sums, each of 4 parts one running sum (1024 x 32768
        # x 1024); the 128 x 128 split's is the few rows' design above.
        Schedule("bf16 inputs, 128 x 256 tiles, K split in 4, one running sum a part",
                 one_part(bf16_round), ((0, 0),), 0, bf16, input_dtype=bf16_round, k_parts=4),
        # mma's slabs are 16 of K, and it does not split K.
        Schedule("3xTF32 + lo x lo (4 passes), 16-k slabs (mma)", TF32_SPLIT_TRUNCATED,
                 ((HI, HI),), 16, tf32, step_major=((TF32_LO, TF32_LO), *PAIRS_3XTF32)),
    ]  # fmt: skip
    # The parts laid along K (branch emulation-parts): hi to nearest, the
    # rest truncated, one product over K x terms on the DEFAULT kernel, whose
    # tiles keep one running sum at the squares.
    for name, parts, core, terms in (
        ("TF32 x3", TF32_SPLIT_NEAREST_THEN_TRUNCATED, tf32, TERMS_X3),
        ("TF32 x4", TF32_SPLIT_NEAREST_THEN_TRUNCATED, tf32, (*TERMS_X3, (1, 1))),
        ("bf16 x3", BF16_SPLIT_NEAREST_THEN_TRUNCATED, bf16, TERMS_X3),
    ):
        designs.append(
            Schedule(
                f"{name} laid along K, one running sum",
                laid_along_k(parts, terms, 0),
                ((0, 0),),
                0,
                core,
                parts_b=laid_along_k(parts, terms, 1),
            )
        )
    for passes, pairs in PAIRS_BF16.items():
        designs.append(
            Schedule(
                f"bf16 x{passes}, Triton's order, 64-k slabs, K split in 8",
                BF16_SPLIT,
                (*pairs, (HI, HI)),
                64,
                bf16,
                k_parts=8,
            )  # fmt: skip
        )
    return {s.name: s for s in designs}


# The calibration: TF32 block 8 with 2 extra bits puts the model within 5% of
# every TF32 and SIMT row below; 16-bit operands' block 16 with 2 extra bits
# (float16's row, -2.3e-5, is matched too) overstates bfloat16's bias 2.3x.
BLOCK, EXTRA_BITS = (8, 16), (2, 2)

# Rows measured on an H100 (jax 0.11.2, 2026-11-23/25; docs/perf/
# h100-2026-11-23-accuracy.json, h100-2026-11-25-presets-accuracy.json),
# `auto`: (schedule, shape m x k x n, inputs) -> (error, bias).
CALIBRATION = {
    ("TF32, one running sum (as built)", 4096, "positive"): (2.75e-5, -2.7e-5),
    ("bf16 inputs, one running sum (as built)", 4096, "positive"): (3.37e-6, -3.4e-6),
    ("3xTF32, 32-k slabs (as built)", 4096, "positive"): (2.15e-7, -1.5e-7),
    ("3xTF32, 32-k slabs (as built)", 8192, "positive"): (2.61e-7, -1.5e-7),
    ("3xTF32, 32-k slabs (as built)", 8192, "normal"): (3.61e-7, -9.1e-10),
    ("SIMT fp32, 128-k partials (as built)", 8192, "positive"): (1.09e-7, 9.6e-11),
}  # fmt: skip
# Designs built and measured, not (yet) what main runs, on an H100, jax
# 0.11.2, 2026-11-25: the branch high-four-products (commit c1cb3f0), 512 x
# 8192 x 512, `--accuracy` (auto: wgmma, K split in 8; and mma); the branch
# emulation-parts below.
MEASURED_DESIGNS = {
    ("3xTF32 + lo x lo (4 passes), K split in 8", 8192, "positive"): (5.38e-8, -2.0e-8),
    ("3xTF32 + lo x lo (4 passes), K split in 8", 8192, "normal"): (1.70e-7, -1.2e-10),
    ("3xTF32 + lo x lo (4 passes), 16-k slabs (mma)", 8192, "positive"): (2.97e-7, 1.8e-8),
    ("3xTF32 + lo x lo (4 passes), 16-k slabs (mma)", 8192, "normal"): (4.21e-7, -9.8e-10),
    # The branch emulation-parts (ca438b8, measured as 0a94e6e before a
    # rebase that changed no library code), 2026-11-25, 4096^3 and
    # 8192^3 (tools/split_high.py, docs/perf/h100-2026-11-25-emulation-parts-split-high.json).
    ("TF32 x3 laid along K, one running sum", 4096, "positive"): (4.24e-5, -4.24e-5),
    ("TF32 x3 laid along K, one running sum", 8192, "positive"): (8.56e-5, -8.55e-5),
    ("TF32 x4 laid along K, one running sum", 4096, "positive"): (5.01e-5, -5.01e-5),
    ("TF32 x4 laid along K, one running sum", 8192, "positive"): (1.01e-4, -1.01e-4),
    # bf16 -> float32 16x8192x8192, main before and at 9a244a6, 2026-11-26
    # (docs/perf/h100-2026-11-26-accuracy-few-rows-{swap,grouped-sums}.json).
    ("bf16 inputs, few rows, K split in 2, 64-k partials", 8192, "positive"): (8.31e-8, -9.2e-11),
    ("bf16 inputs, few rows, K split in 2, 64-k partials", 8192, "normal"): (1.59e-7, 2.3e-9),
    ("bf16 inputs, few rows, K split in 2, 64-k partials in groups of 8 (as built)", 8192,
     "positive"): (3.67e-8, -6.4e-11),
    ("bf16 inputs, few rows, K split in 2, 64-k partials in groups of 8 (as built)", 8192,
     "normal"): (9.88e-8, 2.0e-9),
}  # fmt: skip
# jnp.matmul's rows at the presets, 512 x 8192 x 512, same run (the targets).
JNP_8192 = {
    "BF16_BF16_F32_X3": {"positive": (8.90e-8, -4.5e-8), "normal": (4.43e-6, -2.5e-8)},
    "BF16_BF16_F32_X6": {"positive": (6.93e-8, -4.4e-8), "normal": (1.33e-7, 3.7e-10)},
    "TF32_TF32_F32_X3": {"positive": (1.08e-7, -9.4e-8), "normal": (1.77e-7, -9.1e-10)},
    "HIGHEST": {"positive": (1.56e-7, -5.4e-10), "normal": (5.75e-7, -2.1e-10)},
}


def calibrated_schedules(block=BLOCK, extra_bits=EXTRA_BITS) -> dict[str, Schedule]:
    """The schedules on tensor cores of the given (TF32, bf16) block sizes and
    extra bits (default: the calibration's)."""
    return schedules(
        TensorCore(8, block[0], extra_bits[0]), TensorCore(16, block[1], extra_bits[1])
    )


def print_against_measured(title: str, measured: dict, by_name: dict, samples: int) -> None:
    """Each measured row beside the model's prediction for it."""
    print(f"\n{title}: model against measured (error, bias)")
    for (name, k, inputs), (error, bias) in measured.items():
        e, b = predict(by_name[name], k, inputs, samples)
        print(
            f"  K={k:<5} {inputs:<8} {name:<58} {e:.2e} {b:+.1e}   measured {error:.2e} {bias:+.1e}"
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=32, help="rows and columns of the sample")
    p.add_argument("--block", type=int, nargs=2, default=BLOCK, metavar=("TF32", "BF16"))
    p.add_argument("--extra-bits", type=int, nargs=2, default=EXTRA_BITS, metavar=("TF32", "BF16"))
    args = p.parse_args(argv)
    by_name = calibrated_schedules(args.block, args.extra_bits)
    (tf32_block, bf16_block), (tf32_bits, bf16_bits) = args.block, args.extra_bits
    print(f"TF32: block {tf32_block}, {tf32_bits} extra bits; bf16: block {bf16_block}, "
          f"{bf16_bits} extra bits; {args.samples}^2 outputs")  # fmt: skip
    print_against_measured("calibration", CALIBRATION, by_name, args.samples)
    print("\ndesigns at K = 8192 (error, bias)")
    for name, schedule in by_name.items():
        if "as built" in name:
            continue
        cells = [f"{i} {e:.2e} {b:+.1e}" for i in ("positive", "normal")
                 for e, b in [predict(schedule, 8192, i, args.samples)]]  # fmt: skip
        print(f"  {name:<50} " + "   ".join(cells))
    print_against_measured("designs built since", MEASURED_DESIGNS, by_name, args.samples)
    print("\njnp.matmul measured at 512 x 8192 x 512 (the targets)")
    for preset, rows in JNP_8192.items():
        print(
            f"  {preset:<50} " + "   ".join(f"{i} {e:.2e} {b:+.1e}" for i, (e, b) in rows.items())
        )


if __name__ == "__main__":
    main()
