// Blocked summation: each few hundred of K is summed into a fresh partial
// sum, and the partial sums are added into the running total with ordinary
// round-to-nearest adds.
//
// Why: a thread that adds K products one by one into a single float rounds
// each addition relative to the whole running sum, so on inputs of one sign
// the error grows like sqrt(K) (FFMA, round to nearest) or like K (the tensor
// cores, which truncate each addition into their accumulator). cuBLAS splits
// long K: at 512 x 8192 x 512 float32 one running sum was 7.6x its error at
// HIGHEST, and, with TF32 operands rounded, about 6x at DEFAULT (H100,
// 2026-11-23). Partial sums cost one add per accumulator per partial, free
// next to the partial's multiply-adds (NOTES.md, "Long sums", has the
// measurements that chose the depths below).
//
// It costs a second set of accumulators, so a kernel blocks its sums only
// where its register budget holds both (RoomForBlockedSum); `Accumulators`
// below gives kernels one interface for either choice.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace jax_tiled::cuda {

// K per partial sum where each addition rounds to nearest (FFMA, the SIMT
// kernels): the error of a two-level sum is smallest near sqrt(K) terms a
// level, and 128 is near that over the K of 1000 to 8192 where it matters.
inline constexpr int kRoundedSumDepth = 128;
// K per partial sum on the tensor cores, where the truncation of each
// addition leans one way and so grows with the partial's depth: shallower.
inline constexpr int kTruncatedSumDepth = 64;
// The same for one TF32 pass on wgmma, where each partial sum ends in a
// drain of the wgmma queue: the operands' rounding to TF32 (a random 2^-11
// of every product) outweighs the truncation's lean until partials far
// deeper than 64, so fewer, deeper partials cost no accuracy there.
inline constexpr int kTf32TruncatedSumDepth = 256;

// K per partial sum where the totals lie in shared memory (SharedTotals
// below), which costs a thread 16 shared loads and stores and 64 adds a
// partial: deeper. warptile's float32 blocks ran 2% faster at 256 than at
// 128 (4096^3 and 8192^3, H100), and their error against float64 stayed at
// most 0.53 times jnp HIGHEST's on positive inputs (0.71 on normal ones)
// over K of 556 to 8192 (NOTES.md, "warptile's float32 mainloop, the
// partials' loop").
inline constexpr int kSharedTotalsSumDepth = 2 * kRoundedSumDepth;

// Partial sums per group where a kernel has room for a third set of
// accumulators (RoomForSets(3, ...)): the partials are added into a group's
// sum, and each group's sum into the running total. The running total's
// round-to-nearest adds grow its error with their count: at 16 x 8192 x 8192
// bfloat16 -> float32 (K split in two, 64 partials of 64 a block) the
// model of tools/tensor_core_sums.py matched the measured 8.3e-8, 2.7x jnp's
// error, and predicts 4.7e-8 in groups of 8 (NOTES.md, "Partial sums in
// groups"); groups of 4 and 16 were within 10% of that.
inline constexpr int kPartialsPerGroup = 8;

// Whether a thread with `registers` registers can hold `sets` sets of
// `accumulators` 4-byte accumulators and the 64 or so registers a mainloop
// needs besides.
constexpr bool RoomForSets(int sets, int accumulators, int registers) {
  return sets * accumulators + 64 <= registers;
}
constexpr bool RoomForTwoSets(int accumulators, int registers) {
  return RoomForSets(2, accumulators, registers);
}

// The same for `threads_per_sm` threads (the block times the blocks that
// must fit on an SM) sharing the register file: 64K registers per SM, at
// most 255 per thread.
constexpr bool RoomForBlockedSum(int accumulators, int threads_per_sm) {
  const int budget = 65536 / threads_per_sm < 255 ? 65536 / threads_per_sm : 255;
  return RoomForTwoSets(accumulators, budget);
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
// partial sum starts afresh every kDepth of K (EndSlab moves it into the
// total); otherwise `partial` is the one running sum.
template <class Acc, int kSlabDepth, bool kBlocked, int kDepth = kRoundedSumDepth>
struct Accumulators;

template <class Acc, int kSlabDepth, int kDepth>
struct Accumulators<Acc, kSlabDepth, true, kDepth> {
  static_assert(kDepth % kSlabDepth == 0, "a partial sum is whole slabs");
  static constexpr int kSlabsPerPartial = kDepth / kSlabDepth;
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

template <class Acc, int kSlabDepth, int kDepth>
struct Accumulators<Acc, kSlabDepth, false, kDepth> {
  Acc partial;

  __device__ __forceinline__ Accumulators() { SetZero(partial); }
  __device__ __forceinline__ void EndSlab(int64_t) {}
  __device__ __forceinline__ const Acc& Result() { return partial; }
};

// Blocked summation for a kernel whose registers hold only the partial sums
// (warptile's float32 blocks: 8 x 8 sums a thread at 128 registers): the
// totals lie in shared memory as quads of float4, quad q of thread t at
// [q * kThreads + t], so that a warp's 16-byte accesses are contiguous. They
// are the kernel's dynamic shared memory, kBytes of it, found from the symbol
// at each use rather than kept in a pointer: two registers its mainloop has
// no room for. Each thread touches only its own totals: no barrier. The
// same sums as Accumulators<..., true>: AddPartial every kSharedTotalsSumDepth
// of K (the first time with `first`, which needs no zeroed totals: zeroing them
// before the mainloop made ptxas spill), then, if AddPartial ran, Result.
template <int kThreads, int kRows, int kColumns>
struct SharedTotals {
  static_assert(kColumns % 4 == 0, "the sums move as quads");
  static constexpr int kQuadsPerRow = kColumns / 4;
  static constexpr int kBytes = kRows * kQuadsPerRow * kThreads * 16;

  __device__ __forceinline__ static float4& Quad(int row, int quad) {
    extern __shared__ __align__(16) float4 shared_totals[];
    return shared_totals[(row * kQuadsPerRow + quad) * kThreads + threadIdx.x];
  }

  // total += partial (total = partial where `first`); partial = 0.
  __device__ __forceinline__ static void AddPartial(float (&partial)[kRows][kColumns], bool first) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int q = 0; q < kQuadsPerRow; ++q) {
        float* p = &partial[r][4 * q];
        float4& t = Quad(r, q);
        t = first ? make_float4(p[0], p[1], p[2], p[3])
                  : make_float4(t.x + p[0], t.y + p[1], t.z + p[2], t.w + p[3]);
        p[0] = p[1] = p[2] = p[3] = 0.0f;
      }
  }

  // partial = total + partial: the sums, once every slab is in.
  __device__ __forceinline__ static void Result(float (&partial)[kRows][kColumns]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int q = 0; q < kQuadsPerRow; ++q) {
        float* p = &partial[r][4 * q];
        const float4 t = Quad(r, q);
        p[0] = t.x + p[0];
        p[1] = t.y + p[1];
        p[2] = t.z + p[2];
        p[3] = t.w + p[3];
      }
  }
};

}  // namespace jax_tiled::cuda
