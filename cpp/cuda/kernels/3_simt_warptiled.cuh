// Kernel 3, "warptile": register-blocked, warp-tiled SIMT matmul with 16-byte
// vector loads and a double-buffered global -> shared pipeline.
//
// What it fixes in kernel 1 (see NOTES.md): there, every FMA needed two shared
// loads. Here each thread owns an 8 x 8 block of the output (two 4 x 4 quads
// in each direction), so per k step it reads 8 values of A and 8 of B with four
// 16-byte shared loads and does 64 FMAs from registers. Warps own 32 x 64
// sub-tiles laid out so that those loads are broadcasts or conflict-free.
// Global loads for the next K slab are issued into registers before the
// current slab's FMAs and land in the other shared buffer afterwards, so
// memory latency hides behind arithmetic with one barrier per slab.
//
// Shared tiles are K-major (tile[k][x]) for both operands. An operand stored
// with x contiguous (A transposed, B plain) is copied with vector stores; one
// stored with k contiguous (A plain, B transposed) is transposed on the way in
// by four scalar stores, into rows padded so those stores do not conflict.
//
// Where the output tiles alone would leave SMs idle and K is long, K is cut
// into parts, a block each, added by a second kernel (k_parts.cuh).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/blocks/blocked_sum.cuh"
#include "cuda/blocks/common.cuh"
#include "cuda/blocks/k_parts.cuh"

namespace jax_tiled::cuda {

// Block shape in warps (each warp computes 32 x 64), the K slab depth, how
// many blocks must fit on one SM (which caps registers per thread), and
// whether K may be cut into parts (k_parts.cuh): for float32 accumulators
// only, since a thread's 64 doubles leave no registers for the parts'
// bookkeeping (ptxas spilled), and in the configuration for few tiles only
// (the other one is chosen where its tiles fill the GPU); the others compile
// without it.
template <int kWarpsM_, int kWarpsN_, int kSlab_, int kMinBlocks_, bool kSplitsK_ = false>
struct WarpTileConfig {
  static constexpr int kWarpsM = kWarpsM_, kWarpsN = kWarpsN_, kSlab = kSlab_;
  static constexpr int kMinBlocks = kMinBlocks_;
  template <class Acc>
  static constexpr bool kPartsOfK = kSplitsK_ && sizeof(Acc) == 4;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kBlockM = 32 * kWarpsM, kBlockN = 64 * kWarpsN;
  // Whether each thread's 8 x 8 sums of Acc can be blocked (blocked_sum.cuh).
  template <class Acc>
  static constexpr bool kBlockedSum = RoomForBlockedSum(64 * sizeof(Acc) / 4, kThreads* kMinBlocks);
  // Quads of 4 elements a thread stages per slab (SlabLoader), both operands.
  static constexpr int kStagedQuads = (kBlockM + kBlockN) * kSlab / 4 / kThreads;
  // Whether a thread's 64 sums of Acc fit its registers beside what it
  // stages: doubles did beside 4 staged quads and spilled beside 5 (ptxas -v).
  template <class Acc>
  static constexpr bool kFits = sizeof(Acc) == 4 || kStagedQuads <= 4;
};

// Four consecutive accumulators in shared memory as 16-byte accesses (the
// address is a multiple of 4 elements, and rows are 16-byte aligned).
template <class Acc>
__device__ __forceinline__ void LoadQuad(const Acc* p, Acc (&dst)[8], int at) {
  if constexpr (sizeof(Acc) == 4) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    dst[at] = v.x;
    dst[at + 1] = v.y;
    dst[at + 2] = v.z;
    dst[at + 3] = v.w;
  } else {
    const double2 lo = reinterpret_cast<const double2*>(p)[0];
    const double2 hi = reinterpret_cast<const double2*>(p)[1];
    dst[at] = lo.x;
    dst[at + 1] = lo.y;
    dst[at + 2] = hi.x;
    dst[at + 3] = hi.y;
  }
}

template <class Acc>
__device__ __forceinline__ void StoreQuad(Acc* p, const Acc (&src)[4]) {
  if constexpr (sizeof(Acc) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(src[0], src[1], src[2], src[3]);
  } else {
    reinterpret_cast<double2*>(p)[0] = make_double2(src[0], src[1]);
    reinterpret_cast<double2*>(p)[1] = make_double2(src[2], src[3]);
  }
}

