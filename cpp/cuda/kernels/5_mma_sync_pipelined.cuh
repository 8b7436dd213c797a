// Kernel 5, "mma": tensor cores through warp-wide mma.sync (sm_80+, also runs
// on sm_90), bfloat16 or float16 inputs, or float32 ones as TF32 (one pass, or
// three for close to float32 precision: tf32.cuh), accumulated in float32, fed
// by kernel 4's multi-stage cp.async pipeline.
//
// What it fixes in kernel 4 (see NOTES.md): there, every multiply-add was an
// FFMA issued by one thread, and the loop ran out of issue slots (FFMA 71% of
// issued instructions, 0.8 issued per scheduler per cycle) at about 0.75x of
// jnp.matmul. One mma.sync.m16n8k16 does 16 x 8 x 16 multiply-adds for the
// warp in one issued instruction, so arithmetic stops being issue-bound;
// what remains is feeding the tensor cores, which ldmatrix does by loading
// four 8 x 8 fragments per instruction straight into the registers mma wants.
//
// Shared tiles keep each operand's global layout, so every operand arrives in
// 16-byte cp.async copies with no transpose on the way in: a K-major tile
// ([x][k]: A plain, B transposed) is read by plain ldmatrix, an MN-major one
// ([k][x]: A transposed, B plain) by ldmatrix.trans, which transposes each
// 8 x 8 fragment as it loads it. The two layouts are template parameters of
// the kernel, so the loop holds no layout branches. Rows are padded by 16
// bytes to an odd number of 16-byte units (80, 144 or 272 bytes), so the
// 8 rows of a fragment fall in 8 distinct groups of 4 banks: each ldmatrix
// phase is conflict-free.
//
// float32 goes through mma.sync.m16n8k8 on TF32, whose registers hold one
// float where the 16-bit ones hold two elements; K per instruction halves, so
// a slab of the same 64 bytes per row (32 k of 16-bit, 16 of float) makes
// stages, shared memory and copies the same size for every input. The copies
// move raw float32 bits; each fragment is rounded, or split into two, to TF32
// in registers after it is loaded. ldmatrix still reads K-major float tiles:
// an 8 x 8 b16 matrix is 8 rows of 4 floats, and the plain load hands lane l
// float l % 4 of row l / 4, exactly the TF32 fragment. ldmatrix.trans would
// transpose 2-byte halves of floats, so an MN-major float tile is read by
// scalar 32-bit loads instead: the same bytes in four instructions where
// ldmatrix.x4 issues one, 16 per operand, warp and k8 step where 4 would do,
// beside 32 mma and 32 conversions to TF32 (split, on 64 x 32 warp tiles: 16
// and 8 loads beside 48 mma and 72 instructions of splitting). In those loads lane (g, t) reads
// element (x g, k t) of [k][x] rows, so the rows are padded by 8 floats (not 16 bytes) to a pitch
// of 8 banks mod 32, putting the lane in bank 8t + g: conflict-free too.
//
// cp.async needs 16-byte aligned rows. An operand whose rows are not (odd ld,
// offset base or batch stride) is copied by bounds-checked element loads into
// registers and one 16-byte shared store per chunk, synchronously, through
// the same stages and barriers; that is a correctness path, not a fast one.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/blocks/async_copy.cuh"
#include "cuda/blocks/blocked_sum.cuh"
#include "cuda/blocks/common.cuh"
#include "cuda/blocks/epilogue.cuh"
#include "cuda/blocks/tf32.cuh"
#include "cuda/kernel.h"
#include "stack_slice.h"

