// bfloat16 products on AVX512_BF16's vdpbf16ps (built with -mavx512bf16
// -mavx512bw -mavx512f; picked at run time, see matmul.cc).
//
// vdpbf16ps multiplies a pair of bfloat16 values with another pair in each
// 32-bit lane and adds both products to a float32 accumulator: two products
// per lane per instruction where an FMA on float32 gives one, with no
// conversion of the operands on the way. The Intel SDM defines it as two
// FMAs, the odd element's product first, each rounded to nearest even, with
// denormal inputs read as zero and denormal results flushed to zero whatever
// MXCSR says; this machine's results match that bit for bit (docs/precision.md).
// So the sum is the float32 FMA chain of the other paths, in the order
// p + 1, p for each pair.
#define JAX_TILED_ISA avx512_bf16
#include <immintrin.h>

#include "cpu/kernel_impl.h"
// Keep after kernel_impl.h, which opens the namespace it extends.
#include "cpu/bf16_pack.h"

namespace jax_tiled::cpu {
namespace avx512_bf16 {

// MR rows x NV zmm of 16 float32 columns; the packed depth is in pairs.
// KC: slab depth; L2BlockBytes: the packed B block (kc x nc bfloat16) that
// stays in L2.
template <int MR, int NV, int RowStep, int64_t KC, int64_t L2BlockBytes>
struct DotBf16Path {
  using acc_type = float;
  using packed_type = uint16_t;
  static constexpr int kMr = MR, kNr = NV * 16, kDepthUnit = 2;
  // One micro-kernel call per packed slab, all of a tile's rows per B block,
  // as the float32 kernel.
  static constexpr int64_t kKs = KC, kKc = KC, kMc = int64_t{1} << 40;
  static constexpr int64_t kNc = L2BlockBytes / (KC * 2) / kNr * kNr;
  static constexpr bool kEqualSlabs = true;  // as the float32 kernel (SlabDepth)
  static constexpr bool kReadsInPlace = false;
  static_assert(kNc >= kNr, "the B block must hold at least one micro-panel");
  struct Scope {};

  // Both operands as pairs, depth-pair-major: a step reads kNr B lanes and
  // broadcasts one A lane per row.
  template <class In>
  static void PackA(const In* x, int64_t row_stride, int64_t depth_stride, int64_t rows,
                    int64_t depth, uint16_t* dst) {
    PackAsPairs<kMr, kDepthUnit>(x, row_stride, depth_stride, rows, depth, dst);
  }
  template <class In>
  static void PackB(const In* x, int64_t col_stride, int64_t depth_stride, int64_t cols,
                    int64_t depth, uint16_t* dst) {
    PackAsPairs<kNr, kDepthUnit>(x, col_stride, depth_stride, cols, depth, dst);
  }

  // c[Rows x kNr] = (accumulate ? c : 0) + A B over kcp (even) depth steps.
  // Each call sums its slab from zero and adds the sum to c, as the float32
  // kernel does: a chain of kc products then one addition per slab, not one
  // chain over the whole depth (4-6x the error of jnp.matmul at K = 8192;
  // NOTES.md, "bfloat16").
  template <int Rows>
  __attribute__((always_inline)) static void Micro(int64_t kcp, const uint16_t* __restrict a,
                                                   const uint16_t* __restrict b,
                                                   float* __restrict c, int64_t ldc,
                                                   bool accumulate) {
    __m512 acc[Rows][NV];
#pragma GCC unroll 16
    for (int i = 0; i < Rows; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t q = 0; q < kcp / 2; ++q) {
      __m512bh bv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        bv[v] = reinterpret_cast<__m512bh>(_mm512_load_si512(b + q * 2 * kNr + v * 32));
#pragma GCC unroll 16
      for (int i = 0; i < Rows; ++i) {
        int32_t pair;
        std::memcpy(&pair, a + q * 2 * MR + 2 * i, 4);
        const __m512bh ai = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], ai, bv[v]);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < Rows; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        float* ci = c + i * ldc + v * 16;
        _mm512_storeu_ps(ci,
                         accumulate ? _mm512_add_ps(_mm512_loadu_ps(ci), acc[i][v]) : acc[i][v]);
      }
  }

  __attribute__((always_inline)) static void Full(int64_t kcp, const uint16_t* a, const uint16_t* b,
                                                  float* c, int64_t ldc, bool accumulate) {
    Micro<MR>(kcp, a, b, c, ldc, accumulate);
  }
  // A row edge runs on the fewest rows that cover it, in steps of RowStep.
  template <int Rows = RowStep>
  __attribute__((always_inline)) static void Edge(int64_t rows, int64_t kcp, const uint16_t* a,
                                                  const uint16_t* b, float* c, int64_t ldc,
                                                  bool accumulate) {
    if constexpr (Rows >= MR) {
      Micro<MR>(kcp, a, b, c, ldc, accumulate);
    } else {
      if (rows <= Rows) return Micro<Rows>(kcp, a, b, c, ldc, accumulate);
      Edge<Rows + RowStep>(rows, kcp, a, b, c, ldc, accumulate);
    }
  }
};

// 12 x 2 zmm accumulators, as the float32 AVX-512 kernel: 24 chains of
// vdpbf16ps, two B vectors, and the A pairs broadcast from memory; 256-deep
// slabs, the float32 kernel's, so both sum the same chains.
using Path = DotBf16Path<12, 2, 4, 256, 512 << 10>;
}  // namespace avx512_bf16

const IsaKernels& Avx512Bf16Kernels() {
  static const IsaKernels kernels =
      avx512_bf16::Bf16Kernels<avx512_bf16::Path>::Make("avx512_bf16");
  return kernels;
}
}  // namespace jax_tiled::cpu
