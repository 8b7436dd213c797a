// Hopper (sm_90a) building blocks shared by the TMA + wgmma kernels: tensor maps
// for the copy engine, mbarriers that its copies complete on, shared-memory
// matrix descriptors for wgmma's 128-byte swizzle, and the wgmma instructions
// (16-bit from shared memory; TF32 with A from registers).
//
// Everything device-side here compiles only for sm_90a (wgmma and setmaxnreg
// exist nowhere else); the handler launches these kernels only on compute
// capability 9.0.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only: the encoder comes from the runtime
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/blocks/async_copy.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAX_TILED_SM90A 1
#else
#define JAX_TILED_SM90A 0
#endif

namespace jax_tiled::cuda::hopper {

// ---------------------------------------------------------------- host side

// An operand as the copy engine sees it: a (batches, rows, row_length) array
// with row_length contiguous, read in boxes of box_rows x one 128-byte
// swizzle row (64 16-bit or 32 float32 elements).
struct OperandLayout {
  const void* base;
  int64_t row_length, rows, batches;  // batches: 1 for a broadcast operand
  int64_t row_stride, batch_stride;   // in elements
  int box_rows;
  int element_bytes;
};

inline constexpr int kSwizzleBytes = 128;
template <class In>
inline constexpr int kSwizzleElements = kSwizzleBytes / sizeof(In);  // in one swizzle row

// What the copy engine demands of an operand (cuTensorMapEncodeTiled): a
// 16-byte-aligned base, strides in whole 16-byte units, and coordinates that
// fit its signed 32-bit arguments.
inline bool TmaCanTake(const OperandLayout& o) {
  constexpr int64_t kMaxCoordinate = int64_t{1} << 31, kMaxStrideBytes = int64_t{1} << 40;
  const bool batched = o.batches > 1;
  const int64_t row_bytes = o.element_bytes * o.row_stride;
  const int64_t batch_bytes = o.element_bytes * o.batch_stride;
  return reinterpret_cast<uintptr_t>(o.base) % 16 == 0 && row_bytes % 16 == 0 &&
         (!batched || batch_bytes % 16 == 0) && o.row_length < kMaxCoordinate &&
         o.rows < kMaxCoordinate && o.batches < kMaxCoordinate && row_bytes < kMaxStrideBytes &&
         (!batched || batch_bytes < kMaxStrideBytes);
}

// The driver's tensor-map encoder, looked up once through the runtime so the
// extension needs no link against libcuda.
inline PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encoder;
}

// A tensor map reading `o` in 128-byte-swizzled boxes, zero-filled past every
// edge (so partial tiles need no separate path). Encoding is host work of a
// microsecond or so, redone per call since buffers move between calls.
// round_to_tf32 (float only): the copy engine rounds each float32 to the
// nearest TF32 (ties to even) as it lands, at no instruction cost; without
// it, wgmma would truncate the low 13 bits of a float32 it reads from shared
// memory, a bias of half a TF32 step toward zero on every product.
template <class In>
cudaError_t EncodeOperand(const OperandLayout& o, CUtensorMap* map, bool round_to_tf32 = false) {
  constexpr int64_t kBytes = sizeof(In);
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (!encode) return cudaErrorNotSupported;
  if (round_to_tf32 && !std::is_same_v<In, float>) return cudaErrorInvalidValue;
  const CUtensorMapDataType type = round_to_tf32                ? CU_TENSOR_MAP_DATA_TYPE_TFLOAT32
                                   : std::is_same_v<In, float>  ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : std::is_same_v<In, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  // A broadcast operand's batch stride is never followed; any legal one will do.
  const int64_t batch_stride = o.batches > 1 ? o.batch_stride : o.rows * o.row_stride;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(o.row_length),
                              static_cast<cuuint64_t>(o.rows), static_cast<cuuint64_t>(o.batches)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(kBytes * o.row_stride),
                                 static_cast<cuuint64_t>((kBytes * batch_stride + 15) / 16 * 16)};
  const cuuint32_t box[3] = {kSwizzleElements<In>, static_cast<cuuint32_t>(o.box_rows), 1};
  const cuuint32_t unit_steps[3] = {1, 1, 1};
  const CUresult result =
      encode(map, type, 3, const_cast<void*>(o.base), dims, strides, box, unit_steps,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// -------------------------------------------------------------- device side

// mbarrier: a shared-memory barrier that counts arrivals and, for the copy
// engine, bytes; waiting is by the parity of the phase to complete.
__device__ __forceinline__ void InitBarrier(uint64_t* bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SharedAddress(bar)),
               "r"(arrivals));
}

