// float32 on tensor cores. TF32 is float32's sign and 8-bit exponent with 10
// of its 23 mantissa bits; the tensor cores multiply TF32 operands exactly and
// add into float32. Two ways to use them (precision, ../../../README.md):
//   DEFAULT, one pass:  a * b ~ tf32(a) * tf32(b), relative error ~2^-11 per
//     operand, what XLA's own float32 matmul does on these GPUs;
//   HIGH, three passes: split x = hi + lo, both TF32 (lo = tf32(x - hi)),
//     and a * b ~ a_lo * b_hi + a_hi * b_lo + a_hi * b_hi. The dropped
//     a_lo * b_lo and the rounding of lo are ~2^-22 of |a b|: close to fp32
//     (2^-24) at three times the tensor-core work, still far below SIMT fp32.
//     The tensor cores truncate each addition into their accumulator, and
//     over K / 8 * 3 additions that bias grows linearly in K; so the split
//     kernels sum each slab into a fresh accumulator (small terms first) and
//     add the slabs up with ordinary rounded float adds.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_tiled::cuda {

// float32 rounded to nearest TF32 (ties away), as the bit pattern the tensor
// cores read: the low 13 mantissa bits are zero. The instruction exists from
// sm_80; the rungs that call it are built for sm_80 and sm_90a only.
__device__ __forceinline__ uint32_t RoundToTf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// x ~ hi + lo, both TF32; x - hi is exact in float32. An infinite hi (x
// infinite, or within 2^-12 of the float32 limit) gets lo = 0, not the NaN
// of inf - inf, so infinities come out as one TF32 pass gives them.
__device__ __forceinline__ void SplitTf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = RoundToTf32(x);
  const float rest = x - __uint_as_float(hi);
  lo = isinf(__uint_as_float(hi)) ? 0u : RoundToTf32(rest);
}

}  // namespace jax_tiled::cuda
