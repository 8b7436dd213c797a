// The CUDA FFI handler and the kernel names it accepts.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jax_tiled::cuda {
// Comma-separated, in the order jax_tiled.kernels("cuda") lists them.
inline constexpr const char* kKernelNames = "smem,smem16,regblock,warptile,pipelined";

// "<rung>: <why>" for what kernel="auto" runs on a (batch, m, n, k) problem
// from `dtype` inputs to an `out_dtype` result (numpy's names) on a GPU with
// that many SMs.
std::string ExplainAuto(std::string_view dtype, std::string_view out_dtype, int64_t batch,
                        int64_t m, int64_t n, int64_t k, int multiprocessors);

// Why rung `kernel` cannot run a `dtype` -> `out_dtype` product, or "" if it
// can. Some rungs are built for one input dtype: their copies or instructions
// do not convert.
std::string KernelDtypeMismatch(std::string_view kernel, std::string_view dtype,
                                std::string_view out_dtype);
}  // namespace jax_tiled::cuda

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTiledMatmulCuda);
