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
  if (!WgmmaLayoutFits(p.SplitsTf32(), d))
    return "kernel 'wgmma' does not run 3xTF32 (precision HIGH) with a stored (k, m) and b "
           "stored (k, n) (transpose_a=True, transpose_b=False): TF32 wgmma reads B K-major "
           "only, and B would need rewriting both K-major and into hi and lo parts "
           "(kernel='auto' on a Hopper GPU takes b through XLA's transpose first and runs "
           "the product on 'wgmma')";
  // bfloat16 rows are the same bytes as float16 ones.
  if (!(tf32 ? WgmmaCanTake<float>(d, p.a, p.b) : WgmmaCanTake<__half>(d, p.a, p.b)))
    return "kernel 'wgmma' reads operands with the TMA copy engine, which needs every row and "
           "batch of each stored operand to start at a multiple of 16 bytes; here a's rows are " +
           std::to_string(d.lda) + " and b's " + std::to_string(d.ldb) +
           " elements long (kernel='auto' runs such problems on 'mma')";
  return std::nullopt;
}

// Does nothing and is never launched: the occupancy calculator's stand-in
// for the split-K kernel, whose shared memory (every instance's the same)
// holds it to one block an SM.
__global__ void __launch_bounds__(WgmmaSplitK::kThreads, 1) SplitKStandIn() {}

constexpr int kSplitKSharedBytes =
    kWgmmaSharedBytes<WgmmaSplitK, WgmmaOperands<__half, false, false>, __half>;
static_assert(kSplitKSharedBytes ==
                  kWgmmaSharedBytes<WgmmaSplitK, WgmmaOperands<float, false, false>, float>,
              "16-bit and TF32 split-K kernels take the same shared memory");
// 3xTF32's split-K kernel and the skinny one take other shared memory, but
// they too hold an SM alone, so they fit the same clusters.
static_assert(
    2 * kSplitKSharedBytes > 228 * 1024 &&
        2 * kWgmmaSharedBytes<WgmmaSplitKParts, WgmmaOperands<float, false, false, true>, float> >
            228 * 1024 &&
        2 * kWgmmaSharedBytes<WgmmaSplitKSkinnyParts, WgmmaOperands<float, false, false, true>,
                              float> >
            228 * 1024 &&
        // ... and with A read once, split in registers: one A tile a stage, not two.
        2 * kWgmmaSharedBytes<WgmmaSplitKParts,
                              WgmmaOperands<float, false, false, true, false, kAInRegisters>,
                              float> >
            228 * 1024 &&
        2 * kWgmmaSharedBytes<WgmmaSplitKSkinnyParts,
                              WgmmaOperands<float, false, false, true, false, kAInRegisters>,
                              float> >
            228 * 1024 &&
        2 * kWgmmaSharedBytes<
                WgmmaSplitKSplitInKernel,
                WgmmaOperands<float, true, false, true, true, kAInRegisters | kBOnChip>, float> >
            228 * 1024 &&
        2 * kWgmmaSharedBytes<
                WgmmaSplitKSkinnySplitInKernel,
                WgmmaOperands<float, true, false, true, true, kAInRegisters | kBOnChip>, float> >
            228 * 1024 &&
        2 * kWgmmaSharedBytes<WgmmaSplitKSkinny, WgmmaOperands<__half, false, false>, __half> >
            228 * 1024,
    "a split-K block holds an SM alone");

// Clusters of `size` (2, 4 or 8) split-K blocks the current GPU holds at
// once, asked of the driver once per device; where it cannot say (explain
// without a GPU), multiprocessors / size.
int SplitKClustersHeld(int size, int multiprocessors) {
  struct Held {
    int of[4];  // by log2 of the size; of[0] unused
  };
  static PerDevice<Held> held;
  Held found;
  const cudaError_t err = held.Get(&found, [](Held* h) {
    if (cudaError_t e = AllowSharedMemory<SplitKStandIn>(kSplitKSharedBytes)) return e;
    for (int i = 1; i < 4; ++i) {
      cudaLaunchAttribute cluster;
      cluster.id = cudaLaunchAttributeClusterDimension;
      cluster.val.clusterDim.x = 1u << i;
      cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
      cudaLaunchConfig_t launch{};
      launch.gridDim = dim3(1u << i);
      launch.blockDim = dim3(WgmmaSplitK::kThreads);
      launch.dynamicSmemBytes = kSplitKSharedBytes;
      launch.attrs = &cluster;
      launch.numAttrs = 1;
      if (cudaError_t e = cudaOccupancyMaxActiveClusters(&h->of[i], SplitKStandIn, &launch))
        return e;
    }
    return cudaSuccess;
  });
  if (err != cudaSuccess) {
    cudaGetLastError();  // a GPU the driver cannot ask is no error of the caller's
    return multiprocessors / size;
  }
  return found.of[size == 2 ? 1 : size == 4 ? 2 : 3];
}

LaunchPlan Plan(const Product& p, const DeviceFacts& device) {
  LaunchPlan plan = PlanWgmma(p, device.multiprocessors, SplitKClustersHeld);
  plan.reads_whole_lines = true;
  return plan;
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