// One operand's K slab: global (strided, any layout) -> registers -> shared.
// x is the operand's free axis (M for A, N for B); the stored matrix has
// element (x, k) at k_contiguous ? base[x * ld + k] : base[k * ld + x].
template <int kX, int kSlab, int kThreads, class In, class Acc>
struct SlabLoader {
  static constexpr int kQuads = kX * kSlab / 4;  // groups of 4 contiguous elements
  static constexpr int kPerThread = kQuads / kThreads;
  static_assert(kQuads % kThreads == 0, "slab must split evenly over the threads");
  static constexpr int kPad = 4;  // row padding (elements) for transposing stores
  using Tile = Acc[kSlab][kX + kPad];
  struct alignas(4 * sizeof(In)) Quad { In v[4]; };

  const In* base;
  int64_t ld, x_limit, k_limit;
  bool k_contiguous, vector_ok;  // vector_ok: ld and base allow aligned Quad loads
  Acc staged[kPerThread][4];

  // Where quad q of the slab starts, as (x, k) offsets within the slab.
  __device__ __forceinline__ void QuadOrigin(int q, int& x, int& k) const {
    if (k_contiguous) {
      x = q / (kSlab / 4);
      k = q % (kSlab / 4) * 4;
    } else {
      k = q / (kX / 4);
      x = q % (kX / 4) * 4;
    }
  }

  __device__ __forceinline__ void Fetch(int64_t x0, int64_t k0) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      int x, k;
      QuadOrigin(threadIdx.x + i * kThreads, x, k);
      const int64_t gx = x0 + x, gk = k0 + k;
      // A quad always runs along the stored contiguous axis: p[0..3].
      const In* p = base + (k_contiguous ? gx * ld + gk : gk * ld + gx);
      const bool whole =
          k_contiguous ? (gx < x_limit && gk + 3 < k_limit) : (gk < k_limit && gx + 3 < x_limit);
      if (whole && vector_ok) {
        const Quad q = *reinterpret_cast<const Quad*>(p);
#pragma unroll
        for (int e = 0; e < 4; ++e) staged[i][e] = ToAccumulator<Acc>(q.v[e]);
      } else {  // matrix edge or unaligned: element by element, zeros outside
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool inside = k_contiguous ? (gx < x_limit && gk + e < k_limit)
                                           : (gk < k_limit && gx + e < x_limit);
          staged[i][e] = inside ? ToAccumulator<Acc>(p[e]) : Acc{0};
        }
      }
    }
  }

  __device__ __forceinline__ void Store(Tile& tile) const {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      int x, k;
      QuadOrigin(threadIdx.x + i * kThreads, x, k);
      if (k_contiguous) {
#pragma unroll
        for (int e = 0; e < 4; ++e) tile[k + e][x] = staged[i][e];
      } else {
        StoreQuad(&tile[k][x], staged[i]);
      }
    }
  }
};

// Where this thread's 8 x 8 block sits in the block tile. Within a warp,
// lanes form 4 rows x 8 columns; each lane owns rows {4r..4r+3, 4r+16..4r+19}
// and columns {4c..4c+3, 4c+32..4c+35} of the warp's 32 x 64 tile. A-fragment
// loads are then broadcasts among the 8 lanes of a row, and the B-fragment
// loads of 8 lanes cover 128 contiguous bytes.
struct ThreadTile {
  int m, n;  // first row and column
  __device__ __forceinline__ explicit ThreadTile(int warps_n) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    m = warp / warps_n * 32 + lane / 8 * 4;
    n = warp % warps_n * 64 + lane % 8 * 4;
  }
};

// acc += this thread's share of one K-major slab: per k, four 16-byte shared
// loads feed 64 FMAs.
template <int kSlab, int kRowA, int kRowB, class Acc>
__device__ __forceinline__ void AccumulateSlab(Acc (&acc)[8][8], const Acc (&a)[kSlab][kRowA],
                                               const Acc (&b)[kSlab][kRowB], ThreadTile t) {
#pragma unroll
  for (int k = 0; k < kSlab; ++k) {
    Acc af[8], bf[8];
    LoadQuad(&a[k][t.m], af, 0);
    LoadQuad(&a[k][t.m + 16], af, 4);
    LoadQuad(&b[k][t.n], bf, 0);
    LoadQuad(&b[k][t.n + 32], bf, 4);
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] += af[i] * bf[j];
  }
}

