// The CPU FFI handler and the kernel names it accepts.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_tiled::cpu {
// Comma-separated, in the order jax_tiled.kernels("cpu") lists them.
inline constexpr const char* kKernelNames = "blocked";
}  // namespace jax_tiled::cpu

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTiledMatmulCpu);
