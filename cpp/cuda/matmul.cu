// CUDA handler: validate the problem, pick a rung, launch it on XLA's stream.
//
// The execute stage neither synchronises with the host nor allocates, so the
// handler is safe to capture into a CUDA graph (the command-buffer trait).

#include "cuda/matmul.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "cuda/kernels/mma_sync_pipelined.cuh"
#include "cuda/kernels/register_blocked.cuh"
#include "cuda/kernels/simt_cp_async_pipelined.cuh"
#include "cuda/kernels/simt_warptiled.cuh"
#include "cuda/kernels/smem_tiled.cuh"
#include "cuda/kernels/wgmma_tma_warp_specialized.cuh"
#include "cuda/tensor_core_launches.h"
#include "ffi_common.h"
#include "problem.h"

namespace jax_tiled::cuda {

// Instantiated in mma_launches.cu and wgmma_launches.cu, not here.
#define JAX_TILED_DECLARE_INSTANCES(In, Out, split)                        \
  extern template JAX_TILED_LAUNCHER_SIGNATURE(LaunchMmaSync, In, Out, split); \
  extern template JAX_TILED_LAUNCHER_SIGNATURE(LaunchWgmma, In, Out, split);
JAX_TILED_TENSOR_CORE_PRODUCTS(JAX_TILED_DECLARE_INSTANCES)
#undef JAX_TILED_DECLARE_INSTANCES

namespace {

template <ffi::DataType T> struct StorageOf;
template <> struct StorageOf<ffi::DataType::F16> { using type = __half; };
template <> struct StorageOf<ffi::DataType::BF16> { using type = __nv_bfloat16; };
template <> struct StorageOf<ffi::DataType::F32> { using type = float; };
template <> struct StorageOf<ffi::DataType::F64> { using type = double; };
template <ffi::DataType T> using Storage = typename StorageOf<T>::type;

enum class Rung {
  kAuto, kSmem32, kSmem16, kSmemRacy, kRegisterBlocked, kWarpTiled, kPipelined, kMma, kWgmma
};

std::optional<Rung> ParseKernel(std::string_view name) {
  if (name == "auto") return Rung::kAuto;
  if (name == "smem") return Rung::kSmem32;
  if (name == "regblock") return Rung::kRegisterBlocked;
  if (name == "warptile") return Rung::kWarpTiled;
  if (name == "pipelined") return Rung::kPipelined;
  if (name == "mma") return Rung::kMma;
  if (name == "wgmma") return Rung::kWgmma;
  if (name == "smem16") return Rung::kSmem16;
  // Deliberately missing from kKernelNames: this is "smem" without its second
  // barrier, a known data race that the compute-sanitizer racecheck test runs
  // to prove the tool would catch one. Its results are not to be trusted, so
  // jax_tiled.kernels() never offers it and "auto" never picks it.
  if (name == "smem_racy_for_testing") return Rung::kSmemRacy;
  return std::nullopt;
}

MatmulDims ToDims(const MatmulProblem& p) {
  return {p.batch, p.m, p.n, p.k,
          p.a_batch_stride, p.b_batch_stride, p.out_batch_stride,
          p.lda(), p.ldb(), p.ldc(),
          p.transpose_a, p.transpose_b};
}

ffi::Error CudaError(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("tiled_matmul: ") + what + ": " +
                              cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

// What the launch path needs to know of the current device, read once per
// device: a driver query on every call would cost more than a small matmul.
struct DeviceFacts {
  int multiprocessors = 132;
  int compute_capability = 90;  // major * 10 + minor
};

DeviceFacts CurrentDevice() {
  static std::atomic<int> multiprocessors[64], capability[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return {};
  // multiprocessors is stored last (release): once seen, capability is there too.
  DeviceFacts facts;
  facts.multiprocessors = multiprocessors[device].load(std::memory_order_acquire);
  facts.compute_capability = capability[device].load(std::memory_order_relaxed);
  if (facts.multiprocessors == 0) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&facts.multiprocessors, cudaDevAttrMultiProcessorCount, device) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
      return {};
    facts.compute_capability = 10 * major + minor;
    capability[device].store(facts.compute_capability, std::memory_order_relaxed);
    multiprocessors[device].store(facts.multiprocessors, std::memory_order_release);
  }
  return facts;
}

const char* RungName(Rung rung) {
  switch (rung) {
    case Rung::kSmem32: return "smem";
    case Rung::kSmem16: return "smem16";
    case Rung::kSmemRacy: return "smem_racy_for_testing";
    case Rung::kRegisterBlocked: return "regblock";
    case Rung::kWarpTiled: return "warptile";
    case Rung::kPipelined: return "pipelined";
    case Rung::kMma: return "mma";
    case Rung::kWgmma: return "wgmma";
    case Rung::kAuto: break;
  }
  return "auto";
}

std::optional<ffi::DataType> ParseDtype(std::string_view name) {
  for (ffi::DataType t : {ffi::DataType::F16, ffi::DataType::BF16, ffi::DataType::F32,
                          ffi::DataType::F64})
    if (name == DataTypeName(t)) return t;
  return std::nullopt;
}

bool IsSixteenBit(ffi::DataType t) { return t == ffi::DataType::F16 || t == ffi::DataType::BF16; }

bool IsTensorCoreRung(Rung rung) { return rung == Rung::kMma || rung == Rung::kWgmma; }

// float32 products that may run as TF32 (DEFAULT) or 3xTF32 (HIGH); HIGHEST
// asks for true fp32 arithmetic, which only the SIMT rungs give.
bool AllowsTf32(ffi::DataType in_type, Precision precision) {
  return in_type == ffi::DataType::F32 && precision != Precision::kHighest;
}

// Whether `rung` computes in_type -> out_type: cheap, for the launch path.
bool RungTakes(Rung rung, ffi::DataType in_type, ffi::DataType out_type) {
  switch (rung) {
    case Rung::kPipelined:  // cp.async copies float32 as is, into a float32 accumulator
      return in_type == ffi::DataType::F32 && out_type != ffi::DataType::F64;
    case Rung::kMma:
    case Rung::kWgmma:  // 16-bit or TF32 tensor-core instructions, float32 accumulators
      return (IsSixteenBit(in_type) || in_type == ffi::DataType::F32) &&
             out_type != ffi::DataType::F64;
    default: return true;
  }
}

// Whether the copy engine can read both operands for wgmma, and TF32's
// K-major rule leaves an arrangement (see wgmma_tma_warp_specialized.cuh).
bool WgmmaFits(ffi::DataType in_type, const MatmulDims& d, const void* a, const void* b) {
  if (in_type == ffi::DataType::F32) return WgmmaLayoutFits(true, d) && WgmmaCanTake<float>(d, a, b);
  return WgmmaCanTake<__half>(d, a, b);  // bfloat16 rows are the same bytes
}

// Why `rung` cannot run this problem, or nullopt if it can. No strings are
// built unless it cannot, so the launch path may call it.
std::optional<std::string> Refusal(Rung rung, ffi::DataType in_type, ffi::DataType out_type,
                                   Precision precision, const MatmulDims& d, const void* a,
                                   const void* b, int compute_capability) {
  const auto dtypes = [&] {
    return std::string(DataTypeName(in_type)) + " -> " + DataTypeName(out_type);
  };
  if (!RungTakes(rung, in_type, out_type)) {
    if (rung == Rung::kPipelined)
      return "kernel 'pipelined' computes float32 inputs into a float32, bfloat16 or float16 "
             "result (its cp.async copies cannot convert); got " + dtypes();
    return std::string("kernel '") + RungName(rung) + "' computes bfloat16, float16 or float32 "
           "(as TF32) inputs into a bfloat16, float16 or float32 result (tensor-core "
           "instructions); got " + dtypes();
  }
  if (IsTensorCoreRung(rung) && in_type == ffi::DataType::F32 && !AllowsTf32(in_type, precision))
    return std::string("kernel '") + RungName(rung) + "' computes float32 on TF32 tensor cores "
           "(precision DEFAULT: one TF32 pass, HIGH: 3xTF32) and cannot give the true fp32 "
           "arithmetic that precision HIGHEST asks for; use 'regblock', 'warptile' or "
           "'pipelined', or kernel='auto'";
  if (rung == Rung::kWgmma && compute_capability != 90)
    return "kernel 'wgmma' needs a Hopper GPU (compute capability 9.0); this one is " +
           std::to_string(compute_capability / 10) + "." + std::to_string(compute_capability % 10);
  if (rung == Rung::kWgmma && in_type == ffi::DataType::F32 && !WgmmaLayoutFits(true, d))
    return "kernel 'wgmma' reads float32 as TF32, whose shared-memory operands must be K-major "
           "(one may come through registers instead); with a stored (k, m) and b stored (k, n) "
           "(transpose_a=True, transpose_b=False) both are MN-major (kernel='auto' runs such "
           "problems on 'mma')";
  if (rung == Rung::kWgmma && !WgmmaFits(in_type, d, a, b))
    return "kernel 'wgmma' reads operands with the TMA copy engine, which needs every row and "
           "batch of each stored operand to start at a multiple of 16 bytes; here a's rows are " +
           std::to_string(d.lda) + " and b's " + std::to_string(d.ldb) +
           " elements long (kernel='auto' runs such problems on 'mma')";
  return std::nullopt;
}

// "auto": the fastest rung measured for the dtype and shape (NOTES.md). The
// reason, for jax_tiled.explain, is written only when `why` is given, so the
// launch path builds no strings.
Rung ChooseAuto(ffi::DataType in_type, ffi::DataType out_type, Precision precision,
                const MatmulDims& d, const void* a, const void* b, DeviceFacts device,
                std::string* why = nullptr) {
  auto because = [&](Rung rung, auto&& reason) {
    if (why) *why = reason();
    return rung;
  };
  const int sms = device.multiprocessors;
  const bool tf32 = AllowsTf32(in_type, precision) && device.compute_capability >= 80;
  if ((IsSixteenBit(in_type) || tf32) && out_type != ffi::DataType::F64) {
    const auto inputs = [&] {
      if (!tf32) return std::string("16-bit inputs");
      return std::string("float32 at precision ") +
             (precision == Precision::kHigh ? "HIGH: 3xTF32 (three TF32 products of split "
                                              "operands, close to fp32)"
                                            : "DEFAULT: one TF32 pass, as XLA's own");
    };
    if (device.compute_capability == 90 && WgmmaFits(in_type, d, a, b))
      return because(Rung::kWgmma, [&] {
        const bool swapped = tf32 && !d.transpose_b;
        return inputs() + " on a Hopper GPU, operands the TMA copy engine can read: "
               "warp-specialised wgmma, " +
               (tf32 ? "A through registers, " : "") +
               (swapped ? "computing C^T = B^T A^T (TF32 reads B K-major only), " : "") +
               (tf32 && precision == Precision::kHigh
                    ? "128 x 128"
                    : WgmmaUsesWideTiles(swapped ? ArrangeWgmma<float>(d, a, b).dims : d, sms)
                          ? "128 x 256"
                          : "128 x 128") +
               " tiles";
      });
    return because(Rung::kMma, [&] {
      std::string reason;
      if (device.compute_capability != 90) reason = "wgmma needs a Hopper GPU";
      else if (tf32 && !WgmmaLayoutFits(true, d))
        reason = "TF32 wgmma needs a K-major operand in shared memory and a stored (k, m) with "
                 "b stored (k, n) has none";
      else
        reason = "the TMA copy engine needs rows and batches that start at multiples of "
                 "16 bytes (a's rows are " + std::to_string(d.lda) + " elements, b's " +
                 std::to_string(d.ldb) + ")";
      return inputs() + ": mma.sync tensor cores, since " + reason;
    });
  }
  if (in_type == ffi::DataType::F64)
    return because(Rung::kSmem16, [] {
      return "float64: warptile would spill its 64 double accumulators per thread";
    });
  if (d.m < 64 || d.n < 64)
    return because(Rung::kSmem16, [] {
      return "fewer than 64 rows or columns: warptile's 64-wide tiles would be mostly padding "
             "(16 x 8192 x 8192 ran 2.0 TFLOP/s there, 4.2 on smem16, H200)";
    });
  if (WarpTileUsesLargeBlocks(d, sms))
    return because(Rung::kWarpTiled, [&] {
      return "128 x 128 blocks of 8 warps fill the " + std::to_string(sms) +
             " SMs at least twice; there the register-staged copies beat pipelined's cp.async "
             "(4096^3 fp32: 38.4 vs 36.5 TFLOP/s, H200)";
    });
  auto small = [&] {
    return "64 x 64 blocks of 2 warps, since 128 x 128 blocks would not fill the " +
           std::to_string(sms) + " SMs twice";
  };
  if (RungTakes(Rung::kPipelined, in_type, out_type))
    return because(Rung::kPipelined, [&] {
      return small() + "; with few warps per SM the 4-stage cp.async pipeline hides latency "
                       "best (1024^3 fp32: 25.4 vs warptile's 19.8 TFLOP/s, H200)";
    });
  return because(Rung::kWarpTiled, [&] {
    return small() + "; " + DataTypeName(in_type) + " -> " + DataTypeName(out_type) +
           " needs warptile's converting copies";
  });
}

template <class In, class Out, class Acc>
cudaError_t Launch(Rung rung, const MatmulDims& d, const In* a, const In* b, Out* out,
                   cudaStream_t stream, int multiprocessors, bool split_tf32) {
  constexpr bool kSixteenBitIn = std::is_same_v<In, __half> || std::is_same_v<In, __nv_bfloat16>;
  constexpr bool kTensorCoreIn = kSixteenBitIn || std::is_same_v<In, float>;
  // The handler has refused dtypes a rung does not take (RungTakes); the
  // constexpr guards only keep those from being compiled.
  switch (rung) {
    case Rung::kSmem32: return LaunchSmemTiled<32, In, Out, Acc>(d, a, b, out, stream);
    case Rung::kSmem16: return LaunchSmemTiled<16, In, Out, Acc>(d, a, b, out, stream);
    case Rung::kSmemRacy:
      return LaunchSmemTiled<32, In, Out, Acc, /*kSkipSecondSync=*/true>(d, a, b, out, stream);
    case Rung::kRegisterBlocked: return LaunchRegisterBlocked<In, Out, Acc>(d, a, b, out, stream);
    case Rung::kWarpTiled:
      return LaunchWarpTiled<In, Out, Acc>(d, a, b, out, stream, multiprocessors);
    case Rung::kPipelined:
      if constexpr (std::is_same_v<In, float> && std::is_same_v<Acc, float>)
        return LaunchPipelined<Out>(d, a, b, out, stream, multiprocessors);
      break;
    case Rung::kMma:
      if constexpr (std::is_same_v<In, float> && std::is_same_v<Acc, float>) {
        if (split_tf32) return LaunchMmaSync<In, Out, true>(d, a, b, out, stream, multiprocessors);
      }
      if constexpr (kTensorCoreIn && std::is_same_v<Acc, float>)
        return LaunchMmaSync<In, Out>(d, a, b, out, stream, multiprocessors);
      break;
    case Rung::kWgmma:
      if constexpr (std::is_same_v<In, float> && std::is_same_v<Acc, float>) {
        if (split_tf32) return LaunchWgmma<In, Out, true>(d, a, b, out, stream, multiprocessors);
      }
      if constexpr (kTensorCoreIn && std::is_same_v<Acc, float>)
        return LaunchWgmma<In, Out>(d, a, b, out, stream, multiprocessors);
      break;
    case Rung::kAuto: break;
  }
  return cudaErrorInvalidValue;
}

ffi::Error MatmulCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                      ffi::Result<ffi::AnyBuffer> out, bool transpose_a, bool transpose_b,
                      int32_t precision, std::string_view kernel) {
  auto problem = MakeMatmulProblem(a, b, *out, transpose_a, transpose_b, precision, kernel);
  if (problem.has_error()) return problem.error();
  const MatmulProblem& p = problem.value();
  const std::optional<Rung> rung = ParseKernel(p.kernel);
  if (!rung) return UnknownKernel("CUDA", p.kernel, kKernelNames);
  const MatmulDims dims = ToDims(p);
  const DeviceFacts device = CurrentDevice();
  if (std::optional<std::string> refusal =
          Refusal(*rung, p.in_type, p.out_type, p.precision, dims, a.untyped_data(),
                  b.untyped_data(), device.compute_capability))
    return ffi::Error::InvalidArgument("tiled_matmul: " + *refusal);
  if (p.empty_output()) return ffi::Error::Success();
  if (p.k == 0) {  // an empty sum; 0.0 is all-zero bits in every supported dtype
    const cudaError_t err = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    return err == cudaSuccess ? ffi::Error::Success() : CudaError("zero fill failed", err);
  }
  // Precision matters to float32 on the tensor-core rungs only: TF32 for
  // DEFAULT, 3xTF32 for HIGH (HIGHEST was refused above). The SIMT rungs
  // compute true fp32 at every precision, 16-bit products are exact in
  // float32 and float64 stays float64.
  const Rung chosen = *rung == Rung::kAuto
                          ? ChooseAuto(p.in_type, p.out_type, p.precision, dims, a.untyped_data(),
                                       b.untyped_data(), device)
                          : *rung;
  const bool split_tf32 = p.precision == Precision::kHigh;
  return VisitDtypes(p, [&](auto in_tag, auto out_tag) {
    using In = Storage<in_tag.value>;
    using Out = Storage<out_tag.value>;
    using Acc = Accumulator<in_tag.value, out_tag.value>;
    const cudaError_t err = Launch<In, Out, Acc>(
        chosen, dims, static_cast<const In*>(a.untyped_data()),
        static_cast<const In*>(b.untyped_data()), static_cast<Out*>(out->untyped_data()), stream,
        device.multiprocessors, split_tf32);
    return err == cudaSuccess ? ffi::Error::Success() : CudaError("kernel launch failed", err);
  });
}

// The dims of contiguous operands of these shapes: what the lowering knows
// before any buffer exists.
MatmulDims DimsOf(const ProblemShape& s) {
  return ToDims(MatmulProblem::Contiguous(s.batch_a, s.batch_b, s.m, s.n, s.k, s.transpose_a,
                                          s.transpose_b));
}

std::optional<Precision> ParsePrecision(int code) {
  if (code < 0 || code > 2) return std::nullopt;
  return static_cast<Precision>(code);
}

}  // namespace

