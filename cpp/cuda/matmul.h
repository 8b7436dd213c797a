// The CUDA FFI handler and the kernel names it accepts.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_tiled::cuda {
// Comma-separated, in the order jax_tiled.kernels("cuda") lists them.
inline constexpr const char* kKernelNames = "smem,smem16,regblock,warptile";
}  // namespace jax_tiled::cuda

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTiledMatmulCuda);
