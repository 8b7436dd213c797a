// Kernel 1's descriptors: "smem", whose tile width is chosen at run time from
// the device and the output (PlanRuntimeWidth), "smem16" with 16 x 16 tiles
// (auto's choice for float64 and for problems too small to fill the GPU with
// wide tiles), and the test suite's planted race.
#include "cuda/kernels/1_smem_tiled.cuh"

#include <cstddef>
#include <cstdint>
#include <iterator>

#include "cuda/kernel.h"

namespace jax_tiled::cuda {
namespace {

// "smem"'s width, the one rule: the widest of kSmemWidths whose block (width^2
// threads) and two tiles fit the device's per-block limits; then narrower
// while the output has fewer tiles than the GPU has SMs, so that each SM gets
// a block where narrower tiles can give it one (down to the narrowest). Where
// no width fits, the narrowest, which the launcher refuses. Describe says
// which of these decided (LaunchPlan::runtime_width).
LaunchPlan PlanRuntimeWidth(const Product& p, const DeviceFacts& device) {
  int acc_bytes = sizeof(float);  // the tiles hold the product's accumulator
  VisitStorage<kTakesEveryFloat>(p, [&](auto in, auto out) {
    acc_bytes = sizeof(AccumulatorOf<decltype(in), decltype(out)>);
    return cudaSuccess;
  });
  const auto tiles = [&](int width) {
    return p.dims.batch * ((p.dims.m + width - 1) / width) * ((p.dims.n + width - 1) / width);
  };
  RuntimeWidth why;
  why.shared_bytes_per_block = device.shared_bytes_per_block;
  why.max_threads_per_block = device.max_threads_per_block;
  why.multiprocessors = device.multiprocessors;
  size_t chosen = std::size(kSmemWidths) - 1;
  for (size_t i = 0; i < std::size(kSmemWidths); ++i)
    if (SmemWidthFits(kSmemWidths[i], acc_bytes, device.shared_bytes_per_block,
                      device.max_threads_per_block)) {
      why.widest = kSmemWidths[chosen = i];
      why.widest_tile_bytes = SmemTileBytes(why.widest, acc_bytes);
      why.widest_tiles = tiles(why.widest);
      break;
    }
  while (why.widest && chosen + 1 < std::size(kSmemWidths) &&
         tiles(kSmemWidths[chosen]) < device.multiprocessors)
    ++chosen;
  const int width = kSmemWidths[chosen];
  why.tiles = tiles(width);
  LaunchPlan plan{width, width};
  plan.runtime_width = why;
  return plan;
}

// kTile 0: the plan's width (PlanRuntimeWidth); else kTile.
template <int kTile, bool kSkipSecondSync = false>
cudaError_t LaunchSmem(const LaunchPlan& plan, const Product& p, void* out,
                       const LaunchContext& context) {
  return VisitStorage<kTakesEveryFloat>(p, [&](auto in, auto result) {
    using In = decltype(in);
    using Out = decltype(result);
    return LaunchSmemTiled<kTile, In, Out, AccumulatorOf<In, Out>, kSkipSecondSync>(
        plan, p.dims, static_cast<const In*>(p.a), static_cast<const In*>(p.b),
        static_cast<Out*>(out), context.stream);
  });
}

}  // namespace

extern const KernelDescriptor kSmemTiled{names::kSmem,     true,         kTakesEveryFloat, nullptr,
                                         PlanRuntimeWidth, LaunchSmem<0>};
extern const KernelDescriptor kSmemTiled16{
    names::kSmem16, true, kTakesEveryFloat, nullptr, FixedPlan<16, 16>, LaunchSmem<16>};
// "smem" at a fixed 32 x 32 without its second barrier: a known data race that
// the compute-sanitizer racecheck test runs to prove the tool would catch one.
// Its results are not to be trusted, so kernels() never offers it and auto
// never picks it.
extern const KernelDescriptor kSmemTiledRacy{
    names::kSmemRacy,  false,
    kTakesEveryFloat,  nullptr,
    FixedPlan<32, 32>, LaunchSmem<32, /*kSkipSecondSync=*/true>};

}  // namespace jax_tiled::cuda
