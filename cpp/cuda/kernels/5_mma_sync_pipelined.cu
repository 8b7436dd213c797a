// Kernel 5's descriptor, "mma".
#include "cuda/kernels/5_mma_sync_pipelined.cuh"

#include "cuda/kernel.h"

namespace jax_tiled::cuda {

JAX_TILED_EXTERN_PER_INPUT(LaunchMmaFor)

namespace {

// The block shapes depend neither on the input type nor on 3xTF32.
LaunchPlan Plan(const Product& p, const DeviceFacts& device) {
  if (MmaUsesLargeBlocks(p.dims, device.multiprocessors)) return PlanOf<MmaLarge<float>>();
  if (MmaUsesTinyBlocks(p.dims, device.multiprocessors)) return PlanOf<MmaTiny<float>>();
  return PlanOf<MmaSmall<float>>();
}

cudaError_t Launch(const LaunchPlan& plan, const Product& p, void* out,
                   const LaunchContext& context) {
  return VisitInput<kMmaTakes>(
      p.in_type, [&](auto in) { return LaunchMmaFor<decltype(in)>(plan, p, out, context); });
}

}  // namespace

extern const KernelDescriptor kMmaSyncPipelined{names::kMma, true, kMmaTakes,
                                                nullptr,     Plan, Launch};

}  // namespace jax_tiled::cuda
