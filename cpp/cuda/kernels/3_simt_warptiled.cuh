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
//
// float32 products on the 128 x 128 blocks whose rows start on 16-byte lines
// (HIGHEST's large products) run WarpTiledFloat32: the same blocks, warps
// and slabs, with the operand layouts compiled in, no bounds checks in the
// mainloop, and sums blocked every kSharedTotalsSumDepth of K with the
// totals in shared memory (this kernel has no registers for them); K in
// parts, and 64 x 128 blocks for few rows, where a model of the waves
// (SimtWaves) has them finish first.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "cuda/blocks/blocked_sum.cuh"
#include "cuda/blocks/common.cuh"
#include "cuda/blocks/k_parts.cuh"
#include "cuda/blocks/row_product.cuh"

namespace jax_tiled::cuda {

// Block shape in warps (each warp computes 32 x 64), the K slab depth, how
// many blocks must fit on one SM (which caps registers per thread), and
// whether K may be cut into parts (k_parts.cuh): for float32 accumulators
// only, since a thread's 64 doubles leave no registers for the parts'
// bookkeeping (ptxas spilled), and in the configuration for few tiles only
// (the other one is chosen where its tiles fill the GPU); the others compile
// without it.
//
// Float32Mainloop: whether float32 products whose rows start on 16-byte
// lines run a mainloop of their own (WarpTiledFloat32 below, compiled once
// per operand layout): kNo; kToo, beside the kernel for every product (the
// 128 x 128 blocks); kOnly, a configuration for that mainloop alone, for
// which the planner plans no other product and the kernel for every product
// is not compiled. kFloat32MinBlocks: the blocks an SM that mainloop is
// compiled for (its registers), where it differs from the other kernel's.
enum class Float32Mainloop { kNo, kToo, kOnly };

template <int kWarpsM_, int kWarpsN_, int kSlab_, int kMinBlocks_, bool kSplitsK_ = false,
          Float32Mainloop kFloat32Mainloop = Float32Mainloop::kNo,
          int kFloat32MinBlocks_ = kMinBlocks_>
struct WarpTileConfig {
  static constexpr int kWarpsM = kWarpsM_, kWarpsN = kWarpsN_, kSlab = kSlab_;
  static constexpr int kMinBlocks = kMinBlocks_, kFloat32MinBlocks = kFloat32MinBlocks_;
  static constexpr bool kFloat32Layouts = kFloat32Mainloop != Float32Mainloop::kNo;
  static constexpr bool kFloat32Only = kFloat32Mainloop == Float32Mainloop::kOnly;
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

// The float32 path. The kernel above decides each operand's layout, bounds
// and alignment per quad per slab: its instructions other than FFMA, that
// 64-bit address and predicate arithmetic most of them, were a fifth of
// those it issued (ncu, 4096^3). Here an operand's
// layout is a template parameter (kKContiguous: its element (x, k) at
// base[x * ld + k], else at base[k * ld + x]), each quad's address is
// worked out once a tile and stepped by a constant a slab, and the mainloop
// has no bounds checks:
// - along x, the quads past the matrix's edge read the last quad inside it
//   instead: they only reach the sums of rows or columns that are never
//   stored;
// - along K, the slabs end where K ends, so only the first slab can reach
//   outside (it starts before element 0); it is loaded before the mainloop,
//   with zeros there, and every sum then starts with those zeros' exact
//   0 * 0 + 0.
// The sums are blocked (blocked_sum.cuh), each kSharedTotalsSumDepth of K's
// partial in registers added into a total in shared memory: one FMA chain
// over all of K, as WarpTiledMatmul's 128 x 128 blocks sum, was 4.4 times
// jnp's error at 2304 x 8192 x 2048 on positive inputs.
// Every quad is one 16-byte load, all inside the matrix or all outside
// (Float32LayoutsTake says when: both operands' rows on 16-byte lines, K a
// multiple of 4 where an operand runs along it, the free extent where it
// runs along that). NOTES.md, "warptile's float32 mainloop".
template <int kX, int kSlab, int kThreads, bool kKContiguous>
struct SteppedQuadLoader {
  static constexpr int kQuadsPerLine = kKContiguous ? kSlab / 4 : kX / 4;
  static constexpr int kPerThread = kX * kSlab / 4 / kThreads;
  static_assert(kX * kSlab / 4 % kThreads == 0, "slab must split evenly over the threads");
  static constexpr int kPad = 4;  // as SlabLoader's: the transposing stores do not conflict
  using Tile = float[kSlab][kX + kPad];

