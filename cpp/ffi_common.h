// What the CPU and CUDA handlers share beyond MatmulProblem (problem.h).
#pragma once

#include <string>
#include <string_view>

#include "problem.h"

namespace jax_tiled {

inline ffi::Error UnknownKernel(std::string_view platform, std::string_view kernel,
                                std::string_view available) {
  return ffi::Error::InvalidArgument("tiled_matmul: unknown " + std::string(platform) +
                                     " kernel '" + std::string(kernel) +
                                     "'; available: " + std::string(available));
}

}  // namespace jax_tiled
