// Kernel 4, "pipelined": kernel 3's warp tiling fed by a multi-stage cp.async
// pipeline, float32 inputs only.
//
// What it fixes in kernel 3 (see NOTES.md): there, every K slab went global ->
// registers -> shared, so each thread held 8 staging registers and spent
// per-slab instructions converting, re-checking bounds and storing, and only
// one slab was ever in flight. Here the copy engine moves global -> shared
// directly (cp.async), kStages - 1 slabs ahead of the FMAs, with one barrier
// per slab. The copies cannot convert dtypes, hence float32 only.
//
// Tiles are K-major as in kernel 3. An operand stored with its free axis
// contiguous (A transposed, B plain) arrives in 16-byte copies, zero-filled
// past the matrix edge; one stored with K contiguous (A plain, B transposed)
// is transposed by 4-byte copies, 8 consecutive k of 4 rows per warp, which
// land in distinct banks of the padded rows.
//
// K is cut into parts where the output tiles alone would leave SMs idle, as
// in kernel 3 (k_parts.cuh).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/blocks/async_copy.cuh"
#include "cuda/blocks/common.cuh"
#include "cuda/blocks/k_parts.cuh"
#include "cuda/kernels/3_simt_warptiled.cuh"

namespace jax_tiled::cuda {

template <int kWarpsM_, int kWarpsN_, int kSlab_, int kStages_, int kMinBlocks_,
          bool kSplitsK_ = false>
struct PipelineConfig : WarpTileConfig<kWarpsM_, kWarpsN_, kSlab_, kMinBlocks_, kSplitsK_> {
  static constexpr int kStages = kStages_;  // slabs resident in shared memory
  static_assert(kStages >= 2, "a pipeline needs a slab to fill while one is read");
};

// Issues one operand's K slabs as cp.async copies. x is the operand's free
// axis (M for A, N for B); the stored matrix has element (x, k) at
// k_contiguous ? base[x * ld + k] : base[k * ld + x].
//
// A copy of bytes == 0 reads nothing (cp.async's zero fill), so its source
// address need not be inside the matrix.
//
// Slabs are issued in order: a thread keeps one running pointer, the K left
// from its first k, and a mask of its copies inside the matrix's x range,
// since its copies in one slab are a fixed step apart in x (transposing) or in
// k (otherwise); the 64 accumulators need the rest of the 128 registers.
template <int kX, int kSlab, int kThreads>
class AsyncSlabCopier {
 public:
  static constexpr int kPad = 4;  // keeps the transposing 4-byte copies conflict-free
  using Tile = float[kSlab][kX + kPad];

  __device__ __forceinline__ AsyncSlabCopier(const float* base, int64_t ld, int64_t x_limit,
                                             int64_t k_limit, bool k_contiguous, bool vector_ok,
                                             int64_t x0)
      : ld_(ld), k_contiguous_(k_contiguous), vector_(!k_contiguous && vector_ok) {
    const int t = threadIdx.x;
    if (vector_) {  // quads along x: kX / 4 per k row
      x_ = t % (kX / 4) * 4, k_ = t / (kX / 4);
    } else if (k_contiguous) {  // 8 consecutive k of one x per 8 lanes
      x_ = t / kSlab, k_ = t % kSlab;
    } else {
      x_ = t % kX, k_ = t / kX;
    }
    const int64_t x_left = x_limit - x0 - x_;  // from this thread's first x to the edge
    vector_bytes_ = static_cast<int>(min(max(x_left, int64_t{0}), int64_t{4})) * 4;
    inside_x_ = 0;
#pragma unroll
    for (int i = 0; i < kWords; ++i)
      inside_x_ |= static_cast<unsigned>(x_left > (k_contiguous ? i * kXStep : 0)) << i;
    k_left_ = k_limit - k_;
    src_ = base + (k_contiguous ? (x0 + x_) * ld + k_ : k_ * ld + x0 + x_);
  }

  // Copies the next slab into `tile`.
  __device__ __forceinline__ void IssueNext(Tile& tile) {
    const int k_room = static_cast<int>(min(k_left_, int64_t{kSlab}));
    if (vector_) {
#pragma unroll
      for (int i = 0; i < kQuads; ++i)
        CopyAsync<16>(&tile[k_ + i * kQuadKStep][x_], src_ + i * kQuadKStep * ld_,
                      k_room > i * kQuadKStep ? vector_bytes_ : 0);
    } else {
#pragma unroll
      for (int i = 0; i < kWords; ++i) {
        const int dx = k_contiguous_ ? i * kXStep : 0, dk = k_contiguous_ ? 0 : i * kKStep;
        const bool inside = (inside_x_ >> i & 1) && k_room > dk;
        CopyAsync<4>(&tile[k_ + dk][x_ + dx], src_ + (dx + dk) * ld_, inside ? 4 : 0);
      }
    }
    src_ += k_contiguous_ ? kSlab : kSlab * ld_;
    k_left_ -= kSlab;
  }

 private:
  static constexpr int kQuads = kX * kSlab / 4 / kThreads;  // 16-byte copies per thread
  static constexpr int kWords = kX * kSlab / kThreads;      // 4-byte copies per thread
  static_assert(kQuads * 4 * kThreads == kX * kSlab && kWords <= 32, "slab must split evenly");
  static constexpr int kQuadKStep = kThreads / (kX / 4);  // k between a thread's quads
  static constexpr int kXStep = kThreads / kSlab;         // x between transposing copies
  static constexpr int kKStep = kThreads / kX;            // k between plain 4-byte copies

