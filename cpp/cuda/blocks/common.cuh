// What every CUDA kernel shares: the problem as a kernel sees it, conversions
// to and from the accumulator, and the grid over output tiles.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <type_traits>

namespace jax_tiled::cuda {

// The problem as a kernel sees it: plain 64-bit sizes and strides, no FFI types.
// out[b] = op(A[b]) @ op(B[b]); op(A) is m x k, op(B) is k x n, all row-major.
struct MatmulDims {
  int64_t batch, m, n, k;
  int64_t a_batch_stride, b_batch_stride, out_batch_stride;  // 0 = broadcast
  int64_t lda, ldb, ldc;          // row strides of the matrices as stored
  bool transpose_a, transpose_b;  // a stored (k, m), b stored (n, k)
};

// Widening a 16-bit float through float is exact: float holds every half and
// bfloat16 value.
template <class Acc, class T>
__device__ __forceinline__ Acc ToAccumulator(T x) {
  if constexpr (std::is_same_v<T, __half>) return static_cast<Acc>(__half2float(x));
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return static_cast<Acc>(__bfloat162float(x));
  else return static_cast<Acc>(x);
}

// Narrowing to 16 bits goes through float too, as the CPU backend does, so the
// two backends round a float64 accumulator identically.
template <class T, class Acc>
__device__ __forceinline__ T FromAccumulator(Acc x) {
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(static_cast<float>(x));
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(static_cast<float>(x));
  else return static_cast<T>(x);
}

// x over column tiles, y over row tiles, z over the batch, clamped to the
// hardware limits; the kernels' grid-stride loops cover what the clamp cuts.
inline dim3 OutputTileGrid(const MatmulDims& dims, int64_t block_m, int64_t block_n) {
  constexpr int64_t kMaxGridX = 0x7fffffff, kMaxGridYZ = 65535;
  return dim3(static_cast<unsigned>(std::min((dims.n + block_n - 1) / block_n, kMaxGridX)),
              static_cast<unsigned>(std::min((dims.m + block_m - 1) / block_m, kMaxGridYZ)),
              static_cast<unsigned>(std::min(dims.batch, kMaxGridYZ)));
}

// Output tiles as one linear sequence, in an order kind to L2: batch by batch,
// and within a matrix, bands of kBandRows tile rows walked column by column,
// so the blocks resident at one time share a few rows of A and columns of B.
// A 1-D grid strides over the sequence, so no size hits a grid limit.
// Index: the integer the tiles are counted in. 32 bits where the caller has
// checked that the count fits (PersistentTileScheduler): a 64-bit division by
// a tile width that is not a power of two (192) is a subroutine whose
// registers made the 40-register producer warpgroup spill.
template <int kBlockM, int kBlockN, class Index = int64_t, int kBandRows = 8>
struct TileOrder {
  Index tiles_m, tiles_n, count;

  __host__ __device__ explicit TileOrder(const MatmulDims& d)
      : tiles_m(TilesAlong(d.m, kBlockM)),
        tiles_n(TilesAlong(d.n, kBlockN)),
        count(static_cast<Index>(d.batch) * tiles_m * tiles_n) {}

  dim3 Grid() const { return dim3(static_cast<unsigned>(std::min<int64_t>(count, 0x7fffffff))); }

  // The batch and the first row and column of tile `t`.
  __device__ __forceinline__ void Locate(Index t, Index& batch, Index& row0, Index& col0) const {
    const Index per_matrix = tiles_m * tiles_n;
    batch = t / per_matrix;
    t -= batch * per_matrix;
    const Index band = t / (kBandRows * tiles_n), first_row = band * kBandRows;
    const Index rows = min(tiles_m - first_row, Index{kBandRows});
    t -= band * kBandRows * tiles_n;
    row0 = (first_row + t % rows) * kBlockM;
    col0 = t / rows * kBlockN;
  }

 private:
  // ceil(extent / block) in Index, without the overflow of extent + block - 1.
  __host__ __device__ static Index TilesAlong(int64_t extent, int block) {
    const Index e = static_cast<Index>(extent);
    return e / block + (e % block != 0);
  }
};

// A fact about the current device, found once per device and read without a
// lock afterwards: a driver query on every launch would cost more than a small
// matmul. `find(T*)` returns a cudaError_t; a failure is returned and retried
// on the next call, never cached.
template <class T>
class PerDevice {
 public:
  template <class Find>
  cudaError_t Get(T* value, Find&& find) {
    int device = 0;
    if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
    if (device < 0 || device >= kMaxDevices) return find(value);
    Slot& slot = slots_[device];
    if (!slot.ready.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!slot.ready.load(std::memory_order_relaxed)) {
        if (cudaError_t err = find(&slot.value); err != cudaSuccess) return err;
        slot.ready.store(true, std::memory_order_release);
      }
    }
    *value = slot.value;
    return cudaSuccess;
  }

 private:
  static constexpr int kMaxDevices = 64;
  struct Slot {
    std::atomic<bool> ready{false};
    T value{};
  };
  Slot slots_[kMaxDevices];
  std::mutex mutex_;
};

// Lets kKernel launch with `bytes` of dynamic shared memory (the same bytes
// on every call). Past 48 KB that needs an opt-in per kernel and per device.
template <auto kKernel>
cudaError_t AllowSharedMemory(int bytes) {
  static PerDevice<bool> opted_in;
  bool unused;
  return opted_in.Get(&unused, [&](bool*) {
    return cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  });
}

}  // namespace jax_tiled::cuda
