// Kernel 6, "wgmma": Hopper tensor cores fed by the copy engine, bfloat16,
// float16 or float32 (TF32, one pass or three: tf32.cuh) inputs, float32
// accumulation.
//
// What it fixes in kernel 5 ("mma", see NOTES.md): there, every warp staged
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
//
// Sums over K: the tensor cores truncate each addition into the accumulator,
// so where the registers allow (128-wide tiles) each 64 of K goes into a
// fresh partial sum first (blocked_sum.cuh); 3xTF32 sums every slab afresh.
//
// float32 runs as TF32, where wgmma reads shared-memory operands K-major only.
// TF32 operands are rounded to nearest, never truncated: the copy engine
// rounds the shared-memory operand as it lands (a TFLOAT32 tensor map), and
// the consumers round the register operand the same way, to the bits of
// `cvt.rna.tf32.f32` (CvtRnaTf32): both take the float32 values within half a
// TF32 step of the limit to inf (docs/precision.md, "Special values"); a
// guard against that was more instructions on every A element (NOTES.md,
// "Long sums").
// Its A operand is read from shared memory where it too is K-major, rounded
// by a TFLOAT32 tensor map of its own; else from registers, loaded by the
// consumers from the swizzled tile in whatever layout it arrived
// (ElementOffset), so:
// - B stored K-major (transpose_b): A stored (m, k) from shared memory, A
//   stored (k, m) from registers;
// - B stored MN-major (the plain a @ b): the kernel computes C^T = B^T A^T,
//   where B^T is the register operand and A^T is K-major when a is stored
//   (m, k), and the epilogue writes C transposed back;
// - both MN-major (a stored (k, m), b (k, n), the weight gradient): B lands
//   MN-major and the producer warpgroup's idle warps rewrite each slab
//   K-major into a second buffer before the consumers may read it
//   (TransposeSlabOfB).
// 3xTF32 splits both operands into TF32 hi and lo parts ahead of the kernel,
// K-major whatever their stored layout (tf32_parts.cuh): the producer copies
// the four parts of each slab, and the consumers read all of them from shared
// memory. Split by the kernel's own warps (A in the consumers' registers, B by
// the producer warpgroup's idle warps), the splits and A's loads cost more
// than the tensor cores' work (NOTES.md, "3xTF32's parts split ahead"). An
// operand the kernel reads only once (one column of tiles for A, one row for
// B) and stored K-major lands as stored instead, and the producer
// warpgroup's idle warps split each slab of it in shared memory: a pass ahead
// would read it, write twice its bytes and have the kernel read those back
// (NOTES.md, "3xTF32's parts split on chip where read once"). The plain
// x @ w (w stored (k, n): MN-major, which TF32 wgmma reads from registers
// only) splits in the kernel instead where the passes ahead would cost more
// than the parts save (WgmmaSplitsInKernel):
// as C^T = w^T x^T, w split in the consumers' registers as they load it, x
// in shared memory by those idle warps (NOTES.md, "3xTF32 split ahead, on
// chip, or in the kernel").
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "cuda/blocks/blocked_sum.cuh"
#include "cuda/blocks/common.cuh"
#include "cuda/blocks/epilogue.cuh"
#include "cuda/blocks/hopper.cuh"
#include "cuda/blocks/tf32.cuh"
#include "cuda/blocks/tf32_parts.cuh"
#include "cuda/blocks/tile_scheduler.cuh"
#include "cuda/kernel.h"
#include "stack_slice.h"

namespace jax_tiled::cuda {

// kClusterM: blocks per cluster, along M; the blocks of a cluster share their
// B tiles, each copying 1 / kClusterM of every B slab for all of them
// (PersistentTileScheduler, SwizzledTile::LoadPart).
// kSplitK: clusters along K instead, one tile each, its K split among the
// cluster's blocks and their partial sums added in the epilogue
// (SplitKTileScheduler, ClusterReduceEpilogue); the cluster's size, set at
// launch, is the split count.
template <int kBlockN_, int kStages_, int kClusterM_ = 1, bool kSplitK_ = false>
struct WgmmaConfig {
  static constexpr int kConsumers = 2;  // warpgroups, 64 output rows each
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kClusterM = kClusterM_;
  static constexpr bool kSplitK = kSplitK_;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // setmaxnreg budgets: 128 x 40 + 256 x 232 fits the 64K-register file.
  static constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
  // Whether a consumer's registers hold a second set of accumulators, for
  // blocked sums (blocked_sum.cuh): 128-wide tiles yes, 256-wide ones no; and
  // a third, for partial sums added in groups: 64-wide tiles only.
  static constexpr bool kRoomForBlockedSum = RoomForTwoSets(kBlockN / 2, kConsumerRegisters);
  static constexpr bool kRoomForGroupedSum = RoomForSets(3, kBlockN / 2, kConsumerRegisters);
};

// 128 x 256 tiles, 4 stages of 48 KB, for 16-bit inputs in pairs sharing B;
// one TF32 pass runs them single (clusters measured no faster there: NOTES.md,
// "clusters sharing B"). 128 x 128 tiles, 6 stages of 32 KB. Stages that
// carry a rewritten copy of B (B rewritten K-major): 128 x 128 tiles, 4
// stages of 48 KB; that carry 3xTF32's hi and lo parts of A and B: 128 x 128
// tiles, 3 stages of 64 KB.
using WgmmaWide = WgmmaConfig<256, 4, 2>;
using WgmmaWideTf32 = WgmmaConfig<256, 4, 1>;
// 128 x 192 tiles, 4 stages of 40 KB, for 16-bit inputs in pairs sharing B,
// where their waves end before the 128 x 256 tiles' (WgmmaEndsSooner). As
// the 256-wide tiles, no room for blocked sums: one running sum.
using WgmmaWide192 = WgmmaConfig<192, 4, 2>;
using WgmmaNarrow = WgmmaConfig<128, 6>;
// 128 x 64 tiles, 8 stages of 24 KB, for outputs 64 or fewer columns wide
// (the small M of a swapped TF32 product lands there), where wider tiles
// would multiply padding.
using WgmmaSkinny = WgmmaConfig<64, 8>;
using WgmmaRewritingB = WgmmaConfig<128, 4>;
using WgmmaParts = WgmmaConfig<128, 3>;
// 3xTF32's parts for outputs 64 or fewer columns wide: 128 x 64 tiles, 4
// stages of 48 KB (128-wide tiles there are half padding, and so is half
// the four products' tensor work).
using WgmmaSkinnyParts = WgmmaConfig<64, 4>;
// 3xTF32 split in the kernel (A in registers, B in shared memory): stages of
// A, B's hi and B's lo, as those rewriting B, 128 x 128 tiles, 4 of 48 KB.
using WgmmaSplitInKernel = WgmmaRewritingB;
// ... for outputs 64 or fewer columns wide (x's few rows, swapped onto N):
// 128 x 64 tiles, 6 stages of 32 KB.
using WgmmaSkinnySplitInKernel = WgmmaConfig<64, 6>;
// Split K: 128 x 128 tiles, 6 stages of 32 KB; with 3xTF32's parts, 3 stages
// of 64 KB. The partial sums' 68 KB lie over the stages
// (ClusterReduceEpilogue::kOverStages).
using WgmmaSplitK = WgmmaConfig<128, 6, 1, true>;
using WgmmaSplitKParts = WgmmaConfig<128, 3, 1, true>;
using WgmmaSplitKSkinnyParts = WgmmaConfig<64, 4, 1, true>;
using WgmmaSplitKSplitInKernel = WgmmaConfig<128, 4, 1, true>;
using WgmmaSplitKSkinnySplitInKernel = WgmmaConfig<64, 6, 1, true>;
// Split K on 128 x 256 tiles, 4 stages of 48 KB (the partial sums' 132 KB lie
// over them), for 16-bit inputs into 16-bit results whose K is deep
// (WgmmaSplitsWide): each slab of A then serves 256 columns, not 128, so a
// block's operands cost a quarter less traffic through L2 for the same work.
// No room for a second set of accumulators (blocked sums): each part is one
// running sum, whose truncation a float32 result would show.
using WgmmaSplitKWide = WgmmaConfig<256, 4, 1, true>;
// Split K for outputs at most 64 columns wide (a few rows swapped onto
// wgmma's N, WgmmaSwapsAB): 128 x 64 tiles, 8 stages of 24 KB, where 128-wide
// ones would copy and multiply a B slab mostly of zeros.
using WgmmaSplitKSkinny = WgmmaConfig<64, 8, 1, true>;
// 16-bit parts of BF16_BF16_F32_X3 laid along K (Product::laid_terms 3),
// into float32: 128 x 128 tiles, whole K or split, whose partial sums hold
// one chunk group of 3 slabs, where 16-bit inputs' own hold one slab and
// drain the warpgroup's wgmmas at each (NOTES.md, "BF16_BF16_F32_X3: chunk
// groups, not the wide tiles").
template <class Cfg>
struct WgmmaLaidX3 : Cfg {
  static constexpr int kPartialSlabs = 3;
};
using WgmmaNarrowLaidX3 = WgmmaLaidX3<WgmmaNarrow>;
using WgmmaSplitKLaidX3 = WgmmaLaidX3<WgmmaSplitK>;

// What one kernel instance reads and writes:
//   In: the operands' type; float means TF32, with A from registers.
//   kAMnMajor, kBMnMajor: the operands' layouts as the copy engine lands them.
//   kSplit: 3xTF32 rather than one TF32 pass: A and B each a stack of two
//     parts, hi and lo, both K-major (tf32_parts.cuh), but for those that
//   kSplitOnChip names: kAInRegisters, A landed as stored (either major)
//     and split by the consumers as they load it into registers; kBOnChip,
//     B stored K-major, landed as stored and split in shared memory.
//   kTransposedOut: the kernel's problem is C^T = B^T A^T of the caller's;
//     it writes element (i, j) of its result to C[j][i].
// TF32 wgmma reads B K-major only: a TF32 B landed MN-major is rewritten
// K-major (kTransposesB) by the producer warpgroup's idle warps into the
// stage's second B buffer. Those warps do every rewrite (kRewrites): that,
// or 3xTF32's split of B on chip. A is split by the consumers instead: they
// load it into registers anyway, and its second tile in shared memory would
// double the bytes their wgmmas read there (NOTES.md, "The probes and HIGH
// of few rows, run").
enum SplitOnChip : int {
  kNoneOnChip = 0,
  kBOnChip = 1,
  kAInRegisters = 2,
};
template <class In_, bool kAMnMajor_, bool kBMnMajor_, bool kSplit_ = false,
          bool kTransposedOut_ = false, int kSplitOnChip_ = kNoneOnChip>
struct WgmmaOperands {
  using In = In_;
  static constexpr bool kAMnMajor = kAMnMajor_, kBMnMajor = kBMnMajor_;
  static constexpr bool kSplit = kSplit_, kTransposedOut = kTransposedOut_;
  static constexpr bool kTf32 = std::is_same_v<In, float>;
  static constexpr bool kTransposesB = kTf32 && kBMnMajor;
  static constexpr bool kSplitsBOnChip = (kSplitOnChip_ & kBOnChip) != 0;
  static constexpr bool kSplitsAInRegisters = (kSplitOnChip_ & kAInRegisters) != 0;
  // TF32 A the consumers load into registers: MN-major (TF32 wgmma reads
  // shared memory K-major only), or split there; else read from shared memory.
  static constexpr bool kAFromRegisters = kTf32 && (kSplit ? kSplitsAInRegisters : kAMnMajor);
  static constexpr bool kRewrites = kTransposesB || kSplitsBOnChip;
  static_assert(!kSplit || (kTf32 && !kBMnMajor &&
                            (kSplitsAInRegisters || (!kAMnMajor && !kTransposedOut))),
                "3xTF32 reads float32 operands' parts K-major, but A split in registers");
  static_assert(kSplit || kSplitOnChip_ == kNoneOnChip, "only 3xTF32 splits on chip");
};

template <class Cfg, class Ops>
struct WgmmaTiles {
  using A = hopper::SwizzledTile<typename Ops::In, Ops::kAMnMajor, Cfg::kBlockM>;
  // B as the copy engine lands it, and as the consumers' wgmmas read it.
  using B = hopper::SwizzledTile<typename Ops::In, Ops::kBMnMajor, Cfg::kBlockN>;
  using BRead =
      hopper::SwizzledTile<typename Ops::In, Ops::kBMnMajor && !Ops::kTransposesB, Cfg::kBlockN>;
  static constexpr int kSlab = A::kElements;  // K per stage: one swizzle row
  static constexpr int kSteps = 4;            // instructions per slab: k16 (16-bit), k8 (TF32)
  // Tiles of each operand a stage holds: 3xTF32's hi and lo, but one of an A
  // split in registers.
  static constexpr int kAParts = Ops::kSplit && !Ops::kSplitsAInRegisters ? 2 : 1;
  static constexpr int kBParts = Ops::kSplit ? 2 : 1;
  static constexpr int kBSecondBytes = Ops::kTransposesB ? B::kBytes : 0;
  static constexpr int kStageBytes = kAParts * A::kBytes + kBParts * B::kBytes + kBSecondBytes;
  // Stages, then full, empty and (rewritten) landed barriers; 1 KB of
  // slack to align the start.
  static constexpr int kSharedBytes = 1024 + Cfg::kStages * kStageBytes + 3 * Cfg::kStages * 8;
  // Slack to align the epilogue's shared memory past the barriers (the
  // copy engine's 128-byte swizzle repeats every 1 KB).
  static constexpr int kEpilogueAlignment = 1024;
};

// This thread's TF32 A operands for the kSteps k8 steps of one slab
// (kAFromRegisters): hi, and lo where 3xTF32 splits A in registers. A read
// from shared memory needs none.
template <class Ops, int kSteps, bool = Ops::kAFromRegisters>
struct AFragments {
  __device__ __forceinline__ void Fence() {}
};
template <class Ops, int kSteps>
struct AFragments<Ops, kSteps, true> {
  uint32_t hi[kSteps][4];
  uint32_t lo[Ops::kSplit ? kSteps : 1][4];

