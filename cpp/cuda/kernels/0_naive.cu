// Kernel 0's descriptor, "naive". Listed, so that kernels() offers it and the
// test suites run it like every other kernel; auto never picks it (auto.cu
// names the kernels it chooses).
#include "cuda/kernels/0_naive.cuh"

#include "cuda/kernel.h"

namespace jax_tiled::cuda {
namespace {

// A 1 x 1 tile: each output's reads are its own (2 K elements), which is what
// the benchmark's bytes-per-output column reads from block_m and block_n.
LaunchPlan Plan(const Product&, const DeviceFacts&) {
  static_assert(kNaiveBlock == 16, "the plan's words name the block");
  LaunchPlan plan{1, 1};
  plan.instead_of_tiles =
      "one thread per output element in 16 x 16 thread blocks, A and B read from global memory";
  return plan;
}

cudaError_t Launch(const LaunchPlan&, const Product& p, void* out, const LaunchContext& context) {
  return VisitStorage<kTakesEveryFloat>(p, [&](auto in, auto result) {
    using In = decltype(in);
    using Out = decltype(result);
    return LaunchNaive<In, Out, AccumulatorOf<In, Out>>(p.dims, static_cast<const In*>(p.a),
                                                        static_cast<const In*>(p.b),
                                                        static_cast<Out*>(out), context.stream);
  });
}

}  // namespace

extern const KernelDescriptor kNaiveGlobal{names::kNaive, true, kTakesEveryFloat,
                                           nullptr,       Plan, Launch};

}  // namespace jax_tiled::cuda
