// Rung 5, "wgmma": Hopper tensor cores fed by the copy engine, bfloat16 and
// float16 inputs, float32 accumulation.
//
// What it fixes in rung 4 ("mma", see NOTES.md): there, every warp staged
// its fragments from shared memory into registers with ldmatrix before each
// mma.sync, and every thread spent issue slots on cp.async addresses. Here
// - the copy engine (TMA) moves whole 128-byte-swizzled boxes into shared
//   memory, one instruction per box from one thread, zero-filling past the
//   matrix edges, and signals an mbarrier when the bytes have landed;
// - wgmma reads both operands straight from shared memory (either
//   major-ness: the transposes of the VJP cost nothing), 64 x kBlockN x 16
//   per instruction per warpgroup, asynchronously;
// - warp specialisation: one producer warpgroup (one thread issuing TMA,
//   registers handed back with setmaxnreg) runs kStages slabs ahead of two
//   consumer warpgroups, each owning 64 rows of the 128 x kBlockN tile, over
//   a full/empty mbarrier queue;
// - a persistent grid, one block per SM, walks the output tiles in
//   TileOrder, so the producer fetches the next tile while the consumers
//   store the last one.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/kernels/common.cuh"
#include "cuda/kernels/hopper.cuh"

namespace jax_tiled::cuda {

template <int kBlockN_, int kStages_>
struct WgmmaConfig {
  static constexpr int kConsumers = 2;            // warpgroups, 64 output rows each
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kSlab = hopper::kSwizzleElements;  // K per stage: one swizzle row
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // setmaxnreg budgets: 128 x 40 + 256 x 232 fits the 64K-register file.
  static constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
};

// 128 x 256 tiles, 4 stages of 48 KB; 128 x 128 tiles, 6 stages of 32 KB.
using WgmmaWide = WgmmaConfig<256, 4>;
using WgmmaNarrow = WgmmaConfig<128, 6>;

template <class Cfg, bool kAMnMajor, bool kBMnMajor>
struct WgmmaTiles {
  using A = hopper::SwizzledTile<kAMnMajor, Cfg::kBlockM>;
  using B = hopper::SwizzledTile<kBMnMajor, Cfg::kBlockN>;
  static constexpr int kStageBytes = A::kBytes + B::kBytes;
  // Stages, then full and empty barriers; 1 KB of slack to align the start.
  static constexpr int kSharedBytes = 1024 + Cfg::kStages * kStageBytes + 2 * Cfg::kStages * 8;
};

template <class Cfg, class In, class Out, bool kAMnMajor, bool kBMnMajor>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    WgmmaMatmul(const __grid_constant__ CUtensorMap a_map,
                const __grid_constant__ CUtensorMap b_map, MatmulDims dims, Out* __restrict__ out,
                bool paired_stores) {
#if JAX_TILED_SM90A
  using Tiles = WgmmaTiles<Cfg, kAMnMajor, kBMnMajor>;
  extern __shared__ uint8_t shared_raw[];
  uint8_t* const stages = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(shared_raw) + 1023) / 1024 * 1024);  // the swizzle's period
  uint64_t* const full = reinterpret_cast<uint64_t*>(stages + Cfg::kStages * Tiles::kStageBytes);
  uint64_t* const empty = full + Cfg::kStages;
  auto a_tile = [&](int stage) { return stages + stage * Tiles::kStageBytes; };
  auto b_tile = [&](int stage) { return a_tile(stage) + Tiles::A::kBytes; };

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    hopper::PrefetchTensorMap(&a_map);
    hopper::PrefetchTensorMap(&b_map);
    for (int s = 0; s < Cfg::kStages; ++s) {
      hopper::InitBarrier(&full[s], 1);  // the producer's arrival; TMA adds the bytes
      hopper::InitBarrier(&empty[s], 4 * Cfg::kConsumers);  // every consumer warp
    }
    hopper::FenceBarrierInit();
  }
  __syncthreads();

  const TileOrder<Cfg::kBlockM, Cfg::kBlockN> order(dims);
  const int64_t slabs = (dims.k + Cfg::kSlab - 1) / Cfg::kSlab;

  if (warpgroup == 0) {
    hopper::ShrinkRegisters<Cfg::kProducerRegisters>();
    if (threadIdx.x != 0) return;
    int stage = 0;
    uint32_t parity = 0;
    for (int64_t tile = blockIdx.x; tile < order.count; tile += gridDim.x) {
      int64_t batch, row0, col0;
      order.Locate(tile, batch, row0, col0);
      const int64_t a_batch = dims.a_batch_stride ? batch : 0;
      const int64_t b_batch = dims.b_batch_stride ? batch : 0;
      for (int64_t slab = 0; slab < slabs; ++slab) {
        hopper::WaitBarrier(&empty[stage], parity ^ 1);  // the consumers released it
        hopper::ArriveExpectingBytes(&full[stage], Tiles::kStageBytes);
        Tiles::A::Load(a_tile(stage), &a_map, &full[stage], row0, slab * Cfg::kSlab, a_batch);
        Tiles::B::Load(b_tile(stage), &b_map, &full[stage], col0, slab * Cfg::kSlab, b_batch);
        if (++stage == Cfg::kStages) stage = 0, parity ^= 1;
      }
    }
    return;
  }

  hopper::GrowRegisters<Cfg::kConsumerRegisters>();
  const int consumer = warpgroup - 1, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const int a_rows = 64 * consumer;  // this warpgroup's rows of the tile
  int stage = 0;
  uint32_t parity = 0;
  float acc[Cfg::kBlockN / 2];
  for (int64_t tile = blockIdx.x; tile < order.count; tile += gridDim.x) {
    int64_t batch, row0, col0;
    order.Locate(tile, batch, row0, col0);
    int previous = -1;  // the stage whose wgmmas may still be reading
    for (int64_t slab = 0; slab < slabs; ++slab) {
      hopper::WaitBarrier(&full[stage], parity);
      hopper::WgmmaFence();
#pragma unroll
      for (int step = 0; step < Cfg::kSlab / 16; ++step)
        hopper::Wgmma<Cfg::kBlockN, In, kAMnMajor, kBMnMajor>(
            acc, Tiles::A::Descriptor(a_tile(stage), a_rows, step),
            Tiles::B::Descriptor(b_tile(stage), 0, step), slab > 0 || step > 0);
      hopper::WgmmaCommit();
      // Keep this slab's wgmmas in flight; the previous slab's are done, so
      // its stage can go back to the producer.
      hopper::WgmmaWait<1>();
      if (previous >= 0 && lane == 0) hopper::Arrive(&empty[previous]);
      previous = stage;
      if (++stage == Cfg::kStages) stage = 0, parity ^= 1;
    }
    hopper::WgmmaWait<0>();
    hopper::FenceAccumulators(acc);
    if (lane == 0) hopper::Arrive(&empty[previous]);

    // The accumulator layout of m64nNk16: per 8 columns, a thread holds
    // rows r and r + 8 (r = 16 * warp + lane / 4), columns 2 * (lane % 4) + {0, 1}.
    Out* const c = out + batch * dims.out_batch_stride;
    const int64_t row = row0 + a_rows + 16 * warp + lane / 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t r = row + 8 * half;
      if (r >= dims.m) continue;
      Out* const c_row = c + r * dims.ldc;
#pragma unroll
      for (int j = 0; j < Cfg::kBlockN / 8; ++j) {
        const int64_t col = col0 + 8 * j + 2 * (lane % 4);
        const float x = acc[4 * j + 2 * half], y = acc[4 * j + 2 * half + 1];
        if (paired_stores && col + 1 < dims.n) {
          if constexpr (std::is_same_v<Out, float>) {
            *reinterpret_cast<float2*>(c_row + col) = make_float2(x, y);
          } else if constexpr (std::is_same_v<Out, __nv_bfloat16>) {
            *reinterpret_cast<__nv_bfloat162*>(c_row + col) = __floats2bfloat162_rn(x, y);
          } else {
            *reinterpret_cast<__half2*>(c_row + col) = __floats2half2_rn(x, y);
          }
        } else {
          if (col < dims.n) c_row[col] = FromAccumulator<Out>(x);
          if (col + 1 < dims.n) c_row[col + 1] = FromAccumulator<Out>(y);
        }
      }
    }
  }
