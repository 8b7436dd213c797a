// Epilogue building blocks shared by the tensor-core kernels: mma.sync's and
// wgmma's accumulators have the same per-thread shape (per 8 columns, a pair
// of adjacent columns in each of two rows 8 apart), so one writer stores
// either, clipped to the matrix.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/blocks/common.cuh"

namespace jax_tiled::cuda {

// Two adjacent outputs as one store; `at` is aligned to the pair.
template <class Out>
__device__ __forceinline__ void StorePair(Out* at, float x, float y) {
  if constexpr (std::is_same_v<Out, float>) {
    *reinterpret_cast<float2*>(at) = make_float2(x, y);
  } else if constexpr (std::is_same_v<Out, __nv_bfloat16>) {
    *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(x, y);
  } else {
    static_assert(std::is_same_v<Out, __half>,
                  "tensor-core results are float, bfloat16 or float16");
    *reinterpret_cast<__half2*>(at) = __floats2half2_rn(x, y);
  }
}

// Two adjacent 16-bit outputs packed as one 32-bit word, the first in the low half.
template <class Out>
__device__ __forceinline__ uint32_t PackPair(float x, float y) {
  static_assert(sizeof(Out) == 2, "16-bit outputs only");
  alignas(4) Out packed[2];
  StorePair(packed, x, y);
  return *reinterpret_cast<const uint32_t*>(packed);
}

// Whether every row of C, and every matrix of its batch, starts `bytes`-aligned,
// so that stores of that width at aligned columns stay aligned (a single row
// or matrix has no stride to check). For the launcher's kernel arguments.
template <class Out>
inline bool RowsAligned(const MatmulDims& dims, const Out* out, int bytes) {
  return reinterpret_cast<uintptr_t>(out) % bytes == 0 &&
         (dims.m == 1 || dims.ldc * sizeof(Out) % bytes == 0) &&
         (dims.batch == 1 || dims.out_batch_stride * sizeof(Out) % bytes == 0);
}

// Eight adjacent outputs as 16-byte stores; `at` is 16-byte aligned.
template <class Out>
__device__ __forceinline__ void StoreEight(Out* at, const float (&v)[8]) {
  if constexpr (std::is_same_v<Out, float>) {
    reinterpret_cast<float4*>(at)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(at)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    *reinterpret_cast<uint4*>(at) =
        make_uint4(PackPair<Out>(v[0], v[1]), PackPair<Out>(v[2], v[3]), PackPair<Out>(v[4], v[5]),
                   PackPair<Out>(v[6], v[7]));
  }
}

// One output matrix as the epilogues write it: element (r, c) at c[r * ldc +
// c], or at c[c * ldc + r] where the kernel computed the transposed product
// (kTransposed). paired: every row starts aligned to two elements, so two
// adjacent columns inside the matrix go out as one store. The sizes are read
// from `dims` where used, not copied: a kernel's parameters cost no
// registers, and copies hoisted out of a tile loop would sit beside the
// accumulators through the whole mainloop.
template <class Out, bool kTransposed = false>
struct OutputWriter {
  const MatmulDims& dims;  // the kernel's own rows and columns (before transposing back)
  Out* c;
  bool paired;

  __device__ __forceinline__ OutputWriter(Out* out, const MatmulDims& dims, int64_t batch,
                                          bool paired)
      : dims(dims), c(out + batch * dims.out_batch_stride), paired(paired) {}

  // Whether row `row` is inside: callers test it once per row, not per pair
  // (a test inside Pair, unrolled over a row's pairs, cost the TF32 wgmma
  // kernels registers enough to spill).
  __device__ __forceinline__ bool RowInside(int64_t row) const { return row < dims.m; }

  // x at (row, col), y at (row, col + 1), whichever columns are inside; the
  // row is inside, col is even.
  __device__ __forceinline__ void Pair(int64_t row, int64_t col, float x, float y) const {
    if constexpr (kTransposed) {
      if (col < dims.n) c[col * dims.ldc + row] = FromAccumulator<Out>(x);
      if (col + 1 < dims.n) c[(col + 1) * dims.ldc + row] = FromAccumulator<Out>(y);
    } else if (paired && col + 1 < dims.n) {
      StorePair(c + row * dims.ldc + col, x, y);
    } else {
      if (col < dims.n) c[row * dims.ldc + col] = FromAccumulator<Out>(x);
      if (col + 1 < dims.n) c[row * dims.ldc + col + 1] = FromAccumulator<Out>(y);
    }
  }

  // v[i] at (row, col + i), whichever columns are inside; the row is inside,
  // col is a multiple of 8. vector: every row starts 16-byte aligned, so eight
  // columns inside go out as 16-byte stores.
  __device__ __forceinline__ void Eight(int64_t row, int64_t col, const float (&v)[8],
                                        bool vector) const {
    if (!kTransposed && vector && col + 7 < dims.n) return StoreEight(c + row * dims.ldc + col, v);
#pragma unroll
    for (int i = 0; i < 8; i += 2) Pair(row, col + i, v[i], v[i + 1]);
  }
};

}  // namespace jax_tiled::cuda