  const float* next[kPerThread];  // quad i's first element in the next slab
  int64_t step;                   // elements from one slab to the next
  float staged[kPerThread][4];

  // Where quad i of this thread lies in the slab.
  __device__ __forceinline__ static void Origin(int i, int& x, int& k) {
    const int q = threadIdx.x + i * kThreads;
    if constexpr (kKContiguous) {
      x = q / kQuadsPerLine;
      k = q % kQuadsPerLine * 4;
    } else {
      k = q / kQuadsPerLine;
      x = q % kQuadsPerLine * 4;
    }
  }

  // The operand from row or column x0 of its free axis (x_limit of them) and
  // from element k0 (<= 0) of K.
  __device__ __forceinline__ SteppedQuadLoader(const float* base, int64_t ld, int64_t x0,
                                               int64_t x_limit, int64_t k0)
      : step(kKContiguous ? kSlab : kSlab * ld) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      int x, k;
      Origin(i, x, k);
      const int64_t gx = min(x0 + x, x_limit - (kKContiguous ? 1 : 4));
      next[i] = base + (kKContiguous ? gx * ld + k0 + k : (k0 + k) * ld + gx);
    }
  }

  // The first slab, which starts at K's element k0 (<= 0): zeros before 0.
  __device__ __forceinline__ void FetchFirst(int64_t k0) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      int x, k;
      Origin(i, x, k);
      if (k0 + k >= 0) {
        Load(i);
      } else {
        next[i] += step;
#pragma unroll
        for (int e = 0; e < 4; ++e) staged[i][e] = 0.0f;
      }
    }
  }

  // The next slab, all of it inside the matrix's K.
  __device__ __forceinline__ void Fetch() {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) Load(i);
  }

  __device__ __forceinline__ void Store(Tile& tile) const {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      int x, k;
      Origin(i, x, k);
      if constexpr (kKContiguous) {
#pragma unroll
        for (int e = 0; e < 4; ++e) tile[k + e][x] = staged[i][e];
      } else {
        StoreQuad(&tile[k][x], staged[i]);
      }
    }
  }

 private:
  __device__ __forceinline__ void Load(int i) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(next[i]));
    next[i] += step;
    staged[i][0] = v.x;
    staged[i][1] = v.y;
    staged[i][2] = v.z;
    staged[i][3] = v.w;
  }
};

// This thread's fragments of slab row k: 8 of A and 8 of B (AccumulateSlab's).
struct Fragments {
  float a[8], b[8];

  template <int kRowA, int kRowB>
  __device__ __forceinline__ void Load(const float (&a_tile)[kRowA], const float (&b_tile)[kRowB],
                                       ThreadTile t) {
    LoadQuad(&a_tile[t.m], a, 0);
    LoadQuad(&a_tile[t.m + 16], a, 4);
    LoadQuad(&b_tile[t.n], b, 0);
    LoadQuad(&b_tile[t.n + 32], b, 4);
  }
};

// A thread's 8 x 8 sums: the registers' partials and these totals in shared
// memory (two such blocks an SM leave no registers for a second set; 64 KB a
// block beside its 16.5 KB of tiles).
template <class Cfg>
using Float32Totals = SharedTotals<Cfg::kThreads, 8, 8>;