namespace jax_tiled::cuda {

// The input type, block shape in warps, each warp's output tile, the K slab
// depth, the slabs resident in shared memory, and how many blocks must fit on
// one SM.
template <class In, int kWarpsM_, int kWarpsN_, int kWarpM_, int kWarpN_, int kSlab_, int kStages_,
          int kMinBlocks_>
struct MmaConfig {
  using Input = In;
  static constexpr int kWarpsM = kWarpsM_, kWarpsN = kWarpsN_;
  static constexpr int kWarpM = kWarpM_, kWarpN = kWarpN_;
  static constexpr int kSlab = kSlab_, kStages = kStages_, kMinBlocks = kMinBlocks_;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kBlockM = kWarpsM * kWarpM, kBlockN = kWarpsN * kWarpN;
  static constexpr int kTilesM = kWarpM / 16, kTilesN = kWarpN / 8;  // mma tiles per warp
  // Whether the registers hold a second set of accumulators (blocked_sum.cuh).
  static constexpr bool kRoomForBlockedSum =
      RoomForBlockedSum(kTilesM * kTilesN * 4, kThreads* kMinBlocks_);
  // K per mma: m16n8k16 for 16-bit inputs, m16n8k8 for TF32; 32 bytes either way.
  static constexpr int kStep = sizeof(In) == 2 ? 16 : 8;
  // One ldmatrix.x4 loads a 16 x kStep piece: one m16 tile of A, or two n8 tiles of B.
  static_assert(kWarpM % 16 == 0 && kWarpN % 16 == 0, "warp tiles are whole 16 x 16 pieces");
  static_assert(kSlab % kStep == 0, "a slab is whole mma k steps");
  static_assert(kStages >= 2, "a pipeline needs a slab to fill while one is read");
};

// One operand's K slab in shared memory, in its global layout: K-major
// ([kX][kSlab]) or MN-major ([kSlab][kX]), x being the operand's free axis
// (M for A, N for B).
template <class In, int kX_, int kSlab_, bool kKMajor_>
struct MmaTile {
  static constexpr int kX = kX_, kSlab = kSlab_;
  static constexpr bool kKMajor = kKMajor_;
  static constexpr int kElementBytes = sizeof(In);
  static constexpr int kChunk = 16 / kElementBytes;  // elements per copy and per ldmatrix row
  // ldmatrix.trans cannot transpose floats (see the top of the file).
  static constexpr bool kLdmatrix = kElementBytes == 2 || kKMajor;
  static constexpr int kRows = kKMajor ? kX : kSlab;
  // Elements per padded row: 16 bytes of padding for ldmatrix, 8 floats for
  // scalar loads (see the top of the file for both).
  static constexpr int kPitch = (kKMajor ? kSlab : kX) + (kLdmatrix ? kChunk : 8);
  static constexpr int kBytes = kRows * kPitch * kElementBytes;
  static_assert(kElementBytes == 2 || kElementBytes == 4, "16-bit or float32 elements");
  static_assert(kLdmatrix ? kPitch * kElementBytes % 32 == 16 : kPitch % 32 == 8,
                "ldmatrix rows an odd number of 16-byte units; scalar rows 8 banks apart");

  // Byte offset of element (x, k).
  __host__ __device__ static constexpr int Offset(int x, int k) {
    return (kKMajor ? x * kPitch + k : k * kPitch + x) * kElementBytes;
  }

  // Byte offset of what `lane` reads for the warp's fragments at free-axis
  // offset x0, k = 0. ldmatrix.x4: the 16-byte row it addresses; matrix
  // q = lane / 8 of the four covers free-axis half x_half and 16-byte k part
  // k_part of the piece, lane % 8 being the row. Scalar loads: its element of
  // the first register, (x0 + g, t), x_half and k_part being unused.
  __device__ __forceinline__ static int FragmentOffset(int lane, int x0, int x_half, int k_part) {
    if constexpr (kLdmatrix) {
      const int x = x0 + x_half * 8, k = k_part * kChunk;
      return kKMajor ? Offset(x + lane % 8, k) : Offset(x, k + lane % 8);
    } else {
      return Offset(x0 + lane / 4, lane % 4);
    }
  }
};

// Loads four 8 x 8 b16 matrices; lanes 8q..8q+7 address the rows of matrix q,
// which lands in r[q]. Plain: lane l holds elements (l / 4, 2 (l % 4) + {0, 1})
// of each matrix as stored. .trans: it holds (2 (l % 4) + {0, 1}, l / 4), i.e.
// the same position of the transposed matrix.
template <bool kTrans>
__device__ __forceinline__ void LoadMatrices(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                             uint32_t address) {
  // volatile: the compiler cannot see that cp.async wrote what this reads,
  // so it must not move the load across the barriers.
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(address));
  }
}

// One 32-bit word of shared memory; volatile for the reason LoadMatrices gives.
__device__ __forceinline__ uint32_t LoadSharedWord(uint32_t address) {
  uint32_t r;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(r) : "r"(address));
  return r;
}

