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
extern const KernelDescriptor kSmemTiled, kSmemTiled16, kSmemTiledRacy, kRegisterBlocked,
    kSimtWarpTiled, kSimtCpAsyncPipelined, kMmaSyncPipelined, kWgmmaTmaWarpSpecialized;

namespace {
const KernelDescriptor* const kLadder[] = {
    &kSmemTiled,     &kSmemTiled16,          &kSmemTiledRacy,    &kRegisterBlocked,
    &kSimtWarpTiled, &kSimtCpAsyncPipelined, &kMmaSyncPipelined, &kWgmmaTmaWarpSpecialized,
};
// The CPU module names these kernels from kernel_names.h's list.
static_assert(std::size(kLadder) == std::size(names::kLadder),
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
  for (const KernelDescriptor* k : kLadder)
    if (k->listed && k->takes.true_fp32) names.push_back(std::string("'") + k->name + "'");
  return JoinedWithOr(names);
}

std::string Capability(int compute_capability) {
  return std::to_string(compute_capability / 10) + "." + std::to_string(compute_capability % 10);
}
}  // namespace

const std::vector<const KernelDescriptor*>& Ladder() {
  static const std::vector<const KernelDescriptor*> ladder(std::begin(kLadder), std::end(kLadder));
  return ladder;
}

const KernelDescriptor* FindKernel(std::string_view name) {
  for (const KernelDescriptor* k : kLadder)
    if (name == k->name) return k;
  return nullptr;
}

std::string KernelNames() {
  std::string names;
  for (const KernelDescriptor* k : kLadder)
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
  std::string text = std::to_string(block_m) + " x " + std::to_string(block_n) + " tiles";
  if (stages) text += ", " + std::to_string(stages) + " stages";
  if (cluster_m > 1) text += ", clusters of " + std::to_string(cluster_m) + " blocks sharing B";
  if (split_k > 1)
    text += ", K split in " + std::to_string(split_k) + " across clusters of " +
            std::to_string(split_k) + " blocks (partial sums added in rank order)";
  if (swap_ab) text += ", computing C^T = B^T A^T";
  if (transposes_b) text += ", B rewritten K-major in shared memory by the producer warpgroup";
  if (persistent_blocks)
    text += ", a persistent grid of " + std::to_string(persistent_blocks) + " blocks";
  return text;
}

}  // namespace jax_tiled::cuda
