// Kernel 3's descriptor, "warptile".
#include "cuda/kernels/3_simt_warptiled.cuh"

#include "cuda/kernel.h"

namespace jax_tiled::cuda {
namespace {

cudaError_t Launch(const LaunchPlan& plan, const Product& p, void* out,
                   const LaunchContext& context) {
  return VisitStorage<kTakesEveryFloat>(p, [&](auto in, auto result) {
    using In = decltype(in);
    using Out = decltype(result);
    using Acc = AccumulatorOf<In, Out>;
    constexpr bool kFloat32 = std::is_same_v<In, float> && std::is_same_v<Out, float>;
    return WithConfig<WarpTileLarge, WarpTileWide, WarpTileSmall, WarpTileThin, WarpTileRow>(
        plan, [&](auto cfg) {
          using Cfg = decltype(cfg);
          if constexpr (std::is_same_v<Cfg, WarpTileRow>)
            return LaunchRowProduct<In, Out>(plan, p.dims, static_cast<const In*>(p.a),
                                             static_cast<const In*>(p.b), static_cast<Out*>(out),
                                             context);
          // Not compiled where the planner never runs it.
          else if constexpr (!Cfg::template kFits<Acc> || (Cfg::kFloat32Only && !kFloat32))
            return cudaErrorInvalidValue;
          else
            return LaunchWarpTiledWith<Cfg, In, Out, Acc>(plan, p.dims, static_cast<const In*>(p.a),
                                                          static_cast<const In*>(p.b),
                                                          static_cast<Out*>(out), context);
        });
  });
}

}  // namespace

extern const KernelDescriptor kSimtWarpTiled{names::kWarptile, true,         kTakesEveryFloat,
                                             nullptr,          WarpTilePlan, Launch};

}  // namespace jax_tiled::cuda