// c += a (16 x kStep, row-major) * b (kStep x 8, column-major), float
// accumulators. With g = lane / 4, t = lane % 4: 16-bit registers hold two
// consecutive k (or columns), a0 (row g, k 2t), a1 (row g + 8, k 2t),
// a2 (row g, k 2t + 8), a3 (row g + 8, k 2t + 8); b0 (k 2t, col g),
// b1 (k 2t + 8, col g). TF32 registers hold one float (rounded to TF32):
// a0 (row g, k t), a1 (row g + 8, k t), a2 (row g, k t + 4), a3 (row g + 8,
// k t + 4); b0 (k t, col g), b1 (k t + 4, col g). Both: a2, a3 and b1 are
// kStep / 2 (16 bytes) further along K than a0, a1 and b0, and c0, c1 (row g,
// cols 2t, 2t + 1), c2, c3 (row g + 8, same cols).
template <class In>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (std::is_same_v<In, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else if constexpr (std::is_same_v<In, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<In, float>, "mma.sync takes float16, bfloat16 or TF32");
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// The first `elems` (0..16 / sizeof(In)) of src, zero-padded to 16 bytes, as
// one 16-byte shared store: the fallback for rows cp.async cannot copy (not
// 16-byte aligned).
template <class In>
__device__ __forceinline__ void CopyChunkSync(unsigned char* dst, const In* src, int elems) {
  static_assert(sizeof(In) == 2 || sizeof(In) == 4, "chunks are 16-bit or 32-bit elements");
  using Bits = std::conditional_t<sizeof(In) == 2, unsigned short, uint32_t>;
  constexpr int kPerWord = 4 / sizeof(In);
  const auto* bits = reinterpret_cast<const Bits*>(src);
  uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    w[e] = 0;
#pragma unroll
    for (int p = 0; p < kPerWord; ++p) {  // element e * kPerWord at the lowest address
      const int i = e * kPerWord + p;
      w[e] |= (i < elems ? uint32_t{bits[i]} : 0u) << (p * 16);
    }
  }
  *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Issues one operand's K slabs, in order, into MmaTile stages. The stored
// matrix has element (x, k) at Tile::kKMajor ? base[x * ld + k] : base[k * ld + x].
// A thread copies kCopies 16-byte chunks (Tile::kChunk elements) per slab,
// all in the same column of the stored tile, kRowStep rows apart, so it keeps
// one running pointer and the few facts about the matrix edge that do not
// change along K.
template <class In, class Tile, int kThreads, bool kVector>
class MmaSlabCopier {
  static constexpr int kChunk = Tile::kChunk;
  static constexpr int kChunksPerRow = (Tile::kKMajor ? Tile::kSlab : Tile::kX) / kChunk;
  static constexpr int kCopies = Tile::kRows * kChunksPerRow / kThreads;
  static constexpr int kRowStep = kThreads / kChunksPerRow;
  static_assert(sizeof(In) == Tile::kElementBytes, "the tile holds In");
  static_assert(kThreads % kChunksPerRow == 0 && kCopies * kRowStep == Tile::kRows,
                "slab must split evenly over the threads");

 public:
  __device__ __forceinline__ MmaSlabCopier(const In* base, int64_t ld, int64_t x_limit,
                                           int64_t x0) {
    const int row = threadIdx.x / kChunksPerRow, col = threadIdx.x % kChunksPerRow * kChunk;
    dst_ = (row * Tile::kPitch + col) * Tile::kElementBytes;
    if constexpr (Tile::kKMajor) {  // row = x, col = k
      const int64_t x_left = x_limit - x0 - row;
#pragma unroll
      for (int i = 0; i < kCopies; ++i)
        x_inside_ |= static_cast<unsigned>(x_left > i * kRowStep) << i;
      src_ = base + (x0 + row) * ld + col;
      first_k_ = col;
    } else {  // row = k, col = x; the elements of x inside do not change along K
      x_elems_ = static_cast<int>(min(max(x_limit - x0 - col, int64_t{0}), int64_t{kChunk}));
      src_ = base + row * ld + x0 + col;
      first_k_ = row;
    }
  }

  // Copies the next slab into `tile`. k_left (> 0): K from the slab's first k
  // to the matrix edge. A copy of nothing gets `safe` (the operand's 16-byte
  // aligned first element) as its source, so no address outside the matrix
  // is ever handed to cp.async.
  __device__ __forceinline__ void IssueNext(unsigned char* tile, int64_t k_left, int64_t ld,
                                            const In* safe) {
    // K from this thread's first k to the edge, capped so it fits an int;
    // > -kSlab since k_left > 0.
    constexpr int kCap = Tile::kKMajor ? kChunk : Tile::kSlab;
    const int room = static_cast<int>(min(k_left - first_k_, int64_t{kCap}));
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      int elems;  // of the chunk's kChunk, inside the matrix
      if constexpr (Tile::kKMajor) elems = (x_inside_ >> i & 1) ? max(room, 0) : 0;
      else elems = room > i * kRowStep ? x_elems_ : 0;
      const In* src = src_ + i * kRowStep * ld;
      unsigned char* dst = tile + dst_ + i * kRowStep * Tile::kPitch * Tile::kElementBytes;
      if constexpr (kVector) {
        CopyAsync<16>(dst, elems > 0 ? src : safe, elems * Tile::kElementBytes);
      } else {
        CopyChunkSync(dst, src, elems);
      }
    }
    if constexpr (Tile::kKMajor) src_ += Tile::kSlab;  // along the rows
    else src_ += Tile::kSlab * ld;                     // down the rows
  }

 private:
  const In* src_;          // this thread's first chunk of the next slab
  int dst_;                // its byte offset within a stage's tile
  int first_k_;            // its first k within a slab
  unsigned x_inside_ = 0;  // K-major: bit i, copy i's row is inside the matrix
  int x_elems_ = 0;        // MN-major: elements of its chunks inside the matrix
};

