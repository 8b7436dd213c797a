// Rung 3, "pipelined": rung 2's warp tiling fed by a multi-stage cp.async
// pipeline, float32 inputs only.
//
// What it fixes in rung 2 (see NOTES.md): there, every K slab went global ->
// registers -> shared, so each thread held 8 staging registers and spent
// per-slab instructions converting, re-checking bounds and storing, and only
// one slab was ever in flight. Here the copy engine moves global -> shared
// directly (cp.async), kStages - 1 slabs ahead of the FMAs, with one barrier
// per slab. The copies cannot convert dtypes, hence float32 only.
//
// Tiles are K-major as in rung 2. An operand stored with its free axis
// contiguous (A transposed, B plain) arrives in 16-byte copies, zero-filled
// past the matrix edge; one stored with K contiguous (A plain, B transposed)
// is transposed by 4-byte copies, 8 consecutive k of 4 rows per warp, which
// land in distinct banks of the padded rows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/async_copy.cuh"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/simt_warptiled.cuh"

namespace jax_tiled::cuda {

template <int kWarpsM_, int kWarpsN_, int kSlab_, int kStages_, int kMinBlocks_>
struct PipelineConfig : WarpTileConfig<kWarpsM_, kWarpsN_, kSlab_, kMinBlocks_> {
  static constexpr int kStages = kStages_;  // slabs resident in shared memory
  static_assert(kStages >= 2, "a pipeline needs a slab to fill while one is read");
};

// Issues one operand's K slabs as cp.async copies. x is the operand's free
// axis (M for A, N for B); the stored matrix has element (x, k) at
// k_contiguous ? base[x * ld + k] : base[k * ld + x].
//
// A thread's copies in one slab are a fixed step apart in x (transposing) or
// in k (otherwise), so its state is one pointer, a mask of the copies inside
// the matrix's x range, and what the kernel parameters already hold; the
// 64 accumulators need the rest of the 128 registers.
template <int kX, int kSlab, int kThreads>
class AsyncSlabCopier {
 public:
  static constexpr int kPad = 4;  // keeps the transposing 4-byte copies conflict-free
  using Tile = float[kSlab][kX + kPad];

  // `readable`: any address copies may name when they read nothing (the
  // unbatched operand, which a kernel keeps in its parameter space).
  __device__ __forceinline__ AsyncSlabCopier(const float* readable, const float* base, int64_t ld,
                                             int64_t x_limit, int64_t k_limit, bool k_contiguous,
                                             bool vector_ok, int64_t x0)
      : readable_(readable), ld_(ld), k_limit_(k_limit), k_contiguous_(k_contiguous),
        vector_(!k_contiguous && vector_ok) {
    const int t = threadIdx.x;
    if (vector_) {  // quads along x: kX / 4 per k row
      x_ = t % (kX / 4) * 4, k_ = t / (kX / 4);
    } else if (k_contiguous) {  // 8 consecutive k of one x per 8 lanes
      x_ = t / kSlab, k_ = t % kSlab;
    } else {
      x_ = t % kX, k_ = t / kX;
    }
    const int64_t x_left = x_limit - x0 - x_;  // elements from this thread's first x to the edge
    vector_bytes_ = static_cast<int>(min(max(x_left, int64_t{0}), int64_t{4})) * 4;
    inside_x_ = 0;
    for (int i = 0; i < kWords; ++i)
      inside_x_ |= static_cast<unsigned>(x_left > (k_contiguous_ ? i * kXStep : 0)) << i;
    src_ = base + (k_contiguous ? (x0 + x_) * ld + k_ : k_ * ld + x0 + x_);
  }

  __device__ __forceinline__ void Issue(Tile& tile, int64_t slab) const {
    const int64_t k0 = slab * kSlab;
    const int64_t k_left = k_limit_ - k0 - k_;  // from this thread's first k to the edge
    const float* p = src_ + (k_contiguous_ ? k0 : k0 * ld_);
    if (vector_) {
#pragma unroll
      for (int i = 0; i < kQuads; ++i) {
        const int bytes = k_left > i * kQuadKStep ? vector_bytes_ : 0;
        CopyAsync<16>(&tile[k_ + i * kQuadKStep][x_], bytes ? p + i * kQuadKStep * ld_ : readable_,
                      bytes);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kWords; ++i) {
        const int dx = k_contiguous_ ? i * kXStep : 0, dk = k_contiguous_ ? 0 : i * kKStep;
        const bool inside = (inside_x_ >> i & 1) && k_left > dk;
        const float* src = p + (k_contiguous_ ? dx * ld_ : dk * ld_);
        CopyAsync<4>(&tile[k_ + dk][x_ + dx], inside ? src : readable_, inside ? 4 : 0);
      }
    }
  }

 private:
  static constexpr int kQuads = kX * kSlab / 4 / kThreads;  // 16-byte copies per thread
  static constexpr int kWords = kX * kSlab / kThreads;      // 4-byte copies per thread
  static_assert(kQuads * 4 * kThreads == kX * kSlab && kWords <= 32, "slab must split evenly");
  static constexpr int kQuadKStep = kThreads / (kX / 4);  // k between a thread's quads
  static constexpr int kXStep = kThreads / kSlab;         // x between transposing copies
  static constexpr int kKStep = kThreads / kX;            // k between plain 4-byte copies

