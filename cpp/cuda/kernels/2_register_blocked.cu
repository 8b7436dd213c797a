// Kernel 2's descriptor, "regblock".
#include "cuda/kernels/2_register_blocked.cuh"

#include "cuda/kernel.h"

namespace jax_tiled::cuda {
namespace {

cudaError_t Launch(const LaunchPlan&, const Product& p, void* out, const LaunchContext& context) {
  return VisitStorage<kTakesEveryFloat>(p, [&](auto in, auto result) {
    using In = decltype(in);
    using Out = decltype(result);
    return LaunchRegisterBlocked<In, Out, AccumulatorOf<In, Out>>(
        p.dims, static_cast<const In*>(p.a), static_cast<const In*>(p.b), static_cast<Out*>(out),
        context.stream);
  });
}

}  // namespace

extern const KernelDescriptor kRegisterBlocked{
    names::kRegblock,
    true,
    kTakesEveryFloat,
    nullptr,
    FixedPlan<RegisterBlocked::kBlock, RegisterBlocked::kBlock>,
    Launch};

}  // namespace jax_tiled::cuda