#endif
}

// The copy engine's view of op(A) (free axis M) or op(B) (free axis N).
inline hopper::OperandLayout OperandOf(const void* base, bool k_contiguous, int64_t free_extent,
                                       int64_t k, int64_t ld, int64_t batch_stride,
                                       int64_t batch, int free_box) {
  return {base,
          k_contiguous ? k : free_extent,
          k_contiguous ? free_extent : k,
          batch_stride ? batch : 1,
          ld,
          batch_stride,
          k_contiguous ? free_box : hopper::kSwizzleElements};
}

inline hopper::OperandLayout OperandA(const MatmulDims& d, const void* a, int box_m) {
  return OperandOf(a, !d.transpose_a, d.m, d.k, d.lda, d.a_batch_stride, d.batch, box_m);
}
inline hopper::OperandLayout OperandB(const MatmulDims& d, const void* b, int box_n) {
  return OperandOf(b, d.transpose_b, d.n, d.k, d.ldb, d.b_batch_stride, d.batch, box_n);
}

// Whether the copy engine can read both operands (16-byte-aligned rows and
// batches, coordinates within 32 bits). The others go to "mma".
inline bool WgmmaCanTake(const MatmulDims& d, const void* a, const void* b) {
  return hopper::TmaCanTake(OperandA(d, a, WgmmaWide::kBlockM)) &&
         hopper::TmaCanTake(OperandB(d, b, WgmmaWide::kBlockN));
}

