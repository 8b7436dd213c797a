// The CUDA FFI handler: validate the problem, take the forced kernel or
// auto's choice from the table (kernel.h), launch its plan on XLA's stream.
//
// The execute stage neither synchronises with the host nor allocates, so the
// handler is safe to capture into a CUDA graph (the command-buffer trait).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cuda/auto.h"
#include "cuda/blocks/gather_slice.cuh"
#include "cuda/kernel.h"
#include "cuda/matmul.h"
#include "ffi_common.h"
#include "problem.h"

namespace jax_tiled::cuda {
namespace {

MatmulDims ToDims(const MatmulProblem& p) {
  return {p.batch,
          p.m,
          p.n,
          p.k,
          p.a_batch_stride,
          p.b_batch_stride,
          p.out_batch_stride,
          p.lda(),
          p.ldb(),
          p.ldc(),
          p.transpose_a,
          p.transpose_b};
}

// MakeMatmulProblem admits these four only.
Dtype ToDtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F16: return Dtype::kF16;
    case ffi::DataType::BF16: return Dtype::kBF16;
    case ffi::DataType::F64: return Dtype::kF64;
    default: return Dtype::kF32;
  }
}

ffi::Error CudaError(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("tiled_matmul: ") + what + ": " + cudaGetErrorName(err) +
                              ": " + cudaGetErrorString(err));
}

// The current device's facts; defaults (an H100's) if the driver cannot say.
DeviceFacts CurrentDevice() {
  static PerDevice<DeviceFacts> facts;
  DeviceFacts current;
  const cudaError_t err = facts.Get(&current, [](DeviceFacts* f) {
    int device = 0, major = 0, minor = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&f->multiprocessors, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&f->shared_bytes_per_block, cudaDevAttrMaxSharedMemoryPerBlock,
                                 device);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&f->max_threads_per_block, cudaDevAttrMaxThreadsPerBlock, device);
    f->compute_capability = 10 * major + minor;
    return e;
  });
  return err == cudaSuccess ? current : DeviceFacts{};
}

std::optional<Dtype> ParseDtype(std::string_view name) {
  for (Dtype t : {Dtype::kF16, Dtype::kBF16, Dtype::kF32, Dtype::kF64})
    if (name == DtypeName(t)) return t;
  return std::nullopt;
}

// A product of contiguous operands of these shapes, before buffers exist.
std::optional<Product> ProductOf(std::string_view dtype, std::string_view out_dtype,
                                 const ProblemShape& s, int precision) {
  const std::optional<Dtype> in_type = ParseDtype(dtype), out_type = ParseDtype(out_dtype);
  const std::optional<Precision> mode = PrecisionFromCode(precision);
  if (!in_type || !out_type || !mode) return std::nullopt;
  Product product{ToDims(MatmulProblem::Contiguous(s.batch_a, s.batch_b, s.m, s.n, s.k,
                                                   s.transpose_a, s.transpose_b)),
                  *in_type, *out_type, *mode};
  product.laid_terms = s.laid_terms;
  return product;
}

// Why MatmulCuda launches no kernel for a product, if it launches none: an
// empty output, or K of 0 (a zero fill). The planners are not asked about
// these: they would plan a grid of no tiles, and some divide by the tiles.
std::optional<std::string> NoKernelRuns(const MatmulProblem& p) {
  if (p.empty_output()) return "the output is empty: no kernel runs";
  if (p.k == 0) return "K is 0: the output is filled with zeros, no kernel runs";
  return std::nullopt;
}

std::optional<std::string> NoKernelRuns(const ProblemShape& s) {
  return NoKernelRuns(
      MatmulProblem::Contiguous(s.batch_a, s.batch_b, s.m, s.n, s.k, s.transpose_a, s.transpose_b));
}

// The GPU the Python side plans for; its per-block limits default to
// DeviceFacts' where it gives none (0).
DeviceFacts FactsOf(const GpuFacts& gpu) {
  DeviceFacts facts;
  facts.multiprocessors = gpu.multiprocessors;
  facts.compute_capability = gpu.compute_capability;
  if (gpu.shared_bytes_per_block) facts.shared_bytes_per_block = gpu.shared_bytes_per_block;
  if (gpu.max_threads_per_block) facts.max_threads_per_block = gpu.max_threads_per_block;
  return facts;
}