  // Element (r, k) of A, r = row0 + g (+ 8), k = 8 step + t (+ 4) with
  // g = lane / 4, t = lane % 4: wgmma's TF32 A layout for warp rows row0.
  template <class Tile>
  __device__ __forceinline__ void Load(const uint8_t* tile, int row0, int lane) {
    const uint32_t at = SharedAddress(tile);
#pragma unroll
    for (int step = 0; step < kSteps; ++step)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = row0 + lane / 4 + 8 * (i % 2), k = 8 * step + lane % 4 + 4 * (i / 2);
        const float x = __uint_as_float(hopper::LoadShared(at + Tile::ElementOffset(row, k)));
        if constexpr (Ops::kSplit) SplitTf32(x, hi[step][i], lo[step][i]);  // tf32_parts.cuh's bits
        else hi[step][i] = CvtRnaTf32(x);  // as the copy engine rounds B
      }
  }

  __device__ __forceinline__ void Fence() {
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      hopper::FenceRegisters(hi[step]);
      if constexpr (Ops::kSplit) hopper::FenceRegisters(lo[step]);
    }
  }
};

// The block's shared memory: kStages stages of an A tile and a B tile (3xTF32:
// A's hi and lo parts, then B's) and, where B is rewritten, a second B buffer
// (B K-major); then per stage a full, an empty and (B rewritten) a landed
// barrier. Aligned to the 128-byte swizzle's 1 KB period.
template <class Cfg, class Ops>
struct WgmmaStages {
  using Tiles = WgmmaTiles<Cfg, Ops>;
  uint8_t* base;
  uint64_t* full;    // the consumers may read the stage
  uint64_t* empty;   // the consumers are done with it
  uint64_t* landed;  // rewritten (kRewrites): copied, not yet rewritten

  __device__ __forceinline__ explicit WgmmaStages(uint8_t* shared_raw)
      : base(reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(shared_raw) + 1023) / 1024 *
                                        1024)),
        full(reinterpret_cast<uint64_t*>(base + Cfg::kStages * Tiles::kStageBytes)),
        empty(full + Cfg::kStages),
        landed(empty + Cfg::kStages) {}

  __device__ __forceinline__ uint8_t* A(int stage) const {
    return base + stage * Tiles::kStageBytes;
  }
  __device__ __forceinline__ uint8_t* ALo(int stage) const { return A(stage) + Tiles::A::kBytes; }
  __device__ __forceinline__ uint8_t* B(int stage) const {
    return A(stage) + Tiles::kAParts * Tiles::A::kBytes;
  }
  // B's lo part (3xTF32), or B rewritten K-major.
  __device__ __forceinline__ uint8_t* BSecond(int stage) const {
    return B(stage) + Tiles::B::kBytes;
  }
  // The B tile the consumers' wgmmas read (3xTF32: hi).
  __device__ __forceinline__ uint8_t* BRead(int stage) const {
    return Ops::kTransposesB ? BSecond(stage) : B(stage);
  }
  // The epilogue's shared memory, past the barriers, 1 KB aligned.
  __device__ __forceinline__ uint8_t* Epilogue() const {
    constexpr uintptr_t kAlign = Tiles::kEpilogueAlignment;
    return reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uintptr_t>(full + 3 * Cfg::kStages) + kAlign - 1) / kAlign * kAlign);
  }

  // By one thread, before the block's first __syncthreads.
  __device__ __forceinline__ void Init(int rewriters) const {
    for (int s = 0; s < Cfg::kStages; ++s) {
      // The producer's arrival (the copy engine adds the bytes), or every rewriter's.
      hopper::InitBarrier(&full[s], Ops::kRewrites ? rewriters : 1);
      // Every consumer warp of every block of the cluster: each block's
      // producer copies into all of their stages.
      hopper::InitBarrier(&empty[s], 4 * Cfg::kConsumers * Cfg::kClusterM);
      if constexpr (Ops::kRewrites) hopper::InitBarrier(&landed[s], 1);
    }
    hopper::FenceBarrierInit();
  }
};

// The operands given as slices of stacks (stack_slice.h; an unstacked
// operand's index is null), swapped with the operands where the kernel
// computes C^T (ArrangeWgmma).
struct WgmmaStacks { StackSlice a, b; };

// Where the chosen slice's batches start in a descriptor that spans the
// stack (OperandOf): each slice holds the operand's batches, one where it is
// broadcast. 0 unstacked. Reads the index, which lives on the device.
__device__ __forceinline__ int FirstBatchOf(const StackSlice& stack, int64_t batch_stride,
                                            int64_t batch) {
  return static_cast<int>(stack.Chosen() * (batch_stride ? batch : 1));
}

// A walk around the ring of stages: the stage, and the parity of the pass.
template <int kStages>
struct StageCursor {
  int stage = 0;
  uint32_t parity = 0;
  __device__ __forceinline__ void Advance() {
    if (++stage == kStages) stage = 0, parity ^= 1;
  }
};

// Warpgroup 0. One thread issues the copy engine's loads, kStages slabs ahead
// of the consumers; where a slab is rewritten (kRewrites: TF32 B landed
// MN-major, 3xTF32's operands split on chip), the other three warps rewrite
// each landed slab beside it before the consumers may read it.
// The rest of its registers go to the consumers (setmaxnreg). Both walk the
// block's work units in the scheduler's order, as the consumers do.
template <class Cfg, class Ops, class Scheduler>
struct WgmmaProducer {
  using Stages = WgmmaStages<Cfg, Ops>;
  using Tiles = typename Stages::Tiles;
  static constexpr int kRewriters = 96;  // the warpgroup's threads past its first warp

  __device__ __forceinline__ static void Run(const Stages& stages, const CUtensorMap* a_map,
                                             const CUtensorMap* b_map, const MatmulDims& dims,
                                             const WgmmaStacks& stacks) {
    hopper::ShrinkRegisters<Cfg::kProducerRegisters>();
    if (threadIdx.x == 0) {
      Copy(stages, a_map, b_map, dims, stacks);
    } else if constexpr (Ops::kRewrites) {
      if (threadIdx.x >= 32) Rewrite(stages, dims, threadIdx.x - 32);
    }
  }

 private:
  // A: this block's own rows. B: part `rank` of each slab, multicast to every
  // block of the cluster, whose full barriers count the bytes of all parts.
  // An operand given as a slice of a stack is copied from the chosen slice's
  // batches (its descriptor spans the stack's). 3xTF32: each operand split
  // ahead has its lo part one part's batches past its hi (LaunchWgmmaParts);
  // one split on chip lands as stored where its hi goes.
  __device__ __forceinline__ static void Copy(const Stages& stages, const CUtensorMap* a_map,
                                              const CUtensorMap* b_map, const MatmulDims& dims,
                                              const WgmmaStacks& stacks) {
    constexpr uint16_t kCluster = (1u << Cfg::kClusterM) - 1;
    constexpr bool kALoCopied = Tiles::kAParts == 2;  // A split ahead
    constexpr bool kBLoCopied = Ops::kSplit && !Ops::kSplitsBOnChip;
    constexpr int kSlabBytes =
        (1 + kALoCopied) * Tiles::A::kBytes + (1 + kBLoCopied) * Tiles::B::kBytes;
    uint64_t* const copied = Ops::kRewrites ? stages.landed : stages.full;
    const int a_first = FirstBatchOf(stacks.a, dims.a_batch_stride, dims.batch);
    const int b_first = FirstBatchOf(stacks.b, dims.b_batch_stride, dims.batch);
    const int a_lo = static_cast<int>(dims.a_batch_stride ? dims.batch : 1);
    const int b_lo = static_cast<int>(dims.b_batch_stride ? dims.batch : 1);
    StageCursor<Cfg::kStages> at;
    Scheduler scheduler;
    for (WorkUnit unit; scheduler.Next(dims, unit);) {
      const int a_batch = a_first + (dims.a_batch_stride ? unit.batch : 0);
      const int b_batch = b_first + (dims.b_batch_stride ? unit.batch : 0);
      for (int slab = unit.slab_begin; slab < unit.slab_end; ++slab) {
        // Every block of the cluster released the stage.
        hopper::WaitBarrier(&stages.empty[at.stage], at.parity ^ 1);
        hopper::ArriveExpectingBytes(&copied[at.stage], kSlabBytes);
        const int k0 = slab * Tiles::kSlab;
        Tiles::A::Load(stages.A(at.stage), a_map, &copied[at.stage], unit.row0, k0, a_batch);
        Tiles::B::template LoadPart<Cfg::kClusterM>(stages.B(at.stage), b_map, &copied[at.stage],
                                                    unit.col0, k0, b_batch, Scheduler::Rank(),
                                                    kCluster);
        if constexpr (kALoCopied)
          Tiles::A::Load(stages.ALo(at.stage), a_map, &copied[at.stage], unit.row0, k0,
                         a_batch + a_lo);
        if constexpr (kBLoCopied)
          Tiles::B::template LoadPart<Cfg::kClusterM>(stages.BSecond(at.stage), b_map,
                                                      &copied[at.stage], unit.col0, k0,
                                                      b_batch + b_lo, Scheduler::Rank(), kCluster);
        at.Advance();
      }
    }
  }

  // Every landed slab rewritten, then handed to the consumers.
  __device__ __forceinline__ static void Rewrite(const Stages& stages, const MatmulDims& dims,
                                                 int rewriter) {
    StageCursor<Cfg::kStages> at;
    Scheduler scheduler;
    for (WorkUnit unit; scheduler.Next(dims, unit);) {
      for (int slab = unit.slab_begin; slab < unit.slab_end; ++slab) {
        hopper::WaitBarrier(&stages.landed[at.stage], at.parity);
        if constexpr (Ops::kTransposesB)
          TransposeSlabOfB(stages.B(at.stage), stages.BSecond(at.stage), rewriter);
        if constexpr (Ops::kSplitsBOnChip)
          SplitSlab<Tiles::B::kBytes>(stages.B(at.stage), stages.BSecond(at.stage), rewriter);
        hopper::FenceProxyAsync();  // wgmma reads these through the async proxy
        hopper::Arrive(&stages.full[at.stage]);
        at.Advance();
      }
    }
  }

