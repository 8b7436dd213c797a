// Kernel 4's descriptor, "pipelined".
#include "cuda/kernels/4_simt_cp_async_pipelined.cuh"

#include "cuda/kernel.h"

namespace jax_tiled::cuda {
namespace {

// cp.async copies float32 as it is, into a float32 accumulator.
constexpr Takes kTakes{
    kF32, kSixteenBit | kF32, true, 80, false, "its cp.async copies cannot convert"};

// The same block shapes and parts of K as warptile, for the same reasons.
LaunchPlan Plan(const Product& p, const DeviceFacts& device) {
  return SimtPlan<PipelinedLarge, PipelinedSmall>(p, device);
}

cudaError_t Launch(const LaunchPlan& plan, const Product& p, void* out,
                   const LaunchContext& context) {
  return VisitOutput<kTakes>(p.out_type, [&](auto result) {
    using Out = decltype(result);
    return WithConfig<PipelinedLarge, PipelinedSmall>(plan, [&](auto cfg) {
      return LaunchPipelinedWith<decltype(cfg), Out>(plan, p.dims, static_cast<const float*>(p.a),
                                                     static_cast<const float*>(p.b),
                                                     static_cast<Out*>(out), context);
    });
  });
}

}  // namespace

extern const KernelDescriptor kSimtCpAsyncPipelined{names::kPipelined, true, kTakes,
                                                    nullptr,           Plan, Launch};

}  // namespace jax_tiled::cuda
