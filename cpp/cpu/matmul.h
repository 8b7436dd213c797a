// The CPU FFI handler and the one kernel it runs.
#pragma once

#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_tiled::cpu {
// The CPU kernel: every supported dtype, true fp32 at every precision.
inline constexpr const char* kKernelName = "blocked";

// bfloat16 inputs (into a float32, bfloat16 or float16 result) take one of
// several paths inside it: AMX tiles, vdpbf16ps, or the fallback that every
// CPU runs, converting to float32 for the FMA kernel. The first that this
// machine runs is taken unless this environment variable names one.
inline constexpr const char* kBf16PathVariable = "JAX_TILED_CPU_BF16";
inline constexpr const char* kBf16Fallback = "fallback";

struct Bf16PathFacts {
  std::string name;
  bool runs_here;  // the CPU has the instructions and the OS lets this process use them
};
// The paths compiled into this build, preferred first.
std::vector<Bf16PathFacts> Bf16PathTable();
// The path a bfloat16 product takes now, or "" with *error saying why none.
std::string Bf16PathNow(std::string* error);
}  // namespace jax_tiled::cpu

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTiledMatmulCpu);
