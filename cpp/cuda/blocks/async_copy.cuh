// cp.async (sm_80+): global -> shared copies that skip registers, grouped so a
// kernel can keep several K slabs in flight and wait for the oldest one only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_tiled::cuda {

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies `bytes` (0..kSize) from src and zero-fills the rest of the kSize
// destination bytes, so edge tiles need no separate path: bytes == 0 writes
// zeros and reads nothing. dst and src must be kSize-aligned.
template <int kSize>
__device__ __forceinline__ void CopyAsync(void* dst, const void* src, int bytes) {
  static_assert(kSize == 4 || kSize == 8 || kSize == 16, "cp.async copies 4, 8 or 16 bytes");
  if constexpr (kSize == 16) {  // .cg: cache in L2 only; each block reads its slab once
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SharedAddress(dst)),
                 "l"(src), "r"(bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(SharedAddress(dst)),
                 "l"(src), "n"(kSize), "r"(bytes));
  }
}

// Closes the group of copies this thread issued since the last commit.
__device__ __forceinline__ void CommitCopies() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most kPending of this thread's groups are still in flight.
// Other threads' copies become visible only after a barrier that follows.
template <int kPending>
__device__ __forceinline__ void WaitCopies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

}  // namespace jax_tiled::cuda
