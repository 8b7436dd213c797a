// Kernel 1's descriptors: "smem" with 32 x 32 tiles, "smem16" with 16 x 16
// ones (four times the blocks, for problems too small to fill the GPU with
// 32 x 32 tiles), and the test suite's planted race.
#include "cuda/kernels/1_smem_tiled.cuh"

#include "cuda/kernel.h"

namespace jax_tiled::cuda {
namespace {

template <int kTile, bool kSkipSecondSync = false>
cudaError_t LaunchSmem(const LaunchPlan&, const Product& p, void* out,
                       const LaunchContext& context) {
  return VisitStorage<kTakesEveryFloat>(p, [&](auto in, auto result) {
    using In = decltype(in);
    using Out = decltype(result);
    return LaunchSmemTiled<kTile, In, Out, AccumulatorOf<In, Out>, kSkipSecondSync>(
        p.dims, static_cast<const In*>(p.a), static_cast<const In*>(p.b), static_cast<Out*>(out),
        context.stream);
  });
}

}  // namespace

extern const KernelDescriptor kSmemTiled{
    names::kSmem, true, kTakesEveryFloat, nullptr, FixedPlan<32, 32>, LaunchSmem<32>};
extern const KernelDescriptor kSmemTiled16{
    names::kSmem16, true, kTakesEveryFloat, nullptr, FixedPlan<16, 16>, LaunchSmem<16>};
// "smem" without its second barrier: a known data race that the
// compute-sanitizer racecheck test runs to prove the tool would catch one. Its
// results are not to be trusted, so kernels() never offers it and auto never
// picks it.
extern const KernelDescriptor kSmemTiledRacy{
    names::kSmemRacy,  false,
    kTakesEveryFloat,  nullptr,
    FixedPlan<32, 32>, LaunchSmem<32, /*kSkipSecondSync=*/true>};

}  // namespace jax_tiled::cuda