// One block a tile and part of K: x runs over the tiles in TileOrder
// (counted in 32 bits: Float32LayoutsTake), y over the parts of K
// (k_parts.cuh; one where K is whole). The parts split K's slabs counted
// from its end, as the loop below runs them: part p runs slabs p * depth /
// kSlab on, so only part 0 holds the slab that starts before element 0, and
// every part but the last is parts.depth deep. The slabs go through two
// shared buffers, the next slab's quads staged in registers while the
// current one's FMAs run, as in WarpTiledMatmul; besides, each k's
// fragments are read from shared memory during the k before (two sets of
// Fragments), and the next slab's stores and the one barrier a slab come
// before the last k's FMAs, so that the next slab's first fragments load
// while those run.
template <class Cfg, bool kAKContiguous, bool kBKContiguous>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kFloat32MinBlocks)
    WarpTiledFloat32(MatmulDims dims, const float* __restrict__ a, const float* __restrict__ b,
                     float* __restrict__ out, KParts parts) {
  using LoaderA = SteppedQuadLoader<Cfg::kBlockM, Cfg::kSlab, Cfg::kThreads, kAKContiguous>;
  using LoaderB = SteppedQuadLoader<Cfg::kBlockN, Cfg::kSlab, Cfg::kThreads, kBKContiguous>;
  static_assert(kSharedTotalsSumDepth % Cfg::kSlab == 0, "a partial sum is whole slabs");
  constexpr int kSlabsPerPartial = kSharedTotalsSumDepth / Cfg::kSlab;
  __shared__ __align__(16) typename LoaderA::Tile a_tiles[2];
  __shared__ __align__(16) typename LoaderB::Tile b_tiles[2];

  using Totals = Float32Totals<Cfg>;

  const TileOrder<Cfg::kBlockM, Cfg::kBlockN, int> order(dims);
  const ThreadTile thread_tile(Cfg::kWarpsN);
  float acc[8][8] = {};  // the partial sums
  const int all_slabs = static_cast<int>((dims.k + Cfg::kSlab - 1) / Cfg::kSlab);
  const int part = static_cast<int>(blockIdx.y);
  const int slabs_per_part =
      parts.count == 1 ? all_slabs : static_cast<int>(parts.depth / Cfg::kSlab);
  const int first_slab = part * slabs_per_part;
  const int slabs = min(slabs_per_part, all_slabs - first_slab);
  if (slabs > 0) {
    int batch, row0, col0;
    order.Locate(static_cast<int>(blockIdx.x), batch, row0, col0);
    // Where this part's first slab starts: before element 0 in part 0 only.
    const int64_t k0 = dims.k - int64_t{all_slabs - first_slab} * Cfg::kSlab;
    LoaderA load_a(a + batch * dims.a_batch_stride, dims.lda, row0, dims.m, k0);
    LoaderB load_b(b + batch * dims.b_batch_stride, dims.ldb, col0, dims.n, k0);
    load_a.FetchFirst(k0);
    load_b.FetchFirst(k0);
    load_a.Store(a_tiles[0]);
    load_b.Store(b_tiles[0]);
    __syncthreads();
    Fragments fragments[2];
    fragments[0].Load(a_tiles[0][0], b_tiles[0][0], thread_tile);

    // One slab's FMAs, with the next slab's quads in flight (if there is one).
    const auto accumulate_slab = [&](int slab) {
      const int cur = slab & 1;
      const bool more = slab + 1 < slabs;
      if (more) {
        load_a.Fetch();
        load_b.Fetch();
      }
#pragma unroll
      for (int k = 0; k < Cfg::kSlab; ++k) {
        Fragments& next = fragments[(k + 1) & 1];
        if (k + 1 < Cfg::kSlab) {
          next.Load(a_tiles[cur][k + 1], b_tiles[cur][k + 1], thread_tile);
        } else {
          // The other buffer was last read before the previous slab's barrier.
          if (more) {
            load_a.Store(a_tiles[cur ^ 1]);
            load_b.Store(b_tiles[cur ^ 1]);
          }
          __syncthreads();
          if (more) next.Load(a_tiles[cur ^ 1][0], b_tiles[cur ^ 1][0], thread_tile);
        }
        const Fragments& f = fragments[k & 1];
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[i][j] += f.a[i] * f.b[j];
      }
    };
    // The whole partial sums, each a loop of a constant count, then the slabs
    // after the last of them. One loop over every slab that tested for a
    // partial's end ran 6-8% slower: ptxas scheduled it with the adds into
    // the totals inside, and issued the next slab's loads after about 250 of
    // a slab's 512 FMAs where here it issues them after 120-190 (NOTES.md).
    const int whole_partials = slabs / kSlabsPerPartial;
    int slab = 0;
#pragma unroll 1
    for (int partial = 0; partial < whole_partials; ++partial) {
#pragma unroll 1
      for (int i = 0; i < kSlabsPerPartial; ++i) accumulate_slab(slab++);
      Totals::AddPartial(acc, partial == 0);
    }
#pragma unroll 1
    for (; slab < slabs; ++slab) accumulate_slab(slab);
  }
  if (slabs >= kSlabsPerPartial) Totals::Result(acc);
  // The tile's place found again, not kept through the mainloop's registers.
  int batch, row0, col0;
  order.Locate(static_cast<int>(blockIdx.x), batch, row0, col0);
  StoreThreadTile(acc, thread_tile, out + part * parts.slot_stride + batch * dims.out_batch_stride,
                  dims, row0, col0);
}

