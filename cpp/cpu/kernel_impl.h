// The blocked kernel, written once and compiled once per instruction set.
//
// A kernel_<isa>.cc defines JAX_TILED_ISA (a namespace name) and includes this
// file; everything here lands in jax_tiled::cpu::<isa>, so no symbol is shared
// between units compiled with different -m flags (see kernel.h).
//
// The structure is GotoBLAS/BLIS's, laid out for row-major output. A thread
// owns a tile of the output and walks the depth in kc-deep slabs. Per slab it
// packs the tile's rows of A once into mr-row panels, then, per nc-wide block
// of the tile's columns, packs B into nr-column panels (the packed B block,
// kc x nc, stays in L2) and sweeps it with an mr x nr register-blocked
// micro-kernel: one A micro-panel (kc x mr, in L1) against every B micro-panel
// of the block, streamed from L2. Packing converts to the accumulator type,
// applies the transposes and zero-pads edges, so one micro-kernel per
// accumulator type serves every dtype pair and layout.
//
// Determinism: each output element is the slab sums added in depth order,
// c = s0, c = c + s1, ...; on the FMA path each slab sum is its chains' sums
// added in order, each chain a sequential FMA chain of at most kChainDepth
// terms (Config). The cuts depend on K and the path's slab depth only (SlabDepth),
// never on tile sizes or thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/kernel.h"

#ifndef JAX_TILED_ISA
#error "define JAX_TILED_ISA (the namespace for this instruction set) before including"
#endif

namespace jax_tiled::cpu::JAX_TILED_ISA {

// ---- 16-bit float storage and conversions ------------------------------------

struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float ToFloat(BFloat16 x) { return BitsToFloat(uint32_t{x.bits} << 16); }

inline float ToFloat(Half x) {
  const uint32_t sign = uint32_t{x.bits & 0x8000u} << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1f;
  const uint32_t mantissa = x.bits & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// Round to nearest even, as the hardware conversions do.
inline BFloat16 ToBFloat16(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1);
  return {static_cast<uint16_t>(u >> 16)};
}

inline Half ToHalf(float f) {
  uint32_t u = FloatToBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  uint32_t h;
  if (u >= 0x47800000u) {  // >= 2^16: infinity, or NaN (kept quiet)
    h = (u > 0x7f800000u) ? 0x7e00u : 0x7c00u;
  } else if (u < 0x38800000u) {  // below 2^-14: subnormal half or zero
    // Adding 0.5 aligns the 10 result bits at the bottom of the mantissa and
    // lets the float adder do the round-to-nearest-even.
    h = FloatToBits(BitsToFloat(u) + 0.5f) - FloatToBits(0.5f);
  } else {
    const uint32_t odd = (u >> 13) & 1;
    h = (u + 0xc8000fffu + odd) >> 13;  // rebias exponent (-112 << 23), round
  }
  return {static_cast<uint16_t>(h | sign)};
}

template <class Acc, class T> inline Acc Load(T x) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) return ToFloat(x);
  else return static_cast<Acc>(x);
}

template <class T, class Acc> inline T Store(Acc x) {
  if constexpr (std::is_same_v<T, Half>) return ToHalf(static_cast<float>(x));
  else if constexpr (std::is_same_v<T, BFloat16>) return ToBFloat16(static_cast<float>(x));
  else return static_cast<T>(x);
}

template <class T> inline T Min(T a, T b) { return a < b ? a : b; }
constexpr int64_t RoundUp(int64_t x, int64_t to) { return (x + to - 1) / to * to; }
inline size_t Align64(size_t bytes) { return (bytes + 63) / 64 * 64; }

// ---- Micro-kernel -----------------------------------------------------------------

// Where the micro-kernel reads its operands: both packed, or one of them
// where it is stored: A's rows contiguous in K (kAInPlace: element (i, p) at
// a[i * ld + p]) or B's rows contiguous in its columns (kBInPlace: element
// (p, j) at b[p * ld + j]). RunTile chooses, for tiles that would not pay
// for the pack.
enum class Reads { kPacked, kAInPlace, kBInPlace };

// The register block of one accumulator type on this instruction set: MR rows
// by NR columns of Acc, NR a whole number of VectorBytes-wide vectors.
// Row edges run on multiples of RowStep rows (see EdgeMicroKernel).
template <class Acc, int VectorBytes, int MR, int NRVectors, int RowStep, int64_t KC,
          int64_t L2BlockBytes>
