// The ladder's kernels in order, and what is derived from their descriptors:
// names, lookup, refusals, and plan descriptions for explain. (The facts the
// Python side reads, handler.cu's KernelTable, walk Ladder().)
#include <iterator>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cuda/kernel.h"

namespace jax_tiled::cuda {

// Defined in kernels/<n>_<technique>.cu.
extern const KernelDescriptor kNaiveGlobal, kSmemTiled, kSmemTiled16, kSmemTiledRacy,
    kRegisterBlocked, kSimtWarpTiled, kSimtCpAsyncPipelined, kMmaSyncPipelined,
    kWgmmaTmaWarpSpecialized;

namespace {
// Each kernel with its rung: the number of its file, kernels/<rung>_<technique>.cu
// (kernel 1's descriptors share theirs).
struct Rung {
  int number;
  const KernelDescriptor* kernel;
};
const Rung kRungs[] = {
    {0, &kNaiveGlobal},          {1, &kSmemTiled},        {1, &kSmemTiled16},
    {1, &kSmemTiledRacy},        {2, &kRegisterBlocked},  {3, &kSimtWarpTiled},
    {4, &kSimtCpAsyncPipelined}, {5, &kMmaSyncPipelined}, {6, &kWgmmaTmaWarpSpecialized},
};
// The CPU module names these kernels from kernel_names.h's list.
static_assert(std::size(kRungs) == std::size(names::kLadder),
              "kernel_names.h's kLadder lists every kernel of the ladder");

// "x, y or z".
std::string JoinedWithOr(const std::vector<std::string>& items) {
  std::string list;
  for (size_t i = 0; i < items.size(); ++i)
    list += (i == 0 ? "" : i + 1 == items.size() ? " or " : ", ") + items[i];
  return list;
}

// "bfloat16, float16 or float32": the dtypes among `bits`.
std::string DtypeList(uint8_t bits, bool float32_as_tf32) {
  std::vector<std::string> names;
  for (auto [bit, name] : {std::pair{kBF16, "bfloat16"}, std::pair{kF16, "float16"},
                           std::pair{kF32, "float32"}, std::pair{kF64, "float64"}})
    if (bits & bit)
      names.push_back(std::string(name) + (bit == kF32 && float32_as_tf32 ? " (as TF32)" : ""));
  return JoinedWithOr(names);
}

std::string Quoted(const KernelDescriptor& kernel) {
  return std::string("kernel '") + kernel.name + "'";
}

// 'smem', 'regblock' or 'warptile': the listed kernels that give true fp32.
std::string TrueFp32Kernels() {
  std::vector<std::string> names;
  for (const KernelDescriptor* k : Ladder())
    if (k->listed && k->takes.true_fp32) names.push_back(std::string("'") + k->name + "'");
  return JoinedWithOr(names);
}

std::string Capability(int compute_capability) {
  return std::to_string(compute_capability / 10) + "." + std::to_string(compute_capability % 10);
}

// "32 x 16".
std::string Square(int rows, int cols) {
  return std::to_string(rows) + " x " + std::to_string(cols);
}

// "48 KB", or "8448 bytes" where that would round.
std::string Bytes(int bytes) {
  return bytes % 1024 ? std::to_string(bytes) + " bytes" : std::to_string(bytes / 1024) + " KB";
}

// Why a width chosen at run time (LaunchPlan::runtime_width) is `width`.
std::string WhyThisWidth(int width, const RuntimeWidth& w) {
  const std::string limits = "this GPU's " + std::to_string(w.max_threads_per_block) +
                             " threads and " + Bytes(w.shared_bytes_per_block) +
                             " of shared memory per block";
  if (!w.widest) return "width chosen at run time, but no width fits " + limits;
  const std::string widest = "the widest whose block (" + std::to_string(w.widest * w.widest) +
                             " threads) and two tiles (" + Bytes(w.widest_tile_bytes) + ") fit " +
                             limits;
  const std::string sms = " for " + std::to_string(w.multiprocessors) + " SMs";
  if (width == w.widest)
    return "width chosen at run time: " + widest + ", " + std::to_string(w.tiles) + " tiles" + sms;
  return "width chosen at run time: " + Square(w.widest, w.widest) + ", " + widest + ", makes " +
         std::to_string(w.widest_tiles) + " tiles" + sms + "; " + Square(width, width) + " makes " +
         std::to_string(w.tiles);
}
}  // namespace

const std::vector<const KernelDescriptor*>& Ladder() {
  static const std::vector<const KernelDescriptor*> ladder = [] {
    std::vector<const KernelDescriptor*> kernels;
    for (const Rung& rung : kRungs) kernels.push_back(rung.kernel);
    return kernels;
  }();
  return ladder;
}

int RungOf(const KernelDescriptor& kernel) {
  for (const Rung& rung : kRungs)
    if (rung.kernel == &kernel) return rung.number;
  return -1;
}

const KernelDescriptor* FindKernel(std::string_view name) {
  for (const KernelDescriptor* k : Ladder())
    if (name == k->name) return k;
  return nullptr;
}

std::string KernelNames() {
  std::string names;
  for (const KernelDescriptor* k : Ladder())
    if (k->listed) names += (names.empty() ? "" : ",") + std::string(k->name);
  return names;
}

std::optional<std::string> Refusal(const KernelDescriptor& kernel, const Product& p,
                                   int compute_capability) {
  const Takes& takes = kernel.takes;
  if (!takes.TakesDtypes(p.in_type, p.out_type))
    return Quoted(kernel) + " computes " + DtypeList(takes.inputs, !takes.true_fp32) +
           " inputs into a " + DtypeList(takes.outputs, false) + " result (" + takes.dtype_reason +
           "); got " + DtypeName(p.in_type) + " -> " + DtypeName(p.out_type);
  if (!takes.true_fp32 && p.in_type == Dtype::kF32 && p.precision == Precision::kHighest)
    return Quoted(kernel) +
           " computes float32 on TF32 tensor cores (precision DEFAULT: one "
           "TF32 pass, HIGH: 3xTF32) and cannot give the true fp32 arithmetic that precision "
           "HIGHEST asks for; use " +
           TrueFp32Kernels() + ", or kernel='auto'";
  if (takes.hopper_only && compute_capability != 90)
    return Quoted(kernel) + " needs a Hopper GPU (compute capability 9.0); this one is " +
           Capability(compute_capability);
  if (compute_capability < takes.min_capability)
    return Quoted(kernel) + " needs compute capability " + Capability(takes.min_capability) +
           " or newer; this one is " + Capability(compute_capability);
  if (kernel.refuses_layout) return kernel.refuses_layout(p);
  return std::nullopt;
}

std::string LaunchPlan::Describe() const {
  std::string text =
      instead_of_tiles ? std::string(instead_of_tiles) : Square(block_m, block_n) + " tiles";
  if (runtime_width.Chosen()) text += ", " + WhyThisWidth(block_m, runtime_width);
  if (why_this_width) text += std::string(", ") + why_this_width;
  if (stages) text += ", " + std::to_string(stages) + " stages";
  if (cluster_m > 1) text += ", clusters of " + std::to_string(cluster_m) + " blocks sharing B";
  if (split_k > 1 && split_groups > 1)
    text += ", K split in " + std::to_string(split_k * split_groups) + " across " +
            std::to_string(split_groups) + " clusters of " + std::to_string(split_k) +
            " blocks a tile (partial sums added in rank order, then cluster by cluster "
            "from scratch by a second kernel)";
  else if (split_k > 1)
    text += ", K split in " + std::to_string(split_k) + " across clusters of " +
            std::to_string(split_k) + " blocks (partial sums added in rank order)";
  else if (split_groups > 1)
    text += ", K split in " + std::to_string(split_groups) +
            " parts, a block each (partial sums added in part order from scratch by a second "
            "kernel)";
  if (partial_slabs)
    text += ", partial sums of " + std::to_string(partial_slabs) +
            " slabs (a chunk group of the parts laid along K)";
  if (swap_ab) text += ", computing C^T = B^T A^T";
  if (transposes_b) text += ", B rewritten K-major in shared memory by the producer warpgroup";
  if (tf32_parts) {
    const std::string a_in_registers =
        ", A split into TF32 hi and lo parts in registers as the consumers load it";
    const std::string b_on_chip = "B split into TF32 hi and lo parts in shared memory as it lands";
    const char* const ahead =
        " split into TF32 hi and lo parts ahead of the kernel (K-major, in "
        "XLA's scratch: twice ";
    if (a_split_in_registers && b_split_on_chip)
      text += a_in_registers + ", " + b_on_chip + " (each read once)";
    else if (a_split_in_registers)
      text += a_in_registers + " (read once), B" + ahead + "its bytes)";
    else if (b_split_on_chip) text += ", " + b_on_chip + " (read once), A" + ahead + "its bytes)";
    else text += std::string(", A and B") + ahead + "the operands' bytes)";
  }
  if (tf32_split_in_kernel)
    text +=
        ", its A (read once) split into TF32 hi and lo parts in registers and its B in shared "
        "memory as they land";
  if (persistent_blocks)
    text += ", a persistent grid of " + std::to_string(persistent_blocks) + " blocks";
  return text;
}

}  // namespace jax_tiled::cuda
