// bfloat16 products on AMX tiles (built with -mamx-tile -mamx-bf16 and
// AVX-512BW for the packs; picked at run time, see matmul.cc).
//
// tdpbf16ps multiplies a 16 x 32 bfloat16 tile of A by a 32 x 16 tile of B
// (stored as 16 rows of 16 column pairs) into a 16 x 16 float32 tile: 8192
// multiply-adds per instruction, where an AVX-512 FMA does 16. The SDM
// specifies round to nearest even, denormal inputs read as zero and denormal
// results flushed to zero, MXCSR ignored. Within one instruction the 32
// products of an element are not added as a rounded chain (on this machine
// 84% of results equal the exactly rounded sum of the products and the
// accumulator, against 53% for a chain in either order; docs/precision.md):
// the sum over K is a chain of 32-deep block sums, more accurate than a chain
// of single products, and the same for a given input wherever the element
// sits in the tile or the product.
#define JAX_TILED_ISA amx
#include <immintrin.h>

#include "cpu/kernel_impl.h"
// Keep after kernel_impl.h, which opens the namespace it extends.
#include "cpu/bf16_pack.h"

namespace jax_tiled::cpu {
namespace amx {

// The tile registers: 0-3 the 2 x 2 float32 tiles of C (32 x 32), 4-5 two A
// tiles (rows 0-15 and 16-31, 32 deep), 6-7 two B tiles (columns 0-15 and
// 16-31). Every tile is 16 rows of 64 bytes, so one configuration serves all.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
inline TileConfig EveryTile16x64() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  return config;
}

// A 32 x 32 register block. KS: the depth packed at a time; KC: the depth of
// one micro-kernel call; NC: the columns of the packed B block; MC: the rows
// whose C block (MC x NC float32) is swept per KC step, staying in L2 between
// steps (see NOTES.md, "AMX").
template <int64_t KS, int64_t KC, int64_t NC, int64_t MC>
struct AmxPath {
  using acc_type = float;
  using packed_type = uint16_t;
  static constexpr int kMr = 32, kNr = 32, kDepthUnit = 32;
  static constexpr int64_t kKs = KS, kKc = KC, kNc = NC, kMc = MC;
  // kKs-deep slabs and a remainder, as measured bitwise equal to XLA:CPU's own
  // AMX products (NOTES.md, "Accuracy, subnormals, determinism").
  static constexpr bool kEqualSlabs = false;
  static constexpr bool kReadsInPlace = false;
  static_assert(KC % kDepthUnit == 0 && NC % kNr == 0 && MC % kMr == 0, "whole blocks");

  // The tile configuration is per thread: set for a tile's work and released
  // after it, so that a pool thread does not carry AMX state (and its larger
  // context-switch save) between products.
  struct Scope {
    Scope() {
      static const TileConfig config = EveryTile16x64();
      _tile_loadconfig(&config);
    }
    ~Scope() { _tile_release(); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
  };

  template <class In>
  static void PackA(const In* x, int64_t row_stride, int64_t depth_stride, int64_t rows,
                    int64_t depth, uint16_t* dst) {
    static_assert(std::is_same_v<In, BFloat16>, "this path multiplies bfloat16 as stored");
    PackRowGroups32(reinterpret_cast<const uint16_t*>(x), row_stride, depth_stride, rows, depth,
                    RoundUp(depth, kDepthUnit), dst);
  }
  // Panels of 32 columns as pairs: a B tile is the first or last 64 bytes of
  // 16 consecutive 128-byte rows of pairs.
  template <class In>
  static void PackB(const In* x, int64_t col_stride, int64_t depth_stride, int64_t cols,
                    int64_t depth, uint16_t* dst) {
    PackAsPairs<kNr, kDepthUnit>(x, col_stride, depth_stride, cols, depth, dst);
  }

  // c[Rows x 32] = (accumulate ? c : 0) + A B over kcp (a multiple of 32)
  // depth steps; Rows is 16 (one A tile) or 32. An accumulating call starts
  // from c, so an element's sum continues across slabs as one chain.
  template <int Rows>
  __attribute__((always_inline)) static void Micro(int64_t kcp, const uint16_t* a,
                                                   const uint16_t* b, float* c, int64_t ldc,
                                                   bool accumulate) {
    constexpr bool kTwo = Rows > 16;
    const int64_t stride = ldc * static_cast<int64_t>(sizeof(float));
    if (accumulate) {
      _tile_loadd(0, c, stride);
      _tile_loadd(1, c + 16, stride);
      if constexpr (kTwo) {
        _tile_loadd(2, c + 16 * ldc, stride);
        _tile_loadd(3, c + 16 * ldc + 16, stride);
      }
    } else {
      _tile_zero(0);
      _tile_zero(1);
      if constexpr (kTwo) {
        _tile_zero(2);
        _tile_zero(3);
      }
    }
    for (int64_t p = 0; p < kcp; p += 32) {
      // A group: 32 rows x 32 deep, 64 bytes a row; B: 16 pairs x 32 columns,
      // 128 bytes a row, one tile per half.
      _tile_loadd(4, a + p * 32, 64);
      _tile_loadd(6, b + p * 32, 128);
      _tile_loadd(7, b + p * 32 + 32, 128);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (kTwo) {
        _tile_loadd(5, a + p * 32 + 16 * 32, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c, stride);
    _tile_stored(1, c + 16, stride);
    if constexpr (kTwo) {
      _tile_stored(2, c + 16 * ldc, stride);
      _tile_stored(3, c + 16 * ldc + 16, stride);
    }
  }

  __attribute__((always_inline)) static void Full(int64_t kcp, const uint16_t* a, const uint16_t* b,
                                                  float* c, int64_t ldc, bool accumulate) {
    Micro<32>(kcp, a, b, c, ldc, accumulate);
  }
  __attribute__((always_inline)) static void Edge(int64_t rows, int64_t kcp, const uint16_t* a,
                                                  const uint16_t* b, float* c, int64_t ldc,
                                                  bool accumulate) {
    if (rows <= 16) return Micro<16>(kcp, a, b, c, ldc, accumulate);
    Micro<32>(kcp, a, b, c, ldc, accumulate);
  }
};

using Path = AmxPath<1024, 256, 256, 256>;
}  // namespace amx

const IsaKernels& AmxKernels() {
  static const IsaKernels kernels = amx::Bf16Kernels<amx::Path>::Make("amx");
  return kernels;
}
}  // namespace jax_tiled::cpu
