// What a kernel of the ladder tells the rest of the package about itself.
//
// Each kernel file (kernels/<n>_<technique>.cu) defines the KernelDescriptors
// of its kernel (1_smem_tiled.cu defines three: a width chosen at run time, a
// fixed 16 x 16, and the planted race); kernel_table.cu lists them in ladder
// order. Names, the facts the Python side reads (kernel_table()),
// jax_tiled.kernels(), refusals, kernel="auto" and explain are all derived
// from that table, and what explain prints is the LaunchPlan the launcher
// runs. NOTES.md, "Adding a kernel", has the recipe.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cuda/blocks/common.cuh"
#include "cuda/kernel_names.h"
#include "precision.h"
#include "stack_slice.h"

namespace jax_tiled::cuda {

// The float dtypes, as kernels see them. Kernel code does not include the
// FFI's headers, which cost seconds of compile time in every translation unit
// and every GPU architecture; the handler converts.
enum class Dtype : uint8_t { kF16, kBF16, kF32, kF64 };

constexpr const char* DtypeName(Dtype t) {
  switch (t) {
    case Dtype::kF16: return "float16";
    case Dtype::kBF16: return "bfloat16";
    case Dtype::kF32: return "float32";
    case Dtype::kF64: return "float64";
  }
  return "an unknown dtype";
}

// What the planners and refusals need to know of the GPU. The defaults are an
// H100's, taken where the driver cannot say and where explain plans without a
// GPU; the per-block limits are every sm_80+ GPU's (48 KB of shared memory
// without an opt-in, 1024 threads).
struct DeviceFacts {
  int multiprocessors = 132;
  int compute_capability = 90;         // major * 10 + minor
  int shared_bytes_per_block = 49152;  // cudaDevAttrMaxSharedMemoryPerBlock
  int max_threads_per_block = 1024;
};

// One product as a kernel is asked to run it. The operand pointers are null
// when planning before buffers exist (explain, kernels()): XLA aligns its
// buffers far beyond 16 bytes, so null stands for any of them.
struct Product {
  MatmulDims dims;
  Dtype in_type, out_type;
  Precision precision;
  const void* a = nullptr;
  const void* b = nullptr;
  // An operand that is a slice of a stack: `a` or `b` is the stack's start
  // (stack_slice.h). Kernels whose Takes say stack_slices read it so; the
  // handler gathers the slice for the others.
  StackSlice a_stack, b_stack;
  // > 1: the operands are an emulation preset's parts laid along K
  // (jax_tiled/_presets.py, split_operand): chunk by chunk, each chunk one
  // slab of wgmma's (a 128-byte row of K) and one product of parts, this
  // many a chunk group, the small products first. wgmma's planner keeps
  // such products on tiles with room for partial sums, and BF16_BF16_F32_X3's
  // (3) on configurations whose partial sums hold one chunk group
  // (WgmmaLaidX3).
  int laid_terms = 1;

  // float32 on tensor cores: one TF32 pass at DEFAULT, 3xTF32 at HIGH.
  bool SplitsTf32() const { return in_type == Dtype::kF32 && precision == Precision::kHigh; }
};

// How a planner chose its tile's width at run time from the device (kernel 1's
// "smem"), for Describe and for the launcher's check of the width against the
// limits it was chosen under. All zero where the width is the configuration's.
struct RuntimeWidth {
  int shared_bytes_per_block = 0, max_threads_per_block = 0;  // the limits (DeviceFacts)
  int widest = 0;             // the widest width those limits admit; 0: none does
  int widest_tile_bytes = 0;  // the shared memory of its tiles
  int multiprocessors = 0;
  int64_t widest_tiles = 0, tiles = 0;  // output tiles at the widest and at the chosen width