// A's registers for the warp's m16 tile i at k step s (Mma's a0..a3): one
// ldmatrix.x4, or four scalar loads. lane_address: Tile::FragmentOffset's, in
// the stage being read.
template <class Cfg, class Tile>
__device__ __forceinline__ void LoadFragmentA(uint32_t (&a)[4], uint32_t lane_address, int i,
                                              int s) {
  const int k = s * Cfg::kStep;
  if constexpr (Tile::kLdmatrix) {
    LoadMatrices<!Tile::kKMajor>(a[0], a[1], a[2], a[3], lane_address + Tile::Offset(16 * i, k));
  } else {
#pragma unroll
    for (int r = 0; r < 4; ++r)  // rows g, g + 8, g, g + 8; k t, t, t + h, t + h
      a[r] = LoadSharedWord(lane_address +
                            Tile::Offset(16 * i + r % 2 * 8, k + r / 2 * (Cfg::kStep / 2)));
  }
}

// B's registers (Mma's b0, b1) for the warp's n8 tiles j and j + 1 at k
// step s: one ldmatrix.x4, or four scalar loads.
template <class Cfg, class Tile>
__device__ __forceinline__ void LoadFragmentsB(uint32_t (&b)[2], uint32_t (&b_next)[2],
                                               uint32_t lane_address, int j, int s) {
  const int k = s * Cfg::kStep;
  if constexpr (Tile::kLdmatrix) {
    LoadMatrices<!Tile::kKMajor>(b[0], b[1], b_next[0], b_next[1],
                                 lane_address + Tile::Offset(8 * j, k));
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // col g; k t, t + h
      b[r] = LoadSharedWord(lane_address + Tile::Offset(8 * j, k + r * (Cfg::kStep / 2)));
      b_next[r] =
          LoadSharedWord(lane_address + Tile::Offset(8 * (j + 1), k + r * (Cfg::kStep / 2)));
    }
  }
}

// Float bits in place to TF32 ones (one pass), or to their TF32 high parts,
// with the low parts in `lo` (three passes).
template <int kTiles, int kRegs>
__device__ __forceinline__ void RoundFragmentsToTf32(uint32_t (&f)[kTiles][kRegs]) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int r = 0; r < kRegs; ++r) f[i][r] = RoundToTf32(__uint_as_float(f[i][r]));
}

template <int kTiles, int kRegs>
__device__ __forceinline__ void SplitFragmentsTf32(uint32_t (&f)[kTiles][kRegs],
                                                   uint32_t (&lo)[kTiles][kRegs]) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int r = 0; r < kRegs; ++r) SplitTf32(__uint_as_float(f[i][r]), f[i][r], lo[i][r]);
}

// acc += a * b over the warp's kTilesM x kTilesN mma tiles, one k step.
template <class In, int kTilesM, int kTilesN>
__device__ __forceinline__ void MmaWarpTile(float (&acc)[kTilesM][kTilesN][4],
                                            const uint32_t (&a)[kTilesM][4],
                                            const uint32_t (&b)[kTilesN][2]) {
#pragma unroll
  for (int i = 0; i < kTilesM; ++i)
#pragma unroll
    for (int j = 0; j < kTilesN; ++j) Mma<In>(acc[i][j], a[i], b[j][0], b[j][1]);
}

// The warp's fragments for k step s: one ldmatrix.x4 (or four scalar loads)
// per m16 tile of A and per pair of n8 tiles of B, as raw input bits.
template <class Cfg, class TileA, class TileB>
__device__ __forceinline__ void LoadWarpFragments(uint32_t (&a)[Cfg::kTilesM][4],
                                                  uint32_t (&b)[Cfg::kTilesN][2], uint32_t a_lane,
                                                  uint32_t b_lane, int s) {
#pragma unroll
  for (int i = 0; i < Cfg::kTilesM; ++i) LoadFragmentA<Cfg, TileA>(a[i], a_lane, i, s);
#pragma unroll
  for (int j = 0; j < Cfg::kTilesN; j += 2)
    LoadFragmentsB<Cfg, TileB>(b[j], b[j + 1], b_lane, j, s);
}

