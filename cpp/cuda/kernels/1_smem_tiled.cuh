// Kernel 1, "smem": the shared-memory tiled matmul of Programming Massively
// Parallel Processors, ch. 4-5. The readable reference of the ladder.
//
// A kTile x kTile thread block owns one kTile x kTile output tile. It walks K
// in phases; in each phase every thread loads one element of op(A) and one of
// op(B) into shared memory, the block synchronises, and every thread does kTile
// multiply-adds from shared memory. Each global element is thus fetched once per
// block instead of once per thread, cutting global traffic by a factor of kTile.
// Loads past the matrix edges write zeros, so the inner loop needs no guards.
// Each 128 of K is summed afresh before joining the total (blocked_sum.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/blocks/blocked_sum.cuh"
#include "cuda/blocks/common.cuh"

namespace jax_tiled::cuda {

// One padding column keeps a transposed store (threads walking a column) free
// of bank conflicts; row reads in the inner loop are unaffected.
template <int kTile, class Acc>
using SharedTile = Acc[kTile][kTile + 1];

// Loads the kTile x kTile block at (row0, col0) of a rows x cols matrix into
// tile, zeros past the edges. The matrix is stored row-major with row stride ld,
// or as its transpose when `transposed`. threadIdx.x always walks the stored
// contiguous axis, so a warp's global loads coalesce in both layouts.
template <int kTile, class In, class Acc>
__device__ __forceinline__ void LoadTile(SharedTile<kTile, Acc>& tile, const In* matrix, int64_t ld,
                                         bool transposed, int64_t rows, int64_t cols, int64_t row0,
                                         int64_t col0) {
  const int r = transposed ? threadIdx.x : threadIdx.y;
  const int c = transposed ? threadIdx.y : threadIdx.x;
  const int64_t row = row0 + r, col = col0 + c;
  const bool inside = row < rows && col < cols;
  tile[r][c] =
      inside ? ToAccumulator<Acc>(matrix[transposed ? col * ld + row : row * ld + col]) : Acc{0};
}

// kSkipSecondSync removes the barrier that stops a fast thread from
// overwriting a tile its neighbours are still reading. It exists only so that a
// compute-sanitizer racecheck test can show the tool catches that race (a
// negative control); nothing else may select it.
template <int kTile, class In, class Out, class Acc, bool kSkipSecondSync = false>
__global__ void __launch_bounds__(kTile* kTile)
    SmemTiledMatmul(MatmulDims dims, const In* __restrict__ a, const In* __restrict__ b,
                    Out* __restrict__ out) {
  __shared__ SharedTile<kTile, Acc> a_tile, b_tile;
  const int64_t tiles_m = (dims.m + kTile - 1) / kTile, tiles_n = (dims.n + kTile - 1) / kTile;

  // Grid-stride loops: gridDim.y and gridDim.z stop at 65535, so one block may
  // own several batches or row tiles. The bounds depend only on blockIdx, so
  // the whole block takes the same trips and the barriers stay uniform.
  for (int64_t batch = blockIdx.z; batch < dims.batch; batch += gridDim.z) {
    const In* a_batch = a + batch * dims.a_batch_stride;
    const In* b_batch = b + batch * dims.b_batch_stride;
    for (int64_t tile_m = blockIdx.y; tile_m < tiles_m; tile_m += gridDim.y) {
      for (int64_t tile_n = blockIdx.x; tile_n < tiles_n; tile_n += gridDim.x) {
        const int64_t row0 = tile_m * kTile, col0 = tile_n * kTile;
        Accumulators<Acc, kTile, /*kBlocked=*/true> acc;
        for (int64_t phase = 0; phase * kTile < dims.k; ++phase) {
          const int64_t k0 = phase * kTile;
          LoadTile<kTile>(a_tile, a_batch, dims.lda, dims.transpose_a, dims.m, dims.k, row0, k0);
          LoadTile<kTile>(b_tile, b_batch, dims.ldb, dims.transpose_b, dims.k, dims.n, k0, col0);
          __syncthreads();  // the tiles are complete before anyone reads them
#pragma unroll
          for (int kk = 0; kk < kTile; ++kk)
            acc.partial += a_tile[threadIdx.y][kk] * b_tile[kk][threadIdx.x];
          acc.EndSlab(phase);
          if constexpr (!kSkipSecondSync) {
            __syncthreads();  // everyone is done reading before the next phase overwrites
          }
        }
        const int64_t row = row0 + threadIdx.y, col = col0 + threadIdx.x;
        if (row < dims.m && col < dims.n)
          out[batch * dims.out_batch_stride + row * dims.ldc + col] =
              FromAccumulator<Out>(acc.Result());
      }
    }
  }
}

// Launches on `stream` and returns the launch's error. The output must not be
// empty (a zero-sized grid is a launch error).
template <int kTile, class In, class Out, class Acc, bool kSkipSecondSync = false>
cudaError_t LaunchSmemTiled(const MatmulDims& dims, const In* a, const In* b, Out* out,
                            cudaStream_t stream) {
  const dim3 block(kTile, kTile);
  SmemTiledMatmul<kTile, In, Out, Acc, kSkipSecondSync>
      <<<OutputTileGrid(dims, kTile, kTile), block, 0, stream>>>(dims, a, b, out);
  return cudaGetLastError();
}

}  // namespace jax_tiled::cuda