// Makes initialised barriers visible to the copy engine before its first
// complete_tx lands on them (a barrier over the block must follow).
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` still to come from the copy engine.
__device__ __forceinline__ void ArriveExpectingBytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SharedAddress(bar)),
               "r"(bytes)
               : "memory");
}

// Orders this thread's ordinary shared-memory writes before later reads by
// the async proxy (wgmma's operand fetches, the copy engine).
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void Arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SharedAddress(bar)) : "memory");
}

// Returns once the phase of parity `parity` has completed. A fresh barrier
// is in phase 0, so waiting on parity 1 returns at once: a producer's first
// pass over empty slots needs no special case.
__device__ __forceinline__ void WaitBarrier(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(SharedAddress(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// Copies box (c0, c1, c2) of `map` into shared memory at `dst` (1024-byte
// aligned for the swizzle), counting its bytes on `bar` when they land.
__device__ __forceinline__ void LoadBox(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                        int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(SharedAddress(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(SharedAddress(bar))
      : "memory");
}

// The same box, landing at `dst` and counted on `bar` in every block of the
// cluster named in `cta_mask` (bit r: the block of rank r): one read of the
// global memory serves the blocks that share the box.
__device__ __forceinline__ void LoadBoxMulticast(void* dst, const CUtensorMap* map, uint64_t* bar,
                                                 int c0, int c1, int c2, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(SharedAddress(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(SharedAddress(bar)),
      "h"(cta_mask)
      : "memory");
}

// Copies the shared memory at `src` (1024-byte aligned, in the map's 128-byte
// swizzle) to box (c0, c1, c2) of `map`, clipped to the tensor's bounds, as
// part of this thread's next bulk group (CommitStores). Before it, every
// thread that wrote `src` fences (FenceProxyAsync) and the writers pass a
// barrier with the issuing thread.
__device__ __forceinline__ void StoreBox(const CUtensorMap* map, uint32_t src, int c0, int c1,
                                         int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void CommitStores() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until at most kPending of this thread's committed store groups may
// still read their shared memory.
template <int kPending>
__device__ __forceinline__ void WaitStoresRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// The `threads` threads (whole warps) that pass barrier `id` wait for each
// other; 0 is __syncthreads', the kernels name the others.
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// -------------------------------------------------- thread-block clusters

// This block's rank in its cluster.
__device__ __forceinline__ int ClusterRank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return static_cast<int>(rank);
}

// The number of blocks in this block's cluster.
__device__ __forceinline__ int ClusterSize() {
  uint32_t size;
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(size));
  return static_cast<int>(size);
}

// This block's cluster's index in a one-dimensional grid of clusters.
__device__ __forceinline__ int64_t ClusterIndex() { return blockIdx.x / ClusterSize(); }

// Loads and stores at 32-bit shared-memory addresses (SharedAddress): through
// a generic pointer each costs 64-bit address arithmetic and the generic
// path's longer latency, which made the producer warpgroup's B rewrites the
// slowest stage of their pipelines (NOTES.md, "The weight gradient's layout
// on TF32 wgmma"). Volatile: they stay in order with the barrier waits.
__device__ __forceinline__ uint32_t LoadShared(uint32_t address) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(address) : "memory");
  return v;
}
__device__ __forceinline__ uint4 LoadShared4(uint32_t address) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address)
               : "memory");
  return v;
}
__device__ __forceinline__ void StoreShared(uint32_t address, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(address), "r"(v) : "memory");
}
__device__ __forceinline__ void StoreShared2(uint32_t address, uint2 v) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(address), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void StoreShared4(uint32_t address, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// stmatrix: the warp writes four 8 x 8 matrices of 16-bit elements, lane
// 8 q + i naming at `row` the 16 bytes of row i of matrix q, and holding in
// register q its pair (row lane / 4, columns 2 (lane % 4) + {0, 1}) of matrix
// q: the layout of an mma or wgmma accumulator's 8 x 8 pieces, so one
// instruction stores what st.shared.b32 stores in four.
__device__ __forceinline__ void StoreMatrices(uint32_t row, uint32_t m0, uint32_t m1, uint32_t m2,
                                              uint32_t m3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row),
               "r"(m0), "r"(m1), "r"(m2), "r"(m3)
               : "memory");
}

// Four floats at the shared-memory address of `local` in the cluster's block
// of rank `cta` (distributed shared memory); `local` is 16-byte aligned.
__device__ __forceinline__ float4 LoadSharedInCluster(const float* local, int cta) {
  float4 v;
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %4, %5;\n"
      "ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [remote];\n}\n"
      : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
      : "r"(SharedAddress(local)), "r"(cta)
      : "memory");
  return v;
}

// Every thread of every block in the cluster: arrive, then wait for all the
// others. Release/acquire order the barrier initialisations before the peers'
// first remote arrivals and copies, and the peers' last ones before exit.
__device__ __forceinline__ void ClusterSync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
}

// One arrival on the barrier at the same shared-memory offset as `bar` in
// the cluster's block of rank `cta`. The arrival's default semantics (release
// at CTA scope) suffice where what it announces is that this warp's wgmmas,
// retired by wgmma.wait_group, are done reading a stage: a release at cluster
// scope costs a memory barrier per arrival (NOTES.md, "clusters").
__device__ __forceinline__ void ArriveInCluster(uint64_t* bar, int cta) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(SharedAddress(bar)),
      "r"(cta)
      : "memory");
}

__device__ __forceinline__ void PrefetchTensorMap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// wgmma's view of a tile in shared memory with the 128-byte swizzle: `lead`
// and `stride` are the byte distances between 8 x 16-byte core-matrix groups
// along the two axes (see SwizzledTile below for which is which), and the
// tile starts `offset` bytes past `tile`. The address field counts 16-byte
// units; the offset is added in those units to the masked address, and
// everything but the tile's address is a constant, so the descriptors of one
// tile's steps are one integer add apart (no shift and mask per wgmma).
template <uint32_t kLead, uint32_t kStride>
__device__ __forceinline__ uint64_t MatrixDescriptor(const void* tile, uint32_t offset) {
  constexpr uint32_t kSwizzle128B = 1u << 30;  // bit 62
  constexpr uint32_t kLow = (kLead & 0x3FFFF) >> 4 << 16;
  constexpr uint32_t kHigh = (kStride & 0x3FFFF) >> 4 | kSwizzle128B;
  const uint32_t low = ((SharedAddress(tile) & 0x3FFFF) >> 4) + kLow + offset / 16;
  return uint64_t{kHigh} << 32 | low;
}

// A tile of x_extent x E (k) elements, E = one 128-byte swizzle row (64
// 16-bit or 32 float32), as the copy engine lays it down with the 128-byte
// swizzle, and its descriptor for instruction step `step` (k16 for 16-bit,
// k8 for TF32: 32 bytes of k either way) of the 64 x-rows starting at x0.
//   K-major (k contiguous): one box of x_extent rows of E k (128 bytes);
//     8-row groups 1024 bytes apart; a step is 32 bytes along the row.
//   MN-major (x contiguous): boxes of E k rows of E x side by side along x;
//     8-k groups 1024 bytes apart, a 16-bit k16 step 2 groups, and the next
//     64 x (the "leading" axis) one box further. (TF32 wgmma reads no
//     MN-major tile: its MN-major A goes through registers, ElementOffset.)
template <class In, bool kMnMajor, int kXExtent>
struct SwizzledTile {
  static constexpr int kElements = kSwizzleElements<In>;
  static constexpr int kBytes = kXExtent * kSwizzleBytes;
  static constexpr int kBoxRows = kMnMajor ? kElements : kXExtent;
  static constexpr int kBoxes = kMnMajor ? kXExtent / kElements : 1;
  static constexpr int kBoxBytes = kBytes / kBoxes;
  static_assert(kXExtent % 64 == 0 && kXExtent <= 256, "a box spans at most 256 rows");

  __device__ __forceinline__ static uint64_t Descriptor(const uint8_t* tile, int x0, int step) {
    if constexpr (kMnMajor) {
      static_assert(sizeof(In) == 2, "wgmma reads MN-major tiles of 16-bit types only");
      return MatrixDescriptor<kBoxBytes, 1024>(tile, x0 / kElements * kBoxBytes + step * 2048);
    } else {
      return MatrixDescriptor<16, 1024>(tile, x0 * kSwizzleBytes + step * 32);
    }
  }

  // Byte offset of element (x, k): the swizzle moves 16-byte chunk c of
  // stored row r to chunk c ^ (r % 8). Unsigned: x and k are never negative,
  // and signed division and remainder cost fix-up instructions on every
  // element the consumers and rewriters address.
  __device__ __forceinline__ static uint32_t ElementOffset(uint32_t x, uint32_t k) {
    const uint32_t row = kMnMajor ? k : x;
    const uint32_t byte = (kMnMajor ? x % kElements : k) * sizeof(In);
    const uint32_t box = kMnMajor ? x / kElements : 0;
    return box * kBoxBytes + row * kSwizzleBytes + ((byte / 16) ^ (row % 8)) * 16 + byte % 16;
  }

  // The tensor map's box rows when kParts blocks share the tile, each
  // copying one part: a K-major tile splits along x into whole 8-row swizzle
  // periods, an MN-major one into runs of whole boxes (LoadPart).
  template <int kParts = 1>
  static constexpr int BoxRows() {
    static_assert(kMnMajor ? kBoxes >= kParts : kXExtent % (8 * kParts) == 0,
                  "the parts are whole boxes, or whole swizzle periods");
    return kMnMajor ? kElements : kXExtent / kParts;
  }

  // Copies the tile at (x0, k0), counted on `bar`; the box map was encoded
  // with BoxRows<1>().
  __device__ __forceinline__ static void Load(uint8_t* tile, const CUtensorMap* map, uint64_t* bar,
                                              int64_t x0, int64_t k0, int64_t batch) {
    LoadPart<1>(tile, map, bar, x0, k0, batch, 0, 0);
  }

  // Copies part `part` of kParts of the tile at (x0, k0) into every block of
  // `cta_mask` (kParts > 1), where it lands at the same offset of `tile`
  // and is counted on the barrier at the same offset as `bar`; the map was
  // encoded with BoxRows<kParts>(). MN-major, part p takes boxes
  // [p kBoxes / kParts, (p + 1) kBoxes / kParts): halves of a 256-wide tile's
  // four, one and two of a 192-wide tile's three.
  template <int kParts>
  __device__ __forceinline__ static void LoadPart(uint8_t* tile, const CUtensorMap* map,
                                                  uint64_t* bar, int64_t x0, int64_t k0,
                                                  int64_t batch, int part, uint16_t cta_mask) {
    const int x = static_cast<int>(x0), k = static_cast<int>(k0);
    auto load = [&](uint8_t* to, int c0, int c1) {
      if constexpr (kParts > 1)
        LoadBoxMulticast(to, map, bar, c0, c1, static_cast<int>(batch), cta_mask);
      else LoadBox(to, map, bar, c0, c1, static_cast<int>(batch));
    };
    if constexpr (kMnMajor) {
      const int first = part * kBoxes / kParts, boxes = (part + 1) * kBoxes / kParts - first;
#pragma unroll
      for (int i = 0; i < (kBoxes + kParts - 1) / kParts; ++i)
        if (i < boxes) load(tile + (first + i) * kBoxBytes, x + (first + i) * kElements, k);
    } else {
      constexpr int kRows = kXExtent / kParts;  // along x, per part
      load(tile + part * kRows * kSwizzleBytes, k, x + part * kRows);
    }
  }
};

// Orders this warpgroup's register writes to the accumulators before the
// wgmmas that read them.
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending of this warpgroup's committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Pins accumulators in place across asynchronous wgmmas: without it the
// compiler may read or move them while the tensor cores still write them.
template <int kN>
__device__ __forceinline__ void FenceAccumulators(float (&acc)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// An accumulator's bits, for a store, through a register move. A shared-memory
// store that reads wgmma's accumulator registers themselves (float32 output
// staged as is) had ptxas serialise every wgmma of the kernel, "insufficient
// register resources for the wgmma pipeline" (C7511); read through a move
// it does not, and the move costs nothing where ptxas can fold it.
__device__ __forceinline__ uint32_t AccumulatorBits(float x) {
  uint32_t bits;
  asm("mov.b32 %0, %1;\n" : "=r"(bits) : "f"(x));
  return bits;
}

// Register budgets per warpgroup (setmaxnreg): the producer gives registers
// back so the consumers' accumulators fit.
template <int kRegisters>
__device__ __forceinline__ void ShrinkRegisters() {
#if JAX_TILED_SM90A
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}
template <int kRegisters>
__device__ __forceinline__ void GrowRegisters() {
#if JAX_TILED_SM90A
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}

// The accumulator operands of an m64nN wgmma: %0..%(N/2 - 1).
#define JAX_TILED_ACC_OPERANDS_32                                                    \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define JAX_TILED_ACC_OPERANDS_64                                                    \
  JAX_TILED_ACC_OPERANDS_32                                                          \
  ", %32, %33, "                                                                     \
  "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, " \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define JAX_TILED_ACC_OPERANDS_96                                                    \
  JAX_TILED_ACC_OPERANDS_64                                                          \
  ", "                                                                               \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define JAX_TILED_ACC_OPERANDS_128                                                   \
  JAX_TILED_ACC_OPERANDS_64                                                          \
  ", "                                                                               \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, " \
  "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "   \
  "%123, %124, %125, %126, %127"

// d[kN / 2] (+)= A(64 x 16) * B(16 x kN): the accumulator registers
// %0..%(kN/2 - 1), then the two descriptors, the accumulate flag (0 on a
// tile's first step: d = A * B) and the two transpose immediates.
#define JAX_TILED_WGMMA_N64(type)                                                            \
  "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %34, 0;\n"                             \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." type "." type " {" JAX_TILED_ACC_OPERANDS_32 \
  "}, %32, %33, accumulate, 1, 1, %35, %36;\n}\n"

#define JAX_TILED_WGMMA_N128(type)                                                            \
  "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %66, 0;\n"                              \
  "wgmma.mma_async.sync.aligned.m64n128k16.f32." type "." type " {" JAX_TILED_ACC_OPERANDS_64 \
  "}, %64, %65, accumulate, 1, 1, %67, %68;\n}\n"

#define JAX_TILED_WGMMA_N192(type)                                                            \
  "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %98, 0;\n"                              \
  "wgmma.mma_async.sync.aligned.m64n192k16.f32." type "." type " {" JAX_TILED_ACC_OPERANDS_96 \
  "}, %96, %97, accumulate, 1, 1, %99, %100;\n}\n"

#define JAX_TILED_WGMMA_N256(type)                                                             \
  "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %130, 0;\n"                              \
  "wgmma.mma_async.sync.aligned.m64n256k16.f32." type "." type " {" JAX_TILED_ACC_OPERANDS_128 \
  "}, %128, %129, accumulate, 1, 1, %131, %132;\n}\n"

// TF32, A from registers: the accumulators, then a0..a3, B's descriptor and
// the accumulate flag; TF32 has no transpose immediates (B is K-major).
#define JAX_TILED_WGMMA_TF32_N64                                                    \
  "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %37, 0;\n"                    \
  "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {" JAX_TILED_ACC_OPERANDS_32 \
  "}, {%32, %33, %34, %35}, %36, accumulate, 1, 1;\n}\n"

#define JAX_TILED_WGMMA_TF32_N128                                                    \
  "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %69, 0;\n"                     \
  "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {" JAX_TILED_ACC_OPERANDS_64 \
  "}, {%64, %65, %66, %67}, %68, accumulate, 1, 1;\n}\n"

#define JAX_TILED_WGMMA_TF32_N256                                                     \
  "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %133, 0;\n"                     \
  "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {" JAX_TILED_ACC_OPERANDS_128 \
  "}, {%128, %129, %130, %131}, %132, accumulate, 1, 1;\n}\n"

// TF32, both operands from shared memory (K-major): the accumulators, then
// A's and B's descriptors and the accumulate flag.
#define JAX_TILED_WGMMA_TF32_SS_N64                                                 \
  "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %34, 0;\n"                    \
  "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {" JAX_TILED_ACC_OPERANDS_32 \
  "}, %32, %33, accumulate, 1, 1;\n}\n"

#define JAX_TILED_WGMMA_TF32_SS_N256                                                  \
  "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %130, 0;\n"                     \
  "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {" JAX_TILED_ACC_OPERANDS_128 \
  "}, %128, %129, accumulate, 1, 1;\n}\n"

#define JAX_TILED_WGMMA_TF32_SS_N128                                                 \
  "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %66, 0;\n"                     \
  "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {" JAX_TILED_ACC_OPERANDS_64 \
  "}, %64, %65, accumulate, 1, 1;\n}\n"

#define JAX_TILED_ACC8(d, i)                                                                  \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define JAX_TILED_ACC32(d, i)                                                \
  JAX_TILED_ACC8(d, i), JAX_TILED_ACC8(d, i + 8), JAX_TILED_ACC8(d, i + 16), \
      JAX_TILED_ACC8(d, i + 24)
#define JAX_TILED_ACC64(d, i) JAX_TILED_ACC32(d, i), JAX_TILED_ACC32(d, i + 32)

// One wgmma: d (+)= A * B for a 64 x 16 slice of A and 16 x kN of B, both
// read from shared memory through their descriptors. kTransA / kTransB: the
// operand is MN-major (which wgmma allows for 16-bit types only).
template <int kN, class In, bool kTransA, bool kTransB>
__device__ __forceinline__ void Wgmma(float (&d)[kN / 2], uint64_t a, uint64_t b, int accumulate) {
#if JAX_TILED_SM90A
  constexpr bool kBf16 = std::is_same_v<In, __nv_bfloat16>;
  if constexpr (kN == 256 && kBf16) {
    asm volatile(JAX_TILED_WGMMA_N256("bf16")
                 : JAX_TILED_ACC64(d, 0), JAX_TILED_ACC64(d, 64)
                 : "l"(a), "l"(b), "r"(accumulate), "n"(int{kTransA}), "n"(int{kTransB}));
  } else if constexpr (kN == 256) {
    asm volatile(JAX_TILED_WGMMA_N256("f16")
                 : JAX_TILED_ACC64(d, 0), JAX_TILED_ACC64(d, 64)
                 : "l"(a), "l"(b), "r"(accumulate), "n"(int{kTransA}), "n"(int{kTransB}));
  } else if constexpr (kN == 192 && kBf16) {
    asm volatile(JAX_TILED_WGMMA_N192("bf16")
                 : JAX_TILED_ACC64(d, 0), JAX_TILED_ACC32(d, 64)
                 : "l"(a), "l"(b), "r"(accumulate), "n"(int{kTransA}), "n"(int{kTransB}));
  } else if constexpr (kN == 192) {
    asm volatile(JAX_TILED_WGMMA_N192("f16")
                 : JAX_TILED_ACC64(d, 0), JAX_TILED_ACC32(d, 64)
                 : "l"(a), "l"(b), "r"(accumulate), "n"(int{kTransA}), "n"(int{kTransB}));
  } else if constexpr (kN == 128 && kBf16) {
    asm volatile(JAX_TILED_WGMMA_N128("bf16")
                 : JAX_TILED_ACC64(d, 0)
                 : "l"(a), "l"(b), "r"(accumulate), "n"(int{kTransA}), "n"(int{kTransB}));
  } else if constexpr (kN == 128) {
    asm volatile(JAX_TILED_WGMMA_N128("f16")
                 : JAX_TILED_ACC64(d, 0)
                 : "l"(a), "l"(b), "r"(accumulate), "n"(int{kTransA}), "n"(int{kTransB}));
  } else if constexpr (kN == 64 && kBf16) {
    asm volatile(JAX_TILED_WGMMA_N64("bf16")
                 : JAX_TILED_ACC32(d, 0)
                 : "l"(a), "l"(b), "r"(accumulate), "n"(int{kTransA}), "n"(int{kTransB}));
  } else {
    static_assert(kN == 64, "16-bit wgmma tiles here are 64, 128, 192 or 256 wide");
    asm volatile(JAX_TILED_WGMMA_N64("f16")
                 : JAX_TILED_ACC32(d, 0)
                 : "l"(a), "l"(b), "r"(accumulate), "n"(int{kTransA}), "n"(int{kTransB}));
  }
#endif
}

// One TF32 wgmma: d (+)= A * B for a 64 x 8 slice of A held in registers
// (a: this thread's four TF32 values, the layout of mma.sync's m16n8k8 A per
// warp, warp w holding rows 16w..16w+15) and 8 x kN of B read K-major from
// shared memory. Registers let A be stored either way, which wgmma's TF32
// shared-memory operands cannot be: they must be K-major.
template <int kN>
__device__ __forceinline__ void WgmmaTf32(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t b,
                                          int accumulate) {
#if JAX_TILED_SM90A
  if constexpr (kN == 256) {
    asm volatile(JAX_TILED_WGMMA_TF32_N256
                 : JAX_TILED_ACC64(d, 0), JAX_TILED_ACC64(d, 64)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
  } else if constexpr (kN == 128) {
    asm volatile(JAX_TILED_WGMMA_TF32_N128
                 : JAX_TILED_ACC64(d, 0)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
  } else {
    static_assert(kN == 64, "wgmma tiles here are 64, 128 or 256 wide");
    asm volatile(JAX_TILED_WGMMA_TF32_N64
                 : JAX_TILED_ACC32(d, 0)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
  }
#endif
}

// One TF32 wgmma with both operands read K-major from shared memory: d (+)=
// A(64 x 8) * B(8 x kN). For operands already TF32 values (3xTF32's parts,
// split ahead of the kernel, or one pass's operands rounded by the copy
// engine's TFLOAT32 tensor maps), whose low 13 bits are zero, so the tensor
// cores' reading of the float32 bits as TF32 loses nothing.
template <int kN>
__device__ __forceinline__ void WgmmaTf32Shared(float (&d)[kN / 2], uint64_t a, uint64_t b,
                                                int accumulate) {
#if JAX_TILED_SM90A
  if constexpr (kN == 256) {
    asm volatile(JAX_TILED_WGMMA_TF32_SS_N256
                 : JAX_TILED_ACC64(d, 0), JAX_TILED_ACC64(d, 64)
                 : "l"(a), "l"(b), "r"(accumulate));
  } else if constexpr (kN == 128) {
    asm volatile(JAX_TILED_WGMMA_TF32_SS_N128
                 : JAX_TILED_ACC64(d, 0)
                 : "l"(a), "l"(b), "r"(accumulate));
  } else {
    static_assert(kN == 64, "wgmma tiles here are 64, 128 or 256 wide");
    asm volatile(JAX_TILED_WGMMA_TF32_SS_N64
                 : JAX_TILED_ACC32(d, 0)
                 : "l"(a), "l"(b), "r"(accumulate));
  }
#endif
}

// Keeps register operands of in-flight wgmmas where they are until a wait
// has retired the instructions that read them (see FenceAccumulators).
template <int kN>
__device__ __forceinline__ void FenceRegisters(uint32_t (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

#undef JAX_TILED_WGMMA_TF32_SS_N128
#undef JAX_TILED_WGMMA_TF32_SS_N64
#undef JAX_TILED_WGMMA_TF32_SS_N256
#undef JAX_TILED_WGMMA_TF32_N256
#undef JAX_TILED_WGMMA_TF32_N128
#undef JAX_TILED_WGMMA_TF32_N64
#undef JAX_TILED_ACC64
#undef JAX_TILED_ACC32
#undef JAX_TILED_ACC8
#undef JAX_TILED_WGMMA_N256
#undef JAX_TILED_WGMMA_N192
#undef JAX_TILED_WGMMA_N128
#undef JAX_TILED_WGMMA_N64
#undef JAX_TILED_ACC_OPERANDS_128
#undef JAX_TILED_ACC_OPERANDS_96
#undef JAX_TILED_ACC_OPERANDS_64
#undef JAX_TILED_ACC_OPERANDS_32

}  // namespace jax_tiled::cuda::hopper
