// The CPU FFI handler and the one kernel it runs.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_tiled::cpu {
// The CPU kernel: every supported dtype, true fp32 at every precision.
inline constexpr const char* kKernelName = "blocked";
}  // namespace jax_tiled::cpu

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTiledMatmulCpu);