  constexpr bool Chosen() const { return shared_bytes_per_block > 0; }
};

// What a planner chose and its launcher runs: the block's output tile, the
// slabs its pipeline keeps in shared memory (0: none), the blocks of a
// cluster that share their B tiles, whether it computes C^T = B^T A^T in
// place of C = A B, and for a persistent kernel the blocks that walk the
// tiles (0: one block per tile).
struct LaunchPlan {
  int block_m = 0, block_n = 0, stages = 0, cluster_m = 1;
  bool swap_ab = false;
  int persistent_blocks = 0;
  // > 1: each tile's K split among a cluster of this many blocks (a split-K
  // configuration's plan), whose grid has one block per part of every tile;
  // and among this many such clusters, whose partial sums meet in scratch
  // (with split_k 1, the SIMT kernels: this many parts of one block each,
  // k_parts.cuh).
  int split_k = 1, split_groups = 1;
  // B lands MN-major and is rewritten K-major in shared memory (wgmma's TF32
  // with both operands stored MN-major).
  bool transposes_b = false;
  // 3xTF32's operands are read as TF32 hi and lo parts (wgmma), each split
  // by a pass ahead of the kernel into scratch, K-major (tf32_parts.cuh), but
  // for those the kernel reads once, landed as stored: A split by the
  // consumers as they load it into registers, B in shared memory by the
  // producer warpgroup.
  bool tf32_parts = false;
  bool a_split_in_registers = false, b_split_on_chip = false;
  // 3xTF32 split in the kernel instead (wgmma, the caller's x @ w with few
  // rows): its A split in the consumers' registers, its B in shared memory,
  // as they land.
  bool tf32_split_in_kernel = false;
  // The kernel loads every operand row as whole 16-byte lines (the TMA copy
  // engine; warptile's float32 mainloop, a quad a load): where rows are off
  // them, the lowering pads the operands if that moves `auto` onto such a
  // plan (_lowering.padding_to_whole_lines).
  bool reads_whole_lines = false;
  // This product's plan reads an operand stored transposed in less time than
  // XLA's copy of it takes before the plan for the copy, where its kernel
  // does not read transposes as fast as plain layouts for every product
  // (Takes::reads_transposes): the lowering then passes a transpose as the
  // kernel's flag instead (warptile's row blocks: either layout reads B
  // once, the copy reads and writes it once more).
  bool reads_transposes = false;
  // > 0: the consumers' partial sums hold this many slabs, a configuration's
  // own depth (wgmma's products of parts laid along K: a chunk group); 0:
  // the pass's own.
  int partial_slabs = 0;
  // Set where the width was chosen at run time (kernel 1's "smem").
  RuntimeWidth runtime_width{};
  // Describe's words in place of "block_m x block_n tiles", for a kernel whose
  // tiles say too little (kernel 0: 1 x 1, no shared tiles). Static text: the
  // launch path builds no strings.
  const char* instead_of_tiles = nullptr;
  // Describe's words after the tiles on why they are this wide, where a
  // planner weighed widths (static text, as above).
  const char* why_this_width = nullptr;

