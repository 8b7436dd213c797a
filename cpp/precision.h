// The precision attribute's values, apart from the FFI headers so that kernel
// code can use them without compiling those headers.
#pragma once

#include <cstdint>

namespace jax_tiled {

// Mirrors the Python side's precision names; values are the FFI attribute.
enum class Precision : int32_t { kDefault = 0, kHigh = 1, kHighest = 2 };

}  // namespace jax_tiled