struct Config {
  using acc_type = Acc;
  static constexpr int kVectorBytes = VectorBytes;
  static constexpr int kLanes = VectorBytes / static_cast<int>(sizeof(Acc));
  static constexpr int kMr = MR, kVectors = NRVectors, kNr = NRVectors * kLanes;
  static constexpr int kRowStep = RowStep;
  static_assert(MR % RowStep == 0, "row edges step up to MR");
  static constexpr int64_t kKc = KC;
  // K per chain inside a slab: float32's register chains restart every 64
  // steps and their sums are added in a buffer, so that an element is a
  // three-level sum (chains of 64, the slab's, the slabs'), not a chain as
  // deep as the slab; at K = 300 slab-deep chains had 1.8x XLA:CPU's error.
  // float64 keeps one chain a slab: its rounding is far below what anything
  // here compares, and the flushes cost it 2-4% (NOTES.md, "Slabs of equal
  // depth, and partial sums inside them").
  static constexpr int64_t kChainDepth = std::is_same_v<Acc, float> ? 64 : KC;
  static constexpr int64_t kNc =
      (L2BlockBytes / (KC * static_cast<int64_t>(sizeof(Acc)))) / kNr * kNr;
  static_assert(kNc >= kNr, "the B block must hold at least one micro-panel");
  typedef Acc Vec __attribute__((vector_size(VectorBytes), aligned(VectorBytes)));
  typedef Acc UnalignedVec __attribute__((vector_size(VectorBytes), aligned(sizeof(Acc))));
};

// c[Rows x NR] (row stride ldc) = (accumulate ? c : 0) + A * B over kc, with A
// the first Rows rows of a packed micro-panel (kc x MR, MR contiguous) and B
// one (kc x NR, NR contiguous). The accumulators live in Rows * NR / kLanes
// vector registers, each a chain of at most C::kChainDepth FMAs; a slab
// deeper than that adds its chains' sums in `slab`, a buffer in L1 (there is
// no room for a second set of registers), and c is touched once at the end.
// Each element is the same arithmetic whatever Rows is, so a short row edge
// can run fewer rows without changing a bit of the result; and whatever
// kReads is: A or B may be read where it is stored instead of packed (Reads),
// `ld` elements between its rows, with `live` rows of A real.
template <class C, int Rows = C::kMr, Reads kReads = Reads::kPacked>
__attribute__((always_inline)) inline void MicroKernel(int64_t kc,
                                                       const typename C::acc_type* __restrict a,
                                                       const typename C::acc_type* __restrict b,
                                                       typename C::acc_type* __restrict c,
                                                       int64_t ldc, bool accumulate, int64_t ld = 0,
                                                       int64_t live = Rows) {
  using Acc = typename C::acc_type;
  using Vec = typename C::Vec;
  using UVec = typename C::UnalignedVec;
  constexpr int MR = C::kMr, NV = C::kVectors, NR = C::kNr, L = C::kLanes;
  static_assert(Rows >= 1 && Rows <= MR, "a micro-kernel covers at most MR rows");

  // The tile of c is needed only after the loop: start fetching it now.
#pragma GCC unroll 32
  for (int i = 0; i < Rows; ++i) {
    __builtin_prefetch(c + i * ldc, 1);
    __builtin_prefetch(c + i * ldc + NR - 1, 1);
  }

  // A in place: row i at a + i * ld; rows past `live` (an edge's padding)
  // read the last live row again, and their sums are dropped.
  constexpr bool kAInPlace = kReads == Reads::kAInPlace, kBInPlace = kReads == Reads::kBInPlace;
  [[maybe_unused]] const Acc* a_rows[Rows];
  if constexpr (kAInPlace)
#pragma GCC unroll 32
    for (int i = 0; i < Rows; ++i) a_rows[i] = a + Min<int64_t>(i, live - 1) * ld;

  alignas(64) Vec slab[Rows][NV];  // the partials' sum so far (the first one: as it is)
  for (int64_t p0 = 0; p0 < kc; p0 += C::kChainDepth) {
    Vec acc[Rows][NV];
#pragma GCC unroll 32
    for (int i = 0; i < Rows; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[i][v] = Vec{};

    const int64_t p1 = Min(p0 + C::kChainDepth, kc);
#pragma GCC unroll 2
    for (int64_t p = p0; p < p1; ++p) {
      Vec bv[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v)
        bv[v] = kBInPlace ? Vec(*reinterpret_cast<const UVec*>(b + p * ld + v * L))
                          : *reinterpret_cast<const Vec*>(b + p * NR + v * L);
#pragma GCC unroll 32
      for (int i = 0; i < Rows; ++i) {
        const Acc ai = kAInPlace ? a_rows[i][p] : a[p * MR + i];
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) acc[i][v] += ai * bv[v];
      }
    }

    const bool first = p0 == 0, last = p1 == kc;
#pragma GCC unroll 32
    for (int i = 0; i < Rows; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) {
        const Vec sum = first ? acc[i][v] : slab[i][v] + acc[i][v];
        if (!last) {
          slab[i][v] = sum;
          continue;
        }
        UVec* cv = reinterpret_cast<UVec*>(c + i * ldc + v * L);
        *cv = accumulate ? *cv + sum : sum;
      }
  }
}