  // Whether a configuration with plan `cfg` runs this plan (a split-K
  // configuration runs any split count).
  bool SameConfig(const LaunchPlan& cfg) const {
    return block_m == cfg.block_m && block_n == cfg.block_n && stages == cfg.stages &&
           cluster_m == cfg.cluster_m && (split_k > 1) == (cfg.split_k > 1) &&
           partial_slabs == cfg.partial_slabs;
  }
  // The grid's blocks.
  int Blocks(int64_t tiles) const {
    return split_k > 1 ? static_cast<int>(tiles * split_k * split_groups) : persistent_blocks;
  }
  // "128 x 256 tiles, 4 stages", for explain.
  std::string Describe() const;
};

namespace detail {
template <class Cfg, class = void>
struct StagesOf : std::integral_constant<int, 0> {};
template <class Cfg>
struct StagesOf<Cfg, std::void_t<decltype(Cfg::kStages)>>
    : std::integral_constant<int, Cfg::kStages> {};
template <class Cfg, class = void>
struct SplitsK : std::false_type {};
template <class Cfg>
struct SplitsK<Cfg, std::void_t<decltype(Cfg::kSplitK)>> : std::bool_constant<Cfg::kSplitK> {};
template <class Cfg, class = void>
struct ClusterOf : std::integral_constant<int, 1> {};
template <class Cfg>
struct ClusterOf<Cfg, std::void_t<decltype(Cfg::kClusterM)>>
    : std::integral_constant<int, Cfg::kClusterM> {};
template <class Cfg, class = void>
struct PartialSlabsOf : std::integral_constant<int, 0> {};
template <class Cfg>
struct PartialSlabsOf<Cfg, std::void_t<decltype(Cfg::kPartialSlabs)>>
    : std::integral_constant<int, Cfg::kPartialSlabs> {};
}  // namespace detail

// The plan a kernel's compile-time configuration runs; split_k is the split
// count of a split-K configuration (SameConfig reads only whether it is > 1).
template <class Cfg>
constexpr LaunchPlan PlanOf(bool swap_ab = false, int persistent_blocks = 0,
                            int split_k = detail::SplitsK<Cfg>::value ? 2 : 1) {
  LaunchPlan plan{Cfg::kBlockM,
                  Cfg::kBlockN,
                  detail::StagesOf<Cfg>::value,
                  detail::ClusterOf<Cfg>::value,
                  swap_ab,
                  persistent_blocks,
                  split_k};
  plan.partial_slabs = detail::PartialSlabsOf<Cfg>::value;
  return plan;
}

// Calls f(Cfg{}) for the configuration among Cfgs that `plan` names: a
// launcher runs what its planner chose, never a choice of its own. A plan
// that names none is a planner bug, reported as an invalid launch.
template <class... Cfgs, class F>
cudaError_t WithConfig(const LaunchPlan& plan, F&& f) {
  cudaError_t err = cudaErrorInvalidValue;
  bool found = false;
  auto try_one = [&](auto cfg) {
    using Cfg = decltype(cfg);
    if (!found && plan.SameConfig(PlanOf<Cfg>())) found = true, err = f(cfg);
  };
  (try_one(Cfgs{}), ...);
  return err;
}

// The set of float dtypes a kernel reads or writes, one bit each.
enum DtypeBit : uint8_t { kF16 = 1, kBF16 = 2, kF32 = 4, kF64 = 8 };
inline constexpr uint8_t kSixteenBit = kF16 | kBF16;
inline constexpr uint8_t kEveryFloat = kF16 | kBF16 | kF32 | kF64;

constexpr uint8_t DtypeBits(Dtype t) {
  switch (t) {
    case Dtype::kF16: return kF16;
    case Dtype::kBF16: return kBF16;
    case Dtype::kF32: return kF32;
    case Dtype::kF64: return kF64;
  }
  return 0;
}

// What a kernel takes, for refusals and for compiling only the products it
// computes. Refusals of layouts and alignments, which depend on the problem,
// are the descriptor's refuses_layout.
struct Takes {
  uint8_t inputs = kEveryFloat, outputs = kEveryFloat;
  // Whether float32 inputs get true fp32 arithmetic (precision HIGHEST); the
  // tensor-core kernels compute float32 as TF32 (DEFAULT) or 3xTF32 (HIGH).
  bool true_fp32 = true;
  int min_capability = 0;         // major * 10 + minor
  bool hopper_only = false;       // arch-specific sm_90a instructions: 9.0 exactly
  const char* dtype_reason = "";  // why inputs/outputs are limited, for the refusal
  bool tensor_cores = false;      // computes on the tensor cores (mma.sync, wgmma)
  // Reads an operand given as a slice of a stack in place (MatmulDims'
  // StackSlice, the index read on the device); for other kernels the handler
  // copies the slice out first.
  bool stack_slices = false;
  // Reads an operand stored transposed as fast as one stored plainly (its
  // copy-engine boxes or loads cost the same either way, measured), so the
  // lowering passes a transpose as the kernel's flag instead of XLA's copy.
  bool reads_transposes = false;