// acc += the warp's share of one slab: per k step, the fragments, float bits
// made TF32, then kTilesM x kTilesN mma, three times that when split.
// a_lane and b_lane: FragmentOffset's addresses in the stage being read.
//
// The tensor cores truncate (round toward zero) when they add into the float
// accumulator, so mma-ing three passes per k step straight into acc would
// lose about an ulp of the running sum per mma: an error linear in K and
// biased toward zero (relative 7e-6 at K = 1024, 1e-4 at K = 16384, where
// float32 FFMA stays under 3e-6). So the split path sums each slab's products
// into a chunk that starts at zero, truncating only relative to that slab's
// partial sum, and adds the chunk into acc with ordinary round-to-nearest
// float adds: a chunk's error is a few ulp of its own slab's sum, with that
// sum's sign, which varies from slab to slab. Within the slab the small terms (a_lo b_lo,
// a_lo b_hi, a_hi b_lo, every k step) go in first, while the chunk is still small, and the
// a_hi b_hi ones last.
// That keeps every k step's hi parts live across the slab, and the chunk
// doubles the accumulators, hence the split configs' smaller warp tiles
// (MmaLarge, MmaSmall).
template <class Cfg, class TileA, class TileB, bool kSplit>
__device__ __forceinline__ void MmaSlab(float (&acc)[Cfg::kTilesM][Cfg::kTilesN][4],
                                        uint32_t a_lane, uint32_t b_lane) {
  using In = typename Cfg::Input;
  constexpr int kSteps = Cfg::kSlab / Cfg::kStep;
  if constexpr (!kSplit) {
    // Only one k step's fragments are live at a time.
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      uint32_t af[Cfg::kTilesM][4], bf[Cfg::kTilesN][2];
      LoadWarpFragments<Cfg, TileA, TileB>(af, bf, a_lane, b_lane, s);
      if constexpr (std::is_same_v<In, float>) {
        RoundFragmentsToTf32(af);
        RoundFragmentsToTf32(bf);
      }
      MmaWarpTile<In>(acc, af, bf);
    }
  } else {
    static_assert(std::is_same_v<In, float>, "only float32 inputs are split");
    float chunk[Cfg::kTilesM][Cfg::kTilesN][4];
#pragma unroll
    for (int i = 0; i < Cfg::kTilesM; ++i)
#pragma unroll
      for (int j = 0; j < Cfg::kTilesN; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) chunk[i][j][r] = 0.0f;
    uint32_t a_hi[kSteps][Cfg::kTilesM][4], b_hi[kSteps][Cfg::kTilesN][2];
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      LoadWarpFragments<Cfg, TileA, TileB>(a_hi[s], b_hi[s], a_lane, b_lane, s);
      uint32_t a_lo[Cfg::kTilesM][4], b_lo[Cfg::kTilesN][2];
      SplitFragmentsTf32(a_hi[s], a_lo);
      SplitFragmentsTf32(b_hi[s], b_lo);
      // Each pass is kTilesM x kTilesN independent mma, so no pass waits on
      // the previous one's result for long.
      MmaWarpTile<In>(chunk, a_lo, b_lo);
      MmaWarpTile<In>(chunk, a_lo, b_hi[s]);
      MmaWarpTile<In>(chunk, a_hi[s], b_lo);
    }
#pragma unroll
    for (int s = 0; s < kSteps; ++s) MmaWarpTile<In>(chunk, a_hi[s], b_hi[s]);
#pragma unroll
    for (int i = 0; i < Cfg::kTilesM; ++i)
#pragma unroll
      for (int j = 0; j < Cfg::kTilesN; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[i][j][r] += chunk[i][j][r];
  }
}

// Writes the warp's accumulators (the c layout of Mma) to `out`, clipped to
// the matrix (epilogue.cuh: the same writer as wgmma's).
template <class Cfg, class Out>
__device__ __forceinline__ void StoreWarpTile(const float (&acc)[Cfg::kTilesM][Cfg::kTilesN][4],
                                              const OutputWriter<Out>& out, int64_t row0,
                                              int64_t col0) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < Cfg::kTilesM; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // c0, c1 at row g; c2, c3 at row g + 8
      const int64_t row = row0 + i * 16 + h * 8 + lane / 4;
      if (!out.RowInside(row)) continue;
#pragma unroll
      for (int j = 0; j < Cfg::kTilesN; ++j)
        out.Pair(row, col0 + j * 8 + lane % 4 * 2, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
    }
}

template <class Cfg, bool kAKMajor>
using MmaTileA = MmaTile<typename Cfg::Input, Cfg::kBlockM, Cfg::kSlab, kAKMajor>;
template <class Cfg, bool kBKMajor>
using MmaTileB = MmaTile<typename Cfg::Input, Cfg::kBlockN, Cfg::kSlab, kBKMajor>;

template <class Cfg, bool kAKMajor, bool kBKMajor>
__host__ __device__ constexpr int MmaStageBytes() {
  return MmaTileA<Cfg, kAKMajor>::kBytes + MmaTileB<Cfg, kBKMajor>::kBytes;
}