// Runs the micro-kernel for a row edge of `rows` < MR live rows on the
// fewest rows that cover them, in steps of C::kRowStep: a 16-row problem on
// 12-row blocks would otherwise spend a third of its time on padding.
template <class C, int Rows = C::kRowStep, Reads kReads = Reads::kPacked>
__attribute__((always_inline)) inline void EdgeMicroKernel(int64_t rows, int64_t kc,
                                                           const typename C::acc_type* a,
                                                           const typename C::acc_type* b,
                                                           typename C::acc_type* c, int64_t ldc,
                                                           bool accumulate, int64_t ld = 0) {
  if constexpr (Rows >= C::kMr) {
    MicroKernel<C, C::kMr, kReads>(kc, a, b, c, ldc, accumulate, ld, rows);
  } else {
    if (rows <= Rows) return MicroKernel<C, Rows, kReads>(kc, a, b, c, ldc, accumulate, ld, rows);
    EdgeMicroKernel<C, Rows + C::kRowStep, kReads>(rows, kc, a, b, c, ldc, accumulate, ld);
  }
}

// ---- Packing ------------------------------------------------------------------------

// The 8 x 8 block src[r * stride + q] (r, q < 8) written transposed to
// dst[q * dst_stride + r]: eight vector loads, three rounds of shuffles that
// swap the off-diagonal 4 x 4, 2 x 2 and 1 x 1 blocks between pairs of rows,
// eight vector stores. A scalar transpose costs a load and a store an element.
#if defined(__clang__)
#define JAX_TILED_SHUFFLE(Mask, x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define JAX_TILED_SHUFFLE(Mask, x, y, ...) __builtin_shuffle(x, y, Mask{__VA_ARGS__})
#endif

// One round: between rows i and i + S (i without bit S), element j of row i
// with bit S set trades places with element j - S of row i + S. Shuffle
// indices count x's elements 0-7, then y's 8-15.
template <int S, int J> inline constexpr int kStaysLow = (J & S) ? 8 + J - S : J;
template <int S, int J> inline constexpr int kGoesHigh = (J & S) ? 8 + J : J + S;

template <int S, class Mask, class V>
inline void SwapOffDiagonalBlocks(V (&v)[8]) {
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    if ((i & S) == 0) {
      const V x = v[i], y = v[i + S];
      v[i] = JAX_TILED_SHUFFLE(Mask, x, y, kStaysLow<S, 0>, kStaysLow<S, 1>, kStaysLow<S, 2>,
                               kStaysLow<S, 3>, kStaysLow<S, 4>, kStaysLow<S, 5>, kStaysLow<S, 6>,
                               kStaysLow<S, 7>);
      v[i + S] = JAX_TILED_SHUFFLE(Mask, x, y, kGoesHigh<S, 0>, kGoesHigh<S, 1>, kGoesHigh<S, 2>,
                                   kGoesHigh<S, 3>, kGoesHigh<S, 4>, kGoesHigh<S, 5>,
                                   kGoesHigh<S, 6>, kGoesHigh<S, 7>);
    }
}

template <class T>
inline void Transpose8x8(const T* src, int64_t stride, T* __restrict dst, int64_t dst_stride) {
  typedef T V __attribute__((vector_size(8 * sizeof(T)), aligned(sizeof(T))));
  using Index = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  typedef Index Mask __attribute__((vector_size(8 * sizeof(T))));
  V v[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) v[i] = *reinterpret_cast<const V*>(src + i * stride);
  SwapOffDiagonalBlocks<4, Mask>(v);
  SwapOffDiagonalBlocks<2, Mask>(v);
  SwapOffDiagonalBlocks<1, Mask>(v);
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) *reinterpret_cast<V*>(dst + i * dst_stride) = v[i];
}
#undef JAX_TILED_SHUFFLE

