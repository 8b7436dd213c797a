// The CUDA FFI handler and the kernel names it accepts.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jax_tiled::cuda {
// Comma-separated, in the order jax_tiled.kernels("cuda") lists them.
inline constexpr const char* kKernelNames = "smem,smem16,regblock,warptile,pipelined,mma,wgmma";

// A problem as the lowering sees it, before buffers exist: contiguous
// operands a (batch_a, m, k) or (batch_a, k, m) when transposed, b (batch_b,
// k, n) or (batch_b, n, k); a batch of 1 broadcasts.
struct ProblemShape {
  int64_t batch_a, batch_b, m, n, k;
  bool transpose_a, transpose_b;
};

// "<rung>: <why>" for what kernel="auto" runs on this problem from `dtype`
// inputs to an `out_dtype` result (numpy's names) at `precision` (the FFI
// attribute's code) on a GPU with that many SMs and compute capability
// (major * 10 + minor).
std::string ExplainAuto(std::string_view dtype, std::string_view out_dtype,
                        const ProblemShape& shape, int precision, int multiprocessors,
                        int compute_capability);

// Why rung `kernel` cannot run this problem, or "" if it can: some rungs are
// built for some dtypes only (their copies or instructions do not convert),
// the tensor-core rungs cannot give float32 the true fp32 arithmetic that
// precision HIGHEST asks for, and the Hopper rung needs operands its copy
// engine can read.
std::string KernelRefusal(std::string_view kernel, std::string_view dtype,
                          std::string_view out_dtype, const ProblemShape& shape, int precision,
                          int compute_capability);
}  // namespace jax_tiled::cuda

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTiledMatmulCuda);
