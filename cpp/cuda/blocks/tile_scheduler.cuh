// Tile schedulers: which output tile, and which of its slabs of K, each block
// of a persistent grid computes next. A kernel's producer and consumers each
// walk their own copy of the block's scheduler, so they agree on the order
// without talking; a scheduler is one struct with Next(), and a new order (a
// split of K, stream-K) is a new struct, not an edit of the kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/blocks/common.cuh"
#include "cuda/blocks/hopper.cuh"

namespace jax_tiled::cuda {

// A block's share of the product: the kBlockM x kBlockN output tile at (row0,
// col0) of matrix `batch`, slabs [slab_begin, slab_end) of its K. 32-bit: the
// copy engine's coordinates are, and a unit stays live in the consumers'
// registers beside their accumulators.
struct WorkUnit {
  int batch, row0, col0;
  int slab_begin, slab_end;
};

// Whole tiles, data-parallel, in TileOrder: block b of the grid takes tiles
// b, b + grid, b + 2 grid, ... With clusters of kClusterM blocks (consecutive
// in the grid), a cluster takes a kClusterM kBlockM x kBlockN tile and the
// block of rank r its r-th kBlockM rows, so the blocks of a cluster share
// their B tiles (the copy engine's multicast reads each once for all).
// Its one register is the next tile; the rest is derived from the kernel's
// parameters (dims), which cost none. Tiles are counted in 32 bits, as the
// copy engine's coordinates are (Fits: the launcher refuses more).
template <int kBlockM, int kBlockN, int kClusterM, int kSlabDepth>
struct PersistentTileScheduler {
  using Order = TileOrder<kBlockM * kClusterM, kBlockN, int>;
  static constexpr bool kOneUnitABlock = false;
  int next;

  __device__ __forceinline__ PersistentTileScheduler() : next(blockIdx.x / kClusterM) {}

  // This block's rank among the blocks sharing its B tiles.
  __device__ __forceinline__ static int Rank() { return blockIdx.x % kClusterM; }

  // The next unit, or false once the block's share is done.
  __device__ __forceinline__ bool Next(const MatmulDims& dims, WorkUnit& unit) {
    const Order order(dims);
    if (next >= order.count) return false;
    int batch, row0, col0;
    order.Locate(next, batch, row0, col0);
    unit = {batch, row0 + Rank() * kBlockM, col0, 0,
            static_cast<int>((dims.k + kSlabDepth - 1) / kSlabDepth)};
    next += gridDim.x / kClusterM;
    return true;
  }

  // The tiles (clusters of tiles) the grid walks.
  static int64_t Units(const MatmulDims& dims) {
    return TileOrder<kBlockM * kClusterM, kBlockN>(dims).count;
  }
  // Whether they can be counted in 32 bits, with room for `next` to step
  // past the last: any product whose output fits a GPU's memory, a tile
  // holding at least one of its elements.
  static bool Fits(const MatmulDims& dims) { return Units(dims) <= int64_t{INT32_MAX} / 2; }
};

// Split K: each output tile is split among `groups` clusters (consecutive in
// the grid), each over its own run of the tile's slabs, and the block of rank
// r of a cluster takes the r-th of its cluster's near-equal runs, so tiles too
// few to fill the SMs still keep every SM's tensor cores busy. One unit per
// block, no persistence: the epilogue adds the cluster's partial sums through
// distributed shared memory in rank order, and where there are several
// clusters a tile, writes them to scratch for a second kernel to add cluster
// by cluster (ClusterReduceEpilogue), so a result is the same run to run, with
// no float atomics. The split is the cluster's size (a launch attribute) times
// the clusters a tile (the grid's size over the clusters' tiles), so one
// kernel serves every split. Each block keeps B to itself: Rank() is 0 among
// blocks sharing B.
template <int kBlockM, int kBlockN, int kSlabDepth>
struct SplitKTileScheduler {
  using Order = TileOrder<kBlockM, kBlockN>;
  static constexpr bool kOneUnitABlock = true;  // an epilogue may reuse the stages
  bool taken = false;

  __device__ __forceinline__ static int Rank() { return 0; }

  // The clusters that split each tile.
  __device__ __forceinline__ static int Groups(const MatmulDims& dims) {
    return static_cast<int>(gridDim.x / (hopper::ClusterSize() * Order(dims).count));
  }

  __device__ __forceinline__ bool Next(const MatmulDims& dims, WorkUnit& unit) {
    if (taken) return false;
    taken = true;
    const int size = hopper::ClusterSize(), groups = Groups(dims);
    const int64_t cluster = hopper::ClusterIndex(), parts = int64_t{size} * groups;
    const int64_t part = cluster % groups * size + hopper::ClusterRank();
    const int64_t slabs = (dims.k + kSlabDepth - 1) / kSlabDepth;
    int64_t batch, row0, col0;
    Order(dims).Locate(cluster / groups, batch, row0, col0);
    unit = {static_cast<int>(batch), static_cast<int>(row0), static_cast<int>(col0),
            static_cast<int>(slabs * part / parts), static_cast<int>(slabs * (part + 1) / parts)};
    return true;
  }

  // The tiles; the grid has `groups` clusters of blocks for each.
  static int64_t Units(const MatmulDims& dims) { return Order(dims).count; }
  static bool Fits(const MatmulDims&) { return true; }  // counted in 64 bits
};

}  // namespace jax_tiled::cuda