// Packs rows [0, rows) x depth [0, depth) of a strided matrix x (element (r, p)
// at x[r * row_stride + p * depth_stride]) into panels of W rows, each stored
// depth-major: dst[(r / W) * depth * W + p * W + r % W]. Rows past `rows` up
// to the next multiple of W are zero, so edge micro-tiles need no masking.
// VectorBytes is the instruction set's vector width: transposes go through
// Transpose8x8 where eight elements fill at most one vector.
// GCC would turn the W-wide copies into a memcpy call per depth step, a call
// per 48-128 bytes: keep them inline vector moves.
#if defined(__GNUC__) && !defined(__clang__)
#define JAX_TILED_NO_MEMCPY_CALLS __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define JAX_TILED_NO_MEMCPY_CALLS
#endif

template <int W, int VectorBytes, class Acc, class In>
JAX_TILED_NO_MEMCPY_CALLS void PackPanels(const In* x, int64_t row_stride, int64_t depth_stride,
                                          int64_t rows, int64_t depth, Acc* __restrict dst) {
  // Whether transposes go eight rows at a time. A panel whose width is not a
  // multiple of 8 ends with a block that overlaps the one before it (12 rows:
  // rows 0-7, then 4-11), rewriting a few elements rather than going scalar.
  constexpr bool kVectorTranspose =
      std::is_same_v<In, Acc> && 8 * sizeof(Acc) <= VectorBytes && W >= 8;
  for (int64_t r0 = 0; r0 < rows; r0 += W) {
    Acc* __restrict panel = dst + r0 * depth;
    const In* src = x + r0 * row_stride;
    const int64_t live = Min<int64_t>(W, rows - r0);
    if (live == W && row_stride == 1) {
      // The panel's rows are adjacent in memory: each depth step is a W-wide
      // contiguous copy (vector loads and stores).
      for (int64_t p = 0; p < depth; ++p) {
        const In* s = src + p * depth_stride;
#pragma GCC unroll 8
        for (int r = 0; r < W; ++r) panel[p * W + r] = Load<Acc>(s[r]);
      }
    } else if (live == W && depth_stride == 1) {
      // A transpose, in blocks of depth steps: each source row is read a block
      // at a time while its line is in L1, and the block's writes land in
      // consecutive elements of the panel. The vector path takes 16 steps (a
      // whole 64-byte line of float32) per 8 rows before moving on: rows of a
      // large matrix often share an L1 set, and 12 of them evict each other.
      int64_t p = 0;
      if constexpr (kVectorTranspose) {
        constexpr int kDepthBlock = 64 / sizeof(Acc) >= 16 ? 16 : 8;
        for (; p + kDepthBlock <= depth; p += kDepthBlock)
#pragma GCC unroll 4
          for (int r = 0; r < W; r += 8)
#pragma GCC unroll 2
            for (int q = 0; q < kDepthBlock; q += 8)
              Transpose8x8(reinterpret_cast<const Acc*>(src) + Min(r, W - 8) * row_stride + p + q,
                           row_stride, panel + (p + q) * W + Min(r, W - 8), W);
      }
      for (; p + 8 <= depth; p += 8) {
#pragma GCC unroll 32
        for (int r = 0; r < W; ++r)
#pragma GCC unroll 8
          for (int q = 0; q < 8; ++q)
            panel[(p + q) * W + r] = Load<Acc>(src[r * row_stride + p + q]);
      }
      for (; p < depth; ++p)
#pragma GCC unroll 32
        for (int r = 0; r < W; ++r) panel[p * W + r] = Load<Acc>(src[r * row_stride + p]);
    } else {
      for (int64_t p = 0; p < depth; ++p) {
        for (int64_t r = 0; r < live; ++r)
          panel[p * W + r] = Load<Acc>(src[r * row_stride + p * depth_stride]);
        for (int64_t r = live; r < W; ++r) panel[p * W + r] = Acc{0};
      }
    }
  }
}

// ---- Paths: how a tile is packed and multiplied ---------------------------------------

