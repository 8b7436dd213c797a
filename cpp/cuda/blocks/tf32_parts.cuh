// 3xTF32's operands split ahead of the kernel: each float32 operand into its
// TF32 hi and lo parts (tf32.cuh's SplitTf32, the same bits the kernel's own
// split gave), written K-major whatever the operand's stored layout, as a
// stack of two (hi's batches, then lo's) in XLA's scratch. The Hopper kernel
// then copies all four parts with the copy engine and reads them from shared
// memory, so no warp of its own splits or transposes anything (NOTES.md,
// "3xTF32's parts split ahead").
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/blocks/tf32.cuh"
#include "stack_slice.h"

namespace jax_tiled::cuda {

// One operand as stored, and where its parts go.
struct Tf32PartsLayout {
  const float* source;  // the operand (the stack, where it is a slice of one)
  int64_t rows;         // its free extent: M for A, N for B
  int64_t k;
  int64_t ld;            // elements between the stored rows
  int64_t batch_stride;  // elements between batches; 0: one batch, broadcast
  int64_t batches;       // batches to split: 1 where broadcast
  bool k_contiguous;     // K runs along the stored rows (a stored (m, k), b (n, k))
  int64_t parts_ld;      // K rounded up to whole 16-byte lines (the copy engine's rows)

  // Elements of one part: its batches of rows x parts_ld.
  __host__ __device__ int64_t PartElements() const { return batches * rows * parts_ld; }
};

// K rounded up to whole 16-byte lines of float32.
inline int64_t Tf32PartsLd(int64_t k) { return (k + 3) / 4 * 4; }

inline constexpr int kPartsTile = 32;  // a block's tile: 32 of K x 32 rows
inline constexpr int kPartsRowsAtOnce = 8;

// Block (k tile, row tile, batch): the tile read along its stored rows (either
// layout reads whole 128-byte lines), through shared memory, written along K.
// kKContiguous: layout.k_contiguous.
template <bool kKContiguous>
__global__ void __launch_bounds__(kPartsTile* kPartsRowsAtOnce)
    SplitTf32Parts(const Tf32PartsLayout layout, const StackSlice stack,
                   uint32_t* __restrict__ parts) {
  __shared__ float tile[kPartsTile][kPartsTile + 1];  // [row][k]; + 1: no bank conflicts
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kPartsTile;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kPartsTile;
  const int x = threadIdx.x, y = threadIdx.y;
  const float* const source = layout.source + stack.Offset();
  uint32_t* const lo_parts = parts + layout.PartElements();
  for (int64_t batch = blockIdx.z; batch < layout.batches; batch += gridDim.z) {
    const float* const from = source + batch * layout.batch_stride;
    for (int i = y; i < kPartsTile; i += kPartsRowsAtOnce) {
      // Lane x along the stored row: K where it runs along them, else the rows.
      const int64_t k = kKContiguous ? k0 + x : k0 + i;
      const int64_t r = kKContiguous ? r0 + i : r0 + x;
      const float v = k < layout.k && r < layout.rows
                          ? from[kKContiguous ? r * layout.ld + k : k * layout.ld + r]
                          : 0.0f;
      if (kKContiguous) tile[i][x] = v;
      else tile[x][i] = v;
    }
    __syncthreads();
    for (int i = y; i < kPartsTile; i += kPartsRowsAtOnce) {
      const int64_t r = r0 + i, k = k0 + x;
      if (r < layout.rows && k < layout.k) {
        uint32_t hi, lo;
        SplitTf32(tile[i][x], hi, lo);
        const int64_t at = (batch * layout.rows + r) * layout.parts_ld + k;
        parts[at] = hi;
        lo_parts[at] = lo;
      }
    }
    __syncthreads();
  }
}

// Launches the split of one operand into `parts` (2 x PartElements() floats).
inline cudaError_t SplitIntoTf32Parts(const Tf32PartsLayout& layout, const StackSlice& stack,
                                      void* parts, cudaStream_t stream) {
  if (layout.rows == 0 || layout.k == 0 || layout.batches == 0) return cudaSuccess;
  if ((layout.rows + kPartsTile - 1) / kPartsTile > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((layout.k + kPartsTile - 1) / kPartsTile),
                  static_cast<unsigned>((layout.rows + kPartsTile - 1) / kPartsTile),
                  static_cast<unsigned>(std::min<int64_t>(layout.batches, 65535)));
  const dim3 block(kPartsTile, kPartsRowsAtOnce);
  uint32_t* const out = static_cast<uint32_t*>(parts);
  if (layout.k_contiguous) SplitTf32Parts<true><<<grid, block, 0, stream>>>(layout, stack, out);
  else SplitTf32Parts<false><<<grid, block, 0, stream>>>(layout, stack, out);
  return cudaGetLastError();
}

}  // namespace jax_tiled::cuda