  // A landed float32 slab split into its TF32 parts (tf32.cuh's SplitTf32,
  // the bits the pass ahead makes): hi over the float where it landed, lo at
  // the same offset of `lo`. The two tiles share one swizzled layout, so the
  // split goes byte range by byte range, a 16-byte chunk a thread at a time,
  // consecutive chunks across a warp's lanes: no bank conflicts.
  template <int kBytes>
  __device__ __forceinline__ static void SplitSlab(uint8_t* hi_in_place, uint8_t* lo,
                                                   int rewriter) {
    const uint32_t from = SharedAddress(hi_in_place), to = SharedAddress(lo);
    for (uint32_t at = 16 * rewriter; at < kBytes; at += 16 * kRewriters) {
      const uint4 x = hopper::LoadShared4(from + at);
      uint4 hi, parts_lo;
      SplitTf32(__uint_as_float(x.x), hi.x, parts_lo.x);
      SplitTf32(__uint_as_float(x.y), hi.y, parts_lo.y);
      SplitTf32(__uint_as_float(x.z), hi.z, parts_lo.z);
      SplitTf32(__uint_as_float(x.w), hi.w, parts_lo.w);
      hopper::StoreShared4(from + at, hi);
      hopper::StoreShared4(to + at, parts_lo);
    }
  }

  // TF32 B landed MN-major (already rounded by the copy engine), written
  // K-major: a thread takes one column and eight of K, eight 4-byte reads
  // along the K rows, all in flight at once, and two 16-byte writes. A warp's
  // 32 lanes take 32 consecutive columns, so each read is one whole 128-byte
  // row of the landed tile and each 8 lanes' writes go to 8 rows whose
  // swizzle puts them in 8 distinct 16-byte chunks: no bank conflicts either
  // way. Shared addresses, not generic pointers, and few instructions an
  // element: this runs beside the tensor cores on every slab (NOTES.md, "The
  // weight gradient's layout on TF32 wgmma").
  __device__ __forceinline__ static void TransposeSlabOfB(const uint8_t* landed, uint8_t* k_major,
                                                          int rewriter) {
    using Landed = typename Tiles::B;
    using Read = typename Tiles::BRead;
    // Rows k .. k + 7 of a landed column (k a multiple of 8, the tile 1 KB
    // aligned) lie 128 bytes apart with their 16-byte chunks XORed by 0 .. 7:
    // row k + r is at (row k's address) ^ (144 r), that is + 128 r with the
    // chunk ^ r, no carries. K-major, (col, k + 4) is (col, k)'s next chunk.
    static_assert(Landed::kElements == 32 && hopper::kSwizzleBytes == 128, "32 floats a row");
    const uint32_t from = SharedAddress(landed), to = SharedAddress(k_major);
    for (uint32_t i = rewriter; i < Cfg::kBlockN * Tiles::kSlab / 8; i += kRewriters) {
      const uint32_t col = i % Cfg::kBlockN, k = 8 * (i / Cfg::kBlockN);
      const uint32_t first = from + Landed::ElementOffset(col, k);
      uint32_t v[8];
#pragma unroll
      for (uint32_t r = 0; r < 8; ++r) v[r] = hopper::LoadShared(first ^ (144 * r));
      const uint32_t row = to + Read::ElementOffset(col, k);
      hopper::StoreShared4(row, {v[0], v[1], v[2], v[3]});
      hopper::StoreShared4(row ^ 16, {v[4], v[5], v[6], v[7]});
    }
  }
};

// Warpgroups 1 and 2, 64 rows of the tile each: wgmma over the tile's slabs
// into acc, releasing each stage to the producer once its wgmmas retired.
template <class Cfg, class Ops>
struct WgmmaConsumer {
  using Stages = WgmmaStages<Cfg, Ops>;
  using Tiles = typename Stages::Tiles;
  using A = AFragments<Ops, Tiles::kSteps>;

  // One pass sums each kPartialDepth of K into `partial` first where the
  // registers allow (blocked_sum.cuh); 3xTF32 sums each slab there (tf32.cuh). Either way
  // acc collects the partial sums with rounded float adds, through `group`
  // (kPartialsPerGroup at a time) where a third set fits.
  static constexpr bool kBlocked = !Ops::kSplit && Cfg::kRoomForBlockedSum;
  static constexpr bool kGrouped = (Ops::kSplit || kBlocked) && Cfg::kRoomForGroupedSum;
  static constexpr int kPartialDepth = Ops::kTf32 ? kTf32TruncatedSumDepth : kTruncatedSumDepth;
  static_assert(kPartialDepth % Tiles::kSlab == 0, "a partial sum is whole slabs");
  static constexpr int kSlabsPerPartial = !kBlocked ? 1
                                          : detail::PartialSlabsOf<Cfg>::value
                                              ? detail::PartialSlabsOf<Cfg>::value
                                              : kPartialDepth / Tiles::kSlab;

  float acc[Cfg::kBlockN / 2];
  float partial[Ops::kSplit || kBlocked ? Cfg::kBlockN / 2 : 1];
  float group[kGrouped ? Cfg::kBlockN / 2 : 1];
  int partials_in_group;
  // TF32 A operands of two slabs: one being read by wgmmas in flight, one loading.
  A even, odd;
  StageCursor<Cfg::kStages> at;
  const int a_rows;  // this warpgroup's first row of the tile
  const int warp, lane;

  __device__ __forceinline__ WgmmaConsumer()
      : a_rows(64 * (WarpgroupIndex() - 1)), warp(threadIdx.x / 32 % 4), lane(threadIdx.x % 32) {
    hopper::GrowRegisters<Cfg::kConsumerRegisters>();
  }

  // threadIdx.x / 128 as lane 0 has it: the same in every lane, and seen so
  // by the compiler, which then keeps A's descriptors (built from a_rows) in
  // uniform registers; from threadIdx.x itself it built them per thread and
  // moved them into uniform ones around every wgmma (NOTES.md, "Descriptors
  // in uniform registers").
  __device__ __forceinline__ static int WarpgroupIndex() {
    return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  }

  // acc = this warpgroup's rows of the unit's product.
  __device__ __forceinline__ void Mainloop(const Stages& stages, const WorkUnit& unit) {
    const int slabs = unit.slab_end - unit.slab_begin;  // counted from 0 below
    int previous = -1;  // the stage whose wgmmas may still be reading
    if constexpr (Ops::kSplit || kBlocked)
#pragma unroll
      for (float& x : acc) x = 0.0f;
    if constexpr (kGrouped) StartGroup();
    // Unconditional pairs, so ptxas can see that a buffer is reloaded only
    // after the wait that retired its last readers (else it serialises wgmma).
    for (int slab = 0; slab + 1 < slabs; slab += 2) {
      Consume(stages, slab, slabs, even, previous);
      Consume(stages, slab + 1, slabs, odd, previous);
    }
    if (slabs % 2) Consume(stages, slabs - 1, slabs, even, previous);
    hopper::WgmmaWait<0>();
    hopper::FenceAccumulators(acc);
    if constexpr (kGrouped)
      if (partials_in_group > 0) AddGroup();
    if (previous >= 0) Release(stages, previous);
  }

 private:
  __device__ __forceinline__ void Consume(const Stages& stages, int slab, int slabs, A& a,
                                          int& previous) {
    hopper::WaitBarrier(&stages.full[at.stage], at.parity);
    const uint8_t* const a_stage = stages.A(at.stage);
    if constexpr (Ops::kAFromRegisters)
      a.template Load<typename Tiles::A>(a_stage, a_rows + 16 * warp, lane);
    a.Fence();  // the conversions stay ahead of the fence: wgmma reads A from here on
    hopper::WgmmaFence();
    auto b = [&](int step) { return Tiles::BRead::Descriptor(stages.BRead(at.stage), 0, step); };
    if constexpr (Ops::kSplit) {
      // Into a fresh slab sum: the small terms of every step first (lo x lo
      // too: dropped, it leans, since a truncated hi leaves lo x lo of the
      // product's sign), so only the four big ones are added (truncated)
      // into a large partial sum.
      // A's part (lo or hi) times a B part: A from registers where it is
      // split there, else its part's tile.
      auto mma = [&](bool a_lo, int step, uint64_t b_part, int accumulate) {
        if constexpr (Ops::kSplitsAInRegisters)
          hopper::WgmmaTf32<Cfg::kBlockN>(partial, a_lo ? a.lo[step] : a.hi[step], b_part,
                                          accumulate);
        else
          hopper::WgmmaTf32Shared<Cfg::kBlockN>(
              partial, Tiles::A::Descriptor(a_lo ? stages.ALo(at.stage) : a_stage, a_rows, step),
              b_part, accumulate);
      };
#pragma unroll
      for (int step = 0; step < Tiles::kSteps; ++step) {
        const auto b_lo = Tiles::BRead::Descriptor(stages.BSecond(at.stage), 0, step);
        mma(true, step, b_lo, step > 0);
        mma(true, step, b(step), 1);
        mma(false, step, b_lo, 1);
      }
#pragma unroll
      for (int step = 0; step < Tiles::kSteps; ++step) mma(false, step, b(step), 1);
      hopper::WgmmaCommit();
      // The other consumer warpgroup keeps the tensor cores busy meanwhile.
      AddPartial();
      Release(stages, at.stage);
    } else {
      // The running sum these wgmmas add into, and whether they start it afresh.
      auto& sum = SumOf();
      const bool fresh = kBlocked ? slab % kSlabsPerPartial == 0 : slab == 0;
#pragma unroll
      for (int step = 0; step < Tiles::kSteps; ++step) {
        const int accumulate = !fresh || step > 0;  // 0: the sum's first product overwrites
        if constexpr (Ops::kAFromRegisters)
          hopper::WgmmaTf32<Cfg::kBlockN>(sum, a.hi[step], b(step), accumulate);
        else if constexpr (Ops::kTf32)
          hopper::WgmmaTf32Shared<Cfg::kBlockN>(sum, Tiles::A::Descriptor(a_stage, a_rows, step),
                                                b(step), accumulate);
        else
          hopper::Wgmma<Cfg::kBlockN, typename Ops::In, Ops::kAMnMajor, Ops::kBMnMajor>(
              sum, Tiles::A::Descriptor(a_stage, a_rows, step), b(step), accumulate);
      }
      hopper::WgmmaCommit();
      if (kBlocked && ((slab + 1) % kSlabsPerPartial == 0 || slab + 1 == slabs)) {
        // The partial sum is complete: retire every wgmma (the other consumer
        // warpgroup keeps the tensor cores busy meanwhile), add it into acc,
        // and hand back both stages still held.
        AddPartial();
        if (previous >= 0) Release(stages, previous);
        Release(stages, at.stage);
        previous = -1;
      } else {
        // Keep this slab's wgmmas in flight; the previous slab's are done, so
        // its stage can go back to the producer and its A registers be reloaded.
        hopper::WgmmaWait<1>();
        if (previous >= 0) Release(stages, previous);
        previous = at.stage;
      }
    }
    at.Advance();
  }

  // This warp is done reading `stage`: one arrival on its empty barrier in
  // every block of the cluster (each block's producer copies into it).
  __device__ __forceinline__ void Release(const Stages& stages, int stage) const {
    if constexpr (Cfg::kClusterM == 1) {
      if (lane == 0) hopper::Arrive(&stages.empty[stage]);
    } else if (lane < Cfg::kClusterM) {
      hopper::ArriveInCluster(&stages.empty[stage], lane);
    }
  }

  // What one pass's wgmmas add into: the partial sum, or acc itself.
  __device__ __forceinline__ auto& SumOf() {
    if constexpr (kBlocked) return partial;
    else return acc;
  }

  // acc += partial (or group += partial, and acc += group every
  // kPartialsPerGroup), once every wgmma writing it has retired.
  __device__ __forceinline__ void AddPartial() {
    hopper::WgmmaWait<0>();
    hopper::FenceAccumulators(partial);
    if constexpr (kGrouped) {
#pragma unroll
      for (int i = 0; i < Cfg::kBlockN / 2; ++i) group[i] += partial[i];
      if (++partials_in_group == kPartialsPerGroup) AddGroup();
    } else {
#pragma unroll
      for (int i = 0; i < Cfg::kBlockN / 2; ++i) acc[i] += partial[i];
    }
  }