// Whether WarpTiledFloat32 runs this product: every quad one aligned 16-byte
// load (the rows of both operands on 16-byte lines; an operand's quads
// wholly inside or outside the matrix: K a multiple of 4 where they run
// along K, the free extent where they run along it), and its tiles, rows,
// columns and slabs counted in 32 bits. The planner and the launcher both
// ask here.
template <class Cfg>
bool Float32LayoutsTake(const MatmulDims& dims, bool a_vector_ok, bool b_vector_ok) {
  constexpr int64_t kMax = 0x7fffffff - 256;
  const bool a_quads_whole = dims.transpose_a ? dims.m % 4 == 0 : dims.k % 4 == 0;
  const bool b_quads_whole = dims.transpose_b ? dims.k % 4 == 0 : dims.n % 4 == 0;
  return a_vector_ok && b_vector_ok && a_quads_whole && b_quads_whole && dims.m <= kMax &&
         dims.n <= kMax && dims.k <= kMax &&
         TileOrder<Cfg::kBlockM, Cfg::kBlockN>(dims).count <= kMax;
}

template <class Cfg>
cudaError_t LaunchWarpTiledFloat32(const MatmulDims& dims, const float* a, const float* b,
                                   float* out, const KParts& parts, const LaunchContext& context) {
  const auto launch = [&](auto a_k_contiguous, auto b_k_contiguous) {
    constexpr auto kKernel =
        &WarpTiledFloat32<Cfg, decltype(a_k_contiguous)::value, decltype(b_k_contiguous)::value>;
    constexpr int kBytes = Float32Totals<Cfg>::kBytes;
    if (const cudaError_t err = AllowSharedMemory<kKernel>(kBytes); err != cudaSuccess) return err;
    const TileOrder<Cfg::kBlockM, Cfg::kBlockN, int> order(dims);
    const dim3 grid(order.Grid().x, static_cast<unsigned>(parts.count));
    kKernel<<<grid, Cfg::kThreads, kBytes, context.stream>>>(dims, a, b, out, parts);
    return cudaGetLastError();
  };
  using Yes = std::true_type;
  using No = std::false_type;
  // a stored as (m, k) and b stored as (n, k) are the K-contiguous ones.
  if (!dims.transpose_a) return dims.transpose_b ? launch(Yes{}, Yes{}) : launch(Yes{}, No{});
  return dims.transpose_b ? launch(No{}, Yes{}) : launch(No{}, No{});
}

