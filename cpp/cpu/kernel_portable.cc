// The portable kernel: 16-byte vectors through the compiler's generic vector
// extension, which become SSE2 on x86-64 and NEON on AArch64 without any
// target flag (see kernel_impl.h).
#define JAX_TILED_ISA portable
#include "cpu/kernel_impl.h"

namespace jax_tiled::cpu {
namespace portable {
// 6 x 2 accumulators: 12 registers, leaving 4 of x86-64's 16 for operands.
using F32 = Config<float, 16, 6, 2, 2, 256, 256 << 10>;
using F64 = Config<double, 16, 6, 2, 2, 256, 256 << 10>;
}  // namespace portable

const IsaKernels& PortableKernels() {
  static const IsaKernels kernels =
      portable::Kernels<portable::F32, portable::F64>::Make("portable");
  return kernels;
}
}  // namespace jax_tiled::cpu