  __device__ __forceinline__ void StartGroup() {
#pragma unroll
    for (float& x : group) x = 0.0f;
    partials_in_group = 0;
  }

  __device__ __forceinline__ void AddGroup() {
#pragma unroll
    for (int i = 0; i < Cfg::kBlockN / 2; ++i) acc[i] += group[i];
    StartGroup();
  }
};

// The epilogue that writes a consumer's accumulators to the caller's C
// straight from registers (OutputWriter). The accumulator layout of m64nN:
// per 8 columns, a thread holds rows r and r + 8 (r = 16 * warp + lane / 4),
// columns 2 * (lane % 4) + {0, 1}. An epilogue is a struct of this shape:
// Params (its kernel argument) and ParamsFor, kSharedBytes (its shared
// memory, past the stages, or over them where kOverStages), Store (by the
// consumers, per unit), Finish (by the consumers once their units are done)
// and Join (by the producer warpgroup once its copies are issued: its part in
// any block barriers the epilogue needs); on the host, Prepare (scratch for
// the params, before the kernel) and FixUp (work after it, on the same
// stream), which EpilogueInOneKernel has do nothing.
struct EpilogueInOneKernel {
  static constexpr bool kOverStages = false;
  template <class Params>
  static cudaError_t Prepare(Params&, const MatmulDims&, const LaunchPlan&, const LaunchContext&) {
    return cudaSuccess;
  }
  template <class Params>
  static cudaError_t FixUp(const Params&, const MatmulDims&, const LaunchPlan&,
                           const LaunchContext&) {
    return cudaSuccess;
  }
};

template <class Cfg, class Ops, class Out>
struct WgmmaRegisterEpilogue : EpilogueInOneKernel {
  struct Params {
    Out* out;
    bool paired_stores;  // every row of C starts aligned to two elements
  };
  static constexpr int kSharedBytes = 0;

  __device__ __forceinline__ static void Join() {}
  __device__ __forceinline__ static void Finish() {}

  __device__ __forceinline__ static void Store(const WgmmaConsumer<Cfg, Ops>& consumer,
                                               const Params& params, const MatmulDims& dims,
                                               const WorkUnit& unit, uint8_t* /*shared*/) {
    const OutputWriter<Out, Ops::kTransposedOut> c(params.out, dims, unit.batch,
                                                   params.paired_stores);
    const int lane = consumer.lane;
    const int64_t row = unit.row0 + consumer.a_rows + 16 * consumer.warp + lane / 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (!c.RowInside(row + 8 * half)) continue;
#pragma unroll
      for (int j = 0; j < Cfg::kBlockN / 8; ++j)
        c.Pair(row + 8 * half, unit.col0 + 8 * j + 2 * (lane % 4), consumer.acc[4 * j + 2 * half],
               consumer.acc[4 * j + 2 * half + 1]);
    }
  }

  // The kernel argument for `out`.
  static Params ParamsFor(const MatmulDims& dims, Out* out) {
    return {out, RowsAligned(dims, out, 2 * sizeof(Out))};
  }
};

// The epilogue that stages each consumer warpgroup's 64 rows in shared memory
// and writes them with the copy engine (TMA stores), 64 rows of 128 bytes at a
// time: whole lines to global memory, where the register epilogue writes 16-
// or 32-byte pieces of rows (half sectors, or single elements where C is
// written transposed), and asynchronously, so the consumers go on to the next
// unit's mainloop while the copy engine drains the last steps. Two buffers a
// warpgroup: a step is written while the one before is still being read. The
// copy engine clips at C's edges. Where it cannot write C (rows or batches not
// 16-byte aligned), the register epilogue's stores instead.
// A step's buffer holds boxes of C at its 128-byte swizzle:
// - C as computed: one box, the group's 64 rows by 128 bytes of columns;
// - C written transposed (the group's 64 rows are C's columns), float32
//   only: two boxes, each 128 bytes of the group's columns by the 32 rows of
//   C that fill the buffer. (Staged one element at a time, 16-bit outputs
//   cost the 256-wide TF32 consumers a spill: those go out from registers.)
template <class Cfg, class Ops, class Out>
struct WgmmaTmaStoreEpilogue : EpilogueInOneKernel {
  using Fallback = WgmmaRegisterEpilogue<Cfg, Ops, Out>;
  struct Params {
    CUtensorMap c_map;  // encoded where `tma`
    typename Fallback::Params fallback;
    bool tma;
  };
  static constexpr bool kTransposed = Ops::kTransposedOut;
  static constexpr int kRows = 64;                                         // a consumer warpgroup's
  static constexpr int kBoxColumns = hopper::kSwizzleBytes / sizeof(Out);  // C's, per box row
  using Buffer = hopper::SwizzledTile<Out, false, kRows>;  // kRows rows of 128 bytes
  static constexpr int kBoxesPerStep = kTransposed ? kRows / kBoxColumns : 1;
  static constexpr int kBoxRows = kRows / kBoxesPerStep;
  // Tile columns per step: 128 bytes of C's row, or the rows of C each box holds.
  static constexpr int kStepColumns = kTransposed ? kBoxRows : kBoxColumns;
  static constexpr int kSteps = Cfg::kBlockN / kStepColumns;
  static constexpr int kBufferBytes = Buffer::kBytes;
  static constexpr int kBuffers = kSteps > 1 ? 2 : 1;
  static constexpr int kSharedBytes = Cfg::kConsumers * kBuffers * kBufferBytes;
  static_assert(!kTransposed || std::is_same_v<Out, float>, "see WgmmaEpilogue");
  // Every unit starts on buffer 0. Where the steps are odd (16-bit C of
  // 192-wide tiles: three), the last unit's last step wrote buffer 0 too, so
  // a unit's first step waits for every store, not all but the last.
  static constexpr bool kStepsPairUp = kSteps % kBuffers == 0;

  __device__ __forceinline__ static void Join() {}

  // The warpgroup's thread that issues its stores.
  __device__ __forceinline__ static bool Issues() { return threadIdx.x % 128 == 0; }

  __device__ __forceinline__ static void Store(const WgmmaConsumer<Cfg, Ops>& consumer,
                                               const Params& params, const MatmulDims& dims,
                                               const WorkUnit& unit, uint8_t* shared) {
    if (!params.tma) return Fallback::Store(consumer, params.fallback, dims, unit, shared);
    const int group = consumer.a_rows / kRows;
    const uint32_t buffers = SharedAddress(shared) + group * kBuffers * kBufferBytes;
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      const uint32_t buffer = buffers + step % kBuffers * kBufferBytes;
      // The store that last read this buffer is done with it.
      if (Issues()) {
        if (step == 0 && !kStepsPairUp) hopper::WaitStoresRead<0>();
        else hopper::WaitStoresRead<kBuffers - 1>();
      }
      hopper::NamedBarrierSync(1 + group, 128);
      Stage(consumer, step, buffer);
      hopper::FenceProxyAsync();  // this thread's writes, before the copy engine reads them
      hopper::NamedBarrierSync(1 + group, 128);
      if (Issues()) {
        const int rows = unit.row0 + consumer.a_rows, columns = unit.col0 + step * kStepColumns;
#pragma unroll
        for (int box = 0; box < kBoxesPerStep; ++box) {
          const uint32_t source = buffer + box * kBoxRows * hopper::kSwizzleBytes;
          if constexpr (kTransposed)
            hopper::StoreBox(&params.c_map, source, rows + box * kBoxColumns, columns, unit.batch);
          else hopper::StoreBox(&params.c_map, source, columns, rows, unit.batch);
        }
        hopper::CommitStores();
      }
    }
  }

  // No block leaves while the copy engine may still read its shared memory.
  __device__ __forceinline__ static void Finish() {
    if (Issues()) hopper::WaitStoresRead<0>();
  }

  static Params ParamsFor(const MatmulDims& dims, Out* out) {
    Params params{};
    params.fallback = Fallback::ParamsFor(dims, out);
    // The kernel's rows are C's columns where it writes C transposed.
    const hopper::OperandLayout c{out,
                                  kTransposed ? dims.m : dims.n,
                                  kTransposed ? dims.n : dims.m,
                                  dims.batch,
                                  dims.ldc,
                                  dims.out_batch_stride,
                                  kBoxRows,
                                  static_cast<int>(sizeof(Out))};
    params.tma =
        hopper::TmaCanTake(c) && hopper::EncodeOperand<Out>(c, &params.c_map) == cudaSuccess;
    return params;
  }

 private:
  // The thread's accumulators of tile columns [step, step + 1) * kStepColumns
  // into the buffer. Per 8 tile columns the thread holds (row, column) pairs
  // (r, c), (r, c + 1) and (r + 8, c), (r + 8, c + 1) (r = 16 warp + lane / 4,
  // c = 2 (lane % 4)): a pair of C's columns as one store, or, transposed,
  // two of C's rows.
  __device__ __forceinline__ static void Stage(const WgmmaConsumer<Cfg, Ops>& consumer, int step,
                                               uint32_t buffer) {
    if constexpr (!kTransposed && sizeof(Out) == 2) return StageMatrices(consumer, step, buffer);
    const uint32_t row = 16 * consumer.warp + consumer.lane / 4, column = 2 * (consumer.lane % 4);
#pragma unroll
    for (uint32_t half = 0; half < 2; ++half) {
      const uint32_t r = row + 8 * half;
#pragma unroll
      for (uint32_t j = 0; j < kStepColumns / 8; ++j) {
        const int i = 4 * (step * kStepColumns / 8 + j) + 2 * half;
        const float x = consumer.acc[i], y = consumer.acc[i + 1];
        const uint32_t c = 8 * j + column;
        if constexpr (kTransposed) {
          // C's column r in box r / kBoxColumns, its rows c and c + 1 of the step.
          const uint32_t box_row = r / kBoxColumns * kBoxRows + c;
          hopper::StoreShared(buffer + Buffer::ElementOffset(box_row, r % kBoxColumns),
                              hopper::AccumulatorBits(x));
          hopper::StoreShared(buffer + Buffer::ElementOffset(box_row + 1, r % kBoxColumns),
                              hopper::AccumulatorBits(y));
        } else {
          const uint32_t at = buffer + Buffer::ElementOffset(r, c);
          if constexpr (std::is_same_v<Out, float>)
            hopper::StoreShared2(
                at, make_uint2(hopper::AccumulatorBits(x), hopper::AccumulatorBits(y)));
          else hopper::StoreShared(at, PackPair<Out>(x, y));
        }
      }
    }
  }

  // 16-bit C as computed, by stmatrix: the warp's 16 rows by 16 columns j of
  // the step are four 8 x 8 matrices, q = the 8 rows (q % 2) by the 8 columns
  // (q / 2), whose pairs the thread holds in that order in the accumulators of
  // columns 16 j + [0, 16); lane 8 q + i names row i of matrix q (a 16-byte
  // run of a row, whole within a swizzle chunk). One instruction where Stage
  // issues four stores, and no per-pair addresses.
  __device__ __forceinline__ static void StageMatrices(const WgmmaConsumer<Cfg, Ops>& consumer,
                                                       int step, uint32_t buffer) {
    const uint32_t q = consumer.lane / 8;
    const uint32_t row = 16 * consumer.warp + consumer.lane % 8 + 8 * (q % 2);
#pragma unroll
    for (uint32_t j = 0; j < kStepColumns / 16; ++j) {
      const float* acc = &consumer.acc[4 * (step * kStepColumns / 8 + 2 * j)];
      hopper::StoreMatrices(buffer + Buffer::ElementOffset(row, 16 * j + 8 * (q / 2)),
                            PackPair<Out>(acc[0], acc[1]), PackPair<Out>(acc[2], acc[3]),
                            PackPair<Out>(acc[4], acc[5]), PackPair<Out>(acc[6], acc[7]));
    }
  }
};

