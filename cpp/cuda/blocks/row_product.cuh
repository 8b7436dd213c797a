// One row times B (M = 1: a decode step's vector, a batch of them; or one
// column, N = 1, as the row of the transposed product), for the SIMT
// kernel: each output's sum in double. Such a product reads B once and
// does 2 FLOPs an element of it, so it is bound by the memory and its
// FMAs in double cost nothing measurable, where a float32 chain over K was
// twice jnp's error at 1 x 8192 x 8192 (cuBLAS's matrix-vector product sums
// each output as a tree; NOTES.md, "One row, its sums in double"). The sums
// are rounded once, into the output (or, with K in parts, once more after
// the parts' sum, which AddKParts adds in double).
//
// A block of kThreads threads takes kColumns columns of C over its part of
// K, in either of B's layouts:
// - B stored (k, n), n contiguous: lane l of warp w owns columns 4l..4l+3 and
//   the rows k = w, w + kWarps, ... of the part; a warp reads 512 contiguous
//   bytes a row. The warps' sums meet in shared memory, added in warp order.
// - B stored (n, k), k contiguous (a @ b.T, and a matrix times a vector):
//   warp w owns kColumns / kWarps columns and takes them kColumnGroup at a
//   time, its lanes the quads k = 4l, 4l + 128, ... of each; the lanes' sums
//   meet by shuffles, as a tree. A group's loads are all in flight at once
//   (a column past the matrix reads its last one again, its sum unused), and
//   a group, not the warp's columns, holds registers: several blocks an SM.
// Quads of B move as one load (16 bytes of float32, 8 of a 16-bit type)
// where every row of every batch starts on a quad's line and the quads lie
// wholly inside or outside the matrix (RowProductLoadsQuads), else as four
// loads. `auto` runs one row or one column here at HIGHEST, and on Hopper
// 16-bit operands of one column (where wgmma's C^T would spend 64 of its
// rows on one).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/blocks/common.cuh"
#include "cuda/blocks/k_parts.cuh"

namespace jax_tiled::cuda {

struct RowProductShape {
  static constexpr int kWarps = 8, kThreads = 32 * kWarps;
  static constexpr int kColumns = 128;  // a block's columns: 4 a lane, n contiguous
  static constexpr int kColumnsPerWarp = kColumns / kWarps;  // k contiguous
  static constexpr int kColumnGroup = 8;  // k contiguous: a warp's columns in flight at once
  // n contiguous: rows a warp in flight, twice as many for 16-bit B, whose
  // quads are 8 bytes.
  template <class In>
  static constexpr int kRowsInFlight = sizeof(In) == 2 ? 4 : 2;
  // K a block steps by (its part's depth is a multiple): a row a warp with n
  // contiguous, a quad a lane with k contiguous.
  static constexpr int kStepNContiguous = kWarps, kStepKContiguous = 4 * 32;
};

// B's four elements (k, col .. col + 3) with n contiguous, or (col, k .. k + 3)
// with k contiguous, as double: zeros past the matrix's extent `limit` along
// the contiguous axis (`at` being where the quad starts along it).
template <bool kVector, class In>
__device__ __forceinline__ void LoadQuadAsDouble(const In* p, int64_t at, int64_t limit,
                                                 double (&q)[4]) {
  if constexpr (kVector && sizeof(In) == 4) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(p));
    q[0] = v.x, q[1] = v.y, q[2] = v.z, q[3] = v.w;
  } else if constexpr (kVector && sizeof(In) == 2) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    In e[4];
    memcpy(e, &v, sizeof(v));
#pragma unroll
    for (int j = 0; j < 4; ++j) q[j] = ToAccumulator<double>(e[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) q[j] = at + j < limit ? ToAccumulator<double>(p[j]) : 0.0;
  }
}

