// Kernel 1, "smem": the shared-memory tiled matmul of Programming Massively
// Parallel Processors, ch. 4-5. The readable reference of the ladder.
//
// A TILE x TILE thread block owns one TILE x TILE output tile. It walks K in
// phases; in each phase every thread loads one element of op(A) and one of
// op(B) into shared memory, the block synchronises, and every thread does TILE
// multiply-adds from shared memory. Each global element is thus fetched once per
// block instead of once per thread (kernel 0), cutting global traffic by a
// factor of TILE. Loads past the matrix edges write zeros, so the inner loop
// needs no guards. Each 128 of K is summed afresh before joining the total
// (blocked_sum.cuh).
//
// TILE is the template's kTile ("smem16": 16), or, where kTile is 0, the
// launch's block width ("smem": chosen at run time from the device's per-block
// limits and the output's size, 1_smem_tiled.cu), with the tiles in dynamic
// shared memory. One kernel serves both: Width<kTile>() is a constant or
// blockDim.x, and the compile-time widths compile as they always did.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/blocks/blocked_sum.cuh"
#include "cuda/blocks/common.cuh"
#include "cuda/kernel.h"

namespace jax_tiled::cuda {

// The widths "smem" chooses among at run time, widest first (the widest sets
// the kernel's launch bounds). Each is a whole number of the run-time inner
// loop's kRuntimeUnroll and divides a partial sum's depth, so a partial sum
// is whole phases at every width.
inline constexpr int kSmemWidths[] = {32, 16, 8};
inline constexpr int kRuntimeUnroll = 8;

constexpr bool EveryWidthFitsTheLoop() {
  for (int w : kSmemWidths)
    if (w % kRuntimeUnroll || kRoundedSumDepth % w) return false;
  return true;
}
static_assert(EveryWidthFitsTheLoop(), "kSmemWidths against the loop and the partial sums");

// The shared memory of a block's two width x width tiles of Acc (one padding
// column each).
constexpr int SmemTileBytes(int width, int acc_bytes) {
  return 2 * width * (width + 1) * acc_bytes;
}

// Whether the kernel runs at this width under these per-block limits: one of
// kSmemWidths, width^2 threads, and two tiles in the block's shared memory.
// The planner chooses by it and the launcher checks the plan with it.
constexpr bool SmemWidthFits(int width, int acc_bytes, int shared_bytes_per_block,
                             int max_threads_per_block) {
  bool listed = false;
  for (int w : kSmemWidths) listed = listed || w == width;
  return listed && width * width <= max_threads_per_block &&
         SmemTileBytes(width, acc_bytes) <= shared_bytes_per_block;
}

// The width of the block's tiles: kTile, or for kTile == 0 the launch's (the
// block is width x width threads).
template <int kTile>
__device__ __forceinline__ int Width() {
  if constexpr (kTile != 0) return kTile;
  else return static_cast<int>(blockDim.x);
}

// One padding column keeps a transposed store (threads walking a column) free
// of bank conflicts; row reads in the inner loop are unaffected.
template <int kTile, class Acc>
using SharedTile = Acc[kTile][kTile + 1];

// Loads the width x width block at (row0, col0) of a rows x cols matrix into
// tile (rows `pitch` apart), zeros past the edges. The matrix is stored
// row-major with row stride ld, or as its transpose when `transposed`.
// threadIdx.x always walks the stored contiguous axis, so a warp's global loads
// coalesce in both layouts.
template <class In, class Acc>
__device__ __forceinline__ void LoadTile(Acc* tile, int pitch, const In* matrix, int64_t ld,
                                         bool transposed, int64_t rows, int64_t cols, int64_t row0,
                                         int64_t col0) {
  const int r = transposed ? threadIdx.x : threadIdx.y;
  const int c = transposed ? threadIdx.y : threadIdx.x;
  const int64_t row = row0 + r, col = col0 + c;
  const bool inside = row < rows && col < cols;
  tile[r * pitch + c] =
      inside ? ToAccumulator<Acc>(matrix[transposed ? col * ld + row : row * ld + col]) : Acc{0};
}

// The K that Accumulators counts as a slab (EndSlab): a phase at a
// compile-time width; at a run-time one a whole partial sum (MultiplyTiles
// ends a slab only where a phase completes one).
template <int kTile>
inline constexpr int kSlabOf = kTile != 0 ? kTile : kRoundedSumDepth;

// acc.partial += a_row[kk] * b_col[kk * pitch] over one phase's `width` of K,
// the partial sum restarting every kRoundedSumDepth of K at either kind of
// width, so both add the same products in the same order.
template <int kTile, class Acc, class Sums>
__device__ __forceinline__ void MultiplyTiles(Sums& acc, const Acc* a_row, const Acc* b_col,
                                              int pitch, int width, int64_t phase) {
  if constexpr (kTile != 0) {
#pragma unroll
    for (int kk = 0; kk < kTile; ++kk) acc.partial += a_row[kk] * b_col[kk * pitch];
    acc.EndSlab(phase);
  } else {
#pragma unroll kRuntimeUnroll
    for (int kk = 0; kk < width; ++kk) acc.partial += a_row[kk] * b_col[kk * pitch];
    if ((phase + 1) * width % kRoundedSumDepth == 0) acc.EndSlab(phase);
  }
}

// kSkipSecondSync removes the barrier that stops a fast thread from
// overwriting a tile its neighbours are still reading. It exists only so that a
// compute-sanitizer racecheck test can show the tool catches that race (a
// negative control); nothing else may select it.
//
// A run-time width asks for two blocks of the widest per SM (32 registers a
// thread, all it needs: at the bare thread bound ptxas spilled); a
// compile-time one keeps its bound alone (0: no minimum).
template <int kTile, class In, class Out, class Acc, bool kSkipSecondSync = false>
__global__ void __launch_bounds__(kTile == 0 ? kSmemWidths[0] * kSmemWidths[0] : kTile * kTile,
                                  kTile == 0 ? 2 : 0)
    SmemTiledMatmul(MatmulDims dims, const In* __restrict__ a, const In* __restrict__ b,
                    Out* __restrict__ out) {
  const int width = Width<kTile>(), pitch = width + 1;
  Acc *a_tile, *b_tile;
  if constexpr (kTile != 0) {
    __shared__ SharedTile<kTile, Acc> a_shared, b_shared;
    a_tile = &a_shared[0][0];
    b_tile = &b_shared[0][0];
  } else {  // SmemTileBytes(width, sizeof(Acc)) of them, from the launch
    extern __shared__ __align__(16) unsigned char tiles[];
    a_tile = reinterpret_cast<Acc*>(tiles);
    b_tile = a_tile + width * pitch;
  }
  const int64_t tiles_m = (dims.m + width - 1) / width, tiles_n = (dims.n + width - 1) / width;

  // Grid-stride loops: gridDim.y and gridDim.z stop at 65535, so one block may
  // own several batches or row tiles. The bounds depend only on blockIdx, so
  // the whole block takes the same trips and the barriers stay uniform.
  for (int64_t batch = blockIdx.z; batch < dims.batch; batch += gridDim.z) {
    const In* a_batch = a + batch * dims.a_batch_stride;
    const In* b_batch = b + batch * dims.b_batch_stride;
    for (int64_t tile_m = blockIdx.y; tile_m < tiles_m; tile_m += gridDim.y) {
      for (int64_t tile_n = blockIdx.x; tile_n < tiles_n; tile_n += gridDim.x) {
        const int64_t row0 = tile_m * width, col0 = tile_n * width;
        Accumulators<Acc, kSlabOf<kTile>, /*kBlocked=*/true> acc;
        for (int64_t phase = 0; phase * width < dims.k; ++phase) {
          const int64_t k0 = phase * width;
          LoadTile(a_tile, pitch, a_batch, dims.lda, dims.transpose_a, dims.m, dims.k, row0, k0);
          LoadTile(b_tile, pitch, b_batch, dims.ldb, dims.transpose_b, dims.k, dims.n, k0, col0);
          __syncthreads();  // the tiles are complete before anyone reads them
          MultiplyTiles<kTile>(acc, a_tile + threadIdx.y * pitch, b_tile + threadIdx.x, pitch,
                               width, phase);
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
// empty (a zero-sized grid is a launch error). kTile == 0 runs the plan's
// width, after checking it against the limits it was chosen under: a plan
// the kernel cannot run is an invalid launch, not a launch that fails.
template <int kTile, class In, class Out, class Acc, bool kSkipSecondSync = false>
cudaError_t LaunchSmemTiled(const LaunchPlan& plan, const MatmulDims& dims, const In* a,
                            const In* b, Out* out, cudaStream_t stream) {
  int width = kTile, shared_bytes = 0;
  if constexpr (kTile == 0) {
    const RuntimeWidth& chosen = plan.runtime_width;
    width = plan.block_m;
    if (plan.block_n != width || !SmemWidthFits(width, sizeof(Acc), chosen.shared_bytes_per_block,
                                                chosen.max_threads_per_block))
      return cudaErrorInvalidValue;
    shared_bytes = SmemTileBytes(width, sizeof(Acc));
  }
  SmemTiledMatmul<kTile, In, Out, Acc, kSkipSecondSync>
      <<<OutputTileGrid(dims, width, width), dim3(width, width), shared_bytes, stream>>>(dims, a, b,
                                                                                         out);
  return cudaGetLastError();
}

}  // namespace jax_tiled::cuda
