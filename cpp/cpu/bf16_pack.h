// Packing bfloat16 operands as stored, for the paths that multiply bfloat16
// without converting it (kernel_avx512_bf16.cc, kernel_amx.cc).
//
// Both instruction sets take the depth in pairs: one 32-bit lane holds
// (x[p], x[p + 1]) for an even p, x[p] in the low half, and multiplies it with
// the matching pair of the other operand. Packs are zero-padded to the path's
// depth unit on both operands at the same depths, so padding multiplies zero
// by zero and never meets an inf or a NaN.
//
// Included after kernel_impl.h, inside the same JAX_TILED_ISA namespace, by
// units built with AVX-512BW (and AVX2) enabled.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#ifndef JAX_TILED_ISA
#error "include cpu/kernel_impl.h first"
#endif

namespace jax_tiled::cpu::JAX_TILED_ISA {

// x[r * row_stride + p * depth_stride] where (r, p) is inside the operand, else 0.
inline uint32_t ElementOrZero(const uint16_t* x, int64_t row_stride, int64_t depth_stride,
                              int64_t live_rows, int64_t depth, int64_t r, int64_t p) {
  return r < live_rows && p < depth ? x[r * row_stride + p * depth_stride] : 0;
}

// The 8 x 8 block of pairs src[r * stride + 2q, +1] (r, q < 8; stride in
// bfloat16 elements, any alignment) written transposed, pair (r, q) to
// dst[q * dst_stride + r]: eight loads, 24 shuffles, eight stores.
inline void Transpose8x8Pairs(const uint16_t* src, int64_t stride, uint32_t* dst,
                              int64_t dst_stride) {
  __m256i r[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * stride));
  // Pairs of rows interleaved, then pairs of pairs: within each 128-bit half,
  // u[q] holds column q (q < 4) or q + 4 (upper half) of rows 0-3 or 4-7.
  __m256i t[8], u[8];
#pragma GCC unroll 2
  for (int h = 0; h < 8; h += 4) {
    t[h + 0] = _mm256_unpacklo_epi32(r[h + 0], r[h + 1]);
    t[h + 1] = _mm256_unpackhi_epi32(r[h + 0], r[h + 1]);
    t[h + 2] = _mm256_unpacklo_epi32(r[h + 2], r[h + 3]);
    t[h + 3] = _mm256_unpackhi_epi32(r[h + 2], r[h + 3]);
    u[h + 0] = _mm256_unpacklo_epi64(t[h + 0], t[h + 2]);
    u[h + 1] = _mm256_unpackhi_epi64(t[h + 0], t[h + 2]);
    u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
    u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
  }
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + q * dst_stride),
                        _mm256_permute2x128_si256(u[q], u[q + 4], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (q + 4) * dst_stride),
                        _mm256_permute2x128_si256(u[q], u[q + 4], 0x31));
  }
}

// Eight consecutive elements of two depth steps, interleaved into eight pairs.
inline void Interleave8(const uint16_t* even, const uint16_t* odd, uint16_t* dst) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(even));
  const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(odd));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_unpacklo_epi16(x, y));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 8), _mm_unpackhi_epi16(x, y));
}

// Packs rows [0, rows) x depth [0, depth) of x (element (r, p) at
// x[r * row_stride + p * depth_stride]) into panels of W rows, each stored as
// pairs, depth-pair-major: the pair (p, p + 1) of row r at 32-bit lane
// (p / 2) * W + r % W of panel r / W, panels kcp * W elements apart. Rows past
// `rows` (to a multiple of W) and depths past `depth` (to kcp, even) are zero.
// Whole panels go through vector transposes where the depth is contiguous and
// vector interleaves where the rows are; a panel whose width is not a multiple
// of 8 ends with a block overlapping the one before it (12 rows: 0-7, 4-11).
template <int W>
void PackPairs(const uint16_t* x, int64_t row_stride, int64_t depth_stride, int64_t rows,
               int64_t depth, int64_t kcp, uint16_t* __restrict dst) {
  static_assert(W >= 8, "vector blocks are eight rows");
  const int64_t whole_pairs = depth / 2, pairs = kcp / 2;
  for (int64_t r0 = 0; r0 < rows; r0 += W) {
    uint16_t* panel = dst + r0 * kcp;
    uint32_t* lanes = reinterpret_cast<uint32_t*>(panel);
    const uint16_t* src = x + r0 * row_stride;
    const int64_t live = Min<int64_t>(W, rows - r0);
    int64_t q = 0;  // pairs done
    if (live == W && depth_stride == 1) {
      // 16 pairs (a 64-byte line of each row) per group of 8 rows, so a row's
      // line is read once even where the rows share an L1 set.
      for (; q + 16 <= whole_pairs; q += 16)
#pragma GCC unroll 4
        for (int r = 0; r < W; r += 8) {
          const int rr = Min(r, W - 8);
          Transpose8x8Pairs(src + rr * row_stride + 2 * q, row_stride, lanes + q * W + rr, W);
          Transpose8x8Pairs(src + rr * row_stride + 2 * q + 16, row_stride,
                            lanes + (q + 8) * W + rr, W);
        }
      for (; q + 8 <= whole_pairs; q += 8)
#pragma GCC unroll 4
        for (int r = 0; r < W; r += 8) {
          const int rr = Min(r, W - 8);
          Transpose8x8Pairs(src + rr * row_stride + 2 * q, row_stride, lanes + q * W + rr, W);
        }
    } else if (live == W && row_stride == 1) {
      for (; q < whole_pairs; ++q)
#pragma GCC unroll 4
        for (int r = 0; r < W; r += 8) {
          const int rr = Min(r, W - 8);
          Interleave8(src + 2 * q * depth_stride + rr, src + (2 * q + 1) * depth_stride + rr,
                      panel + q * 2 * W + 2 * rr);
        }
    }
    for (; q < pairs; ++q)
      for (int64_t r = 0; r < W; ++r)
        lanes[q * W + r] = ElementOrZero(src, row_stride, depth_stride, live, depth, r, 2 * q) |
                           ElementOrZero(src, row_stride, depth_stride, live, depth, r, 2 * q + 1)
                               << 16;
  }
}

