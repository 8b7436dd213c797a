// Kernel 3's descriptor, "warptile".
#include "cuda/kernels/3_simt_warptiled.cuh"

#include "cuda/kernel.h"

namespace jax_tiled::cuda {
namespace {

LaunchPlan Plan(const Product& p, const DeviceFacts& device) {
  return SimtPlan<WarpTileLarge, WarpTileSmall>(p, device);
}

cudaError_t Launch(const LaunchPlan& plan, const Product& p, void* out,
                   const LaunchContext& context) {
  return VisitStorage<kTakesEveryFloat>(p, [&](auto in, auto result) {
    using In = decltype(in);
    using Out = decltype(result);
    return WithConfig<WarpTileLarge, WarpTileSmall>(plan, [&](auto cfg) {
      return LaunchWarpTiledWith<decltype(cfg), In, Out, AccumulatorOf<In, Out>>(
          plan, p.dims, static_cast<const In*>(p.a), static_cast<const In*>(p.b),
          static_cast<Out*>(out), context);
    });
  });
}

}  // namespace

extern const KernelDescriptor kSimtWarpTiled{names::kWarptile, true, kTakesEveryFloat,
                                             nullptr,          Plan, Launch};

}  // namespace jax_tiled::cuda