// 128 x 256 tiles unless they would leave a third of the SMs idle.
inline bool WgmmaUsesWideTiles(const MatmulDims& d, int multiprocessors) {
  const int64_t wide_tiles = d.batch * ((d.m + 127) / 128) * ((d.n + 255) / 256);
  return 3 * wide_tiles >= 2 * static_cast<int64_t>(multiprocessors);
}

template <class Cfg, class In, class Out, bool kAMnMajor, bool kBMnMajor>
cudaError_t LaunchWgmmaWith(const MatmulDims& dims, const In* a, const In* b, Out* out,
                            cudaStream_t stream, int multiprocessors) {
  CUtensorMap a_map, b_map;
  if (cudaError_t err = hopper::EncodeOperand<In>(OperandA(dims, a, Cfg::kBlockM), &a_map))
    return err;
  if (cudaError_t err = hopper::EncodeOperand<In>(OperandB(dims, b, Cfg::kBlockN), &b_map))
    return err;
  constexpr auto kernel = WgmmaMatmul<Cfg, In, Out, kAMnMajor, kBMnMajor>;
  constexpr int kShared = WgmmaTiles<Cfg, kAMnMajor, kBMnMajor>::kSharedBytes;
  if (cudaError_t err = AllowSharedMemory<kernel>(kShared)) return err;
  const TileOrder<Cfg::kBlockM, Cfg::kBlockN> order(dims);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(order.count, multiprocessors)));
  // Pairs of columns go out as one store when every row starts aligned to them.
  const bool paired_stores = dims.ldc % 2 == 0 && dims.out_batch_stride % 2 == 0 &&
                             reinterpret_cast<uintptr_t>(out) % (2 * sizeof(Out)) == 0;
  kernel<<<grid, Cfg::kThreads, kShared, stream>>>(a_map, b_map, dims, out, paired_stores);
  return cudaGetLastError();
}

template <class Cfg, class In, class Out>
cudaError_t LaunchWgmmaLayouts(const MatmulDims& d, const In* a, const In* b, Out* out,
                               cudaStream_t stream, int multiprocessors) {
  // wgmma's transpose flags: A stored (k, m) and B stored (k, n) are MN-major.
  const bool a_mn = d.transpose_a, b_mn = !d.transpose_b;
  if (a_mn && b_mn) return LaunchWgmmaWith<Cfg, In, Out, true, true>(d, a, b, out, stream, multiprocessors);
  if (a_mn) return LaunchWgmmaWith<Cfg, In, Out, true, false>(d, a, b, out, stream, multiprocessors);
  if (b_mn) return LaunchWgmmaWith<Cfg, In, Out, false, true>(d, a, b, out, stream, multiprocessors);
  return LaunchWgmmaWith<Cfg, In, Out, false, false>(d, a, b, out, stream, multiprocessors);
}

// In: __half or __nv_bfloat16; the caller has checked WgmmaCanTake and that
// the device is compute capability 9.0.
template <class In, class Out>
cudaError_t LaunchWgmma(const MatmulDims& dims, const In* a, const In* b, Out* out,
                        cudaStream_t stream, int multiprocessors) {
  if (WgmmaUsesWideTiles(dims, multiprocessors))
    return LaunchWgmmaLayouts<WgmmaWide, In, Out>(dims, a, b, out, stream, multiprocessors);
  return LaunchWgmmaLayouts<WgmmaNarrow, In, Out>(dims, a, b, out, stream, multiprocessors);
}

}  // namespace jax_tiled::cuda