// PackPairs for a path's packer: a bfloat16 operand in W-wide panels, its
// depth padded to a multiple of DepthUnit.
template <int W, int DepthUnit, class In>
void PackAsPairs(const In* x, int64_t row_stride, int64_t depth_stride, int64_t rows, int64_t depth,
                 uint16_t* dst) {
  static_assert(std::is_same_v<In, BFloat16>, "the bfloat16 paths multiply bfloat16 as stored");
  PackPairs<W>(reinterpret_cast<const uint16_t*>(x), row_stride, depth_stride, rows, depth,
               RoundUp(depth, DepthUnit), dst);
}

// Packs rows as PackPairs does, but in the layout of an AMX A tile: panels of
// 32 rows, each 32-deep group of the depth stored row-major (a row's 32
// elements, 64 bytes, then the next row's): element (r, p) of panel r / 32 at
// (p / 32) * 1024 + (r % 32) * 32 + p % 32. Zero past `rows` and `depth`.
inline void PackRowGroups32(const uint16_t* x, int64_t row_stride, int64_t depth_stride,
                            int64_t rows, int64_t depth, int64_t kcp, uint16_t* __restrict dst) {
  constexpr int W = 32, G = 32;
  const uint16_t zeros[W] = {};
  for (int64_t r0 = 0; r0 < rows; r0 += W) {
    uint16_t* panel = dst + r0 * kcp;
    const uint16_t* src = x + r0 * row_stride;
    const int64_t live = Min<int64_t>(W, rows - r0);
    for (int64_t p0 = 0; p0 < kcp; p0 += G) {
      uint16_t* group = panel + p0 * W;
      const int64_t n = depth > p0 ? Min<int64_t>(G, depth - p0) : 0;  // live depth
      if (depth_stride == 1) {
        // A row's group is contiguous: one masked 64-byte copy.
        const __mmask32 mask = n == G ? ~__mmask32{0} : (__mmask32{1} << n) - 1;
        for (int r = 0; r < W; ++r) {
          const __m512i v = r < live ? _mm512_maskz_loadu_epi16(mask, src + r * row_stride + p0)
                                     : _mm512_setzero_si512();
          _mm512_store_si512(group + r * G, v);
        }
      } else if (row_stride == 1 && live == W) {
        // Rows are contiguous: interleave depth steps into pairs (pair-major),
        // then transpose the pairs into rows.
        alignas(64) uint32_t pairs[G / 2][W];
        for (int q = 0; q < G / 2; ++q) {
          const int64_t p = p0 + 2 * q;
          const uint16_t* even = p < depth ? src + p * depth_stride : zeros;
          const uint16_t* odd = p + 1 < depth ? src + (p + 1) * depth_stride : zeros;
#pragma GCC unroll 4
          for (int r = 0; r < W; r += 8)
            Interleave8(even + r, odd + r, reinterpret_cast<uint16_t*>(pairs[q] + r));
        }
        uint32_t* rows_out = reinterpret_cast<uint32_t*>(group);
#pragma GCC unroll 2
        for (int q = 0; q < G / 2; q += 8)
#pragma GCC unroll 4
          for (int r = 0; r < W; r += 8)
            Transpose8x8Pairs(reinterpret_cast<const uint16_t*>(pairs[q] + r), 2 * W,
                              rows_out + r * (G / 2) + q, G / 2);
      } else {
        for (int r = 0; r < W; ++r)
          for (int p = 0; p < G; ++p)
            group[r * G + p] = ElementOrZero(src, row_stride, depth_stride, live, depth, r, p0 + p);
      }
    }
  }
}

}  // namespace jax_tiled::cpu::JAX_TILED_ISA