// RunTile is written once against a path, which names:
//   acc_type, packed_type   the accumulator, and the element type of the packs
//   kMr, kNr                the register block
//   kKs                     the depth packed at a time (a pack's "slab")
//   kKc                     the depth of one micro-kernel call, a divisor of kKs
//   kNc                     the columns of the packed B block
//   kMc                     the rows swept per B block and kKc step (the block
//                           of C that stays in cache across the steps)
//   kDepthUnit              packs are zero-padded to a multiple of this depth
//                           (both operands at the same depths, so padding only
//                           ever multiplies zero by zero)
//   kEqualSlabs             K is cut into slabs of equal depth (SlabDepth),
//                           not kKs-deep ones and a remainder
//   PackA, PackB            mr-row panels of A, nr-column panels of B, each
//                           depth-major so that depths [p, p + kc) of a panel
//                           start p * kMr (kNr) elements into it
//   Full, Edge              the micro-kernel on a whole block, and on the first
//                           `rows` rows of one (an edge, into a full-size buffer)
//   Scope                   set up and torn down around a tile (AMX's tile
//                           configuration; nothing here)
//   kReadsInPlace           Full and Edge also take Reads (an operand read
//                           where it is stored, `ld` apart, for operands of
//                           the accumulator type): the FMA path's
// This file's path converts every input to the accumulator type and runs the
// FMA micro-kernel above, one micro-kernel call per packed slab and all of a
// tile's rows per B block; kernel_avx512_bf16.cc and kernel_amx.cc add paths
// that multiply bfloat16 as stored.
template <class C>
struct FmaPath {
  using acc_type = typename C::acc_type;
  using packed_type = acc_type;
  static constexpr int kMr = C::kMr, kNr = C::kNr, kDepthUnit = 1;
  static constexpr int64_t kKs = C::kKc, kKc = C::kKc, kNc = C::kNc, kMc = int64_t{1} << 40;
  static constexpr bool kEqualSlabs = true;
  struct Scope {};

  template <class In>
  static void PackA(const In* x, int64_t row_stride, int64_t depth_stride, int64_t rows,
                    int64_t depth, acc_type* dst) {
    PackPanels<kMr, C::kVectorBytes>(x, row_stride, depth_stride, rows, depth, dst);
  }
  template <class In>
  static void PackB(const In* x, int64_t col_stride, int64_t depth_stride, int64_t cols,
                    int64_t depth, acc_type* dst) {
    PackPanels<kNr, C::kVectorBytes>(x, col_stride, depth_stride, cols, depth, dst);
  }
  // Full and Edge with A or B read where it is stored instead (Reads), `ld` apart.
  static constexpr bool kReadsInPlace = true;
  template <Reads kReads = Reads::kPacked>
  __attribute__((always_inline)) static void Full(int64_t kc, const acc_type* a, const acc_type* b,
                                                  acc_type* c, int64_t ldc, bool accumulate,
                                                  int64_t ld = 0) {
    MicroKernel<C, C::kMr, kReads>(kc, a, b, c, ldc, accumulate, ld);
  }
  template <Reads kReads = Reads::kPacked>
  __attribute__((always_inline)) static void Edge(int64_t rows, int64_t kc, const acc_type* a,
                                                  const acc_type* b, acc_type* c, int64_t ldc,
                                                  bool accumulate, int64_t ld = 0) {
    EdgeMicroKernel<C, C::kRowStep, kReads>(rows, kc, a, b, c, ldc, accumulate, ld);
  }
};

// ---- One output tile ------------------------------------------------------------------

template <class P, class Out>
constexpr bool kWritesOutput = std::is_same_v<Out, typename P::acc_type>;

// Scratch layout: packed A slab (rows padded x ks), packed B block (ks x nc),
// and, when the output is not the accumulator type, accumulators: the whole
// tile's where K takes several slabs (a block's sum continues across them),
// one block's (at most MC x NC), reused, where K fits one slab.
template <class P>
constexpr int64_t kPackedSlab = RoundUp(P::kKs, P::kDepthUnit);

template <class P, class Out>
size_t ScratchBytes(int64_t rows, int64_t cols, int64_t depth) {
  using Acc = typename P::acc_type;
  using Packed = typename P::packed_type;
  size_t bytes = Align64(RoundUp(rows, P::kMr) * kPackedSlab<P> * sizeof(Packed)) +
                 Align64(kPackedSlab<P> * P::kNc * sizeof(Packed));
  const int64_t accumulators =
      depth <= P::kKs ? Min(P::kMc, rows) * Min(P::kNc, cols) : rows * cols;
  if (!kWritesOutput<P, Out>) bytes += Align64(accumulators * sizeof(Acc));
  return bytes;
}

// out[rows x cols] = c rounded to Out: a C block whose sum over K is complete.
template <class Out, class Acc>
void StoreBlock(const Acc* c, int64_t ldc, Out* out, int64_t ld_out, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[i * ld_out + j] = Store<Out>(c[i * ldc + j]);
}