// XLA's scratch allocator as the kernels see it (kernel.h): memory that
// lives until the stream's work of this call is done. It remembers a refusal,
// so that the handler can say what ran out.
class FfiScratch final : public Scratch {
 public:
  explicit FfiScratch(ffi::ScratchAllocator& allocator) : allocator_(allocator) {}
  void* Allocate(size_t bytes, size_t alignment) override {
    void* memory = allocator_.Allocate(bytes, alignment).value_or(nullptr);
    if (memory == nullptr) refused_bytes_ = bytes;
    return memory;
  }
  size_t refused_bytes() const { return refused_bytes_; }

 private:
  ffi::ScratchAllocator& allocator_;
  size_t refused_bytes_ = 0;
};

// A launch's error, or what its scratch allocation was refused.
ffi::Error LaunchError(const char* what, cudaError_t err, const FfiScratch& scratch) {
  if (err == cudaSuccess) return ffi::Error::Success();
  if (scratch.refused_bytes())
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "tiled_matmul: XLA's scratch allocator refused " +
                          std::to_string(scratch.refused_bytes()) + " bytes of device memory");
  return CudaError(what, err);
}

// For a kernel that does not read stacks in place: the slice a StackSlice
// chooses, copied into scratch on the stream (the index stays on the device).
cudaError_t GatherStackSlice(const void*& operand, StackSlice& stack, ffi::DataType in_type,
                             const LaunchContext& context) {
  if (!stack.stacked()) return cudaSuccess;
  const size_t bytes = static_cast<size_t>(stack.stride) * ffi::ByteWidth(in_type);
  void* slice = context.scratch->Allocate(bytes, 16);
  if (slice == nullptr) return cudaErrorMemoryAllocation;
  const cudaError_t err = GatherSlice(operand, stack, bytes, slice, context.stream);
  operand = slice, stack = StackSlice{};
  return err;
}

ffi::Error MatmulCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer a,
                      ffi::AnyBuffer b, ffi::RemainingArgs stack_indices,
                      ffi::Result<ffi::AnyBuffer> out, bool transpose_a, bool transpose_b,
                      Precision precision, std::string_view kernel, int32_t spare_sms,
                      int32_t laid_terms) {
  auto problem =
      MakeMatmulProblem(a, b, *out, stack_indices, transpose_a, transpose_b, precision, kernel);
  if (problem.has_error()) return problem.error();
  const MatmulProblem& p = problem.value();
  const bool is_auto = p.kernel == "auto";
  const KernelDescriptor* const forced = is_auto ? nullptr : FindKernel(p.kernel);
  if (!is_auto && !forced) return UnknownKernel("CUDA", p.kernel, KernelNames());
  Product product{ToDims(p), ToDtype(p.in_type), ToDtype(p.out_type), p.precision};
  product.a = a.untyped_data();
  product.b = b.untyped_data();
  product.a_stack = p.a_stack;
  product.b_stack = p.b_stack;
  if (spare_sms < 0)
    return ffi::Error::InvalidArgument("tiled_matmul: spare_sms must be at least 0, got " +
                                       std::to_string(spare_sms));
  if (laid_terms < 1)
    return ffi::Error::InvalidArgument("tiled_matmul: laid_terms must be at least 1, got " +
                                       std::to_string(laid_terms));
  product.laid_terms = laid_terms;
  // A product that overlaps a transfer (the sharded rings) plans for fewer SMs
  // than the GPU has, so that the communication kernel finds SMs free instead
  // of waiting for a persistent grid to end.
  DeviceFacts device = CurrentDevice();
  device.multiprocessors = std::max(1, device.multiprocessors - spare_sms);
  if (forced)
    if (std::optional<std::string> why = Refusal(*forced, product, device.compute_capability))
      return ffi::Error::InvalidArgument("tiled_matmul: " + *why);
  if (NoKernelRuns(p)) {
    if (p.empty_output()) return ffi::Error::Success();
    // An empty sum; 0.0 is all-zero bits in every supported dtype.
    const cudaError_t err = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    return err == cudaSuccess ? ffi::Error::Success() : CudaError("zero fill failed", err);
  }
  const KernelChoice choice =
      forced ? KernelChoice{forced, forced->plan(product, device)} : ChooseAuto(product, device);
  FfiScratch workspace(scratch);
  const LaunchContext context{stream, &workspace};
  cudaError_t err = cudaSuccess;
  if (!choice.kernel->takes.stack_slices) {
    err = GatherStackSlice(product.a, product.a_stack, p.in_type, context);
    if (err == cudaSuccess) err = GatherStackSlice(product.b, product.b_stack, p.in_type, context);
    if (err != cudaSuccess) return LaunchError("copying a slice of a stack failed", err, workspace);
  }
  err = choice.kernel->launch(choice.plan, product, out->untyped_data(), context);
  return LaunchError("kernel launch failed", err, workspace);
}

