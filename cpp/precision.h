// The precision attribute's values, apart from the FFI headers so that kernel
// code can use them without compiling those headers.
#pragma once

#include <cstdint>
#include <optional>

namespace jax_tiled {

// Mirrors the Python side's precision names (_primitive.PRECISION_CODES); the
// FFI decodes the int32 attribute into it (problem.h).
enum class Precision : int32_t { kDefault = 0, kHigh = 1, kHighest = 2 };

// The precision a code stands for, or nullopt. The one range check: the FFI's
// enum decoding casts any int32, and the nanobind functions take plain ints.
constexpr std::optional<Precision> PrecisionFromCode(int32_t code) {
  if (code < static_cast<int32_t>(Precision::kDefault) ||
      code > static_cast<int32_t>(Precision::kHighest))
    return std::nullopt;
  return static_cast<Precision>(code);
}

}  // namespace jax_tiled