// The split-K epilogue (SplitKTileScheduler): every block of the cluster puts
// its partial sums in its shared memory; then the block of rank q adds rows
// [q R, (q + 1) R) of the tile over the cluster's blocks, in rank order, and
// writes them, eight columns a thread (R = kBlockM / the cluster's size):
// - one cluster a tile: to C. Consecutive threads take consecutive runs of a
//   row, or, where C is written transposed (its rows are the tile's
//   columns), the same run of consecutive rows, so that a warp's stores are
//   contiguous either way.
// - several (a split across clusters): as float32 to the cluster's slot of
//   scratch, a tile's worth; then a second kernel (SplitKFixUp) adds each
//   tile's slots in cluster order and writes C.
// The reduction reads the peers' shared memory directly (distributed shared
// memory). No flags, no float atomics: the sums' order is fixed.
template <class Cfg, class Ops, class Out>
struct ClusterReduceEpilogue {
  struct Params {
    Out* out;
    bool paired_stores;  // every row of C starts aligned to two elements
    bool vector_stores;  // ... and to 16 bytes
    float* partials;     // a split across clusters: a tile's slot per cluster; else null
  };
  // Rows padded by 8 floats: the float2 writes of a half-warp (rows r .. r + 3
  // of the accumulator layout) fall in distinct banks.
  static constexpr int kPitch = Cfg::kBlockN + 8;
  static constexpr int kSharedBytes = Cfg::kBlockM * kPitch * sizeof(float);
  static constexpr int kChunks = Cfg::kBlockN / 8;  // of eight columns, per row
  static constexpr int kSlotFloats = Cfg::kBlockM * Cfg::kBlockN;
  // The partial sums lie over the stages: the scheduler gives a block one
  // unit, so once both consumer warpgroups' wgmmas have retired no stage is
  // read or written again (every slab the producer copied has been consumed),
  // and the stages' shared memory goes to more slabs in flight instead.
  static constexpr bool kOverStages = true;
  // The consumer warpgroups' barrier (bar.sync 0 is the whole block's).
  static constexpr int kConsumersBarrier = 1;

  // The two cluster barriers, which every thread of the cluster passes.
  __device__ __forceinline__ static void Join() {
    hopper::ClusterSync();
    hopper::ClusterSync();
  }
  __device__ __forceinline__ static void Finish() {}

  // sum = part (the first) or sum + part, eight floats: partial sums are
  // added in one fixed order, the first taken as it is.
  __device__ __forceinline__ static void AddPart(float (&sum)[8], float4 lo, float4 hi,
                                                 bool first) {
    const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) sum[e] = first ? v[e] : sum[e] + v[e];
  }

  // sum = the cluster's partial sums at `at` (eight floats), in rank order.
  __device__ __forceinline__ static void AddParts(const float* at, int parts, float (&sum)[8]) {
    for (int q = 0; q < parts; ++q)
      AddPart(sum, hopper::LoadSharedInCluster(at, q), hopper::LoadSharedInCluster(at + 4, q),
              q == 0);
  }

  __device__ __forceinline__ static void Store(const WgmmaConsumer<Cfg, Ops>& consumer,
                                               const Params& params, const MatmulDims& dims,
                                               const WorkUnit& unit, uint8_t* shared) {
    float* const partials = reinterpret_cast<float*>(shared);
    // Each warpgroup's Mainloop waited for its own wgmmas; this waits for the
    // other's, which may still read the stage these writes overwrite.
    hopper::NamedBarrierSync(kConsumersBarrier, 128 * Cfg::kConsumers);
    const int lane = consumer.lane;
    const int row = consumer.a_rows + 16 * consumer.warp + lane / 4;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int j = 0; j < kChunks; ++j)
        *reinterpret_cast<float2*>(partials + (row + 8 * half) * kPitch + 8 * j + 2 * (lane % 4)) =
            make_float2(consumer.acc[4 * j + 2 * half], consumer.acc[4 * j + 2 * half + 1]);
    hopper::ClusterSync();  // every block's partial sums are in place

    const int parts = hopper::ClusterSize(), rows = Cfg::kBlockM / parts;
    const int first_row = hopper::ClusterRank() * rows;
    const int first = threadIdx.x - 128, step = 128 * Cfg::kConsumers;
    if (params.partials) {
      float* const slot = params.partials + hopper::ClusterIndex() * kSlotFloats;
      for (int i = first; i < rows * kChunks; i += step) {
        const int r = first_row + i / kChunks, col = 8 * (i % kChunks);
        float sum[8];
        AddParts(partials + r * kPitch + col, parts, sum);
        float4* const to = reinterpret_cast<float4*>(slot + r * Cfg::kBlockN + col);
        to[0] = make_float4(sum[0], sum[1], sum[2], sum[3]);
        to[1] = make_float4(sum[4], sum[5], sum[6], sum[7]);
      }
    } else {
      const OutputWriter<Out, Ops::kTransposedOut> c(params.out, dims, unit.batch,
                                                     params.paired_stores);
      for (int i = first; i < rows * kChunks; i += step) {
        const int r = first_row + (Ops::kTransposedOut ? i % rows : i / kChunks);
        const int col = 8 * (Ops::kTransposedOut ? i / rows : i % kChunks);
        float sum[8];
        AddParts(partials + r * kPitch + col, parts, sum);
        if (c.RowInside(unit.row0 + r))
          c.Eight(unit.row0 + r, unit.col0 + col, sum, params.vector_stores);
      }
    }
    hopper::ClusterSync();  // no block leaves while another may read its partials
  }

  static Params ParamsFor(const MatmulDims& dims, Out* out) {
    return {out, RowsAligned(dims, out, 2 * sizeof(Out)), RowsAligned(dims, out, 16), nullptr};
  }

  // A split across clusters: a slot of scratch for each cluster.
  static cudaError_t Prepare(Params& params, const MatmulDims& dims, const LaunchPlan& plan,
                             const LaunchContext& context) {
    if (plan.split_groups <= 1) return cudaSuccess;
    const int64_t slots = TileOrder<Cfg::kBlockM, Cfg::kBlockN>(dims).count * plan.split_groups;
    // 16 bytes: the most XLA's scratch allocator takes, and what the slots'
    // 16-byte stores need.
    void* const scratch = context.scratch
                              ? context.scratch->Allocate(slots * kSlotFloats * sizeof(float), 16)
                              : nullptr;
    if (!scratch) return cudaErrorMemoryAllocation;
    params.partials = static_cast<float*>(scratch);
    return cudaSuccess;
  }

  static constexpr int kFixUpThreads = 256;
  static cudaError_t FixUp(const Params& params, const MatmulDims& dims, const LaunchPlan& plan,
                           const LaunchContext& context);
};

// A split across clusters' second kernel: each thread adds eight columns of
// one row of a tile over the tile's clusters' slots, in cluster order, and
// writes them to C (consecutive threads: consecutive runs of a row, or the
// same run of consecutive rows where C is written transposed, as in the
// epilogue).
template <class Cfg, class Ops, class Out>
__global__ void __launch_bounds__(ClusterReduceEpilogue<Cfg, Ops, Out>::kFixUpThreads)
    SplitKFixUp(const MatmulDims dims,
                const typename ClusterReduceEpilogue<Cfg, Ops, Out>::Params params, int groups) {
  using Epilogue = ClusterReduceEpilogue<Cfg, Ops, Out>;
  constexpr int kPerTile = Cfg::kBlockM * Epilogue::kChunks;
  const TileOrder<Cfg::kBlockM, Cfg::kBlockN> order(dims);
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= order.count * kPerTile) return;
  const int64_t tile = i / kPerTile;
  const int j = static_cast<int>(i % kPerTile);
  const int r = Ops::kTransposedOut ? j % Cfg::kBlockM : j / Epilogue::kChunks;
  const int col = 8 * (Ops::kTransposedOut ? j / Cfg::kBlockM : j % Epilogue::kChunks);
  int64_t batch, row0, col0;
  order.Locate(tile, batch, row0, col0);
  const OutputWriter<Out, Ops::kTransposedOut> c(params.out, dims, batch, params.paired_stores);
  if (!c.RowInside(row0 + r)) return;
  const float* at =
      params.partials + tile * groups * Epilogue::kSlotFloats + r * Cfg::kBlockN + col;
  float sum[8];
  for (int g = 0; g < groups; ++g, at += Epilogue::kSlotFloats) {
    const float4* const part = reinterpret_cast<const float4*>(at);
    Epilogue::AddPart(sum, __ldcs(part), __ldcs(part + 1), g == 0);  // read once: past L1
  }
  c.Eight(row0 + r, col0 + col, sum, params.vector_stores);
}

template <class Cfg, class Ops, class Out>
cudaError_t ClusterReduceEpilogue<Cfg, Ops, Out>::FixUp(const Params& params,
                                                        const MatmulDims& dims,
                                                        const LaunchPlan& plan,
                                                        const LaunchContext& context) {
  if (plan.split_groups <= 1) return cudaSuccess;
  const int64_t threads =
      TileOrder<Cfg::kBlockM, Cfg::kBlockN>(dims).count * Cfg::kBlockM * kChunks;
  const auto blocks = static_cast<unsigned>((threads + kFixUpThreads - 1) / kFixUpThreads);
  SplitKFixUp<Cfg, Ops, Out>
      <<<blocks, kFixUpThreads, 0, context.stream>>>(dims, params, plan.split_groups);
  return cudaGetLastError();
}

// The kernel, composed of its pieces: the configuration (tile, stages,
// cluster), the operands (Ops), the tile scheduler that hands each block its
// work units, and the epilogue. The producer and the consumers walk the same
// units; a persistent grid lets the producer fetch the next unit while the
// consumers store the last one.
template <class Cfg, class Ops, class Scheduler, class Epilogue>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    WgmmaMatmul(const __grid_constant__ CUtensorMap a_map,
                const __grid_constant__ CUtensorMap b_map, MatmulDims dims, WgmmaStacks stacks,
                const __grid_constant__ typename Epilogue::Params out) {
#if JAX_TILED_SM90A
  static_assert(!Epilogue::kOverStages || Scheduler::kOneUnitABlock,
                "the stages are free for an epilogue only after a block's last unit");
  using Producer = WgmmaProducer<Cfg, Ops, Scheduler>;
  extern __shared__ uint8_t shared_raw[];
  const WgmmaStages<Cfg, Ops> stages(shared_raw);
  if (threadIdx.x == 0) {
    hopper::PrefetchTensorMap(&a_map);
    hopper::PrefetchTensorMap(&b_map);
    stages.Init(Producer::kRewriters);
  }
  // The barriers are initialised before any block of the cluster copies into
  // this one or arrives on them.
  if constexpr (Cfg::kClusterM > 1) hopper::ClusterSync();
  else __syncthreads();

  if (threadIdx.x < 128) {
    Producer::Run(stages, &a_map, &b_map, dims, stacks);
    Epilogue::Join();
  } else {
    WgmmaConsumer<Cfg, Ops> consumer;
    Scheduler scheduler;
    for (WorkUnit unit; scheduler.Next(dims, unit);) {
      consumer.Mainloop(stages, unit);
      Epilogue::Store(consumer, out, dims, unit,
                      Epilogue::kOverStages ? stages.A(0) : stages.Epilogue());
    }
    Epilogue::Finish();
  }
  // No block leaves while another of its cluster may still arrive on its
  // barriers.
  if constexpr (Cfg::kClusterM > 1) hopper::ClusterSync();
#endif
}

// The copy engine's view of op(A) (free axis M) or op(B) (free axis N); of a
// stack of them (`stack`), every slice's batches, one slice after another
// (the slices are contiguous: WgmmaStackFits).
template <class In>
hopper::OperandLayout OperandOf(const void* base, bool k_contiguous, int64_t free_extent, int64_t k,
                                int64_t ld, int64_t batch_stride, int64_t batch, int free_box,
                                const StackSlice& stack) {
  return {base,
          k_contiguous ? k : free_extent,
          k_contiguous ? free_extent : k,
          (batch_stride ? batch : 1) * stack.count,
          ld,
          batch_stride ? batch_stride : stack.stride,
          k_contiguous ? free_box : hopper::kSwizzleElements<In>,
          static_cast<int>(sizeof(In))};
}