// Writes this thread's 8 x 8 block of the (row0, col0) block tile, clipped to
// the matrix.
template <class Out, class Acc>
__device__ __forceinline__ void StoreThreadTile(const Acc (&acc)[8][8], ThreadTile t, Out* out,
                                                const MatmulDims& dims, int64_t row0,
                                                int64_t col0) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t row = row0 + t.m + (i < 4 ? i : 12 + i);
    if (row >= dims.m) continue;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t col = col0 + t.n + (j < 4 ? j : 28 + j);
      if (col < dims.n) out[row * dims.ldc + col] = FromAccumulator<Out>(acc[i][j]);
    }
  }
}

// The grid's z runs over the batch and the parts of K (k_parts.cuh): z =
// part * batch + the batch index. Part p writes its sums at out + p *
// parts.slot_stride.
template <class Cfg, class In, class Out, class Acc>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    WarpTiledMatmul(MatmulDims dims, const In* __restrict__ a, const In* __restrict__ b,
                    Out* __restrict__ out, bool a_vector_ok, bool b_vector_ok, KParts split_parts) {
  const KParts parts = Cfg::template kPartsOfK<Acc> ? split_parts : KParts{1, dims.k, 0};
  using LoaderA = SlabLoader<Cfg::kBlockM, Cfg::kSlab, Cfg::kThreads, In, Acc>;
  using LoaderB = SlabLoader<Cfg::kBlockN, Cfg::kSlab, Cfg::kThreads, In, Acc>;
  __shared__ __align__(16) typename LoaderA::Tile a_tiles[2];
  __shared__ __align__(16) typename LoaderB::Tile b_tiles[2];

  const ThreadTile thread_tile(Cfg::kWarpsN);
  const int64_t tiles_m = (dims.m + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int64_t tiles_n = (dims.n + Cfg::kBlockN - 1) / Cfg::kBlockN;

  for (int64_t z = blockIdx.z; z < dims.batch * parts.count; z += gridDim.z) {
    const int64_t batch = parts.count == 1 ? z : z % dims.batch;
    const int64_t part = parts.count == 1 ? 0 : z / dims.batch;
    const int64_t k0 = parts.Begin(part), depth = parts.Length(part, dims.k);
    const int64_t slabs = (depth + Cfg::kSlab - 1) / Cfg::kSlab;
    for (int64_t tile_m = blockIdx.y; tile_m < tiles_m; tile_m += gridDim.y) {
      for (int64_t tile_n = blockIdx.x; tile_n < tiles_n; tile_n += gridDim.x) {
        const int64_t row0 = tile_m * Cfg::kBlockM, col0 = tile_n * Cfg::kBlockN;
        LoaderA load_a{FromK(a + batch * dims.a_batch_stride, dims.lda, !dims.transpose_a, k0),
                       dims.lda,
                       dims.m,
                       depth,
                       !dims.transpose_a,
                       a_vector_ok};
        LoaderB load_b{FromK(b + batch * dims.b_batch_stride, dims.ldb, dims.transpose_b, k0),
                       dims.ldb,
                       dims.n,
                       depth,
                       dims.transpose_b,
                       b_vector_ok};

        Accumulators<Acc[8][8], Cfg::kSlab, Cfg::template kBlockedSum<Acc>> acc;
        load_a.Fetch(row0, 0);
        load_b.Fetch(col0, 0);
        load_a.Store(a_tiles[0]);
        load_b.Store(b_tiles[0]);
        __syncthreads();

        for (int64_t slab = 0; slab < slabs; ++slab) {
          const int cur = slab & 1;
          const bool more = slab + 1 < slabs;
          if (more) {  // in flight while the FMAs below run
            load_a.Fetch(row0, (slab + 1) * Cfg::kSlab);
            load_b.Fetch(col0, (slab + 1) * Cfg::kSlab);
          }
          AccumulateSlab(acc.partial, a_tiles[cur], b_tiles[cur], thread_tile);
          acc.EndSlab(slab);
          if (more) {  // the other buffer was last read before the previous barrier
            load_a.Store(a_tiles[cur ^ 1]);
            load_b.Store(b_tiles[cur ^ 1]);
          }
          __syncthreads();
        }

        StoreThreadTile(acc.Result(), thread_tile,
                        out + part * parts.slot_stride + batch * dims.out_batch_stride, dims, row0,
                        col0);
      }
    }
  }
}

// Shape-dependent block size: 128 x 128 blocks once they fill the GPU twice
// over, else 64 x 64 ones, which quadruple the block count on small problems.
// Two large blocks per SM (16 warps) need at most 128 registers a thread.
// 32 x 128 blocks of 1 x 2 warps for products of at most 32 rows (a decode
// step's M): a 64-row block computes two to four times the rows it writes
// there, and B, read once for all rows, is what the product costs.
using WarpTileLarge = WarpTileConfig<4, 2, 8, 2>;
using WarpTileSmall = WarpTileConfig<2, 1, 8, 4, true>;
using WarpTileThin = WarpTileConfig<1, 2, 8, 4, true>;

// Whether every row of every batch of an operand starts 4-element aligned,
// so groups of 4 can move as one 16-byte (or 2 x 16-byte) access.
template <class In>
bool QuadAligned(const In* p, int64_t ld, int64_t batch_stride) {
  return ld % 4 == 0 && batch_stride % 4 == 0 &&
         reinterpret_cast<uintptr_t>(p) % (4 * sizeof(In)) == 0;
}

// Runs the product in plan.split_groups parts of K (1: whole).
template <class Cfg, class In, class Out, class Acc>
cudaError_t LaunchWarpTiledWith(const LaunchPlan& plan, const MatmulDims& dims, const In* a,
                                const In* b, Out* out, const LaunchContext& context) {
  // K's parts keep the quads' alignment: a part starts at a multiple of the slab (of 4).
  static_assert(Cfg::kSlab % 4 == 0, "a part of K starts on a quad");
  const bool a_vector_ok = QuadAligned(a, dims.lda, dims.a_batch_stride);
  const bool b_vector_ok = QuadAligned(b, dims.ldb, dims.b_batch_stride);
  return LaunchInKParts<Acc, Cfg::kSlab, Cfg::template kPartsOfK<Acc>>(
      plan, dims, out, context, [&](const MatmulDims& to, auto* sums, const KParts& parts) {
        dim3 grid = OutputTileGrid(to, Cfg::kBlockM, Cfg::kBlockN);
        grid.z = static_cast<unsigned>(std::min<int64_t>(to.batch * parts.count, 65535));
        WarpTiledMatmul<Cfg, In, std::remove_pointer_t<decltype(sums)>, Acc>
            <<<grid, Cfg::kThreads, 0, context.stream>>>(to, a, b, sums, a_vector_ok, b_vector_ok,
                                                         parts);
        return cudaGetLastError();
      });
}

inline int64_t WarpTileBlocks(const MatmulDims& dims, int block_m, int block_n) {
  return dims.batch * ((dims.m + block_m - 1) / block_m) * ((dims.n + block_n - 1) / block_n);
}

inline bool WarpTileUsesLargeBlocks(const MatmulDims& dims, int multiprocessors) {
  return WarpTileBlocks(dims, WarpTileLarge::kBlockM, WarpTileLarge::kBlockN) >=
         2 * multiprocessors;
}

// float64 in or out: the kernels sum in double.
inline bool AccumulatesInDouble(const Product& p) {
  return p.in_type == Dtype::kF64 || p.out_type == Dtype::kF64;
}

// The plan of a configuration that may cut K (kPartsOfK): into parts, a
// block each, where its blocks alone would leave SMs idle.
template <class Cfg>
LaunchPlan SimtPlanInParts(const Product& p, const DeviceFacts& device) {
  LaunchPlan plan = PlanOf<Cfg>();
  if (!Cfg::template kPartsOfK<float> || AccumulatesInDouble(p)) return plan;
  const int64_t tiles = WarpTileBlocks(p.dims, Cfg::kBlockM, Cfg::kBlockN);
  plan.split_groups = static_cast<int>(
      KPartsOf(p.dims.k,
               KPartsWanted(tiles, p.dims.k, int64_t{device.multiprocessors} * Cfg::kMinBlocks),
               Cfg::kSlab)
          .count);
  return plan;
}

// The plan of warptile and pipelined, whose block shapes are the same (Large
// and Small: WarpTileConfig or PipelineConfig): 128 x 128 blocks once they
// fill the GPU twice over, else 64 x 64 ones, which quadruple the block
// count; and where even those leave SMs idle, K cut into parts. A kernel
// with a Thin configuration runs products of at most its rows on it, K cut
// the same way, where its accumulators fit (kFits).
template <class Large, class Small, class Thin = void>
LaunchPlan SimtPlan(const Product& p, const DeviceFacts& device) {
  if constexpr (!std::is_void_v<Thin>)
    if (p.dims.m <= Thin::kBlockM && (Thin::template kFits<double> || !AccumulatesInDouble(p)))
      return SimtPlanInParts<Thin>(p, device);
  if (WarpTileUsesLargeBlocks(p.dims, device.multiprocessors)) return PlanOf<Large>();
  return SimtPlanInParts<Small>(p, device);
}

}  // namespace jax_tiled::cuda
