// The kernel for AVX-512F (built with -mavx512f -mfma; see kernel_impl.h).
#define JAX_TILED_ISA avx512
#include "cpu/kernel_impl.h"

namespace jax_tiled::cpu {
namespace avx512 {
// 12 x 2 zmm accumulators: 24 of the 32 registers, enough independent FMA
// chains to keep both FMA ports busy through the 4-cycle latency, with room
// for the two B vectors and a broadcast of A. float64 slabs are 128 deep, so
// that the A micro-panel (12 KiB) and a B micro-panel (16 KiB) share L1: at
// 256 (24 + 32 KiB) a 128-column product ran 3-13% slower (NOTES.md).
using F32 = Config<float, 64, 12, 2, 4, 256, 512 << 10>;
using F64 = Config<double, 64, 12, 2, 4, 128, 256 << 10>;
// Tiles that read A where it is stored (at most two micro-panels wide): 6 x 4
// zmm, as many chains, each A element broadcast once for 4 vectors of columns
// where 12 x 2 broadcasts it for 2. Six rows of a large A, 16 KiB or more
// apart, share an 8-way L1 set without evicting each other; twelve did. The
// same sums element for element (the chains' depth and the slabs are the
// same), so the same bits. On a 2-core AMD EPYC, float32 16384 x 4096 x 64
// and 4096 x 4096 x 128 ran 10-25% faster, float64 16384 x 4096 x 64 about
// 15% (NOTES.md, "A read in place on a 6-row block").
using F32ReadingA = Config<float, 64, 6, 4, 2, 256, 512 << 10>;
using F64ReadingA = Config<double, 64, 6, 4, 2, 128, 256 << 10>;
}  // namespace avx512

const IsaKernels& Avx512Kernels() {
  static const IsaKernels kernels =
      avx512::Kernels<avx512::F32, avx512::F64, avx512::F32ReadingA, avx512::F64ReadingA>::Make(
          "avx512");
  return kernels;
}
}  // namespace jax_tiled::cpu
