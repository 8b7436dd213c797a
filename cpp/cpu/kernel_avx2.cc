// The kernel for AVX2 with FMA (built with -mavx2 -mfma; see kernel_impl.h).
#define JAX_TILED_ISA avx2
#include "cpu/kernel_impl.h"

namespace jax_tiled::cpu {
namespace avx2 {
// 6 x 2 ymm accumulators: 12 of the 16 registers (two FMA ports x 5-cycle
// latency wants at least 10 chains), the other 4 for B and broadcasts.
using F32 = Config<float, 32, 6, 2, 2, 256, 512 << 10>;
using F64 = Config<double, 32, 6, 2, 2, 256, 512 << 10>;
}  // namespace avx2

const IsaKernels& Avx2Kernels() {
  static const IsaKernels kernels = avx2::Kernels<avx2::F32, avx2::F64>::Make("avx2");
  return kernels;
}
}  // namespace jax_tiled::cpu