// kAKMajor: A stored (m, k), i.e. not transposed; kBKMajor: B stored (n, k),
// i.e. transposed. kVector: both operands' rows are 16-byte aligned. kSplit:
// float32 inputs in three TF32 passes rather than one.
// Dynamic shared memory: kStages x (A tile, B tile).
template <class Cfg, bool kAKMajor, bool kBKMajor, bool kVector, bool kSplit, class Out>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    MmaSyncMatmul(MatmulDims dims, const typename Cfg::Input* __restrict__ a,
                  const typename Cfg::Input* __restrict__ b, Out* __restrict__ out,
                  bool pair_stores, StackSlice a_stack, StackSlice b_stack) {
  using In = typename Cfg::Input;
  using TileA = MmaTileA<Cfg, kAKMajor>;
  using TileB = MmaTileB<Cfg, kBKMajor>;
  constexpr int kStageBytes = MmaStageBytes<Cfg, kAKMajor, kBKMajor>();
  extern __shared__ __align__(16) unsigned char stages[];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / Cfg::kWarpsN * Cfg::kWarpM, warp_n = warp % Cfg::kWarpsN * Cfg::kWarpN;
  const int q = lane / 8;  // the ldmatrix.x4 matrix this lane addresses a row of
  // A: matrices q = 0..3 are a0..a3 = (m 0-7, k part 0), (m 8-15, k part 0),
  // (m 0-7, k part 1), (m 8-15, k part 1), a k part being 16 bytes (8 k of
  // 16-bit, 4 of float): m half q % 2, k part q / 2. K-major, plain ldmatrix
  // gives lane l (m g, 4 bytes t of the part): k 2t..2t+1 of 16-bit, k t of
  // float; MN-major 16-bit ([k][m]), .trans gives (k 2t..2t+1, m g) as
  // stored, the same elements. MN-major float: scalar loads.
  const uint32_t a_lane = SharedAddress(stages) + TileA::FragmentOffset(lane, warp_m, q % 2, q / 2);
  // B: matrices q = 0..3 are b0, b1 of n tile j, b0, b1 of n tile j + 1 =
  // (n 0-7, k part 0), (n 0-7, k part 1), (n 8-15, k part 0), (n 8-15, k
  // part 1): n half q / 2, k part q % 2. K-major ([n][k]), plain gives lane l
  // (n g, 4 bytes t of the part) = b's (k 2t..2t+1 or t, col g); MN-major
  // 16-bit ([k][n]), .trans gives the same. MN-major float: scalar loads.
  const uint32_t b_lane =
      SharedAddress(stages) + TileA::kBytes + TileB::FragmentOffset(lane, warp_n, q / 2, q % 2);

  const TileOrder<Cfg::kBlockM, Cfg::kBlockN> order(dims);
  const int64_t slabs = (dims.k + Cfg::kSlab - 1) / Cfg::kSlab;
  a += a_stack.Offset();  // an operand that is a slice of a stack: that slice
  b += b_stack.Offset();

  for (int64_t tile = blockIdx.x; tile < order.count; tile += gridDim.x) {
    int64_t batch, row0, col0;
    order.Locate(tile, batch, row0, col0);
    MmaSlabCopier<In, TileA, Cfg::kThreads, kVector> copy_a(a + batch * dims.a_batch_stride,
                                                            dims.lda, dims.m, row0);
    MmaSlabCopier<In, TileB, Cfg::kThreads, kVector> copy_b(b + batch * dims.b_batch_stride,
                                                            dims.ldb, dims.n, col0);
    auto issue = [&](int64_t slab, int stage) {
      // Every thread commits a group per slab, empty past the last one,
      // so the wait below always counts the same number of groups.
      if (slab < slabs) {  // slabs are issued in order
        const int64_t k_left = dims.k - slab * Cfg::kSlab;
        unsigned char* at = stages + stage * kStageBytes;
        copy_a.IssueNext(at, k_left, dims.lda, a);
        copy_b.IssueNext(at + TileA::kBytes, k_left, dims.ldb, b);
      }
      CommitCopies();
    };

    // The split path sums each slab afresh already (MmaSlab); one pass blocks
    // its sums where the registers allow.
    Accumulators<float[Cfg::kTilesM][Cfg::kTilesN][4], Cfg::kSlab,
                 !kSplit && Cfg::kRoomForBlockedSum, kTruncatedSumDepth>
        acc;
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) issue(s, s);
    int read = 0;  // slab % kStages, without 64-bit division
    for (int64_t slab = 0; slab < slabs; ++slab) {
      WaitCopies<Cfg::kStages - 2>();  // this thread's copies of `slab` have landed
      // Everyone's copies of `slab` are visible, and everyone is done
      // reading slab - 1, whose stage the next issue overwrites.
      __syncthreads();
      issue(slab + Cfg::kStages - 1, read == 0 ? Cfg::kStages - 1 : read - 1);
      MmaSlab<Cfg, TileA, TileB, kSplit>(acc.partial, a_lane + read * kStageBytes,
                                         b_lane + read * kStageBytes);
      acc.EndSlab(slab);
      read = read == Cfg::kStages - 1 ? 0 : read + 1;
    }
    StoreWarpTile<Cfg>(acc.Result(), OutputWriter<Out>(out, dims, batch, pair_stores),
                       row0 + warp_m, col0 + warp_n);
    __syncthreads();  // the next tile's first copies overwrite stages still being read
  }
}

