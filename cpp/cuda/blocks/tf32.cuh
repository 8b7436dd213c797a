// float32 on tensor cores. TF32 is float32's sign and 8-bit exponent with 10
// of its 23 mantissa bits; the tensor cores multiply TF32 operands exactly and
// add into float32. Two ways to use them (docs/precision.md):
//   DEFAULT, one pass:  a * b ~ tf32(a) * tf32(b), relative error ~2^-11 per
//     operand, what XLA's own float32 matmul does on these GPUs;
//   HIGH, "3xTF32" and lo x lo: split x = hi + lo, both TF32, and
//     a * b ~ a_lo * b_lo + a_lo * b_hi + a_hi * b_lo + a_hi * b_hi. What is
//     left out is lo's own rounding, ~2^-22 of |a b|: close to fp32 (2^-24)
//     at four times the tensor-core work, still far below SIMT fp32. The
//     classic 3xTF32 drops a_lo * b_lo (~2^-21 of |a b|), which with hi
//     truncated has the product's sign: over a long K on positive inputs it
//     leaned by -1.5e-7 (NOTES.md, "HIGH as four TF32 products, K split").
//     The tensor cores truncate each addition into their accumulator, and
//     over K / 8 * 4 additions that bias grows linearly in K; so the split
//     kernels sum each slab into a fresh accumulator (small terms first) and
//     add the slabs up with ordinary rounded float adds.
//
// Special values. True arithmetic gives inf * b = +-inf for every finite
// nonzero b. A split operand meets the other's low part in a cross term,
// inf * b_lo, so b_lo must never be zero or of the other sign while b is
// nonzero, or the product becomes inf - inf or inf * 0 = NaN. Hence hi is x
// truncated (rounding to nearest may step past x and flip lo's sign), and a
// lo that would be zero is FLT_MIN with x's sign: far below the rounding of
// any product it joins, but enough to carry an infinity's sign. lo is always
// finite, so lo x lo adds no special value of its own (FLT_MIN x FLT_MIN
// flushes to zero).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_tiled::cuda {

// float32 rounded to nearest TF32 (ties away), as the bit pattern the tensor
// cores read (the low 13 mantissa bits zero), where |x| < limit: half a TF32
// step added to the bits carries into the kept ones exactly where rounding to
// nearest rounds up, then the low 13 bits are dropped. At and above the limit,
// and for NaN (whose comparison fails), the bits are truncated. Three
// instructions (a compare, a predicated add, an and).
__device__ __forceinline__ uint32_t RoundToTf32Below(float x, float limit) {
  const uint32_t bits = __float_as_uint(x);
  return (fabsf(x) < limit ? bits + 0x1000u : bits) & 0xffffe000u;
}

// The bits of `cvt.rna.tf32.f32`, which rounds the finite values within half
// a TF32 step of the float32 limit to inf. The cvt is no single instruction
// on sm_90: ptxas emits the same add and and with a compare of |x| with inf
// and a select, four where this takes three, on every element of every TF32
// register operand (NOTES.md, "TF32 rounding in three instructions").
__device__ __forceinline__ uint32_t CvtRnaTf32(float x) {
  return RoundToTf32Below(x, __int_as_float(0x7f800000));  // inf
}

// CvtRnaTf32, except that finite values within half a TF32 step of the
// float32 limit, which it rounds to inf, are truncated instead: only true
// overflow gives inf. A guard after the cvt took five more instructions:
// with the cvt's four, three fifths of all that mma's TF32 kernel executed
// on a small product (NOTES.md, "TF32 rounding in three instructions").
__device__ __forceinline__ uint32_t RoundToTf32(float x) {
  return RoundToTf32Below(x, 0x1.ffep+127f);  // bits 0x7f7ff000: the first to round past
}

// x = hi + lo, both TF32, lo of x's sign (see the top of this file): hi is x
// truncated, x - hi is exact and below one TF32 step of x, and lo rounds it
// (it cannot overflow). Where that gives lo = 0 (x a TF32 value) or NaN (x
// infinite), lo is FLT_MIN with x's sign instead; 0 splits into 0 + 0 and
// NaN into NaN + FLT_MIN. A NaN's hi is made quiet rather than truncated,
// since a NaN whose payload lies in the low 13 bits alone truncates to inf.
// Integer tests and selects, no branches.
__device__ __forceinline__ void SplitTf32(float x, uint32_t& hi, uint32_t& lo) {
  const uint32_t bits = __float_as_uint(x);
  const bool nan_x = (bits << 1) > (0x7f800000u << 1);
  hi = nan_x ? bits | 0x00400000u : bits & 0xffffe000u;
  const uint32_t rounded = CvtRnaTf32(x - __uint_as_float(hi));
  // rounded << 1 drops the sign: 0 for a zero lo, above inf's for a NaN one;
  // minus one wraps zero to the top, so one unsigned compare catches both.
  const bool zero_or_nan = (rounded << 1) - 1u >= (0x7f800000u << 1);
  const bool nonzero_x = (bits << 1) != 0u;
  lo = zero_or_nan & nonzero_x ? (bits & 0x80000000u) | 0x00800000u : rounded;
}

}  // namespace jax_tiled::cuda