// numpy's names of the dtypes among `bits`.
std::vector<std::string> DtypeNames(uint8_t bits) {
  std::vector<std::string> names;
  for (Dtype t : {Dtype::kF16, Dtype::kBF16, Dtype::kF32, Dtype::kF64})
    if (bits & DtypeBits(t)) names.push_back(DtypeName(t));
  return names;
}

}  // namespace

std::vector<KernelFacts> KernelTable() {
  std::vector<KernelFacts> table;
  for (const KernelDescriptor* k : Ladder()) {
    const Takes& t = k->takes;
    table.push_back({k->name, RungOf(*k), k->listed, t.tensor_cores, t.true_fp32, t.min_capability,
                     t.hopper_only, t.stack_slices, t.reads_transposes, DtypeNames(t.inputs),
                     DtypeNames(t.outputs)});
  }
  return table;
}

AutoChoice ExplainAuto(std::string_view dtype, std::string_view out_dtype,
                       const ProblemShape& shape, int precision, const GpuFacts& gpu) {
  const std::optional<Product> product = ProductOf(dtype, out_dtype, shape, precision);
  if (!product)
    return {"",
            "unsupported dtypes " + std::string(dtype) + " -> " + std::string(out_dtype) +
                " or precision code " + std::to_string(precision),
            ""};
  if (std::optional<std::string> why = NoKernelRuns(shape)) return {"", *why, ""};
  std::string why;
  const KernelChoice choice = ChooseAuto(*product, FactsOf(gpu), &why);
  return {choice.kernel->name, why, choice.plan.Describe()};
}

PlanFacts KernelPlan(std::string_view kernel, std::string_view dtype, std::string_view out_dtype,
                     const ProblemShape& shape, int precision, const GpuFacts& gpu) {
  const KernelDescriptor* const k = FindKernel(kernel);
  const std::optional<Product> product = ProductOf(dtype, out_dtype, shape, precision);
  if (!k || !product || NoKernelRuns(shape) || Refusal(*k, *product, gpu.compute_capability))
    return {};
  const LaunchPlan plan = k->plan(*product, FactsOf(gpu));
  return {plan.Describe(),
          plan.block_m,
          plan.block_n,
          plan.stages,
          plan.cluster_m,
          plan.split_k,
          plan.split_groups,
          plan.swap_ab,
          plan.persistent_blocks,
          plan.reads_whole_lines,
          k->takes.reads_transposes || plan.reads_transposes};
}

std::string KernelRefusal(std::string_view kernel, std::string_view dtype,
                          std::string_view out_dtype, const ProblemShape& shape, int precision,
                          int compute_capability) {
  const KernelDescriptor* const k = FindKernel(kernel);
  const std::optional<Product> product = ProductOf(dtype, out_dtype, shape, precision);
  if (!k || !product) return "";  // reported elsewhere, with the valid choices
  return Refusal(*k, *product, compute_capability).value_or("");
}

}  // namespace jax_tiled::cuda
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxTiledMatmulCuda, jax_tiled::cuda::MatmulCuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: every launch goes here
        .Ctx<xla::ffi::ScratchAllocator>()              // device memory for this call's kernels
        .Arg<xla::ffi::AnyBuffer>()  // a: (batch_a, m, k), or (batch_a, k, m) transposed
        .Arg<xla::ffi::AnyBuffer>()  // b: (batch_b, k, n), or (batch_b, n, k) transposed
        .RemainingArgs()             // int32 index of each operand given as a stack (L, ...)
        .Ret<xla::ffi::AnyBuffer>()  // out: (batch, m, n)
        .Attr<bool>("transpose_a")   // a is stored (batch_a, k, m)
        .Attr<bool>("transpose_b")   // b is stored (batch_b, n, k)
        .Attr<jax_tiled::Precision>("precision")  // DEFAULT: TF32, HIGH: 3xTF32, HIGHEST: fp32
        .Attr<std::string_view>("kernel")         // "auto" or a name from KernelNames()
        .Attr<int32_t>("spare_sms")    // SMs left free for communication running beside it
        .Attr<int32_t>("laid_terms"),  // > 1: parts laid along K, this many a chunk (Product)
    {xla::ffi::Traits::kCmdBufferCompatible});