// 128 x 128 blocks of 2 x 2 warps of 64 x 64, four slabs resident (80 KB at
// most, two blocks per SM on A100 and H100); 64 x 64 blocks of 2 x 2 warps of
// 32 x 32 (40 KB) when the large ones would not fill the GPU twice. A slab is
// 64 bytes of K: 32 k of 16-bit inputs, 16 of float32. kSplit (3xTF32) keeps
// a chunk accumulator beside acc (MmaSlab), which 64 x 64 warp tiles have no
// registers for (128 + 128 of 255), so its large blocks are the same 128 x 128
// as 2 x 4 warps of 64 x 32, one 256-thread block per SM (the same 8 warps
// per SM, and up to 255 registers each); its small ones keep their shape,
// two to an SM rather than four (up to 255 registers rather than 128: at
// three, 168, ptxas spilled 4 to 8 bytes a thread where a is stored (k, m), b
// (n, k), and the rows are copied element by element).
// 16-bit inputs' small blocks are three to an SM: at 128 registers ptxas
// spilled 8 bytes a thread in three of their four layouts, and they run the
// small products of lax.scan chains, at most one block an SM (SmallForMma).
template <class In, bool kSplit = false>
using MmaLarge =
    MmaConfig<In, 2, kSplit ? 4 : 2, 64, kSplit ? 32 : 64, 64 / sizeof(In), 4, kSplit ? 1 : 2>;
template <class In, bool kSplit = false>
using MmaSmall = MmaConfig<In, 2, 2, 32, 32, 64 / sizeof(In), 4,
                           kSplit            ? 2
                           : sizeof(In) == 2 ? 3
                                             : 4>;

// 32 x 32 blocks of 2 x 2 warps of 16 x 16 (20 KB), for a product whose
// 64 x 64 tiles would take a few SMs, each running its whole K in series
// while the others idle: four times the blocks, a quarter of each one's
// mma.sync a slab (NOTES.md, "mma's small tiles"). As many blocks an SM as
// MmaSmall's.
template <class In, bool kSplit = false>
using MmaTiny = MmaConfig<In, 2, 2, 16, 16, 64 / sizeof(In), 4, MmaSmall<In, kSplit>::kMinBlocks>;

// The block shapes do not depend on the input type, nor on kSplit.
inline bool MmaUsesLargeBlocks(const MatmulDims& dims, int multiprocessors) {
  using Large = MmaLarge<float>;
  static_assert(MmaLarge<float, true>::kBlockM == Large::kBlockM &&
                    MmaLarge<float, true>::kBlockN == Large::kBlockN,
                "split blocks are the same shape");
  return TileOrder<Large::kBlockM, Large::kBlockN>(dims).count >= 2 * multiprocessors;
}

// Tiny blocks where their tiles take at most half the SMs: then the 64 x 64
// ones take at most an eighth, and auto's test for a small product
// (auto.cu, SmallForMma: the plan's tiles on at most half the SMs) says
// what it said of those.
inline bool MmaUsesTinyBlocks(const MatmulDims& dims, int multiprocessors) {
  using Tiny = MmaTiny<float>;
  return 2 * TileOrder<Tiny::kBlockM, Tiny::kBlockN>(dims).count <= multiprocessors;
}

// Whether every stored row of an operand that the kernel reads starts 16-byte
// aligned, so its slabs can move as 16-byte cp.async copies. The stride
// between rows (or batches, or slices of a stack) is never applied when there
// is only one.
template <class In>
bool ChunkAligned(const In* p, int64_t ld, int64_t rows, int64_t batch_stride, int64_t batch,
                  const StackSlice& stack) {
  constexpr int64_t kChunk = 16 / sizeof(In);  // elements per 16 bytes
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && (rows == 1 || ld % kChunk == 0) &&
         (batch == 1 || batch_stride % kChunk == 0) &&
         (stack.count == 1 || stack.stride % kChunk == 0);
}