// Shape-dependent block size: 128 x 128 blocks once they fill the GPU twice
// over, else 64 x 64 ones, which quadruple the block count on small problems.
// Two large blocks per SM (16 warps) need at most 128 registers a thread.
// 32 x 128 blocks of 1 x 2 warps for products of at most 32 rows (a decode
// step's M): a 64-row block computes two to four times the rows it writes
// there, and B, read once for all rows, is what the product costs. Their
// float32 mainloop is compiled for six an SM (167-168 registers, no spill)
// where the kernel for every product is compiled for four.
// 64 x 128 blocks of 2 x 2 warps, on the float32 mainloop only: for
// products of at most 64 rows, which a 128-row block would half pad or more
// (WarpTilePlan chooses). Three an SM: at four (128 registers) their third
// staged quad a thread spilled 180-200 bytes in most layouts (ptxas). Their
// mirror, 128 x 64 blocks of 4 x 1 warps, ran 30% slower than the model had
// them (NOTES.md) and is not built.
using WarpTileLarge = WarpTileConfig<4, 2, 8, 2, false, Float32Mainloop::kToo>;
using WarpTileWide = WarpTileConfig<2, 2, 8, 3, false, Float32Mainloop::kOnly>;
using WarpTileSmall = WarpTileConfig<2, 1, 8, 4, true>;
using WarpTileThin = WarpTileConfig<1, 2, 8, 4, true, Float32Mainloop::kToo, 6>;
// One row (M = 1), every type: row_product.cuh's kernel, each output's sum in
// double, 128 columns a block.
struct WarpTileRow : RowProductShape {
  static constexpr int kBlockM = 1, kBlockN = kColumns;
  // Blocks an SM the planner counts on when it cuts K, by B's layout: as
  // many as an SM holds of the k-contiguous ones (128 registers a thread:
  // 2); 8 of the n-contiguous ones (of 48 registers, 5 held), as measured
  // when they landed. Counting 8 of the k-contiguous ones made 8192 x 8192 x
  // 1 four waves of blocks where one does (NOTES.md, "Row blocks' parts of
  // K by the blocks an SM holds").
  static constexpr int kMinBlocksKContiguous = 2, kMinBlocksNContiguous = 8;
};

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
  if constexpr (Cfg::kFloat32Layouts && std::is_same_v<In, float> && std::is_same_v<Out, float> &&
                std::is_same_v<Acc, float>)
    if (Float32LayoutsTake<Cfg>(dims, a_vector_ok, b_vector_ok))
      return LaunchInKParts<float, Cfg::kSlab, true>(
          plan, dims, out, context, [&](const MatmulDims& to, float* sums, const KParts& parts) {
            return LaunchWarpTiledFloat32<Cfg>(to, a, b, sums, parts, context);
          });
  // The planner gives these blocks only to products the float32 mainloop runs.
  if constexpr (Cfg::kFloat32Only) return cudaErrorInvalidValue;
  else
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

// A model of the SIMT blocks' time, in slabs of a 128 x 128 float32 block
// on an SM that holds two (1.46 us on an H100), for warptile's choice below.
// Its figures are an H100's (2026-11-28, NOTES.md "warptile's float32
// blocks with K in parts" and "Thin blocks on the float32 mainloop"):
// - blocks run in waves of as many an SM as they are compiled for; an SM
//   given fewer in the last wave runs them faster, but no faster than a
//   floor of a wave's time (2304 x 8192 x 2048: 288 blocks of 128 x 128 in
//   264 places took 1.6 waves' time);
// - a block costs kBlockStartAndStore slabs besides its own (8192 x 128 x
//   8192, 16 slabs a block, took 20 a wave);
// - each block shape's slab time (Figures), against a large block's:
//   64 x 64 blocks, four an SM, kSmall's (their FLOP rates at 2048^3 and
//   4096^3); 64 x 128, three an SM, kWide's (64 x 4096 x 14336: 0.217 ms,
//   where the large blocks' FLOP rate, 0.75, predicted 0.195), taken only
//   kNarrowMargin ahead, their figure being one product's; 32 x 128, six an
//   SM, kThin's: few rows read B at the memory's rate (16 x 8192 x 8192 in
//   one wave of 768 blocks, 0.126 ms), and a partial wave of them reads at
//   a rate that falls less than its share of the blocks (of 792 places,
//   512 blocks took 0.74 of a whole wave's time a slab and 640 took 0.93);
// - parts of K cost their sums' trip through scratch, 8 bytes an element a
//   part at 2.5 TB/s (kScratchElementsPerSlab), and the second kernel's
//   launch (kAddKPartsSlabs).
struct SimtWaves {
  // A block shape's time a slab, and its last wave's floor.
  struct Figures { double slab_time, last_wave_floor; };
  static constexpr Figures kLarge{1.0, 0.6}, kSmall{0.72, 0.6}, kWide{0.835, 0.6}, kThin{0.95, 0.9};
  static constexpr double kBlockStartAndStore = 4, kNarrowMargin = 0.9;
  static constexpr double kScratchElementsPerSlab = 450000, kAddKPartsSlabs = 2;
  int multiprocessors;