  const float* readable_;
  const float* src_;   // this thread's first element of slab 0
  int64_t ld_, k_limit_;
  bool k_contiguous_, vector_;
  int x_, k_;                // this thread's first copy within a slab
  int vector_bytes_;         // bytes of its quads inside the matrix
  unsigned inside_x_;        // bit i: copy i is inside the matrix's x range
};

template <class Cfg, class Out>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    PipelinedMatmul(MatmulDims dims, const float* __restrict__ a, const float* __restrict__ b,
                    Out* __restrict__ out, bool a_vector_ok, bool b_vector_ok) {
  using CopierA = AsyncSlabCopier<Cfg::kBlockM, Cfg::kSlab, Cfg::kThreads>;
  using CopierB = AsyncSlabCopier<Cfg::kBlockN, Cfg::kSlab, Cfg::kThreads>;
  __shared__ __align__(16) typename CopierA::Tile a_tiles[Cfg::kStages];
  __shared__ __align__(16) typename CopierB::Tile b_tiles[Cfg::kStages];

  const ThreadTile thread_tile(Cfg::kWarpsN);
  const int64_t tiles_m = (dims.m + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int64_t tiles_n = (dims.n + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const int64_t slabs = (dims.k + Cfg::kSlab - 1) / Cfg::kSlab;

  for (int64_t batch = blockIdx.z; batch < dims.batch; batch += gridDim.z) {
    for (int64_t tile_m = blockIdx.y; tile_m < tiles_m; tile_m += gridDim.y) {
      for (int64_t tile_n = blockIdx.x; tile_n < tiles_n; tile_n += gridDim.x) {
        const int64_t row0 = tile_m * Cfg::kBlockM, col0 = tile_n * Cfg::kBlockN;
        const CopierA copy_a(a, a + batch * dims.a_batch_stride, dims.lda, dims.m, dims.k,
                           !dims.transpose_a, a_vector_ok, row0);
        const CopierB copy_b(b, b + batch * dims.b_batch_stride, dims.ldb, dims.n, dims.k,
                             dims.transpose_b, b_vector_ok, col0);
        auto issue = [&](int64_t slab) {
          // Every thread commits a group per slab, empty past the last one,
          // so the wait below always counts the same number of groups.
          if (slab < slabs) {
            copy_a.Issue(a_tiles[slab % Cfg::kStages], slab);
            copy_b.Issue(b_tiles[slab % Cfg::kStages], slab);
          }
          CommitCopies();
        };

        float acc[8][8] = {};
#pragma unroll
        for (int s = 0; s < Cfg::kStages - 1; ++s) issue(s);
        for (int64_t slab = 0; slab < slabs; ++slab) {
          WaitCopies<Cfg::kStages - 2>();  // this thread's copies of `slab` have landed
          // Everyone's copies of `slab` are visible, and everyone is done
          // reading slab - 1, whose stage the next issue overwrites.
          __syncthreads();
          issue(slab + Cfg::kStages - 1);
          AccumulateSlab(acc, a_tiles[slab % Cfg::kStages], b_tiles[slab % Cfg::kStages],
                         thread_tile);
        }
        StoreThreadTile(acc, thread_tile, out + batch * dims.out_batch_stride, dims, row0, col0);
        __syncthreads();  // the next tile's first copies overwrite stages still being read
      }
    }
  }
}

// 128 x 128 blocks of 8 warps, 4 slabs of 8 in flight (33 KB of shared memory,
// two blocks per SM); 64 x 64 blocks of 2 warps when the large ones would not
// fill the GPU twice.
using PipelinedLarge = PipelineConfig<4, 2, 8, 4, 2>;
using PipelinedSmall = PipelineConfig<2, 1, 8, 4, 4>;

template <class Cfg, class Out>
cudaError_t LaunchPipelinedWith(const MatmulDims& dims, const float* a, const float* b, Out* out,
                                cudaStream_t stream) {
  const dim3 grid = OutputTileGrid(dims, Cfg::kBlockM, Cfg::kBlockN);
  PipelinedMatmul<Cfg, Out><<<grid, Cfg::kThreads, 0, stream>>>(
      dims, a, b, out, QuadAligned(a, dims.lda) && dims.a_batch_stride % 4 == 0,
      QuadAligned(b, dims.ldb) && dims.b_batch_stride % 4 == 0);
  return cudaGetLastError();
}

template <class Out>
cudaError_t LaunchPipelined(const MatmulDims& dims, const float* a, const float* b, Out* out,
                            cudaStream_t stream, int multiprocessors) {
  if (WarpTileUsesLargeBlocks(dims, multiprocessors))
    return LaunchPipelinedWith<PipelinedLarge, Out>(dims, a, b, out, stream);
  return LaunchPipelinedWith<PipelinedSmall, Out>(dims, a, b, out, stream);
}

}  // namespace jax_tiled::cuda