// Calls f(std::true_type{}) or f(std::false_type{}): a run-time flag picks a
// template instantiation.
template <class F>
cudaError_t WithMmaFlag(bool flag, F&& f) {
  return flag ? f(std::true_type{}) : f(std::false_type{});
}

// Operands given as slices of stacks (`a_stack`, `b_stack`) are read in place.
template <class Cfg, bool kAKMajor, bool kBKMajor, bool kVector, bool kSplit, class Out>
cudaError_t LaunchMmaSyncWith(const MatmulDims& dims, const typename Cfg::Input* a,
                              const typename Cfg::Input* b, Out* out, cudaStream_t stream,
                              bool pair_stores, const StackSlice& a_stack,
                              const StackSlice& b_stack) {
  constexpr auto kKernel = &MmaSyncMatmul<Cfg, kAKMajor, kBKMajor, kVector, kSplit, Out>;
  constexpr int kBytes = Cfg::kStages * MmaStageBytes<Cfg, kAKMajor, kBKMajor>();
  if (const cudaError_t err = AllowSharedMemory<kKernel>(kBytes); err != cudaSuccess) return err;
  const dim3 grid = TileOrder<Cfg::kBlockM, Cfg::kBlockN>(dims).Grid();
  kKernel<<<grid, Cfg::kThreads, kBytes, stream>>>(dims, a, b, out, pair_stores, a_stack, b_stack);
  return cudaGetLastError();
}

// In: __half, __nv_bfloat16, or float (TF32 tensor cores: one pass, or three
// with kSplit = true, see tf32.cuh); kSplit is for float only. Out: __half,
// __nv_bfloat16 or float. Accumulates in float. Needs sm_80+; k > 0 and a
// non-empty output.
template <class In, class Out, bool kSplit = false>
cudaError_t LaunchMmaSync(const LaunchPlan& plan, const MatmulDims& dims, const In* a, const In* b,
                          Out* out, cudaStream_t stream, const StackSlice& a_stack = {},
                          const StackSlice& b_stack = {}) {
  static_assert(!kSplit || std::is_same_v<In, float>, "only float32 inputs are split");
  const bool vector = ChunkAligned(a, dims.lda, dims.transpose_a ? dims.k : dims.m,
                                   dims.a_batch_stride, dims.batch, a_stack) &&
                      ChunkAligned(b, dims.ldb, dims.transpose_b ? dims.n : dims.k,
                                   dims.b_batch_stride, dims.batch, b_stack);
  const bool pairs = RowsAligned(dims, out, 2 * sizeof(Out));
  return WithConfig<MmaLarge<In, kSplit>, MmaSmall<In, kSplit>, MmaTiny<In, kSplit>>(
      plan, [&](auto cfg) {
        using Cfg = decltype(cfg);
        return WithMmaFlag(!dims.transpose_a, [&](auto a_k_major) {
          return WithMmaFlag(dims.transpose_b, [&](auto b_k_major) {
            return WithMmaFlag(vector, [&](auto vector_copies) {
              return LaunchMmaSyncWith<Cfg, decltype(a_k_major)::value, decltype(b_k_major)::value,
                                       decltype(vector_copies)::value, kSplit>(
                  dims, a, b, out, stream, pairs, a_stack, b_stack);
            });
          });
        });
      });
}

inline constexpr Takes kMmaTakes = [] {
  Takes takes = TensorCoreTakes(80, /*hopper_only=*/false);
  takes.stack_slices = true;
  // Each operand's tile reaches shared memory as stored (cp.async) and
  // ldmatrix reads it either way: every layout ran at the plain layout's
  // speed on an H100, where XLA's copy first cost 2.3-2.8 us (NOTES.md,
  // "Transposed operands read as stored").
  takes.reads_transposes = true;
  return takes;
}();

// The descriptor's launcher for one input type, instantiated per input in
// its own translation unit (kernel.h, JAX_TILED_PER_INPUT_LAUNCHER).
template <class In>
cudaError_t LaunchMmaFor(const LaunchPlan& plan, const Product& p, void* out,
                         const LaunchContext& context) {
  return VisitOutput<kMmaTakes>(p.out_type, [&](auto result) -> cudaError_t {
    using Out = decltype(result);
    const auto* a = static_cast<const In*>(p.a);
    const auto* b = static_cast<const In*>(p.b);
    if constexpr (std::is_same_v<In, float>)
      if (p.SplitsTf32())
        return LaunchMmaSync<In, Out, true>(plan, p.dims, a, b, static_cast<Out*>(out),
                                            context.stream, p.a_stack, p.b_stack);
    return LaunchMmaSync<In, Out>(plan, p.dims, a, b, static_cast<Out*>(out), context.stream,
                                  p.a_stack, p.b_stack);
  });
}

}  // namespace jax_tiled::cuda
