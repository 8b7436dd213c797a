// Kernel 2, "regblock": 2-D register blocking on top of kernel 1's shared tiles.
//
// Kernel 1 spends two shared-memory loads on every FMA. Here a 64 x 64 output
// block is computed by 64 threads, each owning an 8 x 8 register block: per k
// it loads 8 values of A and 8 of B into registers and does 64 FMAs with them,
// 8x fewer shared loads per FMA. Everything else stays simple on purpose:
// scalar guarded loads, one shared buffer, two barriers per K phase. Kernel 3
// (warptile) adds what this leaves out: vector loads, warp-aware layouts that
// make each register fill a single 16-byte shared load, and a pipelined copy.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/blocks/blocked_sum.cuh"
#include "cuda/blocks/common.cuh"

namespace jax_tiled::cuda {

template <int kBlock, int kDepth, int kThreadTile>
struct RegisterBlockShape {
  static constexpr int kSide = kBlock / kThreadTile;  // threads along each side
  static constexpr int kThreads = kSide * kSide;
};

// Copies the rows x depth block at (row0, k0) of op(X) into tile[row][k]
// (zeros outside the matrix). op(X) is X or, when transposed, X stored
// (depth, rows). Consecutive threads walk the stored contiguous axis.
template <int kRows, int kDepth, int kThreads, class In, class Acc>
__device__ __forceinline__ void LoadBlock(Acc (&tile)[kRows][kDepth + 1], const In* x, int64_t ld,
                                          bool transposed, int64_t rows, int64_t depth,
                                          int64_t row0, int64_t k0) {
  for (int i = threadIdx.x; i < kRows * kDepth; i += kThreads) {
    const int r = transposed ? i % kRows : i / kDepth;
    const int k = transposed ? i / kRows : i % kDepth;
    const int64_t row = row0 + r, col = k0 + k;
    tile[r][k] = (row < rows && col < depth)
                     ? ToAccumulator<Acc>(x[transposed ? col * ld + row : row * ld + col])
                     : Acc{0};
  }
}

template <class Shape, int kBlock, int kDepth, int kThreadTile, class In, class Out, class Acc>
__global__ void __launch_bounds__(Shape::kThreads)
    RegisterBlockedMatmul(MatmulDims dims, const In* __restrict__ a, const In* __restrict__ b,
                          Out* __restrict__ out) {
  // Both tiles hold (free axis, k); the +1 column spreads a thread's strided
  // reads of its 8 rows over different banks.
  __shared__ Acc a_tile[kBlock][kDepth + 1], b_tile[kBlock][kDepth + 1];
  const int thread_row = threadIdx.x / Shape::kSide * kThreadTile;
  const int thread_col = threadIdx.x % Shape::kSide * kThreadTile;
  const int64_t tiles_m = (dims.m + kBlock - 1) / kBlock, tiles_n = (dims.n + kBlock - 1) / kBlock;

  for (int64_t batch = blockIdx.z; batch < dims.batch; batch += gridDim.z) {
    for (int64_t tile_m = blockIdx.y; tile_m < tiles_m; tile_m += gridDim.y) {
      for (int64_t tile_n = blockIdx.x; tile_n < tiles_n; tile_n += gridDim.x) {
        const int64_t row0 = tile_m * kBlock, col0 = tile_n * kBlock;
        constexpr bool kBlocked =
            RoomForBlockedSum(kThreadTile * kThreadTile * sizeof(Acc) / 4, Shape::kThreads);
        Accumulators<Acc[kThreadTile][kThreadTile], kDepth, kBlocked> acc;
        for (int64_t phase = 0; phase * kDepth < dims.k; ++phase) {
          const int64_t k0 = phase * kDepth;
          // op(B) is (k, n); its tile is stored as (n, k), i.e. op(B)^T, which
          // is b itself when transpose_b and b^T otherwise.
          LoadBlock<kBlock, kDepth, Shape::kThreads>(a_tile, a + batch * dims.a_batch_stride,
                                                     dims.lda, dims.transpose_a, dims.m, dims.k,
                                                     row0, k0);
          LoadBlock<kBlock, kDepth, Shape::kThreads>(b_tile, b + batch * dims.b_batch_stride,
                                                     dims.ldb, !dims.transpose_b, dims.n, dims.k,
                                                     col0, k0);
          __syncthreads();
#pragma unroll
          for (int k = 0; k < kDepth; ++k) {
            Acc a_frag[kThreadTile], b_frag[kThreadTile];
#pragma unroll
            for (int i = 0; i < kThreadTile; ++i) {
              a_frag[i] = a_tile[thread_row + i][k];
              b_frag[i] = b_tile[thread_col + i][k];
            }
#pragma unroll
            for (int i = 0; i < kThreadTile; ++i)
#pragma unroll
              for (int j = 0; j < kThreadTile; ++j) acc.partial[i][j] += a_frag[i] * b_frag[j];
          }
          acc.EndSlab(phase);
          __syncthreads();
        }
        const auto& sum = acc.Result();
        Out* out_batch = out + batch * dims.out_batch_stride;
#pragma unroll
        for (int i = 0; i < kThreadTile; ++i) {
          const int64_t row = row0 + thread_row + i;
#pragma unroll
          for (int j = 0; j < kThreadTile; ++j) {
            const int64_t col = col0 + thread_col + j;
            if (row < dims.m && col < dims.n)
              out_batch[row * dims.ldc + col] = FromAccumulator<Out>(sum[i][j]);
          }
        }
      }
    }
  }
}

// 64 x 64 output tiles, 8 deep in K, 8 x 8 outputs per thread.
struct RegisterBlocked { static constexpr int kBlock = 64, kDepth = 8, kThreadTile = 8; };

template <class In, class Out, class Acc>
cudaError_t LaunchRegisterBlocked(const MatmulDims& dims, const In* a, const In* b, Out* out,
                                  cudaStream_t stream) {
  constexpr int kBlock = RegisterBlocked::kBlock, kDepth = RegisterBlocked::kDepth,
                kThreadTile = RegisterBlocked::kThreadTile;
  using Shape = RegisterBlockShape<kBlock, kDepth, kThreadTile>;
  RegisterBlockedMatmul<Shape, kBlock, kDepth, kThreadTile, In, Out, Acc>
      <<<OutputTileGrid(dims, kBlock, kBlock), Shape::kThreads, 0, stream>>>(dims, a, b, out);
  return cudaGetLastError();
}

}  // namespace jax_tiled::cuda
