// Kernel 6's descriptor, "wgmma".
#include "cuda/kernels/6_wgmma_tma_warp_specialized.cuh"

#include <string>

#include "cuda/kernel.h"

namespace jax_tiled::cuda {

JAX_TILED_EXTERN_PER_INPUT(LaunchWgmmaFor)

namespace {

std::optional<std::string> RefusesLayout(const Product& p) {
  const bool tf32 = p.in_type == Dtype::kF32;
  const MatmulDims& d = p.dims;
  if (!WgmmaLayoutFits(tf32, d))
    return "kernel 'wgmma' reads float32 as TF32, whose shared-memory operands must be K-major "
           "(one may come through registers instead); with a stored (k, m) and b stored (k, n) "
           "(transpose_a=True, transpose_b=False) both are MN-major (kernel='auto' runs such "
           "problems on 'mma')";
  // bfloat16 rows are the same bytes as float16 ones.
  if (!(tf32 ? WgmmaCanTake<float>(d, p.a, p.b) : WgmmaCanTake<__half>(d, p.a, p.b)))
    return "kernel 'wgmma' reads operands with the TMA copy engine, which needs every row and "
           "batch of each stored operand to start at a multiple of 16 bytes; here a's rows are " +
           std::to_string(d.lda) + " and b's " + std::to_string(d.ldb) +
           " elements long (kernel='auto' runs such problems on 'mma')";
  return std::nullopt;
}

LaunchPlan Plan(const Product& p, const DeviceFacts& device) {
  return PlanWgmma(p, device.multiprocessors);
}

cudaError_t Launch(const LaunchPlan& plan, const Product& p, void* out,
                   const LaunchContext& context) {
  return VisitInput<kWgmmaTakes>(
      p.in_type, [&](auto in) { return LaunchWgmmaFor<decltype(in)>(plan, p, out, context); });
}

}  // namespace

extern const KernelDescriptor kWgmmaTmaWarpSpecialized{names::kWgmma, true, kWgmmaTakes,
                                                       RefusesLayout, Plan, Launch};

}  // namespace jax_tiled::cuda