template <class In>
hopper::OperandLayout OperandA(const MatmulDims& d, const void* a, int box_m,
                               const StackSlice& stack = {}) {
  return OperandOf<In>(a, !d.transpose_a, d.m, d.k, d.lda, d.a_batch_stride, d.batch, box_m, stack);
}
template <class In>
hopper::OperandLayout OperandB(const MatmulDims& d, const void* b, int box_n,
                               const StackSlice& stack = {}) {
  return OperandOf<In>(b, d.transpose_b, d.n, d.k, d.ldb, d.b_batch_stride, d.batch, box_n, stack);
}

// A stack the descriptor can span: its slices one after another, each the
// operand's batches (a slice of a batched operand is its batch x batch
// stride elements long).
inline bool WgmmaStackFits(const StackSlice& stack, int64_t batch_stride, int64_t batch) {
  return !stack.stacked() || !batch_stride || stack.stride == batch * batch_stride;
}

// The kernel computes C^T = B^T A^T (see the top of this file):
// - TF32 with B stored MN-major and A stored (m, k) (the plain a @ b): TF32
//   reads B K-major only;
// - 16-bit inputs with at most kFewRows rows of a stored (m, k) and more
//   columns: the rows land on wgmma's N, 64 wide, where 128-row tiles would
//   be mostly padding.
inline constexpr int64_t kFewRows = 64;
inline bool WgmmaSwapsFewRows(bool tf32, const MatmulDims& d) {
  return !tf32 && !d.transpose_a && d.m <= kFewRows && d.n > kFewRows;
}
inline bool WgmmaSwapsAB(bool tf32, const MatmulDims& d) {
  return (tf32 && !d.transpose_b && !d.transpose_a) || WgmmaSwapsFewRows(tf32, d);
}

// ... and with both stored MN-major (a (k, m), b (k, n)), it rewrites B
// K-major in shared memory.
inline bool WgmmaTransposesB(bool tf32, const MatmulDims& d) {
  return tf32 && d.transpose_a && !d.transpose_b;
}

// The problem a wgmma kernel runs for the caller's: the caller's own, or
// C^T = B^T A^T.
struct WgmmaArrangement {
  MatmulDims dims;
  const void* a;
  const void* b;
  bool transposed_out;
  WgmmaStacks stacks;
};

inline WgmmaArrangement ArrangeWgmma(const MatmulDims& d, const void* a, const void* b,
                                     bool swap_ab, const WgmmaStacks& stacks = {}) {
  if (!swap_ab) return {d, a, b, false, stacks};
  MatmulDims t = d;
  t.m = d.n, t.n = d.m;
  t.a_batch_stride = d.b_batch_stride, t.b_batch_stride = d.a_batch_stride;
  t.lda = d.ldb, t.ldb = d.lda;
  t.transpose_a = !d.transpose_b, t.transpose_b = !d.transpose_a;
  // ldc and the output's batch stride stay the caller's.
  return {t, b, a, true, WgmmaStacks{stacks.b, stacks.a}};
}

// 3xTF32 does not run a stored (k, m) with b stored (k, n): B would need
// both rewrites (WgmmaOperands).
inline bool WgmmaLayoutFits(bool split_tf32, const MatmulDims& d) {
  return !WgmmaTransposesB(split_tf32, d);
}

// Which of 3xTF32's operands the kernel splits on chip (SplitOnChip): those
// stored K-major that it reads only once, A where the output is one column of
// 128-wide tiles, B where it is one row (and neither broadcast over batches):
// a pass ahead would read such an operand, write twice its bytes and have the
// kernel read those back (4096 x 4096 by 4096 x 128 on an H200: the pass over
// A took 69 of the product's 137 us; NOTES.md). A is split in the consumers'
// registers, B in shared memory: split there too, A's two tiles made the
// wgmmas read a third more bytes of shared memory (16384 x 4096 by 4096 x 64
// on an H200: 0.234 ms, 0.162 split in registers).
inline int WgmmaSplitsOnChip(const MatmulDims& d) {
  const bool a_once = d.n <= WgmmaParts::kBlockN && (d.a_batch_stride || d.batch == 1);
  const bool b_once = d.m <= WgmmaParts::kBlockM && (d.b_batch_stride || d.batch == 1);
  return (!d.transpose_a && a_once ? kAInRegisters : kNoneOnChip) |
         (d.transpose_b && b_once ? kBOnChip : kNoneOnChip);
}
// Whether 3xTF32 splits in the kernel, not into parts: for the caller's
// x @ w, w stored (k, n) and x (m, k), where the passes ahead would take
// longer than the parts save. Swapped (C^T = w^T x^T), the kernel's A, w, is
// MN-major, which TF32 wgmma reads from registers only: the consumers split it
// as they load it (kAInRegisters) and the producer warpgroup's idle warps
// split x in shared memory (kBOnChip). A pass ahead reads its operand and
// writes twice its bytes; the parts then run at about 1.5x the rate of the
// split in the kernel (4096^3 on an H200: 1.50 ms against 2.15). Measured
// there: 16 x 8192 by 8192 x 8192, 0.28 ms in the kernel, 0.50 ahead;
// 256 x 4096 by 4096 x 4096, 0.151 against 0.176; 512 x 8192 by 8192 x 512,
// 0.081 against 0.092 (NOTES.md, "3xTF32 split ahead, on chip, or in the
// kernel"; the model: "The stack landed").
inline bool WgmmaSplitsInKernel(const MatmulDims& d) {
  if (d.transpose_a || d.transpose_b) return false;
  constexpr double kPassBytesPerElement = 12, kBytesPerSecond = 4e12;
  constexpr double kPartsFlopsPerSecond = 97e12, kInKernelFlopsPerSecond = 64e12;
  const double w_elements = double(d.k) * d.n * (d.b_batch_stride ? d.batch : 1);
  const double x_elements = double(d.m) * d.k * (d.a_batch_stride ? d.batch : 1);
  const bool x_on_chip = (WgmmaSplitsOnChip(d) & kAInRegisters) != 0;
  const double pass_seconds =
      kPassBytesPerElement * (w_elements + (x_on_chip ? 0 : x_elements)) / kBytesPerSecond;
  const double flops = 2.0 * d.m * d.n * d.k * d.batch;
  return pass_seconds > flops * (1 / kInKernelFlopsPerSecond - 1 / kPartsFlopsPerSecond);
}

static_assert(WgmmaParts::kBlockM == WgmmaSplitKParts::kBlockM &&
                  WgmmaParts::kBlockN == WgmmaSplitKParts::kBlockN,
              "3xTF32's tiles are one shape, split or not");

// Whether the copy engine can read both operands (16-byte-aligned rows and
// batches, coordinates within 32 bits) as the kernel would arrange them.
template <class In>
bool WgmmaCanTake(const MatmulDims& d, const void* a, const void* b) {
  const WgmmaArrangement w = ArrangeWgmma(d, a, b, WgmmaSwapsAB(std::is_same_v<In, float>, d));
  return hopper::TmaCanTake(OperandA<In>(w.dims, w.a, WgmmaWide::kBlockM)) &&
         hopper::TmaCanTake(OperandB<In>(w.dims, w.b, WgmmaWide::kBlockN));
}

// Whether tiles of 128 x `width` leave no more than a third of the SMs idle.
inline bool WgmmaTilesFill(const MatmulDims& d, int width, int multiprocessors) {
  const int64_t tiles = d.batch * ((d.m + 127) / 128) * ((d.n + width - 1) / width);
  return 3 * tiles >= 2 * static_cast<int64_t>(multiprocessors);
}

// 128 x 256 tiles unless they would leave a third of the SMs idle.
inline bool WgmmaUsesWideTiles(const MatmulDims& d, int multiprocessors) {
  return WgmmaTilesFill(d, 256, multiprocessors);
}

// The waves a persistent grid of Cfg's clusters sharing B takes over its
// tiles: a grid's time is its waves', the last as long as a whole one
// however few its tiles.
template <class Cfg>
int64_t WgmmaWaves(const MatmulDims& d, int multiprocessors) {
  constexpr int64_t kRows = Cfg::kBlockM * Cfg::kClusterM;
  const int64_t tiles =
      d.batch * ((d.m + kRows - 1) / kRows) * ((d.n + Cfg::kBlockN - 1) / Cfg::kBlockN);
  const int64_t clusters = std::max(multiprocessors / Cfg::kClusterM, 1);
  return (tiles + clusters - 1) / clusters;
}

// Whether 128 x 192 tiles (WgmmaWide192) end sooner than 128 x 256 ones:
// fewer waves times the width, a wave's time in proportion to its tiles'
// width. Measured on the H100 (NOTES.md, "128 x 192 tiles by waves"): a
// 192-wide tile takes 0.79 of a 256-wide one's time, so the model holds where
// the 256-wide tiles' last wave is mostly empty (3072^3 21% faster); ties go
// to 256, which reads fewer operand bytes through L2 per unit of work.
inline bool WgmmaEndsSooner(const MatmulDims& d, int multiprocessors) {
  return WgmmaWide192::kBlockN * WgmmaWaves<WgmmaWide192>(d, multiprocessors) <
         WgmmaWide::kBlockN * WgmmaWaves<WgmmaWide>(d, multiprocessors);
}

// 128 x 64 tiles for outputs at most 64 columns wide, whole or with K split.
inline bool WgmmaOutputIsSkinny(const MatmulDims& d) { return d.n <= WgmmaSkinny::kBlockN; }

// How many clusters of `size` split-K blocks a GPU of `multiprocessors` SMs
// holds at once: at most its SMs / size, fewer where the size does not divide
// the SMs of its GPCs (a cluster's blocks share one).
using ClustersHeld = int (*)(int size, int multiprocessors);

// A split of each 128 x 128 tile's K: among a cluster of `parts` blocks, in
// each of `groups` clusters.
struct WgmmaSplit {
  int parts = 1, groups = 1;
  int Total() const { return parts * groups; }
};

// A split across clusters costs a second kernel and a round trip through
// scratch, measured on the H100 at about what a block's 16 slabs take
// (NOTES.md): it is taken where it spares each block at least twice that
// over the split within one cluster, and leaves each block 16 slabs or more.
inline constexpr int64_t kSlabsPerBlockAcrossClusters = 16;
inline constexpr int64_t kSlabsSparedAcrossClusters = 32;

// How to split each 128 x `block_n` tile's K (parts 1: none). Within one cluster:
// the parts double while every tile's cluster still fits the GPU at once (a
// second wave of clusters doubles the time), each part keeps at least two
// slabs of slab_depth, and the cluster stays within the portable 8 blocks.
// Across clusters, where K is deep enough (kSlabsPerBlockAcrossClusters,
// kSlabsSparedAcrossClusters): the split with the most blocks whose clusters
// all fit at once (ties: the larger clusters, whose partials meet in shared
// memory, not scratch).
inline WgmmaSplit WgmmaSplitFor(const MatmulDims& d, int block_n, int multiprocessors,
                                int slab_depth, ClustersHeld held) {
  const int64_t tiles = d.batch * ((d.m + 127) / 128) * ((d.n + block_n - 1) / block_n);
  const int64_t slabs = (d.k + slab_depth - 1) / slab_depth;
  WgmmaSplit within;
  while (2 * within.parts <= 8 && tiles <= held(2 * within.parts, multiprocessors) &&
         slabs >= 2 * 2 * within.parts)
    within.parts *= 2;
  WgmmaSplit across = within;
  for (int size = 8; size >= 2; size /= 2) {
    const int64_t groups = std::min<int64_t>(held(size, multiprocessors) / tiles,
                                             slabs / (kSlabsPerBlockAcrossClusters * size));
    if (groups >= 2 && size * groups > across.Total()) across = {size, static_cast<int>(groups)};
  }
  const int64_t spared = slabs / within.Total() - slabs / across.Total();
  return spared >= kSlabsSparedAcrossClusters ? across : within;
}

// Slabs a block of the wide split keeps at least: it halves each block's K
// against the narrow split of as many blocks, and its partial sums are twice
// the bytes to reduce. Measured on the H100 (NOTES.md, "K split on 128 x 256
// tiles"): 16 slabs a block (512x8192x512) 10% slower than the narrow split,
// 32 (1024x8192x1024) 5-7% faster.
inline constexpr int64_t kSlabsPerWideSplitBlock = 32;

