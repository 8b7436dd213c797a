// Helpers shared by the CPU and CUDA handlers: dtype dispatch and kernel names.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>

#include "problem.h"

namespace jax_tiled {

template <ffi::DataType T>
using DTypeTag = std::integral_constant<ffi::DataType, T>;

// Calls f(DTypeTag<t>{}) for one of the four supported float types.
template <class F>
ffi::Error VisitFloatType(ffi::DataType t, F&& f) {
  switch (t) {
    case ffi::DataType::F16: return f(DTypeTag<ffi::DataType::F16>{});
    case ffi::DataType::BF16: return f(DTypeTag<ffi::DataType::BF16>{});
    case ffi::DataType::F32: return f(DTypeTag<ffi::DataType::F32>{});
    case ffi::DataType::F64: return f(DTypeTag<ffi::DataType::F64>{});
    default:
      return ffi::Error::InvalidArgument(
          "tiled_matmul: unsupported dtype (float16, bfloat16, float32 and float64 are)");
  }
}

// Calls f(in_tag, out_tag) for the problem's input and output dtypes.
template <class F>
ffi::Error VisitDtypes(const MatmulProblem& p, F&& f) {
  return VisitFloatType(p.in_type, [&](auto in_tag) {
    return VisitFloatType(p.out_type, [&](auto out_tag) { return f(in_tag, out_tag); });
  });
}

// The accumulator: float64 when either side is float64, float32 otherwise.
template <ffi::DataType In, ffi::DataType Out>
using Accumulator = std::conditional_t<In == ffi::DataType::F64 || Out == ffi::DataType::F64, double, float>;

inline ffi::Error UnknownKernel(std::string_view platform, std::string_view kernel,
                                std::string_view available) {
  return ffi::Error::InvalidArgument("tiled_matmul: unknown " + std::string(platform) +
                                     " kernel '" + std::string(kernel) +
                                     "'; available: " + std::string(available));
}

}  // namespace jax_tiled