  // `blocks` blocks of `slabs` slabs, `per_sm` resident an SM.
  double Blocks(int64_t blocks, int per_sm, int64_t slabs, const Figures& figures) const {
    const int64_t wave = int64_t{per_sm} * multiprocessors;
    double waves = static_cast<double>(blocks / wave);
    if (const int64_t last = blocks % wave) {
      const int64_t busiest = (last + multiprocessors - 1) / multiprocessors;
      waves += std::max(static_cast<double>(busiest) / per_sm, figures.last_wave_floor);
    }
    return waves * (static_cast<double>(slabs) + kBlockStartAndStore) * figures.slab_time;
  }
  // A plan of `Cfg`'s blocks, `per_sm` resident an SM, with K in `parts`.
  template <class Cfg>
  double Plan(const MatmulDims& dims, const KParts& parts, const Figures& figures,
              int per_sm = Cfg::kMinBlocks) const {
    const int64_t tiles = WarpTileBlocks(dims, Cfg::kBlockM, Cfg::kBlockN);
    const int64_t slabs = (parts.count == 1 ? dims.k : parts.depth + Cfg::kSlab - 1) / Cfg::kSlab;
    const double scratch = parts.count == 1
                               ? 0.0
                               : static_cast<double>(parts.count * dims.batch * dims.m * dims.n) /
                                         kScratchElementsPerSlab +
                                     kAddKPartsSlabs;
    return Blocks(tiles * parts.count, per_sm, slabs, figures) + scratch;
  }
};

// Whether WarpTiledFloat32 will run the product (before buffers exist, as
// Product says, any pointer is taken as aligned).
template <class Cfg>
bool RunsFloat32Mainloop(const Product& p) {
  const auto aligned = [](const void* x, int64_t ld, int64_t batch_stride) {
    return x == nullptr ? ld % 4 == 0 && batch_stride % 4 == 0
                        : QuadAligned(static_cast<const float*>(x), ld, batch_stride);
  };
  return Cfg::kFloat32Layouts && p.in_type == Dtype::kF32 && p.out_type == Dtype::kF32 &&
         Float32LayoutsTake<Cfg>(p.dims, aligned(p.a, p.dims.lda, p.dims.a_batch_stride),
                                 aligned(p.b, p.dims.ldb, p.dims.b_batch_stride));
}

// The fastest plan of Cfg's blocks on the float32 mainloop for a product by
// SimtWaves: K in as many parts (1 included) as finish first, each at least
// kMinKPartDepth deep, at most so many that the blocks make 8 waves.
template <class Cfg>
std::pair<LaunchPlan, double> FastestInParts(const MatmulDims& d, const SimtWaves& waves,
                                             const SimtWaves::Figures& figures) {
  const int64_t tiles = WarpTileBlocks(d, Cfg::kBlockM, Cfg::kBlockN);
  constexpr int kPerSm = Cfg::kFloat32MinBlocks;
  const int64_t wave = int64_t{kPerSm} * waves.multiprocessors;
  const int64_t most =
      std::min<int64_t>({d.k / kMinKPartDepth, (8 * wave + tiles - 1) / tiles, 65535});
  KParts best = KPartsOf(d.k, 1, Cfg::kSlab);
  double best_time = waves.Plan<Cfg>(d, best, figures, kPerSm);
  for (int64_t wanted = 2; wanted <= most; ++wanted) {
    const KParts parts = KPartsOf(d.k, wanted, Cfg::kSlab);
    if (const double time = waves.Plan<Cfg>(d, parts, figures, kPerSm); time < best_time)
      best = parts, best_time = time;
  }
  LaunchPlan plan = PlanOf<Cfg>();
  plan.split_groups = static_cast<int>(best.count);
  return {plan, best_time};
}