  const float* src_;  // this thread's first element of the next slab
  int64_t ld_;
  int64_t k_left_;  // K from this thread's first k in the next slab to the edge
  bool k_contiguous_, vector_;
  int x_, k_;          // this thread's first copy within a slab
  int vector_bytes_;   // bytes of its quads inside the matrix
  unsigned inside_x_;  // bit i: copy i is inside the matrix's x range
};

// The grid walks the tiles of every part of K (k_parts.cuh) in turn: unit u
// is tile u % tiles of part u / tiles, whose sums go to out + part *
// parts.slot_stride.
template <class Cfg, class Out>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    PipelinedMatmul(MatmulDims dims, const float* __restrict__ a, const float* __restrict__ b,
                    Out* __restrict__ out, bool a_vector_ok, bool b_vector_ok, KParts split_parts) {
  const KParts parts = Cfg::template kPartsOfK<float> ? split_parts : KParts{1, dims.k, 0};
  using CopierA = AsyncSlabCopier<Cfg::kBlockM, Cfg::kSlab, Cfg::kThreads>;
  using CopierB = AsyncSlabCopier<Cfg::kBlockN, Cfg::kSlab, Cfg::kThreads>;
  __shared__ __align__(16) typename CopierA::Tile a_tiles[Cfg::kStages];
  __shared__ __align__(16) typename CopierB::Tile b_tiles[Cfg::kStages];

  const ThreadTile thread_tile(Cfg::kWarpsN);
  const TileOrder<Cfg::kBlockM, Cfg::kBlockN> order(dims);

  for (int64_t unit = blockIdx.x; unit < order.count * parts.count; unit += gridDim.x) {
    const int64_t tile = parts.count == 1 ? unit : unit % order.count;
    const int64_t part = parts.count == 1 ? 0 : unit / order.count;
    const int64_t k0 = parts.Begin(part), depth = parts.Length(part, dims.k);
    const int64_t slabs = (depth + Cfg::kSlab - 1) / Cfg::kSlab;
    int64_t batch, row0, col0;
    order.Locate(tile, batch, row0, col0);
    CopierA copy_a(FromK(a + batch * dims.a_batch_stride, dims.lda, !dims.transpose_a, k0),
                   dims.lda, dims.m, depth, !dims.transpose_a, a_vector_ok, row0);
    CopierB copy_b(FromK(b + batch * dims.b_batch_stride, dims.ldb, dims.transpose_b, k0), dims.ldb,
                   dims.n, depth, dims.transpose_b, b_vector_ok, col0);
    auto issue = [&](int64_t slab) {
      // Every thread commits a group per slab, empty past the last one,
      // so the wait below always counts the same number of groups.
      if (slab < slabs) {  // slabs are issued in order
        copy_a.IssueNext(a_tiles[slab % Cfg::kStages]);
        copy_b.IssueNext(b_tiles[slab % Cfg::kStages]);
      }
      CommitCopies();
    };

    Accumulators<float[8][8], Cfg::kSlab, Cfg::template kBlockedSum<float>> acc;
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) issue(s);
    for (int64_t slab = 0; slab < slabs; ++slab) {
      WaitCopies<Cfg::kStages - 2>();  // this thread's copies of `slab` have landed
      // Everyone's copies of `slab` are visible, and everyone is done
      // reading slab - 1, whose stage the next issue overwrites.
      __syncthreads();
      issue(slab + Cfg::kStages - 1);
      AccumulateSlab(acc.partial, a_tiles[slab % Cfg::kStages], b_tiles[slab % Cfg::kStages],
                     thread_tile);
      acc.EndSlab(slab);
    }
    StoreThreadTile(acc.Result(), thread_tile,
                    out + part * parts.slot_stride + batch * dims.out_batch_stride, dims, row0,
                    col0);
    __syncthreads();  // the next tile's first copies overwrite stages still being read
  }
}

// 128 x 128 blocks of 8 warps, 4 slabs of 8 in flight (33 KB of shared memory,
// two blocks per SM); 64 x 64 blocks of 2 warps when the large ones would not
// fill the GPU twice.
using PipelinedLarge = PipelineConfig<4, 2, 8, 4, 2>;
using PipelinedSmall = PipelineConfig<2, 1, 8, 4, 4, true>;

// Runs the product in plan.split_groups parts of K (1: whole).
template <class Cfg, class Out>
cudaError_t LaunchPipelinedWith(const LaunchPlan& plan, const MatmulDims& dims, const float* a,
                                const float* b, Out* out, const LaunchContext& context) {
  const bool a_vector_ok = QuadAligned(a, dims.lda, dims.a_batch_stride);
  const bool b_vector_ok = QuadAligned(b, dims.ldb, dims.b_batch_stride);
  return LaunchInKParts<float, Cfg::kSlab, Cfg::template kPartsOfK<float>>(
      plan, dims, out, context, [&](const MatmulDims& to, auto* sums, const KParts& parts) {
        const int64_t units = TileOrder<Cfg::kBlockM, Cfg::kBlockN>(to).count * parts.count;
        const dim3 grid(static_cast<unsigned>(std::min<int64_t>(units, 0x7fffffff)));
        PipelinedMatmul<Cfg, std::remove_pointer_t<decltype(sums)>>
            <<<grid, Cfg::kThreads, 0, context.stream>>>(to, a, b, sums, a_vector_ok, b_vector_ok,
                                                         parts);
        return cudaGetLastError();
      });
}

}  // namespace jax_tiled::cuda