// Whether 128 x 256 tiles split K (WgmmaSplitKWide) rather than 128 x 128
// ones: for 16-bit inputs into a 16-bit result, whose rounding hides the
// parts' one running sums (a float32 result would not: NOTES.md, the model's
// figures), where the wide tiles are fewer (N past 128 columns), their split
// runs as many blocks as the narrow one, and each block keeps
// kSlabsPerWideSplitBlock slabs or more: where K is deep, so that operand
// traffic, not the partial sums' reduction, is what the split's blocks wait
// on. Not where the narrow split already crosses clusters: there the wide
// one doubles the partial sums that the second kernel adds, and measured
// slower on the H100 (256x65536x256 by 10%, 256x40000x512 by 5%).
inline bool WgmmaSplitsWide(const MatmulDims& d, bool sixteen_bit_result, int multiprocessors,
                            int slab_depth, ClustersHeld held) {
  if (!sixteen_bit_result) return false;
  const WgmmaSplit wide = WgmmaSplitFor(d, 256, multiprocessors, slab_depth, held);
  const WgmmaSplit narrow = WgmmaSplitFor(d, 128, multiprocessors, slab_depth, held);
  const int64_t rows = d.batch * ((d.m + 127) / 128);
  const int64_t wide_tiles = rows * ((d.n + 255) / 256), narrow_tiles = rows * ((d.n + 127) / 128);
  const int64_t slabs = (d.k + slab_depth - 1) / slab_depth;
  return wide_tiles < narrow_tiles && wide.Total() > 1 && narrow.groups == 1 &&
         wide_tiles * wide.Total() >= narrow_tiles * narrow.Total() &&
         slabs / wide.Total() >= kSlabsPerWideSplitBlock;
}

// The pieces a configuration runs with: its scheduler and its epilogue.
template <class Cfg, class Ops>
using WgmmaScheduler =
    std::conditional_t<Cfg::kSplitK,
                       SplitKTileScheduler<Cfg::kBlockM, Cfg::kBlockN, WgmmaTiles<Cfg, Ops>::kSlab>,
                       PersistentTileScheduler<Cfg::kBlockM, Cfg::kBlockN, Cfg::kClusterM,
                                               WgmmaTiles<Cfg, Ops>::kSlab>>;
template <class Cfg, class Ops, class Out>
using WgmmaEpilogue = std::conditional_t<
    Cfg::kSplitK, ClusterReduceEpilogue<Cfg, Ops, Out>,
    std::conditional_t<Ops::kTransposedOut && sizeof(Out) == 2,
                       WgmmaRegisterEpilogue<Cfg, Ops, Out>, WgmmaTmaStoreEpilogue<Cfg, Ops, Out>>>;

// A kernel's shared memory: its stages and barriers, then its epilogue's
// (none more where the epilogue's lies over the stages).
template <class Cfg, class Ops, class Out>
inline constexpr int kWgmmaSharedBytes = [] {
  using Tiles = WgmmaTiles<Cfg, Ops>;
  using Epilogue = WgmmaEpilogue<Cfg, Ops, Out>;
  static_assert(
      !Epilogue::kOverStages || Epilogue::kSharedBytes <= Cfg::kStages * Tiles::kStageBytes,
      "an epilogue over the stages fits in them");
  if constexpr (Epilogue::kOverStages) return Tiles::kSharedBytes;
  else return Tiles::kSharedBytes + Tiles::kEpilogueAlignment + Epilogue::kSharedBytes;
}();

template <class Cfg, class Ops, class Out>
cudaError_t LaunchWgmmaKernel(const WgmmaArrangement& w, Out* out, const LaunchContext& context,
                              const LaunchPlan& plan) {
  using In = typename Ops::In;
  using Epilogue = WgmmaEpilogue<Cfg, Ops, Out>;
  using Tiles = WgmmaTiles<Cfg, Ops>;
  const MatmulDims& dims = w.dims;
  CUtensorMap a_map, b_map;
  if (!WgmmaScheduler<Cfg, Ops>::Fits(dims) ||
      !WgmmaStackFits(w.stacks.a, dims.a_batch_stride, dims.batch) ||
      !WgmmaStackFits(w.stacks.b, dims.b_batch_stride, dims.batch))
    return cudaErrorInvalidValue;
  // One TF32 pass reads B, and A from shared memory, as the copy engine
  // rounds them; 3xTF32's parts are TF32 values already, and an operand it
  // splits on chip must land whole. Each block of a cluster copies its part of B.
  constexpr bool kRoundA = Ops::kTf32 && !Ops::kSplit && !Ops::kAFromRegisters;
  constexpr bool kRoundB = Ops::kTf32 && !Ops::kSplit;
  if (cudaError_t err = hopper::EncodeOperand<In>(
          OperandA<In>(dims, w.a, Tiles::A::BoxRows(), w.stacks.a), &a_map, kRoundA))
    return err;
  constexpr int kBRows = Tiles::B::template BoxRows<Cfg::kClusterM>();
  if (cudaError_t err =
          hopper::EncodeOperand<In>(OperandB<In>(dims, w.b, kBRows, w.stacks.b), &b_map, kRoundB))
    return err;
  constexpr auto kernel = WgmmaMatmul<Cfg, Ops, WgmmaScheduler<Cfg, Ops>, Epilogue>;
  constexpr int kShared = kWgmmaSharedBytes<Cfg, Ops, Out>;
  static_assert(kShared <= 227 * 1024, "past a Hopper block's shared memory");
  if (cudaError_t err = AllowSharedMemory<kernel>(kShared)) return err;
  typename Epilogue::Params params = Epilogue::ParamsFor(dims, out);
  if (cudaError_t err = Epilogue::Prepare(params, dims, plan, context)) return err;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  const int cluster_size = Cfg::kSplitK ? plan.split_k : Cfg::kClusterM;
  cluster.val.clusterDim.x = static_cast<unsigned>(cluster_size);
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t launch{};
  launch.gridDim = dim3(static_cast<unsigned>(plan.Blocks(WgmmaScheduler<Cfg, Ops>::Units(dims))));
  launch.blockDim = dim3(Cfg::kThreads);
  launch.dynamicSmemBytes = kShared;
  launch.stream = context.stream;
  launch.attrs = &cluster;
  launch.numAttrs = cluster_size > 1 ? 1 : 0;
  if (cudaError_t err = cudaLaunchKernelEx(&launch, kernel, a_map, b_map, dims, w.stacks, params))
    return err;
  return Epilogue::FixUp(params, dims, plan, context);
}

template <class Cfg, class In, class Out>
cudaError_t LaunchWgmmaLayouts(const WgmmaArrangement& w, Out* out, const LaunchContext& context,
                               const LaunchPlan& plan) {
  // wgmma's transpose flags: A stored (k, m) and B stored (k, n) are MN-major.
  const bool a_mn = w.dims.transpose_a, b_mn = !w.dims.transpose_b;
  if constexpr (std::is_same_v<In, float>) {  // B is K-major: LaunchWgmmaFor rewrites it else
    if (w.transposed_out)                     // A = B^T of the caller's B stored (k, n): MN-major
      return LaunchWgmmaKernel<Cfg, WgmmaOperands<In, true, false, false, true>>(w, out, context,
                                                                                 plan);
    if (a_mn) return LaunchWgmmaKernel<Cfg, WgmmaOperands<In, true, false>>(w, out, context, plan);
    return LaunchWgmmaKernel<Cfg, WgmmaOperands<In, false, false>>(w, out, context, plan);
  } else {
    if (w.transposed_out) return cudaErrorInvalidValue;  // LaunchWgmmaFewRows's
    if (a_mn && b_mn)
      return LaunchWgmmaKernel<Cfg, WgmmaOperands<In, true, true>>(w, out, context, plan);
    if (a_mn) return LaunchWgmmaKernel<Cfg, WgmmaOperands<In, true, false>>(w, out, context, plan);
    if (b_mn) return LaunchWgmmaKernel<Cfg, WgmmaOperands<In, false, true>>(w, out, context, plan);
    return LaunchWgmmaKernel<Cfg, WgmmaOperands<In, false, false>>(w, out, context, plan);
  }
}

// 3xTF32: A and B split into their TF32 hi and lo parts (tf32_parts.cuh), in
// XLA's scratch, each a stack of two K-major parts (A's (m, k), B's (n, k),
// whatever the stored layouts), but for those the plan splits on chip
// (WgmmaSplitsOnChip), read as stored; then the kernel on them.
template <class Cfg, class Out>
cudaError_t LaunchWgmmaParts(const Product& p, Out* out, const LaunchContext& context,
                             const LaunchPlan& plan) {
  const MatmulDims& d = p.dims;
  const int64_t ld = Tf32PartsLd(d.k);
  MatmulDims arranged = d;
  const void* operands[2] = {p.a, p.b};
  WgmmaStacks stacks{p.a_stack, p.b_stack};
  // Operand 0 (A, rows m) or 1 (B, rows n) split ahead into scratch: the
  // kernel reads its parts K-major, a stack of two (the descriptor spans hi
  // and lo, OperandOf; no index to choose a slice, so the kernel starts at
  // hi and finds lo past it).
  auto split_ahead = [&](int operand) -> cudaError_t {
    const bool is_a = operand == 0;
    const Tf32PartsLayout layout{static_cast<const float*>(operands[operand]),
                                 is_a ? d.m : d.n,
                                 d.k,
                                 is_a ? d.lda : d.ldb,
                                 is_a ? d.a_batch_stride : d.b_batch_stride,
                                 (is_a ? d.a_batch_stride : d.b_batch_stride) ? d.batch : 1,
                                 is_a ? !d.transpose_a : d.transpose_b,
                                 ld};
    // 16 bytes: the most XLA's scratch allocator takes, and what the copy engine asks.
    void* const parts =
        context.scratch ? context.scratch->Allocate(2 * layout.PartElements() * sizeof(float), 16)
                        : nullptr;
    if (!parts) return cudaErrorMemoryAllocation;
    if (cudaError_t err =
            SplitIntoTf32Parts(layout, is_a ? p.a_stack : p.b_stack, parts, context.stream))
      return err;
    operands[operand] = parts;
    (is_a ? stacks.a : stacks.b) = StackSlice{nullptr, 2, layout.PartElements()};
    (is_a ? arranged.lda : arranged.ldb) = ld;
    if (is_a) {
      arranged.transpose_a = false;  // (m, k)
      arranged.a_batch_stride = d.a_batch_stride ? d.m * ld : 0;
    } else {
      arranged.transpose_b = true;  // (n, k)
      arranged.b_batch_stride = d.b_batch_stride ? d.n * ld : 0;
    }
    return cudaSuccess;
  };
  if (!plan.a_split_in_registers)
    if (cudaError_t err = split_ahead(0)) return err;
  if (!plan.b_split_on_chip)
    if (cudaError_t err = split_ahead(1)) return err;
  const WgmmaArrangement w{arranged, operands[0], operands[1], false, stacks};
  auto launch = [&](auto on_chip) {
    constexpr int kOnChip = decltype(on_chip)::value;
    return LaunchWgmmaKernel<Cfg, WgmmaOperands<float, false, false, true, false, kOnChip>>(
        w, out, context, plan);
  };
  if (plan.a_split_in_registers && plan.b_split_on_chip)
    return launch(std::integral_constant<int, kAInRegisters | kBOnChip>{});
  if (plan.a_split_in_registers) return launch(std::integral_constant<int, kAInRegisters>{});
  if (plan.b_split_on_chip) return launch(std::integral_constant<int, kBOnChip>{});
  return launch(std::integral_constant<int, kNoneOnChip>{});
}

// 16-bit inputs with a few rows swapped onto wgmma's N (WgmmaSwapsFewRows, a
// stored (m, k)): the swapped problem's B is a^T, K-major; its A is b,
// MN-major where b is stored (k, n).
template <class Cfg, class In, class Out>
cudaError_t LaunchWgmmaFewRows(const WgmmaArrangement& w, Out* out, const LaunchContext& context,
                               const LaunchPlan& plan) {
  if (w.dims.transpose_a)
    return LaunchWgmmaKernel<Cfg, WgmmaOperands<In, true, false, false, true>>(w, out, context,
                                                                               plan);
  return LaunchWgmmaKernel<Cfg, WgmmaOperands<In, false, false, false, true>>(w, out, context,
                                                                              plan);
}

