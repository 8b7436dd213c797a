// Blocked summation: each kBlockedSumDepth of K is summed into a fresh partial
// sum, and the partial sums are added into the running total with ordinary
// round-to-nearest adds.
//
// Why: a thread that adds K products one by one into a single float rounds
// each addition relative to the whole running sum, so on inputs of one sign
// the error grows like sqrt(K) (FFMA, round to nearest) or like K (the tensor
// cores, which truncate each addition into their accumulator). cuBLAS splits
// long K, and at 512 x 8192 x 512 float32 it was 7.6x (HIGHEST) and, once
// TF32 operands were rounded, about 6x (DEFAULT) more accurate than one long
// chain (H100, 2026-11-23). Two levels of sqrt(depth) and sqrt(K / depth)
// terms, or K / 4 / depth truncations per partial, bring the error at K = 8192
// to about half of cuBLAS's (NOTES.md, "Long sums"), for one add per
// accumulator per 256 k: free next to 256 multiply-adds.
//
// It costs a second set of accumulators, so a kernel blocks its sums only
// where its register budget holds both (RoomForBlockedSum); `Accumulators`
// below gives kernels one interface for either choice.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace jax_tiled::cuda {

// K per partial sum. 256 is a multiple of every kernel's slab depth.
inline constexpr int kBlockedSumDepth = 256;

// Whether `threads_per_sm` threads (the block times the blocks that must fit
// on an SM) can each hold two sets of `accumulators` 4-byte accumulators and
// the 64 or so registers a mainloop needs besides: the register file is 64K
// registers per SM, at most 255 per thread.
constexpr bool RoomForBlockedSum(int accumulators, int threads_per_sm) {
  const int budget = 65536 / threads_per_sm < 255 ? 65536 / threads_per_sm : 255;
  return 2 * accumulators + 64 <= budget;
}

// Elementwise over accumulator arrays of any rank: total += partial, partial = 0.
template <class T>
__device__ __forceinline__ void MoveInto(T& total, T& partial) {
  total += partial;
  partial = T(0);
}
template <class T, size_t N>
__device__ __forceinline__ void MoveInto(T (&total)[N], T (&partial)[N]) {
#pragma unroll
  for (size_t i = 0; i < N; ++i) MoveInto(total[i], partial[i]);
}

template <class T>
__device__ __forceinline__ void SetZero(T& x) {
  x = T(0);
}
template <class T, size_t N>
__device__ __forceinline__ void SetZero(T (&x)[N]) {
#pragma unroll
  for (size_t i = 0; i < N; ++i) SetZero(x[i]);
}

// A thread's accumulators (Acc: a scalar or an array of any rank) for a
// mainloop that adds kSlabDepth of K per slab into `partial`. kBlocked: the
// partial sum starts afresh every kBlockedSumDepth of K (EndSlab moves it into
// the total); otherwise `partial` is the one running sum.
template <class Acc, int kSlabDepth, bool kBlocked>
struct Accumulators;

template <class Acc, int kSlabDepth>
struct Accumulators<Acc, kSlabDepth, true> {
  static_assert(kBlockedSumDepth % kSlabDepth == 0, "a partial sum is whole slabs");
  static constexpr int kSlabsPerPartial = kBlockedSumDepth / kSlabDepth;
  Acc partial, total;

  __device__ __forceinline__ Accumulators() {
    SetZero(partial);
    SetZero(total);
  }
  // After slab `slab` (counted from 0) went into `partial`.
  __device__ __forceinline__ void EndSlab(int64_t slab) {
    if ((slab + 1) % kSlabsPerPartial == 0) MoveInto(total, partial);
  }
  // The sum, once every slab is in.
  __device__ __forceinline__ const Acc& Result() {
    MoveInto(total, partial);
    return total;
  }
};

template <class Acc, int kSlabDepth>
struct Accumulators<Acc, kSlabDepth, false> {
  Acc partial;

  __device__ __forceinline__ Accumulators() { SetZero(partial); }
  __device__ __forceinline__ void EndSlab(int64_t) {}
  __device__ __forceinline__ const Acc& Result() { return partial; }
};

}  // namespace jax_tiled::cuda
