// The copy of one slice of a stack, for kernels that cannot read it in place
// (kernel.h, Takes::stack_slices): the index is read on the device, so the
// host never waits for it and a CUDA graph replays the copy for any index.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "stack_slice.h"

namespace jax_tiled::cuda {

// Word: the widest unit that divides the slice's bytes (the stack's start
// is aligned far beyond it, so every slice is too).
template <class Word>
__global__ void GatherSliceKernel(const Word* __restrict__ stack, StackSlice slice, int64_t words,
                                  Word* __restrict__ out) {
  const int64_t first = slice.Chosen() * words;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < words;
       i += int64_t{gridDim.x} * blockDim.x)
    out[i] = stack[first + i];
}

template <class Word>
cudaError_t GatherSliceAs(const void* stack, const StackSlice& slice, size_t bytes, void* out,
                          cudaStream_t stream) {
  constexpr int kThreads = 256, kMaxBlocks = 1024;
  const int64_t words = static_cast<int64_t>(bytes / sizeof(Word));
  const int blocks =
      static_cast<int>(std::min<int64_t>((words + kThreads - 1) / kThreads, kMaxBlocks));
  GatherSliceKernel<Word><<<std::max(blocks, 1), kThreads, 0, stream>>>(
      static_cast<const Word*>(stack), slice, words, static_cast<Word*>(out));
  return cudaGetLastError();
}

// Copies the slice `slice` chooses (`bytes` long) of the stack at `stack`
// into `out`, 16-byte aligned, on `stream`.
inline cudaError_t GatherSlice(const void* stack, const StackSlice& slice, size_t bytes, void* out,
                               cudaStream_t stream) {
  if (bytes % 16 == 0) return GatherSliceAs<uint4>(stack, slice, bytes, out, stream);
  if (bytes % 4 == 0) return GatherSliceAs<uint32_t>(stack, slice, bytes, out, stream);
  return GatherSliceAs<uint16_t>(stack, slice, bytes, out, stream);
}

}  // namespace jax_tiled::cuda