// The depth of K's slabs. A slab's sum (one chain, or on the FMA path chains
// of kChainDepth) rounds more the deeper it is, and the slab sums' chain
// the more slabs there are, so the deepest slab sets the error for a given
// count: where the path allows, ceil(K / kKs) slabs of equal depth (rounded
// up to the packs' depth unit), not kKs-deep ones and a remainder. At K =
// 263 that is 132 + 131 where it was 256 + 7, as Eigen's blocking behind
// XLA:CPU's products cuts K (NOTES.md, "Slabs of equal depth, and partial
// sums inside them").
template <class P>
int64_t SlabDepth(int64_t k) {
  if (!P::kEqualSlabs || k <= P::kKs) return P::kKs;
  const int64_t slabs = (k + P::kKs - 1) / P::kKs;
  return RoundUp((k + slabs - 1) / slabs, P::kDepthUnit);  // <= kKs: kKs is a multiple
}

// The most uses of a pack that do not pay for it: A is read in place where
// its packed panel would serve at most this many micro-panels of B (a tile
// that narrow, counted in the micro-panels of the path that reads it), B
// where its packed block would serve at most this many panels of A (a tile
// that short). Measured on a 2-core AMD EPYC: 16384 x 4096 x 64 and 32 x
// 4096 x 4096 ~20% faster, 1024^3 (both packed) as before (NOTES.md,
// "Operands read in place").
inline constexpr int64_t kAInPlaceMicroPanels = 2, kBInPlacePanels = 4;

// One micro-kernel call: on the packed panels (ai, bj), or with A or B read
// where it is stored (a_stored, b_stored; Reads); an edge (not `full`) on
// the fewest rows that cover its live_rows.
template <class P, class In>
__attribute__((always_inline)) inline void Multiply(
    Reads reads, const Operands& op, bool full, int64_t live_rows, int64_t kc,
    const typename P::packed_type* ai, const typename P::packed_type* bj, const In* a_stored,
    const In* b_stored, typename P::acc_type* c, int64_t ldc, bool accumulate) {
  if constexpr (P::kReadsInPlace && std::is_same_v<In, typename P::acc_type>) {
    // Out of line, so that RunTile's packed loop stays the code it was (the
    // packed shapes measured within 1-3% of before either way: noise here).
    auto call = [&](auto in_place, const In* a, const In* b, int64_t ld) __attribute__((noinline)) {
      constexpr Reads kReads = decltype(in_place)::value;
      if (full) return P::template Full<kReads>(kc, a, b, c, ldc, accumulate, ld);
      P::template Edge<kReads>(live_rows, kc, a, b, c, ldc, accumulate, ld);
    };
    if (reads == Reads::kAInPlace)
      return call(std::integral_constant<Reads, Reads::kAInPlace>{}, a_stored, bj, op.a_row);
    if (reads == Reads::kBInPlace)
      return call(std::integral_constant<Reads, Reads::kBInPlace>{}, ai, b_stored, op.b_depth);
  }
  if (full) return P::Full(kc, ai, bj, c, ldc, accumulate);
  P::Edge(live_rows, kc, ai, bj, c, ldc, accumulate);
}

// Where a tile's micro-kernels read their operands: an operand read where it
// is stored, not packed (the FMA path, operands of the accumulator type; the
// rows it reads contiguous), A where a packed panel would serve at most
// kAInPlaceMicroPanels micro-panels of B, B where a packed block would serve
// at most kBInPlacePanels panels of A. Too few uses to pay for the pack, a
// pass over the operand of its own before any product (NOTES.md, "Operands
// read in place").
template <class P, class In>
Reads ReadsOf(const Operands& op, const Tile& t) {
  if constexpr (P::kReadsInPlace && std::is_same_v<In, typename P::acc_type>) {
    if (op.a_depth == 1 && t.cols <= kAInPlaceMicroPanels * P::kNr) return Reads::kAInPlace;
    if (op.b_col == 1 && t.rows <= kBInPlacePanels * P::kMr && t.cols % P::kNr == 0)
      return Reads::kBInPlace;
  }
  return Reads::kPacked;
}