  constexpr bool TakesDtypes(Dtype in, Dtype out) const {
    return (inputs & DtypeBits(in)) && (outputs & DtypeBits(out));
  }
};

inline constexpr Takes kTakesEveryFloat{};

// The tensor-core kernels: 16-bit inputs, or float32 as TF32, into a float32
// accumulator and a 16- or 32-bit result.
constexpr Takes TensorCoreTakes(int min_capability, bool hopper_only) {
  Takes takes{kSixteenBit | kF32, kSixteenBit | kF32, false, min_capability, hopper_only};
  takes.dtype_reason = "tensor-core instructions";
  takes.tensor_cores = true;
  return takes;
}

// The storage type of a dtype in device code.
template <Dtype T> struct StorageOf;
template <> struct StorageOf<Dtype::kF16> { using type = __half; };
template <> struct StorageOf<Dtype::kBF16> { using type = __nv_bfloat16; };
template <> struct StorageOf<Dtype::kF32> { using type = float; };
template <> struct StorageOf<Dtype::kF64> { using type = double; };
template <Dtype T> using Storage = typename StorageOf<T>::type;

// Calls f(std::integral_constant<Dtype, t>{}) for the dtype t.
template <class F>
cudaError_t VisitDtype(Dtype t, F&& f) {
  switch (t) {
    case Dtype::kF16: return f(std::integral_constant<Dtype, Dtype::kF16>{});
    case Dtype::kBF16: return f(std::integral_constant<Dtype, Dtype::kBF16>{});
    case Dtype::kF32: return f(std::integral_constant<Dtype, Dtype::kF32>{});
    case Dtype::kF64: return f(std::integral_constant<Dtype, Dtype::kF64>{});
  }
  return cudaErrorInvalidValue;
}

// The accumulator of a product: float64 when either side is float64.
template <class In, class Out>
using AccumulatorOf =
    std::conditional_t<std::is_same_v<In, double> || std::is_same_v<Out, double>, double, float>;

// Calls f(In{}) with the storage type of `in_type`, for the inputs kTakes
// admits only, so a launcher compiles nothing else. The handler has refused
// the others; reaching one is an invalid launch.
template <const Takes& kTakes, class F>
cudaError_t VisitInput(Dtype in_type, F&& f) {
  return VisitDtype(in_type, [&](auto tag) -> cudaError_t {
    constexpr Dtype kIn = decltype(tag)::value;
    if constexpr ((kTakes.inputs & DtypeBits(kIn)) != 0) return f(Storage<kIn>{});
    return cudaErrorInvalidValue;
  });
}

// The same for the result's storage type.
template <const Takes& kTakes, class F>
cudaError_t VisitOutput(Dtype out_type, F&& f) {
  return VisitDtype(out_type, [&](auto tag) -> cudaError_t {
    constexpr Dtype kOut = decltype(tag)::value;
    if constexpr ((kTakes.outputs & DtypeBits(kOut)) != 0) return f(Storage<kOut>{});
    return cudaErrorInvalidValue;
  });
}

// Calls f(In{}, Out{}) for the product's storage types.
template <const Takes& kTakes, class F>
cudaError_t VisitStorage(const Product& p, F&& f) {
  return VisitInput<kTakes>(p.in_type, [&](auto in) {
    return VisitOutput<kTakes>(p.out_type, [&](auto out) { return f(in, out); });
  });
}

// Device memory a launch may use for the duration of its stream work (XLA's
// scratch allocator behind the FFI), for kernels whose blocks exchange
// partial results; null where none is offered.
class Scratch {
 public:
  virtual ~Scratch() = default;
  // `bytes` aligned to `alignment` (XLA's allocator takes at most 16), or null
  // if none is left.
  virtual void* Allocate(size_t bytes, size_t alignment) = 0;
};

// What a launcher runs with besides the product: XLA's stream, and scratch.
struct LaunchContext {
  cudaStream_t stream;
  Scratch* scratch = nullptr;
};

// The plan of a kernel with one configuration, whatever the product.
template <int kBlockM, int kBlockN>
LaunchPlan FixedPlan(const Product&, const DeviceFacts&) {
  return {kBlockM, kBlockN};
}

// The signature of a launcher instantiated once per input type, each in its
// own translation unit (cmake/cuda.cmake generates them), so the heaviest
// kernels compile in parallel; the kernel's .cu file sees them through
// JAX_TILED_EXTERN_PER_INPUT.
#define JAX_TILED_PER_INPUT_LAUNCHER(Launcher, In) \
  cudaError_t Launcher<In>(const LaunchPlan&, const Product&, void*, const LaunchContext&)
#define JAX_TILED_EXTERN_PER_INPUT(Launcher)                             \
  extern template JAX_TILED_PER_INPUT_LAUNCHER(Launcher, __half);        \
  extern template JAX_TILED_PER_INPUT_LAUNCHER(Launcher, __nv_bfloat16); \
  extern template JAX_TILED_PER_INPUT_LAUNCHER(Launcher, float);

// One kernel of the ladder, as the handler, auto and explain see it.
struct KernelDescriptor {
  const char* name;
  // Offered by jax_tiled.kernels(); false for kernels that exist for the
  // test suite only (auto never names them).
  bool listed;
  Takes takes;
  // Why it cannot run a product whose dtypes and precision it takes (layout,
  // alignment), or nullopt; null when every layout runs.
  std::optional<std::string> (*refuses_layout)(const Product&);
  // The launch configuration for a product it takes, on this GPU.
  LaunchPlan (*plan)(const Product&, const DeviceFacts&);
  // Runs that plan on the context's stream. k > 0 and a non-empty output.
  cudaError_t (*launch)(const LaunchPlan&, const Product&, void* out, const LaunchContext& context);
};

// Every kernel of the table (kernel_table.cu), in ladder order.
const std::vector<const KernelDescriptor*>& Ladder();

// The kernel's rung of the ladder: the number of its file,
// kernels/<rung>_<technique>.cu.
int RungOf(const KernelDescriptor& kernel);

// Comma-separated, in ladder order: the listed kernels, for error messages.
std::string KernelNames();

// The kernel of that name in the table (kernel_table.cu), or null.
const KernelDescriptor* FindKernel(std::string_view name);

// Why `kernel` cannot run `product` on this GPU, or nullopt if it can. No
// strings are built unless it cannot, so the launch path may call it.
std::optional<std::string> Refusal(const KernelDescriptor& kernel, const Product& product,
                                   int compute_capability);

}  // namespace jax_tiled::cuda
