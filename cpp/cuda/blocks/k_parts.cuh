// K cut into parts, for the SIMT kernels where their output tiles alone leave
// SMs idle (a long K over a small output): each part of a tile is a block of
// its own, which sums its range of K into its own slot of scratch in the
// accumulator type; then a second kernel (AddKParts) adds each element's
// parts in part order and writes C. No atomics: the order of the sums is
// fixed, so results are bitwise the same run to run. Shorter sums are also
// more accurate ones: each part's running total is a 1/count of K deep
// (NOTES.md, "Split K for the SIMT kernels").
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/blocks/common.cuh"
#include "cuda/kernel.h"

namespace jax_tiled::cuda {

struct KParts {
  int64_t count = 1;  // 1: K whole, and the kernel writes C itself
  int64_t depth = 0;  // K of every part but the last, a multiple of the kernel's slab
  // Elements between two parts' outputs in scratch (0 where K is whole).
  int64_t slot_stride = 0;

  __host__ __device__ int64_t Begin(int64_t part) const { return part * depth; }
  // The K of part `part` of a product whose K is k.
  __host__ __device__ int64_t Length(int64_t part, int64_t k) const {
    const int64_t left = k - part * depth;
    return count == 1 || left < depth ? left : depth;
  }
};

// K cut into at most `wanted` parts of whole slabs of `slab`, every part but
// the last equally deep; fewer where K has fewer slabs. The plan and the
// launch both take the count from here, so explain says what runs.
inline KParts KPartsOf(int64_t k, int64_t wanted, int slab) {
  const int64_t slabs = (k + slab - 1) / slab;
  if (wanted <= 1 || slabs < 2) return {1, k, 0};
  const int64_t depth = (slabs + wanted - 1) / wanted * slab;
  return {(k + depth - 1) / depth, depth, 0};
}

// The least K a part is given: two of the SIMT kernels' partial sums
// (kRoundedSumDepth), so a part's mainloop is long next to its start and its
// store to scratch.
inline constexpr int64_t kMinKPartDepth = 256;

// How many parts to cut K into where `tiles` blocks would leave SMs idle: the
// largest power of two whose blocks the GPU still holds at once (`resident`:
// the SMs times the blocks each is sure to hold), each part at least
// kMinKPartDepth deep. 1 where the tiles fill the GPU alone.
inline int64_t KPartsWanted(int64_t tiles, int64_t k, int64_t resident) {
  int64_t parts = 1;
  while (tiles * 2 * parts <= resident && k >= 2 * parts * kMinKPartDepth) parts *= 2;
  return parts;
}

// Element (x, k0 + k) of an operand whose element (x, k) is at
// k_contiguous ? base[x * ld + k] : base[k * ld + x]: the operand from k0 on,
// as a kernel reads one part's K.
template <class T>
__device__ __forceinline__ const T* FromK(const T* base, int64_t ld, bool k_contiguous,
                                          int64_t k0) {
  return base + (k_contiguous ? k0 : k0 * ld);
}

// Parts summed as a tree of eights: parts added one after another into a
// group's sum, eight groups' sums one after another into a sum of the next
// level, and so on; then the levels' sums from the top down. A sum of n
// parts then rounds about 8 log8(n) times in a row where one running sum
// rounded n times (128 parts of a few rows' long K were twice jnp's error;
// 196 parts in 25 groups added in a row, 1.07x: NOTES.md, "Odd rows padded
// for the float32 mainloop"). Up to 8 parts it is that running sum, and up
// to 64 the groups' sums added in a row.
inline constexpr int kKPartsPerGroup = 8;
// Levels enough for 8^6 parts (a grid's y holds 65535).
inline constexpr int kKPartsLevels = 6;

// The second kernel: C = the sum of the parts' slots, in part order, as a
// tree of kKPartsPerGroup. The slots hold the batch's outputs densely (row
// stride n, batch stride m n).
template <class Acc, class Out>
__global__ void __launch_bounds__(256)
    AddKParts(const MatmulDims dims, const Acc* __restrict__ partials, const KParts parts,
              Out* __restrict__ out) {
  const int64_t per_matrix = dims.m * dims.n, total = dims.batch * per_matrix;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    // Each level's running sum and how many sums of the level below it holds
    // (unrolled over the levels: registers, not local memory).
    Acc level[kKPartsLevels];
    int held[kKPartsLevels] = {};
    for (int64_t part = 0; part < parts.count; ++part) {
      Acc sum = partials[part * parts.slot_stride + i];
      bool carry = true;
#pragma unroll
      for (int l = 0; l < kKPartsLevels; ++l)
        if (carry) {
          level[l] = held[l] ? level[l] + sum : sum;
          carry = ++held[l] == kKPartsPerGroup && l + 1 < kKPartsLevels;
          if (carry) {
            sum = level[l];
            held[l] = 0;
          }
        }
    }
    Acc sum = 0;
    bool first = true;
#pragma unroll
    for (int l = kKPartsLevels - 1; l >= 0; --l)
      if (held[l]) {
        sum = first ? level[l] : sum + level[l];
        first = false;
      }
    const int64_t batch = i / per_matrix, row = i % per_matrix / dims.n, col = i % dims.n;
    out[batch * dims.out_batch_stride + row * dims.ldc + col] = FromAccumulator<Out>(sum);
  }
}

// Runs a SIMT kernel in the plan's parts of K (plan.split_groups, in whole
// slabs of kSlab; `launch(dims, out, parts)` writes the parts' sums where
// `out` points, with the row and batch strides of `dims`), then, where K is
// split, AddKParts. Scratch holds the parts' sums: count x batch x m x n
// accumulators. kCompiled: whether the kernel's configuration compiles parts.
template <class Acc, int kSlab, bool kCompiled, class Out, class Launch>
cudaError_t LaunchInKParts(const LaunchPlan& plan, const MatmulDims& dims, Out* out,
                           const LaunchContext& context, Launch&& launch) {
  // Parts the configuration does not compile: a planner bug, an invalid launch.
  if (plan.split_groups > 1 && !kCompiled) return cudaErrorInvalidValue;
  KParts parts = KPartsOf(dims.k, plan.split_groups, kSlab);
  if (parts.count == 1) return launch(dims, out, parts);
  MatmulDims slots = dims;
  slots.ldc = dims.n;
  slots.out_batch_stride = dims.m * dims.n;
  parts.slot_stride = dims.batch * dims.m * dims.n;
  // 16 bytes: the most XLA's scratch allocator takes.
  void* const scratch =
      context.scratch ? context.scratch->Allocate(parts.count * parts.slot_stride * sizeof(Acc), 16)
                      : nullptr;
  if (!scratch) return cudaErrorMemoryAllocation;
  Acc* const partials = static_cast<Acc*>(scratch);
  if (const cudaError_t err = launch(slots, partials, parts); err != cudaSuccess) return err;
  constexpr int64_t kThreads = 256, kMaxBlocks = 0x7fffffff;
  const auto blocks =
      static_cast<unsigned>(std::min((parts.slot_stride + kThreads - 1) / kThreads, kMaxBlocks));
  AddKParts<Acc, Out><<<blocks, kThreads, 0, context.stream>>>(dims, partials, parts, out);
  return cudaGetLastError();
}

}  // namespace jax_tiled::cuda
