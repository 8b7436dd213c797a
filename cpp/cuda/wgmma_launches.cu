// Rung 5's launchers for every tensor-core product (tensor_core_launches.h).
#include "cuda/kernels/wgmma_tma_warp_specialized.cuh"
#include "cuda/tensor_core_launches.h"

namespace jax_tiled::cuda {
#define JAX_TILED_INSTANTIATE(In, Out, split) \
  template JAX_TILED_LAUNCHER_SIGNATURE(LaunchWgmma, In, Out, split);
JAX_TILED_TENSOR_CORE_PRODUCTS(JAX_TILED_INSTANTIATE)
}  // namespace jax_tiled::cuda