// grid (column blocks, parts of K, batch); `out` is C, or the parts' slots
// (Sum: double) whose part `blockIdx.y` this block writes.
template <bool kKContiguous, bool kVector, class In, class Sum>
__global__ void __launch_bounds__(RowProductShape::kThreads)
    RowProduct(const MatmulDims dims, const In* __restrict__ a, const In* __restrict__ b,
               Sum* __restrict__ out, const KParts parts) {
  using S = RowProductShape;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t part = blockIdx.y;
  const int64_t k_begin = parts.Begin(part), k_end = k_begin + parts.Length(part, dims.k);
  // a's element k: a stored (1, k), or (k, 1) with rows lda apart.
  const int64_t a_k_stride = dims.transpose_a ? dims.lda : 1;
  __shared__ double warp_sums[kKContiguous ? 1 : S::kWarps][S::kColumns];
  for (int64_t batch = blockIdx.z; batch < dims.batch; batch += gridDim.z) {
    const In* const a_row = a + batch * dims.a_batch_stride;
    const In* const b_batch = b + batch * dims.b_batch_stride;
    Sum* const c_row = out + part * parts.slot_stride + batch * dims.out_batch_stride;
    const int64_t col0 = int64_t{blockIdx.x} * S::kColumns;
    if constexpr (!kKContiguous) {
      const int64_t col = col0 + 4 * lane;
      double sums[4] = {0, 0, 0, 0};
      // Two float32 rows a warp in flight: four or eight ran slower (NOTES.md,
      // "Row blocks: a group of columns at a time, transposes as stored").
      constexpr int kRows = S::template kRowsInFlight<In>;
      if (col < dims.n)
#pragma unroll kRows
        for (int64_t k = k_begin + warp; k < k_end; k += S::kStepNContiguous) {
          double q[4];
          LoadQuadAsDouble<kVector>(b_batch + k * dims.ldb + col, col, dims.n, q);
          const double x = ToAccumulator<double>(a_row[k * a_k_stride]);
#pragma unroll
          for (int j = 0; j < 4; ++j) sums[j] = fma(x, q[j], sums[j]);
        }
#pragma unroll
      for (int j = 0; j < 4; ++j) warp_sums[warp][4 * lane + j] = sums[j];
      __syncthreads();
      if (threadIdx.x < S::kColumns && col0 + threadIdx.x < dims.n) {
        double sum = warp_sums[0][threadIdx.x];
#pragma unroll
        for (int w = 1; w < S::kWarps; ++w) sum += warp_sums[w][threadIdx.x];
        c_row[col0 + threadIdx.x] = FromAccumulator<Sum>(sum);
      }
      __syncthreads();  // warp_sums is read before the next batch writes it
    } else {
      constexpr int kGroup = S::kColumnGroup;
      static_assert(S::kColumnsPerWarp % kGroup == 0, "whole groups a warp");
      for (int64_t first = col0 + warp * S::kColumnsPerWarp,
                   end = std::min(first + S::kColumnsPerWarp, dims.n);
           first < end; first += kGroup) {
        // Column c of the group is row `first + min(c, last)` of B as stored.
        const In* const group = b_batch + first * dims.ldb;
        const int last = static_cast<int>(std::min<int64_t>(kGroup, dims.n - first)) - 1;
        double sums[kGroup] = {};
#pragma unroll 1
        for (int64_t k = k_begin + 4 * lane; k < k_end; k += S::kStepKContiguous) {
          double x[4];
#pragma unroll
          for (int j = 0; j < 4; ++j)
            x[j] = k + j < k_end ? ToAccumulator<double>(a_row[(k + j) * a_k_stride]) : 0.0;
#pragma unroll
          for (int c = 0; c < kGroup; ++c) {
            double q[4];
            LoadQuadAsDouble<kVector>(group + std::min(c, last) * dims.ldb + k, k, k_end, q);
#pragma unroll
            for (int j = 0; j < 4; ++j) sums[c] = fma(x[j], q[j], sums[c]);
          }
        }
#pragma unroll
        for (int c = 0; c < kGroup; ++c) {
#pragma unroll
          for (int offset = 16; offset > 0; offset /= 2)
            sums[c] += __shfl_xor_sync(0xffffffffu, sums[c], offset);
          if (lane == c && first + c < end) c_row[first + c] = FromAccumulator<Sum>(sums[c]);
        }
      }
    }
  }
}

// Whether B's quads move as one load (16 bytes of float32, 8 of a 16-bit
// type): every row of every batch starting on a quad's line, and an extent
// along the contiguous axis (n, or K) whole in quads, so no quad straddles
// its end.
template <class In>
bool RowProductLoadsQuads(const MatmulDims& dims, const In* b) {
  const int64_t contiguous = dims.transpose_b ? dims.k : dims.n;
  return (sizeof(In) == 4 || sizeof(In) == 2) && contiguous % 4 == 0 && dims.ldb % 4 == 0 &&
         dims.b_batch_stride % 4 == 0 && reinterpret_cast<uintptr_t>(b) % (4 * sizeof(In)) == 0;
}

// One column (N = 1, M > 1: a matrix times a vector) as the one row of the
// transposed product, C^T = B^T A^T: B's column is the row, A read
// transposed is the matrix. C's column is C^T's row where C's rows are one
// element apart (ldc 1: the FFI's dense result of one column).
inline bool RowProductOfOneColumn(const MatmulDims& dims) {
  return dims.m > 1 && dims.n == 1 && dims.ldc == 1;
}
inline MatmulDims TransposedProduct(const MatmulDims& d) {
  MatmulDims t = d;
  t.m = d.n, t.n = d.m;
  t.a_batch_stride = d.b_batch_stride, t.b_batch_stride = d.a_batch_stride;
  t.lda = d.ldb, t.ldb = d.lda;
  t.transpose_a = !d.transpose_b, t.transpose_b = !d.transpose_a;
  t.ldc = d.m;
  return t;
}

// The one-row product (or one column's, transposed) in the plan's parts of
// K (LaunchInKParts: scratch of doubles, AddKParts adding them in double).
template <class In, class Out>
cudaError_t LaunchRowProduct(const LaunchPlan& plan, const MatmulDims& given, const In* given_a,
                             const In* given_b, Out* out, const LaunchContext& context) {
  using S = RowProductShape;
  const bool column = RowProductOfOneColumn(given);
  const MatmulDims dims = column ? TransposedProduct(given) : given;
  const In* const a = column ? given_b : given_a;
  const In* const b = column ? given_a : given_b;
  const bool quads = RowProductLoadsQuads(dims, b);
  const auto launch = [&](const MatmulDims& to, auto* sums, const KParts& parts) {
    using Sum = std::remove_pointer_t<decltype(sums)>;
    const dim3 grid(static_cast<unsigned>((to.n + S::kColumns - 1) / S::kColumns),
                    static_cast<unsigned>(parts.count),
                    static_cast<unsigned>(std::min<int64_t>(to.batch, 65535)));
    const auto run = [&](auto k_contiguous, auto vector) {
      RowProduct<decltype(k_contiguous)::value, decltype(vector)::value, In, Sum>
          <<<grid, S::kThreads, 0, context.stream>>>(to, a, b, sums, parts);
      return cudaGetLastError();
    };
    using Yes = std::true_type;
    using No = std::false_type;
    if (to.transpose_b) return quads ? run(Yes{}, Yes{}) : run(Yes{}, No{});
    return quads ? run(No{}, Yes{}) : run(No{}, No{});
  };
  // Parts start on whole steps of either layout (both divide this).
  return LaunchInKParts<double, S::kStepKContiguous, true>(plan, dims, out, context, launch);
}

}  // namespace jax_tiled::cuda