template <class P, class In, class Out>
void RunTile(const Operands& op, const Tile& t, void* scratch) {
  using Acc = typename P::acc_type;
  using Packed = typename P::packed_type;
  constexpr int MR = P::kMr, NR = P::kNr;
  constexpr int64_t KS = P::kKs, KC = P::kKc, NC = P::kNc, MC = P::kMc;
  static_assert(KS % KC == 0 && KC % P::kDepthUnit == 0, "micro-kernel steps tile the slab");

  char* bytes = static_cast<char*>(scratch);
  Packed* apack = reinterpret_cast<Packed*>(bytes);
  bytes += Align64(RoundUp(t.rows, MR) * kPackedSlab<P> * sizeof(Packed));
  Packed* bpack = reinterpret_cast<Packed*>(bytes);
  bytes += Align64(kPackedSlab<P> * NC * sizeof(Packed));

  const In* a = static_cast<const In*>(op.a) + t.batch * op.a_batch_stride + t.i0 * op.a_row;
  const In* b = static_cast<const In*>(op.b) + t.batch * op.b_batch_stride + t.j0 * op.b_col;
  Out* out = static_cast<Out*>(op.out) + t.batch * op.out_batch_stride + t.i0 * op.ldc + t.j0;
  // Same-type results accumulate in place in the output; others in scratch,
  // and are rounded to Out block by block as each block's last slab ends,
  // while the block is still in cache: with one slab (short K) its
  // accumulators are one block's, so a bfloat16 8192x64x8192 no longer
  // writes a float32 copy of C to memory and reads it back (NOTES.md).
  const bool block_accumulators = !kWritesOutput<P, Out> && op.k <= KS;
  Acc* c;
  int64_t ldc;
  if constexpr (kWritesOutput<P, Out>) {
    c = out, ldc = op.ldc;
  } else {
    c = reinterpret_cast<Acc*>(bytes), ldc = block_accumulators ? Min(NC, t.cols) : t.cols;
  }

  const Reads reads = ReadsOf<P, In>(op, t);

  [[maybe_unused]] const typename P::Scope scope;
  const int64_t slab = SlabDepth<P>(op.k);
  for (int64_t k0 = 0; k0 < op.k; k0 += slab) {
    const int64_t ks = Min(slab, op.k - k0);
    const int64_t ksp = RoundUp(ks, P::kDepthUnit);  // the packed depth of this slab
    if (reads != Reads::kAInPlace)
      P::PackA(a + k0 * op.a_depth, op.a_row, op.a_depth, t.rows, ks, apack);
    for (int64_t j0 = 0; j0 < t.cols; j0 += NC) {
      const int64_t nc = Min(NC, t.cols - j0);
      if (reads != Reads::kBInPlace)
        P::PackB(b + k0 * op.b_depth + j0 * op.b_col, op.b_col, op.b_depth, nc, ks, bpack);
      for (int64_t i0 = 0; i0 < t.rows; i0 += MC) {
        const int64_t i_end = Min(i0 + MC, t.rows);
        Acc* const block = block_accumulators ? c : c + i0 * ldc + j0;
        for (int64_t p = 0; p < ksp; p += KC) {
          const int64_t kc = Min(KC, ksp - p);
          const bool accumulate = k0 > 0 || p > 0;
          for (int64_t i = i0; i < i_end; i += MR) {
            const int64_t live_rows = Min<int64_t>(MR, t.rows - i);
            const Packed* ai = apack + i * ksp + p * MR;
            for (int64_t j = 0; j < nc; j += NR) {
              const int64_t live_cols = Min<int64_t>(NR, nc - j);
              const Packed* bj = bpack + j * ksp + p * NR;
              Acc* cij = block + (i - i0) * ldc + j;
              if (live_rows == MR && live_cols == NR) {
                Multiply<P, In>(reads, op, true, live_rows, kc, ai, bj, a + i * op.a_row + k0 + p,
                                b + (k0 + p) * op.b_depth + j0 + j, cij, ldc, accumulate);
                continue;
              }
              // An edge: run the same micro-kernel on a full-size copy, so edge
              // elements see exactly the arithmetic of interior ones.
              alignas(64) Acc edge[MR * NR];
              for (int r = 0; r < live_rows; ++r)
                for (int s = 0; s < live_cols; ++s)
                  edge[r * NR + s] = accumulate ? cij[r * ldc + s] : Acc{0};
              Multiply<P, In>(reads, op, false, live_rows, kc, ai, bj, a + i * op.a_row + k0 + p,
                              b + (k0 + p) * op.b_depth + j0 + j, edge, NR, accumulate);
              for (int r = 0; r < live_rows; ++r)
                for (int s = 0; s < live_cols; ++s) cij[r * ldc + s] = edge[r * NR + s];
            }
          }
        }
        if constexpr (!kWritesOutput<P, Out>)
          if (k0 + slab >= op.k)  // the block's last slab: its sums are complete
            StoreBlock(block, ldc, out + i0 * op.ldc + j0, op.ldc, i_end - i0, nc);
      }
    }
  }
}