// Its copy-engine boxes land either major-ness at one speed (NOTES.md,
// "Transposed operands read as stored").
inline constexpr Takes kWgmmaTakes = [] {
  Takes takes = TensorCoreTakes(90, /*hopper_only=*/true);
  takes.reads_transposes = true;
  takes.stack_slices = true;  // the descriptors span the stack (OperandOf, WgmmaProducer::Copy)
  return takes;
}();

// The plan for a product: for 3xTF32 split in the kernel (WgmmaSplitsInKernel),
// swapped, WgmmaSplitInKernel's configurations, else its operands' parts
// (WgmmaParts'), never swapped; for outputs 64 or fewer columns wide, 128 x
// 64 tiles, with K split where they would leave most SMs idle (as for one
// pass, below), else 128 x 128 tiles with K split across clusters where the
// tiles alone would leave most SMs idle. WgmmaRewritingB for one TF32 pass
// with both operands stored MN-major; else, for outputs 64 or fewer columns
// wide, 128 x 64 tiles, with K split where they would leave most SMs idle; else
// wide tiles in pairs sharing B where they fill the GPU (16-bit inputs: 128 x
// 192 where their waves end sooner, else 128 x 256), else 128 x 128
// tiles with K split where the tiles alone would leave most SMs idle, else
// 128 x 128 tiles. Swapped (C^T = B^T A^T, WgmmaSwapsAB) for TF32 with B
// stored MN-major and A not, and for 16-bit inputs with a few rows, whose
// swapped output is then 64 or fewer columns wide. Whole tiles run on a
// persistent grid of one block per SM (whole clusters), or per tile where
// there are fewer. Parts laid along K (Product::laid_terms) never take the
// 128 x 256 tiles; BF16_BF16_F32_X3's (laid_terms 3) into float32 take 128 x
// 128 tiles whose partial sums hold a chunk group (WgmmaLaidX3).
inline LaunchPlan PlanWgmma(const Product& p, int multiprocessors, ClustersHeld held) {
  const bool swap_ab =
      p.SplitsTf32() ? WgmmaSplitsInKernel(p.dims) : WgmmaSwapsAB(p.in_type == Dtype::kF32, p.dims);
  const MatmulDims arranged = ArrangeWgmma(p.dims, nullptr, nullptr, swap_ab).dims;
  auto plan = [&](auto cfg) {
    using Cfg = decltype(cfg);
    // Every block of a cluster holds an SM at once: the persistent grid is
    // whole clusters, no more than fit.
    // (The slab depth does not change the tiles: any operands will do.)
    using Scheduler = WgmmaScheduler<Cfg, WgmmaOperands<__half, false, false>>;
    const int64_t clusters =
        std::min<int64_t>(Scheduler::Units(arranged), multiprocessors / Cfg::kClusterM);
    return PlanOf<Cfg>(swap_ab, static_cast<int>(std::max<int64_t>(clusters, 1) * Cfg::kClusterM));
  };
  if (!p.SplitsTf32() && WgmmaTransposesB(p.in_type == Dtype::kF32, p.dims)) {
    LaunchPlan transposing = plan(WgmmaRewritingB{});
    transposing.transposes_b = true;
    return transposing;
  }
  // K per slab: one 128-byte swizzle row of the input type.
  const int slab_depth =
      p.in_type == Dtype::kF32 ? hopper::kSwizzleElements<float> : hopper::kSwizzleElements<__half>;
  auto split_k = [&](auto cfg) -> std::optional<LaunchPlan> {
    const WgmmaSplit split =
        WgmmaSplitFor(arranged, decltype(cfg)::kBlockN, multiprocessors, slab_depth, held);
    if (split.parts <= 1) return std::nullopt;
    LaunchPlan splitting = PlanOf<decltype(cfg)>(swap_ab, 0, split.parts);
    splitting.split_groups = split.groups;
    return splitting;
  };
  // For outputs 64 or fewer columns wide: 128 x 64 tiles, with K split
  // where they would leave most SMs idle.
  auto skinny_tiles = [&](auto skinny, auto split) {
    return WgmmaTilesFill(arranged, decltype(skinny)::kBlockN, multiprocessors)
               ? plan(skinny)
               : split_k(split).value_or(plan(skinny));
  };
  const bool skinny = WgmmaOutputIsSkinny(arranged);
  if (p.SplitsTf32() && swap_ab) {
    LaunchPlan in_kernel =
        skinny ? skinny_tiles(WgmmaSkinnySplitInKernel{}, WgmmaSplitKSkinnySplitInKernel{})
               : split_k(WgmmaSplitKSplitInKernel{}).value_or(plan(WgmmaSplitInKernel{}));
    in_kernel.tf32_split_in_kernel = true;
    return in_kernel;
  }
  if (p.SplitsTf32()) {
    LaunchPlan parts = skinny ? skinny_tiles(WgmmaSkinnyParts{}, WgmmaSplitKSkinnyParts{})
                              : split_k(WgmmaSplitKParts{}).value_or(plan(WgmmaParts{}));
    const int on_chip = WgmmaSplitsOnChip(p.dims);
    parts.tf32_parts = true;
    parts.a_split_in_registers = (on_chip & kAInRegisters) != 0;
    parts.b_split_on_chip = (on_chip & kBOnChip) != 0;
    return parts;
  }
  if (skinny) return skinny_tiles(WgmmaSkinny{}, WgmmaSplitKSkinny{});
  // Parts laid along K need blocked sums, for which 128 x 256 tiles have no
  // room: one running sum over K x terms there had up to 14x jnp's error
  // (NOTES.md, "BF16_BF16_F32_X3: chunk groups, not the wide tiles").
  const bool laid = p.laid_terms > 1;
  if (!laid && WgmmaUsesWideTiles(arranged, multiprocessors)) {
    if (p.in_type == Dtype::kF32) return plan(WgmmaWideTf32{});
    if (!WgmmaEndsSooner(arranged, multiprocessors)) return plan(WgmmaWide{});
    LaunchPlan narrower = plan(WgmmaWide192{});
    narrower.why_this_width =
        "192 wide where their waves over the SMs end before 128 x 256 tiles' (a persistent "
        "grid's last wave takes a whole one's time, however few its tiles)";
    return narrower;
  }
  const bool sixteen_bit_result =
      p.in_type != Dtype::kF32 && (DtypeBits(p.out_type) & kSixteenBit) != 0;
  if (!laid && WgmmaSplitsWide(arranged, sixteen_bit_result, multiprocessors, slab_depth, held))
    if (std::optional<LaunchPlan> wide = split_k(WgmmaSplitKWide{})) return *wide;
  if (p.in_type != Dtype::kF32 && p.out_type == Dtype::kF32 &&
      p.laid_terms == WgmmaNarrowLaidX3::kPartialSlabs)
    return split_k(WgmmaSplitKLaidX3{}).value_or(plan(WgmmaNarrowLaidX3{}));
  return split_k(WgmmaSplitK{}).value_or(plan(WgmmaNarrow{}));
}

// The descriptor's launcher for one input type (kernel.h,
// JAX_TILED_PER_INPUT_LAUNCHER).
template <class In>
cudaError_t LaunchWgmmaFor(const LaunchPlan& plan, const Product& p, void* out,
                           const LaunchContext& context) {
  constexpr bool kTf32 = std::is_same_v<In, float>;
  if (p.SplitsTf32() && WgmmaSplitsInKernel(p.dims)) {
    if (!plan.swap_ab || plan.transposes_b || plan.tf32_parts || !plan.tf32_split_in_kernel)
      return cudaErrorInvalidValue;
    if constexpr (kTf32) {
      // w, the kernel's A, is MN-major; x, its B, K-major (WgmmaSplitsInKernel).
      using Ops = WgmmaOperands<float, true, false, true, true, kAInRegisters | kBOnChip>;
      const WgmmaArrangement w =
          ArrangeWgmma(p.dims, p.a, p.b, true, WgmmaStacks{p.a_stack, p.b_stack});
      return VisitOutput<kWgmmaTakes>(p.out_type, [&](auto result) -> cudaError_t {
        using Out = decltype(result);
        return WithConfig<WgmmaSplitInKernel, WgmmaSplitKSplitInKernel, WgmmaSkinnySplitInKernel,
                          WgmmaSplitKSkinnySplitInKernel>(plan, [&](auto cfg) {
          return LaunchWgmmaKernel<decltype(cfg), Ops>(w, static_cast<Out*>(out), context, plan);
        });
      });
    }
  }
  if (p.SplitsTf32()) {
    const int on_chip = WgmmaSplitsOnChip(p.dims);
    if (!WgmmaLayoutFits(true, p.dims) || plan.swap_ab || plan.transposes_b ||
        plan.tf32_split_in_kernel ||
        plan.a_split_in_registers != ((on_chip & kAInRegisters) != 0) ||
        plan.b_split_on_chip != ((on_chip & kBOnChip) != 0))
      return cudaErrorInvalidValue;
    if constexpr (kTf32)
      return VisitOutput<kWgmmaTakes>(p.out_type, [&](auto result) -> cudaError_t {
        using Out = decltype(result);
        return WithConfig<WgmmaParts, WgmmaSplitKParts, WgmmaSkinnyParts, WgmmaSplitKSkinnyParts>(
            plan, [&](auto cfg) {
              return LaunchWgmmaParts<decltype(cfg), Out>(p, static_cast<Out*>(out), context, plan);
            });
      });
  }
  if (plan.swap_ab != WgmmaSwapsAB(kTf32, p.dims) ||
      plan.transposes_b != WgmmaTransposesB(kTf32, p.dims))
    return cudaErrorInvalidValue;
  const WgmmaArrangement w =
      ArrangeWgmma(p.dims, p.a, p.b, plan.swap_ab, WgmmaStacks{p.a_stack, p.b_stack});
  return VisitOutput<kWgmmaTakes>(p.out_type, [&](auto result) -> cudaError_t {
    using Out = decltype(result);
    Out* const c = static_cast<Out*>(out);
    if constexpr (kTf32) {
      if (plan.transposes_b)  // A and B both MN-major: the only such TF32 instance
        return WithConfig<WgmmaRewritingB>(plan, [&](auto cfg) {
          return LaunchWgmmaKernel<decltype(cfg), WgmmaOperands<In, true, true>>(w, c, context,
                                                                                 plan);
        });
    } else if (plan.swap_ab) {  // a few rows: always 64 wide (PlanWgmma)
      return WithConfig<WgmmaSkinny, WgmmaSplitKSkinny>(plan, [&](auto cfg) {
        return LaunchWgmmaFewRows<decltype(cfg), In, Out>(w, c, context, plan);
      });
    }
    using Wide = std::conditional_t<kTf32, WgmmaWideTf32, WgmmaWide>;
    auto launch = [&](auto cfg) {
      return LaunchWgmmaLayouts<decltype(cfg), In, Out>(w, c, context, plan);
    };
    // WgmmaSplitKWide only where PlanWgmma may choose it: 16-bit in and out;
    // WgmmaWide192 for 16-bit inputs only.
    if constexpr (!kTf32 && sizeof(Out) == 2)
      return WithConfig<Wide, WgmmaWide192, WgmmaNarrow, WgmmaSkinny, WgmmaSplitK,
                        WgmmaSplitKSkinny, WgmmaSplitKWide>(plan, launch);
    // The laid parts' chunk groups only where PlanWgmma may choose them: 16-bit into float32.
    else if constexpr (!kTf32 && std::is_same_v<Out, float>)
      return WithConfig<Wide, WgmmaWide192, WgmmaNarrow, WgmmaSkinny, WgmmaSplitK,
                        WgmmaSplitKSkinny, WgmmaNarrowLaidX3, WgmmaSplitKLaidX3>(plan, launch);
    else
      return WithConfig<Wide, WgmmaNarrow, WgmmaSkinny, WgmmaSplitK, WgmmaSplitKSkinny>(plan,
                                                                                        launch);
  });
}

}  // namespace jax_tiled::cuda
