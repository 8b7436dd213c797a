// Rung 4's launchers for every tensor-core product (tensor_core_launches.h).
#include "cuda/kernels/mma_sync_pipelined.cuh"
#include "cuda/tensor_core_launches.h"

namespace jax_tiled::cuda {
#define JAX_TILED_INSTANTIATE(In, Out, split) \
  template JAX_TILED_LAUNCHER_SIGNATURE(LaunchMmaSync, In, Out, split);
JAX_TILED_TENSOR_CORE_PRODUCTS(JAX_TILED_INSTANTIATE)
}  // namespace jax_tiled::cuda