std::string ExplainAuto(std::string_view dtype, std::string_view out_dtype,
                        const ProblemShape& shape, int precision, int multiprocessors,
                        int compute_capability) {
  const std::optional<ffi::DataType> in_type = ParseDtype(dtype), out_type = ParseDtype(out_dtype);
  if (!in_type || !out_type)
    return "unsupported dtypes " + std::string(dtype) + " -> " + std::string(out_dtype);
  const std::optional<Precision> mode = ParsePrecision(precision);
  if (!mode) return "unsupported precision code " + std::to_string(precision);
  std::string why;
  // XLA's buffers are aligned far beyond 16 bytes: null stands for any of them.
  const Rung rung = ChooseAuto(*in_type, *out_type, *mode, DimsOf(shape), nullptr, nullptr,
                               {multiprocessors, compute_capability}, &why);
  return std::string(RungName(rung)) + ": " + why;
}

std::string KernelRefusal(std::string_view kernel, std::string_view dtype,
                          std::string_view out_dtype, const ProblemShape& shape, int precision,
                          int compute_capability) {
  const std::optional<Rung> rung = ParseKernel(kernel);
  const std::optional<ffi::DataType> in_type = ParseDtype(dtype), out_type = ParseDtype(out_dtype);
  const std::optional<Precision> mode = ParsePrecision(precision);
  if (!rung || !in_type || !out_type || !mode) return "";  // reported elsewhere, with the valid choices
  return Refusal(*rung, *in_type, *out_type, *mode, DimsOf(shape), nullptr, nullptr,
                 compute_capability)
      .value_or("");
}

}  // namespace jax_tiled::cuda
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxTiledMatmulCuda, jax_tiled::cuda::MatmulCuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: every launch goes here
        .Arg<xla::ffi::AnyBuffer>()     // a: (batch_a, m, k), or (batch_a, k, m) transposed
        .Arg<xla::ffi::AnyBuffer>()     // b: (batch_b, k, n), or (batch_b, n, k) transposed
        .Ret<xla::ffi::AnyBuffer>()     // out: (batch, m, n)
        .Attr<bool>("transpose_a")      // a is stored (batch_a, k, m)
        .Attr<bool>("transpose_b")      // b is stored (batch_b, n, k)
        .Attr<int32_t>("precision")     // 0 DEFAULT (TF32), 1 HIGH (3xTF32), 2 HIGHEST (fp32)
        .Attr<std::string_view>("kernel"),  // "auto" or a name from kKernelNames
    {xla::ffi::Traits::kCmdBufferCompatible});
