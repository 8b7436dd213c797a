// Kernel 0, "naive": one thread per output element, both operands read
// straight from global memory. The ladder's starting point, and the measure of
// what kernel 1's shared tiles buy.
//
// Thread (x, y) of a kNaiveBlock x kNaiveBlock block computes one C[row, col]
// = sum_k op(A)[row, k] op(B)[k, col], loading its row of op(A) and column of
// op(B) itself: 2 K elements per output, where kernel 1's TILE x TILE tiles load
// 2 K / TILE. Nothing is shared on purpose; whatever reuse there is (the
// threads of a block read the same few rows and columns) is the caches', not
// the kernel's. In the plain layouts a warp covers two rows of 16 columns, so
// its B loads coalesce and its A loads are two addresses; a transposed B is
// read down columns, one sector per thread. Sums are blocked as in the other
// SIMT kernels (blocked_sum.cuh), in the same order as kernel 1's, so the
// rungs differ in speed, not in their rounding.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/blocks/blocked_sum.cuh"
#include "cuda/blocks/common.cuh"

namespace jax_tiled::cuda {

// The block's side in threads: kNaiveBlock x kNaiveBlock outputs per block.
inline constexpr int kNaiveBlock = 16;

// Element (row, col) of a matrix stored row-major with row stride ld, or of the
// transpose of the one stored when `transposed`, widened to the accumulator.
template <class Acc, class In>
__device__ __forceinline__ Acc ElementOf(const In* matrix, int64_t ld, bool transposed, int64_t row,
                                         int64_t col) {
  return ToAccumulator<Acc>(matrix[transposed ? col * ld + row : row * ld + col]);
}

template <class In, class Out, class Acc>
__global__ void __launch_bounds__(kNaiveBlock* kNaiveBlock)
    NaiveMatmul(MatmulDims dims, const In* __restrict__ a, const In* __restrict__ b,
                Out* __restrict__ out) {
  // Grid-stride loops, as in kernel 1: gridDim.y and gridDim.z stop at 65535.
  const int64_t row_stride = int64_t{gridDim.y} * kNaiveBlock;
  const int64_t col_stride = int64_t{gridDim.x} * kNaiveBlock;
  for (int64_t batch = blockIdx.z; batch < dims.batch; batch += gridDim.z) {
    const In* a_batch = a + batch * dims.a_batch_stride;
    const In* b_batch = b + batch * dims.b_batch_stride;
    for (int64_t row = int64_t{blockIdx.y} * kNaiveBlock + threadIdx.y; row < dims.m;
         row += row_stride) {
      for (int64_t col = int64_t{blockIdx.x} * kNaiveBlock + threadIdx.x; col < dims.n;
           col += col_stride) {
        // One slab per partial sum: the partial restarts every kRoundedSumDepth of K.
        Accumulators<Acc, kRoundedSumDepth, /*kBlocked=*/true> acc;
        int64_t slab = 0;
        for (int64_t k0 = 0; k0 < dims.k; k0 += kRoundedSumDepth, ++slab) {
          const int64_t k_end = min(dims.k, k0 + kRoundedSumDepth);
          for (int64_t kk = k0; kk < k_end; ++kk)
            acc.partial += ElementOf<Acc>(a_batch, dims.lda, dims.transpose_a, row, kk) *
                           ElementOf<Acc>(b_batch, dims.ldb, dims.transpose_b, kk, col);
          acc.EndSlab(slab);
        }
        out[batch * dims.out_batch_stride + row * dims.ldc + col] =
            FromAccumulator<Out>(acc.Result());
      }
    }
  }
}

// Launches on `stream` and returns the launch's error. The output must not be
// empty (a zero-sized grid is a launch error).
template <class In, class Out, class Acc>
cudaError_t LaunchNaive(const MatmulDims& dims, const In* a, const In* b, Out* out,
                        cudaStream_t stream) {
  NaiveMatmul<In, Out, Acc><<<OutputTileGrid(dims, kNaiveBlock, kNaiveBlock),
                              dim3(kNaiveBlock, kNaiveBlock), 0, stream>>>(dims, a, b, out);
  return cudaGetLastError();
}

}  // namespace jax_tiled::cuda