// ---- Dtype dispatch and the exported table ---------------------------------------------

template <class F>
void VisitStorage(Dtype t, F&& f) {
  switch (t) {
    case Dtype::kF16: return f(Half{});
    case Dtype::kBF16: return f(BFloat16{});
    case Dtype::kF32: return f(float{});
    case Dtype::kF64: return f(double{});
  }
}

// Config32 and Config64 are this instruction set's Config for float and double;
// Config32ReadingA and Config64ReadingA, theirs for tiles that read A where it
// is stored (by default the same).
template <class Config32, class Config64, class Config32ReadingA = Config32,
          class Config64ReadingA = Config64>
struct Kernels {
  // float64 accumulates when either side is float64, as on CUDA (AccumulatorOf).
  template <class In, class Out>
  static constexpr bool kDouble = std::is_same_v<In, double> || std::is_same_v<Out, double>;
  template <class In, class Out>
  using PathFor = FmaPath<std::conditional_t<kDouble<In, Out>, Config64, Config32>>;
  template <class In, class Out>
  using ReadingA =
      FmaPath<std::conditional_t<kDouble<In, Out>, Config64ReadingA, Config32ReadingA>>;
  template <class In, class Out>
  static constexpr bool kMayReadA = std::is_same_v<In, typename PathFor<In, Out>::acc_type> &&
                                    !std::is_same_v<ReadingA<In, Out>, PathFor<In, Out>>;

  static size_t Scratch(const Operands& op, int64_t rows, int64_t cols) {
    size_t bytes = 0;
    VisitStorage(op.in, [&](auto in) {
      VisitStorage(op.out_type, [&](auto out) {
        using In = decltype(in);
        using Out = decltype(out);
        bytes = ScratchBytes<PathFor<In, Out>, Out>(rows, cols, op.k);
        if constexpr (kMayReadA<In, Out>)
          bytes = std::max(bytes, ScratchBytes<ReadingA<In, Out>, Out>(rows, cols, op.k));
      });
    });
    return bytes;
  }

  static void Run(const Operands& op, const Tile& tile, void* scratch) {
    VisitStorage(op.in, [&](auto in) {
      VisitStorage(op.out_type, [&](auto out) {
        using In = decltype(in);
        using Out = decltype(out);
        // A tile that reads A in place on ReadingA's register block runs there.
        if constexpr (kMayReadA<In, Out>)
          if (ReadsOf<ReadingA<In, Out>, In>(op, tile) == Reads::kAInPlace)
            return RunTile<ReadingA<In, Out>, In, Out>(op, tile, scratch);
        RunTile<PathFor<In, Out>, In, Out>(op, tile, scratch);
      });
    });
  }

  static IsaKernels Make(const char* name) {
    return {name,
            {Config32::kMr, Config32::kNr, Config32::kKc, Config32::kNc},
            {Config64::kMr, Config64::kNr, Config64::kKc, Config64::kNc},
            &Scratch,
            &Run};
  }
};

// The table of a path that multiplies bfloat16 as stored (P: a path, as
// FmaPath): bfloat16 inputs into a float32, bfloat16 or float16 result,
// accumulated in float32. matmul.cc sends it nothing else: a float64 result
// accumulates in float64, on the FMA path.
template <class P>
struct Bf16Kernels {
  template <class F>
  static void VisitOut(Dtype t, F&& f) {
    switch (t) {
      case Dtype::kF16: return f(Half{});
      case Dtype::kBF16: return f(BFloat16{});
      default: return f(float{});
    }
  }
  static size_t Scratch(const Operands& op, int64_t rows, int64_t cols) {
    size_t bytes = 0;
    VisitOut(op.out_type,
             [&](auto out) { bytes = ScratchBytes<P, decltype(out)>(rows, cols, op.k); });
    return bytes;
  }
  static void Run(const Operands& op, const Tile& tile, void* scratch) {
    VisitOut(op.out_type,
             [&](auto out) { RunTile<P, BFloat16, decltype(out)>(op, tile, scratch); });
  }
  static IsaKernels Make(const char* name) {
    const Geometry g{P::kMr, P::kNr, P::kKc, P::kNc};
    return {name, g, g, &Scratch, &Run};
  }
};

}  // namespace jax_tiled::cpu::JAX_TILED_ISA