// One row's plan: WarpTileRow's blocks, K cut into parts (KPartsWanted)
// where the blocks alone would leave SMs idle; in whole steps of either of
// B's layouts (LaunchRowProduct's).
inline LaunchPlan RowPlan(const Product& p, const DeviceFacts& device) {
  LaunchPlan plan = PlanOf<WarpTileRow>();
  const MatmulDims dims = RowProductOfOneColumn(p.dims) ? TransposedProduct(p.dims) : p.dims;
  const int64_t blocks = WarpTileBlocks(dims, WarpTileRow::kBlockM, WarpTileRow::kBlockN);
  const int per_sm =
      dims.transpose_b ? WarpTileRow::kMinBlocksKContiguous : WarpTileRow::kMinBlocksNContiguous;
  const int64_t wanted = KPartsWanted(blocks, p.dims.k, int64_t{device.multiprocessors} * per_sm);
  plan.split_groups =
      static_cast<int>(KPartsOf(p.dims.k, wanted, RowProductShape::kStepKContiguous).count);
  plan.why_this_width =
      RowProductOfOneColumn(p.dims)
          ? "one column as the transposed product's row, each output's sum in double"
          : "one row, each output's sum in double";
  plan.reads_transposes = true;  // B read once in either layout, A's row or column a vector
  return plan;
}

// warptile's plan: RowPlan's for one row or one column; else SimtPlan's,
// but for the float32 products WarpTiledFloat32 runs, whose mainloop
// computes about 1.4 times the FLOPs a second that the 64 x 64 blocks do:
// those of at most 32 rows take its thin blocks with K in parts as SimtWaves
// has them finish first; the others its 128 x 128 or 64 x 128 blocks (the
// latter for at most 64 rows) the same way, also where SimtPlan gives 64 x
// 64 blocks if SimtWaves has the mainloop's ahead of them.
inline LaunchPlan WarpTilePlan(const Product& p, const DeviceFacts& device) {
  if (p.dims.m == 1 || RowProductOfOneColumn(p.dims)) return RowPlan(p, device);
  constexpr const char* kByTheModel =
      "float32's own mainloop, width and K's parts by a model of the waves";
  const LaunchPlan plan = SimtPlan<WarpTileLarge, WarpTileSmall, WarpTileThin>(p, device);
  const SimtWaves waves{device.multiprocessors};
  const MatmulDims& d = p.dims;
  if (plan.block_m == WarpTileThin::kBlockM) {
    if (!RunsFloat32Mainloop<WarpTileThin>(p)) return plan;
    LaunchPlan thin = FastestInParts<WarpTileThin>(d, waves, SimtWaves::kThin).first;
    thin.why_this_width = kByTheModel;
    thin.reads_whole_lines = true;
    return thin;
  }
  if (!RunsFloat32Mainloop<WarpTileLarge>(p)) return plan;
  auto [best, best_time] = FastestInParts<WarpTileLarge>(d, waves, SimtWaves::kLarge);
  // The 64 x 128 blocks were measured on 64 rows only (SimtWaves).
  if (d.m <= WarpTileWide::kBlockM && RunsFloat32Mainloop<WarpTileWide>(p))
    if (auto [wide, time] = FastestInParts<WarpTileWide>(d, waves, SimtWaves::kWide);
        time < SimtWaves::kNarrowMargin * best_time)
      best = wide, best_time = time;
  const bool large_already = plan.block_m == WarpTileLarge::kBlockM;
  if (!large_already && best_time >= waves.Plan<WarpTileSmall>(
                                         d, KPartsOf(d.k, plan.split_groups, WarpTileSmall::kSlab),
                                         SimtWaves::kSmall))
    return plan;
  if (!large_already || !best.SameConfig(plan) || best.split_groups > 1)
    best.why_this_width = kByTheModel;
  best.reads_whole_lines = true;
  return best;
}

}  // namespace jax_tiled::cuda
