// The names of the CUDA ladder's kernels. Each kernel's descriptor
// (kernels/<n>_<technique>.cu) takes its name from here, and the CPU module,
// which is built where the CUDA one may not be, exports the list, so that a
// CPU-only install can say a CUDA kernel is not built rather than unknown.
// No CUDA code: the CPU module includes this header.
#pragma once

namespace jax_tiled::cuda::names {

inline constexpr char kNaive[] = "naive";
inline constexpr char kSmem[] = "smem";
inline constexpr char kSmem16[] = "smem16";
inline constexpr char kSmemRacy[] = "smem_racy_for_testing";
inline constexpr char kRegblock[] = "regblock";
inline constexpr char kWarptile[] = "warptile";
inline constexpr char kPipelined[] = "pipelined";
inline constexpr char kMma[] = "mma";
inline constexpr char kWgmma[] = "wgmma";

// Every kernel of the ladder, listed or not, in kernel_table.cu's order (which
// checks the count at compile time; tests/test_kernels.py the names).
inline constexpr const char* kLadder[] = {kNaive,    kSmem,      kSmem16, kSmemRacy, kRegblock,
                                          kWarptile, kPipelined, kMma,    kWgmma};

}  // namespace jax_tiled::cuda::names
