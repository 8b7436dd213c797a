// The tensor-core rungs' launchers are compiled in their own translation
// units (mma_launches.cu, wgmma_launches.cu), in parallel with the handler's;
// the handler sees them through these explicit-instantiation declarations.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// X(In, Out, split_tf32) for every product the tensor-core rungs compute:
// 16-bit inputs, and float32 inputs as TF32 in one pass or three.
#define JAX_TILED_TENSOR_CORE_PRODUCTS(X)                                            \
  X(__half, __half, false) X(__half, __nv_bfloat16, false) X(__half, float, false)   \
  X(__nv_bfloat16, __half, false) X(__nv_bfloat16, __nv_bfloat16, false)             \
  X(__nv_bfloat16, float, false)                                                     \
  X(float, __half, false) X(float, __nv_bfloat16, false) X(float, float, false)      \
  X(float, __half, true) X(float, __nv_bfloat16, true) X(float, float, true)

#define JAX_TILED_LAUNCHER_SIGNATURE(launcher, In, Out, split)                              \
  cudaError_t launcher<In, Out, split>(const MatmulDims&, const In*, const In*, Out*, \
                                       cudaStream_t, int)
